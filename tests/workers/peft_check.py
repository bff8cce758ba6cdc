"""Run under torchrun in place of fsdp_train.py: fsdp_train.main, with its training loop wrapped to record what the
peft tests check from inside a run. Rank 0 writes EXPERIMENT_DIR/peft_check.json: whether every frozen base shard
is bit-identical after training, the names of the parameters the optimizer holds, the bytes and element count of
the frozen base on rank 0, and the trained model's logits on fixed inputs (all ranks take part)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # fsdp_train.py, a script at the repository root
import fsdp_train  # noqa: E402
from fsdp_lib.data.batch import Batch  # noqa: E402
from fsdp_lib.model.quantize import is_nf4, resident_bytes  # noqa: E402

FIXED_INPUTS = [[3, 17, 25, 9, 40, 11, 5, 60], [7, 8, 9, 10, 11, 12, 13, 14]]


def shard_digest(param: torch.Tensor) -> str:
    local = param._local_tensor if hasattr(param, "_local_tensor") else param
    inner = (
        [local.quantized_data, local.quantized_scalers, local.quantization_factor]
        if hasattr(local, "quantized_data")
        else [local]
    )
    digest = hashlib.sha256()
    for tensor in inner:
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


original_loop = fsdp_train.train_loop


def checked_loop(cfg, d, bundle, data, optimizer, *rest):
    frozen = {n: p for n, p in bundle.model.named_parameters() if not p.requires_grad}
    before = {n: shard_digest(p) for n, p in frozen.items()}
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    in_optimizer = sorted(n for n, p in bundle.model.named_parameters() if id(p) in held)
    finished = original_loop(cfg, d, bundle, data, optimizer, *rest)
    unchanged = all(shard_digest(p) == before[n] for n, p in frozen.items())
    ids = torch.tensor(FIXED_INPUTS)
    with torch.no_grad():
        logits, _ = bundle.train_forward(Batch(ids, torch.full_like(ids, -100), None), probe=True)
    if d.is_main:
        report = {
            "base_unchanged": unchanged,
            "frozen_count": len(frozen),
            "optimizer_params": in_optimizer,
            "frozen_bytes": sum(resident_bytes(p) for p in frozen.values()),
            "nf4_bytes": sum(resident_bytes(p) for p in frozen.values() if is_nf4(p)),
            "nf4_numel": sum(p.numel() for p in frozen.values() if is_nf4(p)) // d.world_size,
            "frozen_numel": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in frozen.values()),
            "inputs": FIXED_INPUTS,
            "logits": logits.tolist(),
        }
        (cfg.experiment_dir / "peft_check.json").write_text(json.dumps(report))
    return finished


fsdp_train.train_loop = checked_loop

if __name__ == "__main__":
    sys.exit(fsdp_train.main(sys.argv[1:]))
