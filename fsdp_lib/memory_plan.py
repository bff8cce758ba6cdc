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
    parameter, sharded evenly over the GPUs; plus, unsharded on every GPU, the bf16 copy of the largest FSDP
    unit (2 B/param, all-gathered for compute) and its bf16 gradient before the reduce-scatter (2 B/param).
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


def format_memory_plan(rows: list[dict[str, int | bool]]) -> str:
    """A table of training_memory_plan() rows, with the rule it uses."""
    lines = [
        "full fine-tuning memory per GPU (FSDP + AdamW; activations NOT included):",
        "  rule: 16 B/param sharded over the GPUs (fp32 weights 4 + fp32 grads 4 + Adam moments 8)",
        "        + 4 B/param of the largest FSDP unit unsharded (bf16 weights + bf16 grads)",
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
