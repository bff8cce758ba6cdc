"""Run under torchrun in place of fsdp_train.py: fsdp_train.main, with its training loop wrapped to record what the
peft tests check from inside a run. Rank 0 writes EXPERIMENT_DIR/peft_check.json: whether every frozen base shard
is bit-identical after training, the names of the parameters the optimizer holds, the bytes and element count of
the frozen base on rank 0, the trained model's logits on fixed inputs (all ranks take part), and for QLoRA how its
NF4 weights were filled (from each rank's rows or whole) and whether every rank's NF4 shards hold exactly the rows
of the whole weight quantised whole."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # fsdp_train.py, a script at the repository root
import fsdp_train  # noqa: E402
from fsdp_lib.data.batch import Batch  # noqa: E402
from fsdp_lib.interrupts import exit_without_teardown  # noqa: E402
from fsdp_lib.model import hf_weights  # noqa: E402
from fsdp_lib.model.quantize import BLOCK, SCALER_BLOCK, is_nf4, resident_bytes  # noqa: E402

fills = {"rows": 0, "whole": 0}  # how load_pretrained_sharded filled the NF4 weights on this rank


def counted(kind, fill):
    def wrapper(*args):
        fills[kind] += 1
        return fill(*args)

    return wrapper


hf_weights.fill_nf4_rows = counted("rows", hf_weights.fill_nf4_rows)
hf_weights.fill_nf4_shard = counted("whole", hf_weights.fill_nf4_shard)


def nf4_as_whole(model: torch.nn.Module, model_dir: Path) -> bool:
    """Whether every NF4 shard on this rank holds exactly its rows of the whole weight quantised whole (codes,
    scales, their factors and the tensor-wide mean)."""
    from safetensors import safe_open
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    files, _ = hf_weights.weight_keys(model_dir)
    for name, param in model.named_parameters():
        if not is_nf4(param) or not hasattr(param, "device_mesh"):
            continue
        key = hf_weights.base_fqn(name)
        with safe_open(str(files[key]), framework="pt") as f:
            full = f.get_tensor(key)
        local, mesh = param._local_tensor, param.device_mesh
        whole = to_nf4(full.to(local.dtype).contiguous(), BLOCK, SCALER_BLOCK)
        mine = torch.chunk(whole, mesh.size(), dim=0)[mesh.get_local_rank()]
        inner = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean")
        if not all(torch.equal(getattr(local, t), getattr(mine, t)) for t in inner):
            return False
    return True


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
    as_whole = torch.tensor(int(nf4_as_whole(bundle.model, Path(cfg.model_name))))
    torch.distributed.all_reduce(as_whole, op=torch.distributed.ReduceOp.MIN)
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
            "nf4_fills": fills,
            "nf4_as_whole": bool(as_whole.item()),
            "inputs": FIXED_INPUTS,
            "logits": logits.tolist(),
        }
        (cfg.experiment_dir / "peft_check.json").write_text(json.dumps(report))
    return finished


fsdp_train.train_loop = checked_loop

if __name__ == "__main__":
    exit_without_teardown(fsdp_train.main(sys.argv[1:]))
