"""The TRL-style DPO baseline that bench_dpo.py measures ours against (its docstring says how it is run and
measured): TRL DPOTrainer's preprocessing of the pairs, and its training step written here (not imported) under
FSDP2 with a live reference copy, run by torchrun as `python bench/dpo_baseline.py <config.json>`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from launch import GIB, write_worker_figures
from trl_style import adamw, build_sharded, selective_log_softmax, start_process_group

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


def baseline_worker(config_file: str) -> int:
    """One torchrun process of the TRL-style run; rank 0 writes the windows, every rank its RSS figures."""
    c = json.loads(Path(config_file).read_text())
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    rank, world, device, mesh, peaks = start_process_group()
    model_dir = Path(c["model"])
    policy = build_sharded(model_dir, mesh, c["precision"], device, trainable=True)
    reference = build_sharded(model_dir, mesh, c["precision"], device, trainable=False)
    optimizer = adamw(policy, c["lr"])
    rows = json.loads(Path(c["pairs"]).read_text())
    order = np.random.default_rng(c["seed"]).permutation(len(rows))
    per_rank, steps = c["pairs_per_rank"], len(rows) // (c["pairs_per_rank"] * world)
    windows, check = [], {}
    dist.barrier()
    for step in range(steps):
        peaks.reset()
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
        peak = torch.tensor([peaks.now()], dtype=torch.float64)
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
    write_worker_figures(c["out"], rank, peaks, windows, reference_check=check)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # launched by torchrun from bench_dpo.run_baseline
    sys.exit(baseline_worker(sys.argv[1]))
