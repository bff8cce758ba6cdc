"""--fp8 (fsdp_lib/model/float8.py): which Linear layers train in float8, packed documents kept apart by rowwise
scales (tensorwise ones would couple them), the flag's refusals, and on CPU through torchao's emulation a 2-process
run (tensorwise scales, weights all-gathered in float8, scales precomputed after each step) that resumes bit for bit
and exports a plain Hugging Face model."""

from __future__ import annotations

import shutil

import pytest
import torch

from fsdp_lib.checks import validate_config
from fsdp_lib.config import load_config
from fsdp_lib.data.batch import Batch
from fsdp_lib.model import varlen
from fsdp_lib.model.float8 import convert_to_float8
from fsdp_lib.model.loss import CausalLMLoss
from fsdp_lib.testing import tiny_config
from tests.fsdp_helpers import losses_by_step, make_dataset, make_model, output_of, run_trainer, trainer_args


def _model(intermediate: int | None = None):
    from transformers import AutoModelForCausalLM

    varlen.register()
    config = tiny_config("llama", 64, 0)
    if intermediate:
        config.intermediate_size = intermediate
    config.use_cache = False
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=varlen.NAME).eval()


def test_decoder_linears_whose_dimensions_are_multiples_of_16_are_converted():
    from torchao.float8.float8_linear import Float8Linear

    model = _model(intermediate=72)  # the MLP's 72 is not a multiple of 16: gate, up and down stay
    converted, left = convert_to_float8(list(model.model.layers), "emulate", "rowwise")
    assert (converted, left) == (8, 6)
    for layer in model.model.layers:
        assert {n for n, m in layer.named_modules() if isinstance(m, Float8Linear)} == {
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        }  # fmt: skip
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.embed_tokens) is torch.nn.Embedding


@torch.no_grad()
def _second_document_logits(recipe: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits of a document packed after another, of the same document alone): varlen attention keeps the
    documents apart, so only a float8 scale shared by the tokens of both can tell them apart."""
    model = _model()
    if recipe:
        convert_to_float8(list(model.model.layers), "emulate", recipe)
    forward = CausalLMLoss(model, 0)
    forward.document_masking = "varlen"
    ids = torch.randint(1, 64, (1, 24), generator=torch.Generator().manual_seed(3))
    ids[0, :10] *= 0  # the first document: ten times token 0, whose activations are unlike the second's
    positions = torch.tensor([[*range(10), *range(14)]])
    packed = forward(Batch(ids, ids, positions).to(torch.device("cpu")), probe=True)[0].reshape(1, 24, -1)
    second = ids[:, 10:]
    alone = forward(Batch(second, second, None).to(torch.device("cpu")), probe=True)[0].reshape(1, 14, -1)
    return packed[0, 10:], alone[0]


def test_rowwise_scales_keep_packed_documents_apart_and_tensorwise_ones_would_not():
    """--document-masking on takes rowwise scales: a token's float8 scale is its own row's, so a document packed
    after another gets its logits alone (as in full precision); one scale per tensor lets the first document change
    how the second is rounded (which the start-up probe refuses). And float8's logits stay near full precision's."""
    exact_packed, exact_alone = _second_document_logits(None)
    assert (exact_packed - exact_alone).abs().max() < 1e-5
    packed, alone = _second_document_logits("rowwise")
    assert (packed - alone).abs().max() < 1e-5
    assert 0 < (packed - exact_alone).abs().max() < 0.1 * exact_alone.abs().max()  # float8's rounding, not garbage
    packed, alone = _second_document_logits("tensorwise")
    assert (packed - alone).abs().max() > 1e-3


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--fp8", "on"], "--fp8 on needs a CUDA GPU with float8 matmuls"),
        (["--fp8", "emulate", "--peft", "lora"], "with --peft lora the base is frozen"),
        (["--fp8", "emulate", "--precision", "fp16"], "--fp8 with --precision fp16"),
        (["--fp8", "on", "--precision", "fp16"], "--fp8 with --precision fp16"),
    ],
)
def test_fp8_that_cannot_work_is_refused_naming_the_flag(tmp_path, flags, message):
    cfg = load_config(["-e", "x", "-d", str(tmp_path), "-m", str(tmp_path), *flags])
    problems = validate_config(cfg, 2)
    assert any(message in problem for problem in problems)
    assert sum("--fp8" in p and "--precision" in p for p in problems) <= 1, problems  # one message per mistake


@pytest.mark.slow
def test_emulated_fp8_trains_resumes_bit_for_bit_and_exports(tmp_path):
    """2 processes, --document-masking off: tensorwise scales, weights all-gathered in float8, their scales computed
    after every step (and at start, so a resumed step scales as the uninterrupted one did)."""
    from transformers import AutoModelForCausalLM

    dataset = make_dataset(tmp_path / "data")
    model = make_model(tmp_path / "model", with_weights=True, fill_stored=False)
    args = trainer_args("f8", dataset, model, tmp_path / "whole")
    args += ["--fp8", "emulate", "--document-masking", "off", "--seq-length", "64", "--max-steps", "4"]
    args += ["--ckpt-freq", "2", "--lr", "1e-3"]
    whole = run_trainer(args)
    assert whole.returncode == 0, output_of(whole)
    assert "14 Linear layers in float8 (tensorwise scales, all-gathered in float8; emulated" in output_of(whole)
    # as if stopped after its step-2 checkpoint: the run's folder without the step-4 checkpoint and the export
    shutil.copytree(tmp_path / "whole" / "f8", tmp_path / "part" / "f8")
    for later in ("checkpoint/step_00000004", "final"):
        shutil.rmtree(tmp_path / "part" / "f8" / later)
    part_args = list(args)
    part_args[part_args.index("--save-dir") + 1] = str(tmp_path / "part")
    resumed = run_trainer(part_args)
    assert resumed.returncode == 0 and "resumed from" in output_of(resumed), output_of(resumed)
    whole_losses, part_losses = losses_by_step(tmp_path / "whole" / "f8"), losses_by_step(tmp_path / "part" / "f8")
    assert whole_losses[4] < whole_losses[1]
    assert [part_losses[s] for s in (3, 4)] == [whole_losses[s] for s in (3, 4)], (part_losses, whole_losses)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "whole" / "f8" / "final", dtype=torch.float32)
    assert {type(m) for m in exported.model.layers[0].modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}
    with torch.no_grad():
        assert torch.isfinite(exported(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


def test_dpo_pair_losses_through_float8_layers_are_near_full_precision():
    """--fp8 with --objective dpo (and kto, the same per-token path): the chunked per-token log-probabilities of packed
    pairs go through the float8 layers; the pair losses stay near full precision's and their gradients reach the
    float8 layers' weights."""
    from types import SimpleNamespace

    from fsdp_lib.train.dpo import DPOObjective
    from tests.test_host_syncs import pair_batch

    losses = {}
    for recipe in (None, "rowwise"):
        model = _model()  # the same weights each time
        if recipe:
            convert_to_float8(list(model.model.layers), "emulate", recipe)
        policy = CausalLMLoss(model, 8)
        policy.document_masking = "varlen"
        cfg = SimpleNamespace(
            dpo_beta=0.1, dpo_loss="sigmoid", simpo_gamma=0.0, dpo_label_smoothing=0.0, sft_weight=0.0
        )
        loss, _ = DPOObjective(cfg, policy, "precomputed")(pair_batch())
        loss.backward()
        losses[recipe] = loss.item()
        assert model.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
    assert losses["rowwise"] != losses[None] and abs(losses["rowwise"] - losses[None]) < 0.05 * abs(losses[None])
