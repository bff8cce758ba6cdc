"""--context-parallel N checked before any process group: it divides the processes and --seq-length, attention runs
through the varlen kernel, and the model's heads (read from its config.json) split N ways (Ulysses); each refusal
names the largest degree that works. model/build.py checks the built model again with the same rule."""

from __future__ import annotations

import json

from fsdp_lib.config import TrainConfig
from fsdp_lib.offline import resolve_model_dir


def context_problems(cfg: TrainConfig, world_size: int) -> list[str]:
    """--context-parallel N against the processes, --seq-length, the attention kernel and the heads in config.json."""
    n = cfg.context_parallel
    if n == 1:
        return []
    if n < 1:
        return [f"--context-parallel must be 1 or more (got {n}); 1 = each sequence on one process"]
    problems = []
    if world_size == 1:
        problems.append(
            f"--context-parallel {n} splits each sequence over {n} processes, and this is one process: start it with "
            f"torchrun --nproc_per_node {n} (or a multiple of {n}), or leave --context-parallel out"
        )
    elif world_size % n:
        problems.append(
            f"--context-parallel {n} does not divide the {world_size} processes; use a divisor of {world_size}"
        )
    if cfg.seq_length % n:
        problems.append(f"--context-parallel {n} does not divide --seq-length {cfg.seq_length}; use a multiple of {n}")
    if cfg.attn_implementation not in ("auto", "varlen"):
        problems.append(
            f"--context-parallel {n} runs attention through the varlen kernel (each process attends over whole "
            f"sequences for its heads); --attn-implementation {cfg.attn_implementation} cannot: use auto or varlen"
        )
    if not problems and (heads := config_heads(cfg.model_name)):
        problems += [problem] if (problem := context_heads_problem(n, *heads, world_size, cfg.seq_length)) else []
    return problems


def config_heads(model_name: str) -> tuple[int, int, str] | None:
    """(attention heads, key/value heads, architecture) from the model folder's config.json, or None where it does
    not say (the check then happens when the model is built)."""
    try:
        config = json.loads((resolve_model_dir(model_name) / "config.json").read_text(encoding="utf-8"))
        text = config.get("text_config") or config
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    name = (config.get("architectures") or [f"the {config.get('model_type', '')} model".replace("  ", " ")])[0]
    return (heads, kv_heads, name) if heads > 0 and kv_heads > 0 else None


def context_degree_fits(heads: int, kv_heads: int, n: int) -> bool:
    """Whether N processes can each attend with 1/N of the query heads (Ulysses): N divides the query heads, and
    the key/value heads split evenly or, fewer than N, are each replicated to N / kv_heads processes (varlen.py)."""
    return heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)


def context_heads_problem(n: int, heads: int, kv_heads: int, model: str, world: int, seq_length: int) -> str | None:
    """--context-parallel N against the model's heads: the message naming the largest degree that works, or None."""
    if context_degree_fits(heads, kv_heads, n):
        return None
    fits = [m for m in range(n, 0, -1) if context_degree_fits(heads, kv_heads, m) and not (world % m or seq_length % m)]
    return (
        f"--context-parallel {n}: each process attends with 1/{n} of the heads, and {model} has {heads} attention "
        f"and {kv_heads} key/value heads (the degree must divide the attention heads, and divide or be a multiple of "
        f"the key/value heads); the largest that works (and divides the processes and --seq-length) is {fits[0]}: "
        f"use --context-parallel {fits[0]}"
    )
