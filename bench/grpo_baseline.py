"""The TRL-style GRPO baseline that bench_grpo.py measures ours against (its docstring says how it is run and
measured): TRL GRPOTrainer's step written here (not imported) with the policy under FSDP2 and the generation by
transformers' `generate` on an unsharded copy of the policy on every rank, its weights gathered from the shards
before every generation; run by torchrun as `python bench/grpo_baseline.py <config.json>`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from launch import GIB, write_worker_figures
from trl_style import adamw, build_sharded, selective_log_softmax, start_process_group

from fsdp_lib.train.rewards import accuracy_reward

STD_EPS = 1e-4  # TRL: advantages = (reward - group mean) / (group std + 1e-4)


# --- Generation on the unsharded copy ---------------------------------------------------------------------------


def generation_copy(model_dir: Path, compute: str, device: Any) -> Any:
    """The plain Hugging Face model every rank generates with: whole, in the compute dtype, with its KV cache."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[compute]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval().requires_grad_(False)


def refresh_weights(policy: Any, copy: Any) -> None:
    """The policy's current weights into the copy, as TRL's unwrap_model_for_generation gathers them under ZeRO-3 or
    FSDP: every parameter gathered whole from its shards (an all-gather each), then cast to the copy's dtype."""
    import torch

    targets = dict(copy.named_parameters())
    with torch.no_grad():
        for name, param in policy.named_parameters():
            targets.pop(name).copy_(param.full_tensor())
    if targets:
        raise RuntimeError(f"the policy has no parameters {sorted(targets)[:5]}")


def left_padded(prompts: list[list[int]], pad_id: int, device: Any) -> tuple[Any, Any]:
    """(input ids, attention mask) of the prompts left-padded to the longest, as TRL's processing class pads them."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def completion_mask(completion_ids: Any, stops: list[int]) -> Any:
    """TRL's completion mask: 1 up to and including the first stop token of each row (the whole row if none)."""
    import torch

    is_stop = torch.isin(completion_ids, torch.tensor(stops, device=completion_ids.device))
    first = torch.full((len(completion_ids),), completion_ids.shape[1], dtype=torch.long, device=completion_ids.device)
    any_stop = is_stop.any(dim=1)
    first[any_stop] = is_stop.int().argmax(dim=1)[any_stop]
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)[None, :]
    return (positions <= first[:, None]).long()


# --- The loss (TRL's GRPOTrainer._compute_loss, loss_type "dapo") ------------------------------------------------


def group_advantages(rewards: Any, group: int) -> Any:
    """(reward - its group's mean) / (its group's standard deviation + 1e-4); a prompt's completions are adjacent."""
    grouped = rewards.view(-1, group)
    mean = grouped.mean(dim=1).repeat_interleave(group)
    std = grouped.std(dim=1).repeat_interleave(group)
    return (rewards - mean) / (std + STD_EPS)


def per_token_logps(model: Any, prompt_ids: Any, prompt_mask: Any, completion_ids: Any, temperature: float) -> Any:
    """TRL's _get_per_token_logps: one forward of prompt + completion with its attention mask, the logits of the
    completion positions only (logits_to_keep), divided by the temperature, then selective_log_softmax."""
    import torch

    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)
    keep = completion_ids.shape[1]
    logits = model(input_ids=input_ids, attention_mask=mask, logits_to_keep=keep + 1).logits
    logits = logits[:, :-1, :] / temperature  # the last position predicts past the completion
    return selective_log_softmax(logits, completion_ids)


def dapo_loss(logps: Any, advantages: Any, mask: Any, epsilon: float, normaliser: float) -> Any:
    """The clipped objective per token, -min(r A, clip(r, 1 - eps, 1 + eps) A) with r = exp(logp - logp.detach())
    (one step per generation: the old policy is the current one), summed over the completion tokens and divided by
    the global batch's completion tokens over the processes (FSDP averages the gradients over them)."""
    import torch

    ratio = torch.exp(logps - logps.detach())
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon)
    per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])
    return (per_token * mask).sum() / normaliser


# --- The run (under torchrun) -----------------------------------------------------------------------------------


def train_step(c: dict[str, Any], policy: Any, copy: Any, optimizer: Any, prompts: list[dict], tokenizer: Any) -> dict:
    """One GRPO step on this rank's prompts: refresh the copy, generate, score, the loss, backward, clip, AdamW.
    Returns this rank's figures (the caller sums them over the ranks)."""
    import torch
    import torch.distributed as dist

    g, device = c["num_generations"], next(policy.parameters()).device
    start = time.perf_counter()
    refresh_weights(policy, copy)
    refreshed = time.perf_counter()
    prompt_ids, prompt_mask = left_padded([p["ids"] for p in prompts], c["pad_id"], device)
    out = copy.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        do_sample=True,
        temperature=c["temperature"],
        top_p=c["top_p"],
        top_k=0,  # TRL passes its top_k (default: none); transformers' own default of 50 would differ from ours
        max_new_tokens=c["max_new_tokens"],
        num_return_sequences=g,
        pad_token_id=c["pad_id"],
        eos_token_id=c["stops"],
    )
    generated = time.perf_counter()
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(g, 0), prompt_mask.repeat_interleave(g, 0)
    completion_ids = out[:, prompt_ids.shape[1] :]
    mask = completion_mask(completion_ids, c["stops"])
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    answers = [p["answer"] for p in prompts for _ in range(g)]
    scores = accuracy_reward([p["text"] for p in prompts for _ in range(g)], texts, answer=answers)
    rewards = torch.tensor([0.0 if s is None else s for s in scores], dtype=torch.float32, device=device)
    advantages = group_advantages(rewards, g)
    tokens = mask.sum().to(torch.float64)
    total_tokens = tokens.clone()
    dist.all_reduce(total_tokens)  # TRL's num_items_in_batch: the global batch's completion tokens
    logps = per_token_logps(policy, prompt_ids, prompt_mask, completion_ids, c["temperature"])
    loss = dapo_loss(logps, advantages, mask, c["epsilon"], float(total_tokens) / dist.get_world_size())
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    return {
        "loss_sum": float(loss.detach()) * float(total_tokens) / dist.get_world_size(),
        "completions": float(len(rewards)),
        "reward": float(rewards.sum()),
        "reward_sq": float((rewards**2).sum()),
        "completion_tokens": float(tokens),
        "prompt_tokens": float(prompt_mask.sum()),
        "stopped": float(torch.isin(completion_ids, torch.tensor(c["stops"], device=device)).any(dim=1).sum()),
        "generation_s": generated - start,
        "refresh_s": refreshed - start,
        "grad_norm": float(norm),
    }


def window(step: int, sums: dict[str, float], elapsed: float, world: int, peak: float) -> dict[str, Any]:
    """The step's record, in fsdp_train.py's metric names where it has them."""
    n = max(1.0, sums["completions"])
    mean = sums["reward"] / n
    return {
        "step": step,
        "seconds": elapsed,
        "loss": sums["loss_sum"] / max(1.0, sums["completion_tokens"]),
        "reward": mean,
        "reward_std": max(0.0, sums["reward_sq"] / n - mean**2) ** 0.5,
        "completion_length": sums["completion_tokens"] / n,
        "completions/truncated": 1.0 - sums["stopped"] / n,
        "grad_norm": sums["grad_norm"] / world,  # every rank has the global norm
        "trained_tokens": int(sums["completion_tokens"]),
        "tokens_per_s": (sums["prompt_tokens"] + sums["completion_tokens"]) / elapsed,
        # generated tokens over all ranks / the ranks' mean generation time, as fsdp_train.py reports it
        "generation_tokens_per_s": sums["completion_tokens"] / max(1e-9, sums["generation_s"] / world),
        "generation_s": sums["generation_s"] / world,
        "refresh_s": sums["refresh_s"] / world,
        "mem_peak_alloc_gb": peak / GIB,
    }


def baseline_worker(config_file: str) -> int:
    """One torchrun process of the TRL-style run; rank 0 writes the windows, every rank its RSS figures."""
    c = json.loads(Path(config_file).read_text())
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    rank, world, device, mesh, peaks = start_process_group()
    torch.manual_seed(c["seed"] + rank)  # generate's sampling
    model_dir = Path(c["model"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = build_sharded(model_dir, mesh, c["precision"], device, trainable=True)
    copy = generation_copy(model_dir, c["precision"], device)
    optimizer = adamw(policy, c["lr"])
    prompts = json.loads(Path(c["prompts"]).read_text())
    windows = []
    dist.barrier()
    for step, ranks in enumerate(c["schedule"]):
        peaks.reset()
        start = time.perf_counter()
        figures = train_step(c, policy, copy, optimizer, [prompts[i] for i in ranks[rank]], tokenizer)
        totals = torch.tensor(list(figures.values()), dtype=torch.float64)
        dist.all_reduce(totals)
        peak = torch.tensor([peaks.now()], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        elapsed = time.perf_counter() - start
        windows.append(window(step + 1, dict(zip(figures, totals.tolist())), elapsed, world, float(peak)))
        windows[-1]["first_prompt"] = ranks[0][0]  # rank 0's first prompt: the one our samples.jsonl shows
        if rank == 0:
            print(f"baseline step {step + 1}/{len(c['schedule'])}: {json.dumps(windows[-1])}", flush=True)
    write_worker_figures(c["out"], rank, peaks, windows)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":  # launched by torchrun from bench_grpo.run_baseline
    sys.exit(baseline_worker(sys.argv[1]))
