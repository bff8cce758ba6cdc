"""Per-GPU memory of full fine-tuning with FSDP and AdamW, as a table: the rule model_download.py prints after a
download and fsdp_train.py --dry-run prints for a run. Pure arithmetic; no torch."""

from __future__ import annotations

from collections.abc import Sequence


def training_memory_plan(
    num_params: int,
    world_sizes: Sequence[int] = (1, 2, 4, 8),
    largest_unit_params: int = 0,
    master_bytes: int = 4,
    grad_bytes: int = 4,
    optimizer_bytes: int = 8,
    compute_bytes: int = 2,
) -> list[dict[str, int | bool]]:
    """Per-GPU memory for full fine-tuning with FSDP and AdamW, without activations.

    Rule: fp32 master weights (4 B) + fp32 gradients (4 B) + AdamW's two fp32 moments (8 B) = 16 bytes per
    parameter, sharded evenly over the GPUs; plus, unsharded on every GPU, the compute copy of the largest FSDP
    unit (all-gathered) and its gradient before the reduce-scatter, compute_bytes each (bf16: 2; fp32: 4).
    With CPU offload (FSDP2 CPUOffloadPolicy) the sharded state lives in host RAM and the optimizer steps
    there, so the GPU holds only the unsharded unit. Activations, prefetch of the next unit, the CUDA context
    and allocator fragmentation are not included: leave headroom.
    """
    rows: list[dict[str, int | bool]] = []
    unsharded = largest_unit_params * compute_bytes * 2  # compute copy + its gradient
    for world_size in world_sizes:
        if world_size < 1:
            raise ValueError(f"world size must be >= 1, got {world_size}")
        shard = -(-num_params // world_size)  # ceil: shards are padded to equal size
        state = {
            "params_bytes": shard * master_bytes,
            "grads_bytes": shard * grad_bytes,
            "optimizer_bytes": shard * optimizer_bytes,
        }
        sharded_total = sum(state.values())
        for cpu_offload in (False, True):
            on_gpu = {key: 0 if cpu_offload else value for key, value in state.items()}
            rows.append(
                {
                    "world_size": world_size,
                    "cpu_offload": cpu_offload,
                    **on_gpu,
                    "unsharded_unit_bytes": unsharded,
                    "gpu_total_bytes": sum(on_gpu.values()) + unsharded,
                    "cpu_bytes_per_gpu": sharded_total if cpu_offload else 0,
                }
            )
    return rows


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(num_bytes) < 1000 or unit == "TB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1000
    raise AssertionError("unreachable")


def format_count(count: float) -> str:
    for unit in ("", "K", "M", "B"):
        if abs(count) < 1000 or unit == "B":
            return f"{count:.0f}" if unit == "" else f"{count:.2f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


# Bytes per value of the compute dtype, by --precision (fp32: no mixed precision, the unit is gathered in fp32).
COMPUTE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def format_memory_plan(rows: list[dict[str, int | bool]], compute: str = "bf16") -> str:
    """A table of training_memory_plan() rows, with the rule it uses (`compute`: the --precision they assume)."""
    unit = 2 * COMPUTE_BYTES[compute]
    lines = [
        "full fine-tuning memory per GPU (FSDP + AdamW; activations NOT included):",
        "  rule: 16 B/param sharded over the GPUs (fp32 weights 4 + fp32 grads 4 + Adam moments 8)",
        f"        + {unit} B/param of the largest FSDP unit unsharded ({compute} weights + {compute} grads)",
        f"  {'GPUs':>4}  {'GPU memory':>12}  {'with --cpu-offload: GPU':>24}  {'+ host RAM per GPU':>18}",
    ]
    by_world: dict[int, dict[bool, dict[str, int | bool]]] = {}
    for row in rows:
        by_world.setdefault(int(row["world_size"]), {})[bool(row["cpu_offload"])] = row
    for world_size, pair in by_world.items():
        plain, offload = pair[False], pair[True]
        lines.append(
            f"  {world_size:>4}  {format_bytes(plain['gpu_total_bytes']):>12}"
            f"  {format_bytes(offload['gpu_total_bytes']):>24}  {format_bytes(offload['cpu_bytes_per_gpu']):>18}"
        )
    return "\n".join(lines)


NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # 4-bit codes, an 8-bit scale per 64 weights, an fp32 factor per 256 scales


def peft_memory_plan(
    num_params: int,
    linear_params: int,
    adapter_params: int,
    world_sizes: Sequence[int] = (1, 2, 4, 8),
    largest_unit_params: int = 0,
    compute_bytes: int = 2,
) -> list[dict[str, float]]:
    """Per-GPU memory of --peft lora and qlora (no CPU offload), without activations.

    LoRA: the frozen base in the compute dtype (2 B/param, no gradients, no optimizer state) and the adapters at
    16 B/param (fp32 weights, gradients, AdamW moments), both sharded; plus the largest FSDP unit unsharded in the
    compute dtype (its gradients are only the adapters'). QLoRA: the decoder layers' Linear weights
    (`linear_params`) in NF4 (NF4_BYTES = 0.516 B/param), the rest as LoRA; the unit is all-gathered in NF4 and
    dequantised one Linear at a time (counted as the unit at NF4 plus a tenth of it in the compute dtype).
    """
    rows = []
    for world_size in world_sizes:
        for mode in ("lora", "qlora"):
            quantized = linear_params if mode == "qlora" else 0
            base = (num_params - quantized) * compute_bytes + quantized * NF4_BYTES
            sharded = (base + adapter_params * 16) / world_size
            unit_share = min(1.0, linear_params / max(1, num_params)) if mode == "qlora" else 0.0
            unit = largest_unit_params * (
                compute_bytes * (1 - unit_share) + unit_share * (NF4_BYTES + 0.1 * compute_bytes)
            )
            rows.append(
                {"mode": mode, "world_size": world_size, "sharded_bytes": sharded, "gpu_total_bytes": sharded + unit}
            )
    return rows


def format_peft_memory_plan(
    full_rows: list[dict[str, int | bool]], peft_rows: list[dict[str, float]], rank: int, compute: str = "bf16"
) -> str:
    """Full fine-tuning next to LoRA and QLoRA, per GPU, with the rule (`compute`: the --precision they assume)."""
    lines = [
        f"memory per GPU by --peft (rank-{rank} adapters on the decoder layers' Linear layers; activations NOT "
        "included):",
        f"  rule: full 16 B/param sharded; lora: base {COMPUTE_BYTES[compute]} B/param ({compute}) + adapters 16 "
        "B/param sharded; qlora: the decoder "
        f"Linear weights at {NF4_BYTES:.3f} B/param (NF4), the rest as lora; + the largest unit unsharded",
        f"  {'GPUs':>4}  {'full':>12}  {'lora':>12}  {'qlora':>12}",
    ]
    full = {int(r["world_size"]): r["gpu_total_bytes"] for r in full_rows if not r["cpu_offload"]}
    by_world: dict[int, dict[str, float]] = {}
    for row in peft_rows:
        by_world.setdefault(int(row["world_size"]), {})[str(row["mode"])] = row["gpu_total_bytes"]
    for world_size, modes in by_world.items():
        lines.append(
            f"  {world_size:>4}  {format_bytes(full.get(world_size, 0)):>12}  {format_bytes(modes['lora']):>12}"
            f"  {format_bytes(modes['qlora']):>12}"
        )
    return "\n".join(lines)


GIB = 2**30
HEADROOM_BYTES = 5 * 10**9  # the CUDA context, the allocator's slack, the next unit's prefetch: left free
GPU_SIZES_GB = (80, 141)  # H100/A100 80GB, H200


# Values per token x hidden of attention's gradients in flight during a layer's backward (activation_bytes_per_token)
BACKWARD_ATTENTION_GRADIENTS = 6


def activation_bytes_per_token(
    hidden: int,
    intermediate: int,
    layers: int,
    kv_dim: int,
    checkpointing: bool = True,
    context_parallel: int = 1,
    compute_bytes: int = 2,
    offload: bool = False,
    mlp_tiles: int = 1,
    kv_copies: int = 1,
    every_n: int = 1,
) -> int:
    """Activation bytes per token a GPU holds at the peak of a step, with varlen attention (nothing grows with
    the sequence squared; the dense document mask would add T x T bytes per row).

    Rule: with activation checkpointing each decoder layer keeps its input (hidden x 2 B), and one layer at a
    time holds everything it saves for backward while it is recomputed: q, the attention output, the o-proj
    input, two norm inputs and the residual (6 x hidden), k and v (2 x kv_dim), the MLP's gate, up, activation and
    down input (4 x intermediate), all x 2 B. Without checkpointing every layer holds that. The loss adds the
    decoder output's fp32 gradient and its bf16 copy (6 B x hidden). Under --context-parallel the all-to-alls copy
    q, k, v and the output twice (2 x (2 x hidden + 2 x kv_dim) x 2 B). While a layer runs backward its gradients
    are in flight too: the MLP's gate and up gradients (2 x intermediate; one tile's with --tiled-mlp) and about
    6 x hidden for attention's (q's, the output's and the o-proj input's, the kernel's fp32 accumulator), x 2 B.

    Checked on an H200 (BENCHMARKS.md rows 11 and 16), the 1B preset, activation checkpointing on, with the
    model state's 17.1 GB: seq 8192 peaked at 18.07 GB (the rule: 19.0); 262,144 at 70.0 GB (76.7); 393,216 at
    98.5 GB (106.5); 786,432 with --activation-offload and --tiled-mlp 8 at 84.9 GB (83.2). Without the backward's
    gradients the rule had said 61.7, 84.0 and 60.6 GB for the long ones: 12-29% short; with them it errs 5-10%
    on the safe side for the plain runs and 2% short for the offloaded one, inside the 5 GB the planner leaves
    free. One model's three points fit two terms only roughly: a rule, not a measurement of other shapes.

    --tiled-mlp N: a layer saves its MLP's input (hidden) instead of the 4 x intermediate, and one tile's
    4 x intermediate / N exists at a time. --activation-offload: what the layers save goes to host memory
    (offloaded_bytes_per_token), and the GPU holds one layer's worth at a time, while it runs or is recomputed
    (with checkpointing, that layer's input brought back too).

    kv_copies: --context-parallel above the key/value heads copies each head to degree / kv-heads processes before
    the all-to-all (varlen.py), so the k and v that attention saves, and their all-to-all copies, are kv_copies x
    kv_dim per token of this process's part. every_n (--ac-every-n-layers): only every Nth layer is checkpointed
    (checkpointed_layers); the others keep all they save, as without checkpointing."""
    kv_dim *= kv_copies
    transient = 4 * intermediate // mlp_tiles if mlp_tiles > 1 else 0
    one_layer = _saved_per_layer(hidden, intermediate, kv_dim, mlp_tiles) * compute_bytes
    wrapped = checkpointed_layers(layers, every_n) if checkpointing else 0
    if offload:
        kept = one_layer + (hidden * compute_bytes if checkpointing else 0)
    else:
        # the peak: backward's start (every layer left out holds its saved tensors), or the recompute of the last
        # checkpointed layer (the layers left out below it, and the recomputed one)
        below_last = (wrapped - 1) * (every_n - 1) + 1 if wrapped else 0
        kept = wrapped * hidden * compute_bytes + max(layers - wrapped, below_last) * one_layer
    ulysses = 2 * (2 * hidden + 2 * kv_dim) * compute_bytes if context_parallel > 1 else 0
    backward = (2 * intermediate // max(1, mlp_tiles) + BACKWARD_ATTENTION_GRADIENTS * hidden) * compute_bytes
    return kept + transient * compute_bytes + 6 * hidden + ulysses + backward


def offloaded_bytes_per_token(
    hidden: int, intermediate: int, layers: int, kv_dim: int, checkpointing: bool = True, compute_bytes: int = 2,
    mlp_tiles: int = 1, kv_copies: int = 1, every_n: int = 1,
) -> int:  # fmt: skip
    """Host memory per token that --activation-offload fills: every layer's saved tensors (a checkpointed layer's:
    its input; kv_copies and every_n as in activation_bytes_per_token)."""
    wrapped = checkpointed_layers(layers, every_n) if checkpointing else 0
    saved = _saved_per_layer(hidden, intermediate, kv_dim * kv_copies, mlp_tiles)
    return (wrapped * hidden + (layers - wrapped) * saved) * compute_bytes


def checkpointed_layers(layers: int, every_n: int) -> int:
    """How many of `layers` decoder layers --ac-every-n-layers N checkpoints: the 1st, the (N+1)th, ... (build.py)."""
    return -(-layers // max(1, every_n))


def _saved_per_layer(hidden: int, intermediate: int, kv_dim: int, mlp_tiles: int) -> int:
    """Values per token one decoder layer saves for backward: q, the attention output, the o-proj input, two norm
    inputs and the residual (6 x hidden), k and v (2 x kv_dim), and the MLP's gate, up, activation and down input
    (4 x intermediate), or with --tiled-mlp only its input (hidden)."""
    return 6 * hidden + 2 * kv_dim + (hidden if mlp_tiles > 1 else 4 * intermediate)


def longest_sequence(
    gpu_bytes: float, state_bytes: float, per_token: int, fixed_bytes: float, micro_batch: int, context_parallel: int
) -> int:
    """The longest --seq-length whose activations fit beside the model state on one GPU, leaving HEADROOM_BYTES:
    each GPU holds micro_batch x seq / context_parallel tokens. Rounded down to a multiple of 1024 x the
    degree (0 when not even that fits)."""
    tokens = (gpu_bytes - state_bytes - fixed_bytes - HEADROOM_BYTES) / per_token
    step = 1024 * context_parallel
    return max(0, int(tokens * context_parallel / micro_batch) // step * step)


def format_long_context_plan(
    per_token: int,
    state_bytes: float,
    fixed_bytes: float,
    seq_length: int,
    micro_batch: int,
    context_parallel: int,
    offloaded_per_token: int = 0,
    mlp_tiles: int = 1,
    kv_copies: int = 1,
    position_limit: int | None = None,
    every_n: int = 1,
) -> str:
    """The activation line of --dry-run and the longest sequence per GPU size, with the rule; a length beyond the
    model's positions (`position_limit`, its max_position_embeddings) is shown capped there."""
    tokens = micro_batch * seq_length // context_parallel
    extras = [f"--ac-every-n-layers {every_n}"] if every_n > 1 else []
    extras += [f"--tiled-mlp {mlp_tiles}"] if mlp_tiles > 1 else []
    extras += ["--activation-offload on"] if offloaded_per_token else []
    lines = [
        f"activations per GPU: {format_bytes(per_token)}/token x {tokens:,} tokens (--seq-length {seq_length:,} x "
        f"-b {micro_batch} / --context-parallel {context_parallel}) = {format_bytes(per_token * tokens)}, plus "
        f"{format_bytes(fixed_bytes)} for one loss chunk's fp32 logits; "
        f"with the model state ({format_bytes(state_bytes)}): {format_bytes(state_bytes + fixed_bytes + per_token * tokens)}",
        "  rule (activation_bytes_per_token): checkpointed layer inputs + one layer's saved tensors at a time + the "
        "loss's hidden-state gradient ("
        + (f"the layers --ac-every-n-layers {every_n} leaves out keep all they save; " if every_n > 1 else "")
        + "+ the all-to-all copies with --context-parallel"
        + (f", each key/value head copied to {kv_copies} processes" if kv_copies > 1 else "")
        + (", one MLP tile's intermediate with --tiled-mlp" if mlp_tiles > 1 else "")
        + (", the layers' saved tensors in host memory with --activation-offload" if offloaded_per_token else "")
        + "); no T x T term (varlen)",
    ]
    if offloaded_per_token:
        lines.append(
            f"  host memory per GPU for --activation-offload: {format_bytes(offloaded_per_token)}/token x {tokens:,} "
            f"tokens = {format_bytes(offloaded_per_token * tokens)} (pinned on a GPU machine)"
        )
    lines.append(
        f"  longest --seq-length that fits one GPU beside this state ({format_bytes(HEADROOM_BYTES)} left free), "
        f"-b {micro_batch}, --context-parallel {context_parallel}"
        + "".join(f", {extra}" for extra in extras)
        + ": "
        + ", ".join(
            f"{gb} GB: "
            + _capped(
                longest_sequence(gb * 1e9, state_bytes, per_token, fixed_bytes, micro_batch, context_parallel),
                position_limit,
            )
            for gb in GPU_SIZES_GB
        )
    )
    return "\n".join(lines)


def _capped(longest: int, position_limit: int | None) -> str:
    if position_limit is None or longest <= position_limit:
        return f"{longest:,}"
    return f"{position_limit:,} (the model's max_position_embeddings; memory allows {longest:,})"
