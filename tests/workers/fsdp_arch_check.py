"""Run under torchrun: one architecture of the matrix, end to end in one process group.

`fsdp_train.main` trains as a user would (3 steps, then the export to outputs/EXP/final). Two of its
functions are wrapped to look inside: after `build_model`, every gathered parameter is compared with
`from_pretrained` (the sharded load must be exact); before `export_hf_model`, the trained parameters and
the logits of a fixed input are kept. After the run, rank 0 reads the export with `from_pretrained` and
compares both, and the export's tensor names and shapes with those save_pretrained wrote. Prints one line per check; exits non-zero if any fails.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM

import fsdp_train as ft
from fsdp_lib.config import TrainConfig, load_config
from fsdp_lib.interrupts import exit_without_teardown
from fsdp_lib.model.anatomy import clean_fqn
from fsdp_lib.model.build import ModelBundle
from fsdp_lib.runtime import ENV_RANK, Dist

PROBE = torch.arange(3, 19).remainder(100).view(1, 16)  # token ids below every tiny vocab size
trained: dict[str, torch.Tensor] = {}
failures: list[str] = []
built: list[ModelBundle] = []  # what build_model returned: the export wrapper needs its FSDP root


def gathered_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full copies of every parameter and persistent buffer (a collective: every rank calls it)."""
    return {
        clean_fqn(name): (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
        for name, t in model.state_dict().items()
    }


def build_and_compare(cfg: TrainConfig, precision: str, d: Dist, **options: Any) -> ModelBundle:
    bundle = build_model(cfg, precision, d, **options)  # (a fresh run: from_checkpoint False, the weights are read)
    reference = AutoModelForCausalLM.from_pretrained(cfg.model_name, dtype=torch.float32).state_dict()
    loaded = gathered_state(bundle.model)
    differ = sorted(n for n, t in loaded.items() if n not in reference or not torch.equal(t, reference[n]))
    if differ or len(loaded) != len(reference):
        failures.append(f"LOAD MISMATCH {differ[:5]} ({len(loaded)} loaded, {len(reference)} in from_pretrained)")
    else:
        print(f"LOAD EQUAL {len(loaded)} parameters and persistent buffers", flush=True)
    # One FSDP unit per decoder layer, an untied embedding and head one each, plus the root: MoE experts live
    # inside their layer's unit, a tied embedding and head in the root's.
    units = [m for m in bundle.train_forward.modules() if isinstance(m, FSDPModule)]  # the root wraps the model
    own = 0 if getattr(bundle.config, "tie_word_embeddings", False) else 2
    if len(units) != bundle.config.num_hidden_layers + own + 1:
        failures.append(f"FSDP UNITS {len(units)}, expected {bundle.config.num_hidden_layers} layers + {own} + root")
    built.append(bundle)
    return bundle


def keep_trained_then_export(model, tokenizer, out_dir, d: Dist, *args) -> None:
    root = built[0].train_forward  # the FSDP root is the training forward around the model: gather its group
    trained.update(gathered_state(model))
    model.eval()
    root.unshard()
    with torch.no_grad():
        trained["logits"] = model(input_ids=PROBE.to(d.device)).logits.float().cpu()
    root.reshard()
    model.train()
    export(model, tokenizer, out_dir, d, *args)


def saved_layout(folder: str) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    layout = {}
    for f in Path(folder).glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            layout.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
    return layout


def compare_export(final_dir: str, model_dir: str) -> None:
    if saved_layout(final_dir) != saved_layout(model_dir):  # the names and shapes save_pretrained wrote
        only_export = sorted(set(saved_layout(final_dir)) - set(saved_layout(model_dir)))
        failures.append(f"EXPORT LAYOUT differs from save_pretrained's, e.g. {only_export[:4]}")
    exported = AutoModelForCausalLM.from_pretrained(final_dir, dtype=torch.float32).eval()
    params = exported.state_dict()
    differ = sorted(n for n in params if not torch.equal(params[n], trained[n]))
    if differ or len(params) != len(trained) - 1:
        failures.append(f"EXPORT MISMATCH {differ[:5]} ({len(params)} exported, {len(trained) - 1} trained)")
    with torch.no_grad():
        logits = exported(input_ids=PROBE).logits.float()
    if not torch.allclose(logits, trained["logits"], rtol=0, atol=1e-5):
        failures.append(f"LOGITS DIFFER by {(logits - trained['logits']).abs().max().item():.3g}")
    if not failures:
        print("EXPORT REPRODUCES the trained parameters and logits", flush=True)


build_model, export = ft.build_model, ft.export_hf_model
ft.build_model, ft.export_hf_model = build_and_compare, keep_trained_then_export

if __name__ == "__main__":
    argv = sys.argv[1:]
    code = ft.main(argv)
    if code == 0 and ENV_RANK == 0:
        cfg = load_config(argv)
        compare_export(str(cfg.experiment_dir / "final"), cfg.model_name)
    for failure in failures:
        print(failure, flush=True)
    exit_without_teardown(code or (1 if failures else 0))
