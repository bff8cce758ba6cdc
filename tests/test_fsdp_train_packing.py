"""Packed documents never attend to each other, on every path: each way of marking documents (position ids, the
micro-batch as one row for varlen kernels, an explicit block mask) against the model families that need it, the
start-up probe that picks one, and the refusal where none works (recurrent layers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fsdp_lib.model.loss import CausalLMLoss, block_diagonal_mask
from fsdp_lib.model.probes import ALONE_TOLERANCE, LEAK_TOLERANCE, document_leaks
from tests.fsdp_helpers import (
    REPO_ROOT,
    arithmetic_documents,
    losses_by_step,
    make_dataset,
    make_model,
    output_of,
    run_trainer,
    tiny_config,
    train_tokenizer,
    trainer_args,
)

WORKERS = REPO_ROOT / "tests" / "workers"


def isolated(train_forward: CausalLMLoss, mode: str) -> bool:
    train_forward.document_masking = mode
    leak, apart = document_leaks(train_forward, 64, torch.device("cpu"))
    return leak <= LEAK_TOLERANCE["fp32"] and apart <= ALONE_TOLERANCE["fp32"]


def tiny_model(arch: str, attn: str) -> CausalLMLoss:
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, 64, 0)
    config.use_cache = False
    torch.manual_seed(0)
    return CausalLMLoss(AutoModelForCausalLM.from_config(config, attn_implementation=attn), 0)


def test_block_diagonal_mask_lets_a_token_see_its_own_documents_past_only():
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 0, 1, 2, 3]])
    mask = block_diagonal_mask(positions, None)
    assert mask.shape == (2, 1, 5, 5) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    additive = block_diagonal_mask(positions, torch.bfloat16)
    assert additive.dtype == torch.bfloat16 and torch.equal(additive == 0, mask)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_opt_ignores_packed_position_ids_and_gets_an_explicit_block_mask(attn):
    """OPT builds its causal mask without the position ids: packed documents leak into each other unless the
    mask is given explicitly. Llama derives it from the position ids."""
    opt = tiny_model("opt", attn)
    assert not isolated(opt, "position_ids") and not isolated(opt, "one_row")
    assert isolated(opt, "block_mask")
    assert isolated(tiny_model("llama", attn), "position_ids")


def test_flash_attention_batches_of_several_rows_leak_unless_sent_as_one_row(monkeypatch):
    """transformers' flash-attention path finds packed documents from the position ids only in a batch of one
    row; with -b 2 it runs the plain causal kernel over the whole block. Sent as one row, the varlen kernel keeps
    every document (and every block) apart. Run with a CPU stand-in for flash_attn under transformers' own path."""
    sys.path.insert(0, str(WORKERS))
    from flash_stand_in import install

    install(monkeypatch.setattr)  # undone after the test: later tests in this process load models as usual
    model = tiny_model("llama", "flash_attention_2")
    assert model.model.config._attn_implementation == "flash_attention_2"
    assert not isolated(model, "position_ids")
    assert isolated(model, "one_row")


def test_trainer_sends_flash_attention_micro_batches_as_one_row(tmp_path):
    """-b 4 with the flash path (CPU stand-in in each worker): the start-up probe picks one row, and it trains."""
    dataset = make_dataset(tmp_path / "data")
    model = make_model(tmp_path / "model", with_weights=True)
    args = trainer_args("flash", dataset, model, tmp_path) + ["-b", "4", "--max-steps", "6"]
    args += ["--attn-implementation", "flash_attention_2"]
    result = run_trainer(args, script=WORKERS / "flash_stand_in.py", env={"PYTHONPATH": str(REPO_ROOT)})
    out = output_of(result)
    assert result.returncode == 0, out
    assert "attention flash_attention_2" in out and "packed documents kept apart by one_row" in out
    losses = losses_by_step(tmp_path / "flash")
    assert losses[6] < losses[1]


def _recurrent_gemma(folder: Path) -> Path:
    """A tiny RecurrentGemma: recurrent (RG-LRU) layers and a logits soft cap under its own config key."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, RecurrentGemmaConfig

    folder.mkdir(parents=True)
    train_tokenizer(folder, arithmetic_documents())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    eos = tokenizer.eos_token_id
    config = RecurrentGemmaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, lru_width=32, attention_window_size=16, logits_soft_cap=30.0,
        block_types=["recurrent", "attention"], eos_token_id=eos, bos_token_id=eos, pad_token_id=eos,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_a_recurrent_model_refuses_document_masking_and_trains_without_it(tmp_path):
    """Its recurrent layers carry state across documents whatever the mask: --document-masking on is refused with
    the reason and the flag to use; with it off it trains, on the model's own (soft-capped) logits."""
    dataset = make_dataset(tmp_path / "data")
    model = _recurrent_gemma(tmp_path / "recurrent_gemma")
    args = trainer_args("rg", dataset, model, tmp_path) + ["-b", "2", "--max-steps", "4"]
    refused = run_trainer(args, nproc=1)
    out = output_of(refused)
    assert refused.returncode == 1
    assert "--document-masking on: RecurrentGemmaForCausalLM lets packed documents see each other" in out
    assert "Use --document-masking off" in out
    trained = run_trainer(args + ["--document-masking", "off"], nproc=1)
    out = output_of(trained)
    assert trained.returncode == 0, out
    assert "full logits instead of the chunked loss for RecurrentGemmaForCausalLM" in out
    assert "kept apart" not in out


FAMILIES = sorted({"llama", "qwen2", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "gpt2", "opt", "gpt_neox"}
                  | {"mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "glm4_moe"})  # fmt: skip
BLOCK_MASK_FAMILIES = {"opt"}  # their causal mask ignores the position ids


# Gemma2 has no sdpa attention (transformers refuses it: the trainer builds it with eager on its own)
KERNELS = [(arch, attn) for arch in FAMILIES for attn in ("sdpa", "eager") if (arch, attn) != ("gemma2", "sdpa")]


@pytest.mark.parametrize("arch,attn", KERNELS, ids=[f"{a}-{k}" for a, k in KERNELS])
def test_every_family_of_the_matrix_keeps_packed_documents_apart(arch, attn):
    """Per family and kernel: the way the start-up probe would pick (the first of position ids, one row, block
    mask that isolates) exists, it is the expected one, and with it a changed document leaves the next one's
    logits unchanged and equal to the document alone."""
    from fsdp_lib.model.probes import MASKING_MODES

    model = tiny_model(arch, attn)
    chosen = next((mode for mode in MASKING_MODES if isolated(model, mode)), None)
    assert chosen == ("block_mask" if arch in BLOCK_MASK_FAMILIES else "position_ids")


OUTSIDE_THE_MATRIX = {  # families the review named: config, attention kernel, the masking that keeps them apart
    "falcon": ("FalconConfig", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}, "sdpa", "position_ids"),
    "mpt": ("MptConfig", {"d_model": 32, "n_layers": 2, "n_heads": 4}, "eager", "block_mask"),
    "biogpt": ("BioGptConfig", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}, "sdpa", "block_mask"),
    "xglm": ("XGLMConfig", {"d_model": 32, "num_layers": 2, "attention_heads": 4, "ffn_dim": 64}, "eager", "block_mask"),
    "bloom": ("BloomConfig", {"hidden_size": 32, "n_layer": 2, "n_head": 4}, "eager", None),  # ALiBi from a 2-D mask
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(OUTSIDE_THE_MATRIX))
def test_families_that_ignore_packed_position_ids_get_a_block_mask_or_are_refused(family):
    """MPT, BioGPT and XGLM build their causal mask without the position ids: the block mask keeps their documents
    apart. Bloom takes neither position ids nor a 4-D mask (its ALiBi is built from a 2-D one): no way works, so
    the trainer refuses --document-masking on for it (choose_document_masking raises)."""
    import transformers as tf

    name, sizes, attn, expected = OUTSIDE_THE_MATRIX[family]
    config = getattr(tf, name)(vocab_size=64, **sizes)
    config.use_cache = False
    torch.manual_seed(0)
    model = CausalLMLoss(tf.AutoModelForCausalLM.from_config(config, attn_implementation=attn), 0)
    works = []
    for mode in ("position_ids", "one_row", "block_mask"):
        try:
            works.append(isolated(model, mode))
        except Exception:  # noqa: BLE001 - as in choose_document_masking: a mode the model refuses does not work
            works.append(False)
    chosen = next((mode for mode, ok in zip(("position_ids", "one_row", "block_mask"), works) if ok), None)
    assert chosen == expected


def test_a_sliding_window_model_is_never_given_one_block_mask_for_every_layer():
    """The block_mask route hands every layer one [T x T] mask, which would drop a sliding window; the start-up probe
    (documents shorter than any window) cannot see that, so the chooser skips the route for a model with a window
    that some layer uses."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, OPTConfig, Qwen2Config

    from fsdp_lib.model.probes import sliding_window

    assert sliding_window(MistralConfig(sliding_window=16)) == 16 and sliding_window(Gemma2Config()) == 4096
    qwen = {"use_sliding_window": True, "sliding_window": 64, "num_hidden_layers": 2}
    assert sliding_window(Qwen2Config(**qwen, max_window_layers=1)) == 64  # layer 1 slides
    assert sliding_window(Qwen2Config(**qwen)) is None  # max_window_layers 28: no layer of 2 slides
    for no_window in (MistralConfig(sliding_window=None), Qwen2Config(), OPTConfig(), LlamaConfig()):
        assert sliding_window(no_window) is None, type(no_window).__name__
