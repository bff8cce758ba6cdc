"""The size presets of `model_download.py --init`: Llama-style shapes from a CPU-sized `tiny` to 70B, the size flags
that change a preset's shape and what makes a custom shape unbuildable, and the exact parameter count of a shape.
Pure arithmetic; no torch."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class SizePreset:
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    default_vocab_size: int


# Llama-style shapes: 20M is a small GQA model for CPU runs (head_dim 64, 8/3 * hidden rounded to a multiple of
# 128); 125M is SmolLM-135M's shape (30 narrow layers, GQA 9/3; 135M there with its 49152 vocab);
# 350M is GPT-3-Medium-like; 1B/3B follow Llama-3.2-1B/3B (GQA, tied embeddings);
# 7B/13B follow Llama-2; 30B is LLaMA-1 33B; 70B is Llama-2-70B (GQA with 8 kv heads).
# intermediate_size as in those models; 350M uses Llama's 8/3 * hidden rounded up to a multiple of 256.
# Exact counts per vocabulary: preset_parameter_count (20M: 21,730,176 and 125M: 124,635,456 with 32000 tokens).
SIZE_PRESETS: dict[str, SizePreset] = {
    "tiny": SizePreset(2, 64, 4, 2, 176, 512, True, 1024),
    "20M": SizePreset(6, 384, 6, 2, 1024, 2048, True, 32000),
    "125M": SizePreset(30, 576, 9, 3, 1536, 2048, True, 32000),
    "350M": SizePreset(24, 1024, 16, 16, 2816, 4096, True, 32000),
    "1B": SizePreset(16, 2048, 32, 8, 8192, 4096, True, 32000),
    "3B": SizePreset(28, 3072, 24, 8, 8192, 4096, True, 32000),
    "7B": SizePreset(32, 4096, 32, 32, 11008, 4096, False, 32000),
    "13B": SizePreset(40, 5120, 40, 40, 13824, 4096, False, 32000),
    "30B": SizePreset(60, 6656, 52, 52, 17920, 4096, False, 32000),
    "70B": SizePreset(80, 8192, 64, 8, 28672, 4096, False, 32000),
}


def preset_config_kwargs(preset: SizePreset, vocab_size: int) -> dict[str, Any]:
    """LlamaConfig keyword arguments for a preset (special-token ids are added by the caller)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "max_position_embeddings": preset.max_position_embeddings,
        "tie_word_embeddings": preset.tie_word_embeddings,
    }


# --init size flags: (flag, SizePreset field) for custom shapes on top of a preset
SIZE_FLAGS: dict[str, str] = {
    "--num-layers": "num_hidden_layers",
    "--hidden-size": "hidden_size",
    "--num-heads": "num_attention_heads",
    "--num-kv-heads": "num_key_value_heads",
    "--intermediate-size": "intermediate_size",
}


# Bounds checked before any work: a typo of 100000000 layers would build modules for hours.
SIZE_LIMITS = {
    "--num-layers": 1024,
    "--hidden-size": 65536,
    "--num-heads": 1024,
    "--num-kv-heads": 1024,
    "--intermediate-size": 262144,
}


def apply_size_overrides(preset: SizePreset, overrides: dict[str, int]) -> SizePreset:
    return replace(preset, **{SIZE_FLAGS[flag]: value for flag, value in overrides.items()})


def size_problems(preset_name: str, overrides: dict[str, int]) -> list[str]:
    """What makes a custom shape unbuildable, each naming the flag and the fix (the preset's own values count too)."""
    problems = [f"{flag} {value} must be a positive integer" for flag, value in overrides.items() if value < 1]
    problems += [
        f"{flag} {value:,} is above {SIZE_LIMITS[flag]:,}, far beyond any published model (70B: {flag} "
        f"{getattr(SIZE_PRESETS['70B'], SIZE_FLAGS[flag]):,}); check the number"
        for flag, value in overrides.items()
        if value > SIZE_LIMITS[flag]
    ]
    if problems:
        return problems
    shape = apply_size_overrides(SIZE_PRESETS[preset_name], overrides)
    hidden, heads, kv_heads = shape.hidden_size, shape.num_attention_heads, shape.num_key_value_heads

    def source(flag: str, value: int) -> str:
        return f"{flag} {value}" if flag in overrides else f"{flag} {value} (preset {preset_name})"

    if hidden % heads:
        problems.append(
            f"{source('--hidden-size', hidden)} is not divisible by {source('--num-heads', heads)}: each head gets"
            f" hidden/heads dimensions; pick --num-heads dividing {hidden} (e.g. {hidden // 64 or 1} for head size 64)"
            " or a --hidden-size that is a multiple of it"
        )
    elif (hidden // heads) % 2:
        problems.append(
            f"{source('--hidden-size', hidden)} / {source('--num-heads', heads)} = head size {hidden // heads}, which"
            " is odd; rotary position embeddings need an even head size: change --num-heads or --hidden-size"
        )
    if heads % kv_heads:
        problems.append(
            f"{source('--num-heads', heads)} is not divisible by {source('--num-kv-heads', kv_heads)}: grouped-query"
            f" attention shares each kv head among heads/kv-heads query heads; pick --num-kv-heads dividing {heads}"
        )
    return problems


def describe_init(preset_name: str, overrides: dict[str, int]) -> str:
    """`--init 125M --num-layers 12`: how the user asked for this shape, for logs and the verification record."""
    return " ".join([f"--init {preset_name}", *(f"{flag} {value}" for flag, value in overrides.items())])


def preset_parameter_count(preset: SizePreset, vocab_size: int) -> int:
    """Exact parameter count of a preset Llama model (no biases; tied embeddings counted once)."""
    hidden, head_dim = preset.hidden_size, preset.hidden_size // preset.num_attention_heads
    attention = 2 * hidden * preset.num_attention_heads * head_dim + 2 * hidden * preset.num_key_value_heads * head_dim
    mlp = 3 * hidden * preset.intermediate_size  # gate, up, down (SwiGLU)
    per_layer = attention + mlp + 2 * hidden  # + input and post-attention RMSNorm weights
    embeddings = vocab_size * hidden * (1 if preset.tie_word_embeddings else 2)
    return preset.num_hidden_layers * per_layer + embeddings + hidden  # + final norm
