"""Pieces of TRL's trainers written here (not imported from TRL) for the bench/ baselines that run under torchrun:
a worker's process group, the Hugging Face model under FSDP2 loaded shard by shard, as TRL's trainers get it from
accelerate (dpo_baseline.py, grpo_baseline.py), TRL's per-token log-probabilities (`selective_log_softmax`) and the
optimizer as our trainer sets it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from launch import WindowPeaks


def start_process_group() -> tuple[int, int, Any, Any, WindowPeaks]:
    """(rank, world size, device, a 1-D device mesh over the processes, the window peaks) of a torchrun worker: nccl
    on GPUs, gloo on CPU. The peaks' idle figure is the RSS after torch and transformers are imported, before any
    process group or model exists (fsdp_train's worker reads it after importing fsdp_train)."""
    import torch
    import torch.distributed as dist
    import transformers  # noqa: F401  (imported before the idle reading, as fsdp_train's runtime is)
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    peaks = WindowPeaks(device)
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    return rank, world, device, init_device_mesh(device.type, (world,)), peaks


def selective_log_softmax(logits: Any, index: Any) -> Any:
    """TRL's trl.trainer.utils.selective_log_softmax: log_softmax(logits)[index] per token. fp32: gather less a
    row-wise logsumexp; bf16/fp16 (ours: the logits of a bf16 forward): log_softmax one row at a time."""
    import torch
    import torch.nn.functional as F

    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        return selected - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    rows = [F.log_softmax(row, dim=-1).gather(-1, i.unsqueeze(-1)).squeeze(-1) for row, i in zip(logits, index)]
    return torch.stack(rows)


def build_sharded(model_dir: Path, mesh: Any, compute: str, device: Any, trainable: bool) -> Any:
    """The HF model built on meta, fully_shard per decoder layer then the root (bf16 MixedPrecisionPolicy, fp32
    reduce), each rank's shards loaded from the safetensors tensor by tensor (no full copy on any rank)."""
    import torch
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import distribute_tensor
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.use_cache = False
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.tie_weights()  # accelerate's meta parameters replace the tied head's Parameter with a second one
    mp = MixedPrecisionPolicy(param_dtype={"bf16": torch.bfloat16, "fp32": None}[compute], reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    model.to_empty(device=device)
    for name, value in buffers.items():
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._buffers[leaf] = value.to(device)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for file in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    if key in params:
                        param = params.pop(key)
                        full = f.get_tensor(key).to(device=device, dtype=torch.float32)
                        shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                        param.to_local().copy_(shard.to_local())
    if params:
        raise RuntimeError(f"no weights for {sorted(params)[:5]} in {model_dir}")
    model.requires_grad_(trainable)
    return model.train(trainable)


def adamw(model: Any, lr: float) -> Any:
    """AdamW as fsdp_train.py sets it (fsdp_lib/train/optim.py, no --weight-decay): betas (0.9, 0.95), eps 1e-8,
    no weight decay; fused where the build has it."""
    import torch

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)
