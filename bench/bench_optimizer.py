"""The optimizer step over many small sharded tensors (LoRA's case): fsdp_train.py's step on the local shards
(train/optim.py: global_grad_norm + fused_adamw_on_local_shards) against the step it replaced, written here as the
baseline: torch.nn.utils.get_total_norm over the DTensor gradients, full_tensor(), a _foreach_mul_ clip pass and
AdamW(fused=True).step() dispatching through DTensor.

    python bench/bench_optimizer.py             # CPU, 2 processes (gloo): 224 tensors; about a minute
    python bench/bench_optimizer.py --quick     # seconds

The model: 112 pairs of Linear(512, 16) / Linear(16, 512) without bias (224 tensors, 1.8M parameters: the shapes
of rank-16 adapters), each pair its own fully_shard unit, fp32. Every repetition sets the same random gradients,
then times one step of each side, interleaved, after warm-up; the medians are compared. The two sides start from
the same parameters and state, and their parameters after the first step are compared (they differ only by
rounding: the clip is a multiply on one side, a divide inside the fused kernel on the other).
Goal (issue 32): the new step at least 3x faster.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PAIRS, WIDTH, RANK = 112, 512, 16


def build(seed: int):
    import torch
    import torch.nn as nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.ModuleList(
        nn.Sequential(nn.Linear(WIDTH, RANK, bias=False), nn.Linear(RANK, WIDTH, bias=False)) for _ in range(PAIRS)
    )
    for pair in model:  # each pair a unit (a ModuleList has no forward to shard)
        fully_shard(pair)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), fused=True)
    return model, optimizer


def set_grads(model, seed: int) -> None:
    import torch
    from torch.distributed.tensor import distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=gen)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements)


def old_step(model, optimizer, clip: float = 1.0) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters()]
    norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    found_inf = (~torch.isfinite(norm)).float()
    coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
    torch._foreach_mul_([g.to_local() for g in grads], coef)
    optimizer.found_inf = found_inf
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def new_step(model, optimizer, clip: float = 1.0) -> None:
    import torch

    from fsdp_lib.train.optim import fused_adamw_on_local_shards, global_grad_norm

    norm = global_grad_norm([p.grad for p in model.parameters()])
    found_inf = (~torch.isfinite(norm)).float()
    coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
    fused_adamw_on_local_shards(optimizer, 1.0 / coef, found_inf)
    optimizer.zero_grad(set_to_none=True)


def worker(reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    sides = {"old": (build(0), old_step), "new": (build(0), new_step)}
    set_grads(sides["old"][0][0], 1)
    set_grads(sides["new"][0][0], 1)
    for (model, optimizer), step in sides.values():
        step(model, optimizer)
    first = {name: torch.cat([p.to_local().flatten() for p in m.parameters()]) for name, ((m, _), _) in sides.items()}
    difference = float((first["old"] - first["new"]).abs().max())
    times: dict[str, list[float]] = {"old": [], "new": []}
    for rep in range(reps + 3):
        for name, ((model, optimizer), step) in sides.items():
            set_grads(model, rep + 2)
            dist.barrier()
            start = time.perf_counter()
            step(model, optimizer)
            if rep >= 3:
                times[name].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"times": times, "max_param_difference": difference}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import subprocess
    import tempfile

    from common import REPO_ROOT, bench_arg_parser, machine_info, median, print_table, write_results

    from fsdp_lib.testing import torchrun_command

    parser = bench_arg_parser(__doc__.split("\n\n")[0])
    args = parser.parse_args(argv)
    reps = 5 if args.quick else 40
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        cmd = torchrun_command(__file__, ["--worker", str(reps), str(out)])
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            print((proc.stdout + proc.stderr)[-3000:])
            return 1
        result = json.loads(out.read_text())
    old, new = (median(result["times"][k]) * 1000 for k in ("old", "new"))
    print(f"{2 * PAIRS} tensors ({PAIRS} pairs of {WIDTH}x{RANK}), fp32, 2 processes, {reps} timed steps each side")
    print_table(["step", "median (ms)"], [["DTensor (before)", round(old, 3)], ["local shards (now)", round(new, 3)]])
    speedup = old / new
    print(f"speed-up {speedup:.2f}x (goal >= 3x: {'met' if speedup >= 3 else 'NOT met'}); parameters after the "
          f"first step differ by at most {result['max_param_difference']:.2e}")  # fmt: skip
    write_results(
        args.results_dir, "optimizer", {"machine": machine_info(), "reps": reps, **result, "speedup": speedup}
    )
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":  # run with PYTHONPATH at the repository root
        from fsdp_lib.interrupts import exit_without_teardown  # a worker skips the interpreter teardown

        worker(int(sys.argv[2]), sys.argv[3])
        exit_without_teardown(0)
    sys.exit(main())
