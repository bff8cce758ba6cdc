"""The architecture matrix: every family docs/architectures.md lists, loaded, trained and exported for real.

One torchrun launch (2 processes, gloo) per architecture runs the worker tests/workers/fsdp_arch_check.py:
sharded load equals `from_pretrained` bit for bit, 3 training steps lower the loss, and `from_pretrained` of
the export reproduces the trained parameters and logits.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import fsdp_train as ft
from fsdp_lib.data.batch import Batch
from fsdp_lib.errors import TrainError
from fsdp_lib.model.build import build_model_skeleton
from fsdp_lib.model.loss import CausalLMLoss, chunked_loss_problem
from fsdp_lib.train.metrics import PhaseTimer
from tests.fsdp_helpers import (
    REPO_ROOT,
    losses_by_step,
    make_dataset,
    make_model,
    output_of,
    read_metrics,
    run_trainer,
    torchrun_command,
    trainer_args,
)

MATRIX = [
    ("llama", True),
    ("llama", False),
    ("qwen2", False),
    ("mistral", False),
    ("gemma", True),
    ("gemma2", True),
    ("gemma3_text", True),
    ("phi3", False),
    ("gpt2", True),
    ("opt", True),
    ("gpt_neox", True),
    ("mixtral", False),
    ("qwen2_moe", False),
    ("olmoe", False),
    ("qwen3_moe", False),
    ("glm4_moe", False),
]
MOE = {"mixtral", "qwen2_moe", "olmoe", "qwen3_moe"}


@pytest.fixture(scope="module")
def matrix_dataset(tmp_path_factory) -> Path:
    return make_dataset(tmp_path_factory.mktemp("data") / "corpus", validation=False, n_docs=48)


@pytest.mark.parametrize("arch,tied", MATRIX, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in MATRIX])
def test_load_train_export(tmp_path, matrix_dataset, arch, tied):
    model = make_model(tmp_path / "model", arch=arch, with_weights=True, tied=tied)  # fp32: the export is exact
    args = [*trainer_args("run", matrix_dataset, model, tmp_path), "--max-steps", "3", "-b", "2", "--lr", "1e-2"]
    proc = subprocess.run(
        torchrun_command("tests/workers/fsdp_arch_check.py", args),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("LOAD EQUAL") == 2, out  # both ranks compared every parameter
    assert "EXPORT REPRODUCES" in out, out
    # The start-up probe's choice for the family: each document attends to itself (varlen), except Gemma2, which
    # has no sdpa (soft-capped attention logits) and gets eager attention, its mask derived from the position ids.
    masking = "position_ids" if arch == "gemma2" else "varlen"
    assert f"attention {'eager' if arch == 'gemma2' else 'varlen'}" in out, out
    assert f"packed documents kept apart by {masking}" in out, out
    losses = losses_by_step(tmp_path / "run")
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1], losses
    aux = [r.get("aux_loss") for r in read_metrics(tmp_path / "run")]
    if arch in MOE:  # the router loss is logged beside the token loss; dense models have none
        assert all(a is not None and a > 0 for a in aux), aux
    else:
        assert aux == [None, None, None], aux


def test_attn_implementation_is_honoured_or_reported_with_the_flag(tmp_path):
    model = make_model(tmp_path / "gemma2", arch="gemma2")
    assert build_model_skeleton(model, "auto").config._attn_implementation == "eager"  # no SDPA in Gemma2
    assert build_model_skeleton(model, "eager").config._attn_implementation == "eager"
    with pytest.raises(TrainError, match="--attn-implementation sdpa"):
        build_model_skeleton(model, "sdpa")


@pytest.mark.parametrize("chunk", [0, 5])
def test_moe_router_loss_joins_the_gradient_like_transformers_own_loss(tmp_path, chunk):
    """One process, one micro-batch: forward_backward's gradients equal those of transformers' objective,
    mean cross entropy + router_aux_loss_coef * aux_loss (so the router loss is neither dropped nor rescaled),
    with the model's own logits (chunk 0) and with the chunked loss, which computes the router loss itself."""
    import types

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    folder = make_model(tmp_path / "mixtral", arch="mixtral", with_weights=True, tied=False)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.config.router_aux_loss_coef = 0.5  # large, so a dropped or rescaled router loss shows in the gradients
    batch = torch.randint(0, 100, (2, 17), generator=torch.Generator().manual_seed(0))
    d = types.SimpleNamespace(world_size=1, device=torch.device("cpu"))
    guard = types.SimpleNamespace(scale=torch.tensor(1.0))
    micro = Batch(batch[:, :-1], batch[:, 1:], None)
    train_forward = CausalLMLoss(model, chunk)
    assert chunked_loss_problem(model) is None
    loss_sum, aux = ft.forward_backward(train_forward, [micro], batch[:, 1:].numel(), guard, d, PhaseTimer(d.device))
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    outputs = model(input_ids=batch[:, :-1], output_router_logits=True)
    mean_ce = F.cross_entropy(outputs.logits.flatten(0, 1), batch[:, 1:].flatten())
    (mean_ce + 0.5 * outputs.aux_loss).backward()
    assert aux is not None and torch.allclose(aux, 0.5 * outputs.aux_loss)
    assert torch.allclose(loss_sum / batch[:, 1:].numel(), mean_ce)
    gate = "model.layers.0.mlp.gate.weight"
    assert ours[gate].abs().sum() > 0
    for name, param in model.named_parameters():
        torch.testing.assert_close(ours[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_resume_at_another_micro_batch_says_an_moe_router_loss_changes():
    """The router loss is a product of two means over a micro-batch's tokens (as transformers computes it per
    forward), so at a fixed global batch -b changes an MoE model's updates (an audit measured 6.8e-3 in the weights
    after 3 steps of a tiny Mixtral; the process count and --grad-accum-steps at the same -b agree to 1e-7). A
    resume that changes -b says so; a dense model's, or one that keeps -b, says nothing."""
    from transformers import LlamaConfig, MixtralConfig

    from fsdp_lib.model.loss import micro_batch_note

    moe, dense = MixtralConfig(router_aux_loss_coef=0.001), LlamaConfig()
    assert "router loss is computed per micro-batch" in micro_batch_note(moe, ["--batch-size 4 (was 2)"])
    assert micro_batch_note(moe, ["--weight-decay 0.1 (was 0.0)"]) == ""
    assert micro_batch_note(dense, ["--batch-size 4 (was 2)"]) == ""
    assert micro_batch_note(MixtralConfig(router_aux_loss_coef=0.0), ["--batch-size 4 (was 2)"]) == ""


def _folder_of(config_class: str, folder: Path, **sizes) -> Path:
    """A tiny model folder of a family outside the matrix: the suite's tokenizer and a config (no weights)."""
    import transformers
    from transformers import AutoTokenizer

    from fsdp_lib.testing import arithmetic_documents, train_tokenizer

    folder.mkdir(parents=True)
    train_tokenizer(folder, arithmetic_documents(), vocab_size=128)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = {"vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.eos_token_id}
    getattr(transformers, config_class)(**sizes, **ids).save_pretrained(folder)
    return folder


SWEPT = {  # families an audit found crashing or silently wrong (2026-12-08), and what each must now do
    "phimoe": ("PhimoeConfig", dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
               max_position_embeddings=512)),
    "gpt_neo": ("GPTNeoConfig", dict(hidden_size=64, num_layers=2, num_heads=4, window_size=16,
                attention_types=[[["global", "local"], 1]], max_position_embeddings=512)),
    "mamba": ("MambaConfig", dict(hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, time_step_rank=8)),
}  # fmt: skip


@pytest.mark.parametrize("arch", sorted(SWEPT))
def test_families_outside_the_matrix_train_or_are_refused_by_name(tmp_path, matrix_dataset, arch):
    """PhiMoE applies its sliding window through its mask alone: varlen, reading no mask, trained it without the
    window while the probe (varlen against itself) passed; it now keeps documents apart by position ids, whose mask
    has the window. GPT-Neo's own table of attention classes raised KeyError: 'varlen' under auto. Mamba (its
    _no_split_modules name a block and the mixer inside it: sharded twice) crashed, even with --document-masking
    off; it now trains with it off and is refused by name with it on."""
    config_class, sizes = SWEPT[arch]
    model = _folder_of(config_class, tmp_path / "model", **sizes)
    base = [*trainer_args("run", matrix_dataset, model, tmp_path), "--max-steps", "1", "-b", "2", "--seq-length", "64"]
    if arch == "mamba":
        refused = run_trainer([*base[:1], "refused", *base[2:]], nproc=1)
        assert refused.returncode != 0 and "Traceback" not in output_of(refused), output_of(refused)
        assert "--document-masking on: MambaForCausalLM lets packed documents see each other" in output_of(refused)
        base += ["--document-masking", "off"]
    proc = run_trainer(base, nproc=1)
    out = output_of(proc)
    assert proc.returncode == 0 and (tmp_path / "run" / "final" / "config.json").is_file(), out
    if arch == "phimoe":
        assert "varlen: the model applies its sliding window (16) through its mask alone" in out, out
        assert "packed documents kept apart by position_ids" in out, out


def test_decoder_layers_nested_are_sharded_once_and_shared_weights_are_refused():
    """A _no_split_modules class inside another (Mamba's mixer in its block, Zamba2's Mamba layer in its hybrid
    layer) was sharded twice ('Cannot concatenate overlapping meshes'): the outer layer is the unit. Layers that
    share weights (Zamba2's shared attention block) cannot each be a unit: refused by name."""
    import torch.nn as nn

    from fsdp_lib.model.anatomy import find_decoder_layers

    class Inner(nn.Linear):
        pass

    class Block(nn.Module):
        def __init__(self, shared: nn.Module | None = None):
            super().__init__()
            self.inner, self.shared = Inner(4, 4), shared

    class Model(nn.Module):
        _no_split_modules = ["Block", "Inner"]

        def __init__(self, share: bool):
            super().__init__()
            common = nn.Linear(4, 4) if share else None
            self.layers = nn.ModuleList([Block(common), Block(common)])

    layers = find_decoder_layers(Model(share=False))
    assert [type(layer).__name__ for layer in layers] == ["Block", "Block"]
    with pytest.raises(TrainError, match="Model shares weights between its decoder layers"):
        find_decoder_layers(Model(share=True))
