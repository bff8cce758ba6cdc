"""The TRL-style DPO baseline that bench_dpo.py measures ours against (its docstring says how it is run and
measured): TRL DPOTrainer's preprocessing of the pairs, and its training step written here (not imported) under
FSDP2 with a live reference copy, run by torchrun as `python bench/dpo_baseline.py <config.json>`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from launch import GIB, status_bytes

# --- Preprocessing ----------------------------------------------------------------------------------------------


def trl_tokenize(tokenizer: Any, pairs: list[dict]) -> list[dict[str, list[int]]]:
    """TRL DPOTrainer's preprocessing: maybe_apply_chat_template (the prompt rendered with the generation prompt;
    each completion = the full render less the prompt's text), then the prompt and each completion tokenised
    separately without special tokens (the template writes BOS). TRL appends EOS to each completion; not here, so
    the trained tokens equal ours."""
    out = []
    for pair in pairs:
        prompt = tokenizer.apply_chat_template(pair["prompt"], tokenize=False, add_generation_prompt=True)
        row = {"prompt": tokenizer(prompt, add_special_tokens=False)["input_ids"]}
        for key in ("chosen", "rejected"):
            full = tokenizer.apply_chat_template(pair["prompt"] + pair[key], tokenize=False)
            if not full.startswith(prompt):
                raise RuntimeError("the template renders the prompt differently with a response after it")
            row[key] = tokenizer(full[len(prompt) :], add_special_tokens=False)["input_ids"]
        out.append(row)
    return out


# --- The step under FSDP2 (runs under torchrun) -------------------------------------------------------------


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


def concatenated_logps(model: Any, batch: dict[str, Any]) -> Any:
    """TRL's concatenated_forward: one forward of chosen + rejected, labels = inputs rolled left, the completion
    tokens' log-probs summed per sequence ([2 x pairs], chosen first)."""
    import torch

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    labels = torch.roll(batch["input_ids"], shifts=-1, dims=1)
    loss_mask = torch.roll(batch["loss_mask"], shifts=-1, dims=1).bool()
    per_token = selective_log_softmax(logits, labels).float()
    return per_token.masked_fill(~loss_mask, 0.0).sum(-1)


def collate(rows: list[dict[str, list[int]]], pad_id: int, device: Any) -> dict[str, Any]:
    """TRL's concatenated inputs after flush_left: chosen sequences then rejected ones (prompt + completion), right-
    padded to the longest of them; attention_mask 1 on real tokens; loss_mask 1 on completion tokens."""
    import torch

    seqs = [(r["prompt"], r[k]) for k in ("chosen", "rejected") for r in rows]
    width = max(len(a) + len(b) for a, b in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (prompt, completion) in enumerate(seqs):
        n = len(prompt) + len(completion)
        ids[i, :n] = torch.tensor(prompt + completion)
        attention[i, :n] = 1
        loss_mask[i, len(prompt) : n] = 1
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    return {k: v.to(device) for k, v in batch.items()}


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


def baseline_worker(config_file: str) -> int:
    """One torchrun process of the TRL-style run; rank 0 writes the windows, every rank its RSS figures."""
    c = json.loads(Path(config_file).read_text())
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import transformers  # noqa: F401  (imported before the idle reading, as fsdp_train's runtime is)
    from torch.distributed.device_mesh import init_device_mesh

    idle = status_bytes("VmRSS")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    mesh = init_device_mesh(device.type, (world,))
    model_dir = Path(c["model"])
    policy = build_sharded(model_dir, mesh, c["precision"], device, trainable=True)
    reference = build_sharded(model_dir, mesh, c["precision"], device, trainable=False)
    decay = [p for p in policy.parameters() if p.ndim >= 2]
    no_decay = [p for p in policy.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        optimizer = torch.optim.AdamW(groups, lr=c["lr"], betas=(0.9, 0.95), eps=1e-8, fused=True)
    except (RuntimeError, ValueError):
        optimizer = torch.optim.AdamW(groups, lr=c["lr"], betas=(0.9, 0.95), eps=1e-8, foreach=True)
    rows = json.loads(Path(c["pairs"]).read_text())
    order = np.random.default_rng(c["seed"]).permutation(len(rows))
    per_rank, steps = c["pairs_per_rank"], len(rows) // (c["pairs_per_rank"] * world)
    peaks, windows, check = [idle], [], {}

    def reset_peak() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        else:
            peaks.append(status_bytes("VmHWM"))
            Path("/proc/self/clear_refs").write_text("5")

    def peak_now() -> float:
        return torch.cuda.max_memory_allocated(device) if cuda else status_bytes("VmHWM")

    dist.barrier()
    for step in range(steps):
        reset_peak()
        start = time.perf_counter()
        first = step * per_rank * world + rank * per_rank
        batch = collate([rows[i] for i in order[first : first + per_rank]], c["pad_id"], device)
        policy_logps = concatenated_logps(policy, batch)
        with torch.no_grad():
            reference_logps = concatenated_logps(reference, batch)
        chosen = policy_logps[:per_rank] - reference_logps[:per_rank]
        rejected = policy_logps[per_rank:] - reference_logps[per_rank:]
        losses = -F.logsigmoid(c["beta"] * (chosen - rejected))
        if step == 0:  # compared with our precomputed reference of the same pairs
            check = {"pairs": order[first : first + per_rank].tolist(), "reference_logps": reference_logps.tolist()}
        losses.mean().backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        figures = torch.tensor(
            [
                losses.detach().sum().item(),
                float(per_rank),
                float(batch["input_ids"].numel()),
                float(batch["attention_mask"].sum()),
                float(batch["loss_mask"].sum()),
                ((chosen - rejected).detach() > 0).float().sum().item(),
            ],
            dtype=torch.float64,
        )
        dist.all_reduce(figures)
        peak = torch.tensor([peak_now()], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        elapsed = time.perf_counter() - start
        loss, pairs, padded, real, trained, right = figures.tolist()
        norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        windows.append(
            {
                "step": step + 1,
                "seconds": elapsed,
                "pairs": int(pairs),
                "pairs_per_s": pairs / elapsed,
                "loss": loss / pairs,
                "accuracy": right / pairs,
                "grad_norm": float(norm),
                "padded_tokens": int(padded),
                "real_tokens": int(real),
                "trained_tokens": int(trained),
                "mem_peak_alloc_gb": float(peak.item()) / GIB,
            }
        )
        if rank == 0:
            print(f"baseline step {step + 1}/{steps}: {json.dumps(windows[-1])}", flush=True)
    peaks.append(status_bytes("VmHWM"))
    figures = {"idle_rss_bytes": idle, "run_peak_rss_bytes": max(peaks), "code": 0, "reference_check": check}
    Path(f"{c['out']}.rank{rank}.json").write_text(json.dumps(figures))
    if rank == 0:
        Path(f"{c['out']}.windows.json").write_text(json.dumps(windows))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # launched by torchrun from bench_dpo.run_baseline
    sys.exit(baseline_worker(sys.argv[1]))
