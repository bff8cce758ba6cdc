"""Where a LoRA step's time goes next to full fine-tuning's: `fsdp_train.py --profile-steps` over two steps of each
mode at bench_peft's setting, then the operators that differ most in device time (host time on a CPU).

    python bench/profile_peft.py                 # a GPU: bench_peft's 1B setting (seq 2048, micro-batch 4, bf16)
    python bench/profile_peft.py --compiled      # --compile on, activation checkpointing off
    python bench/profile_peft.py --quick         # CPU: bench_peft's quick Llama, 1 process (the plumbing only)

Runs: full fine-tuning, LoRA (fused kernel) and LoRA with `--lora-kernel peft`, one launch each of 10 steps, steps 7
and 8 profiled. Prints each run's tokens/s and phase times (metrics.jsonl) and a table of the operators whose total
over the two steps differs most between LoRA and full fine-tuning; on a GPU, from each trace, the kernels' time per
step by kind and the device's busy time against its span and per phase (busy well below the span: the host is the
bottleneck; trace_summary). The tables (profile/rank0.txt) and, gzipped, the
traces go to --results-dir/profile_peft/<mode>, the figures to --results-dir/profile_peft.json.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import bench_peft
from common import REPO_ROOT, bench_arg_parser, machine_info, median, print_table, work_folder, write_results
from inputs import make_corpus, make_llama_folder, save_text_dataset
from launch import gpus_hidden, torchrun

MODES = (("full", "none", ()), ("lora", "lora", ()), ("lora_peft", "lora", ("--lora-kernel", "peft")))
PROFILED = "7:8"
PROFILED_STEPS = 2
UNPROFILED = (4, 6, 10)  # the 2-step metric windows after the first that the profiler is not running in
UNITS_US = {"us": 1.0, "ms": 1e3, "s": 1e6}


def operator_times(table: str, column: str) -> dict[str, float]:
    """Microseconds per operator name from a profiler table's `column` ("Self CUDA" or "Self CPU")."""
    lines = table.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("Name"))
    cells = re.split(r"\s{2,}", header.strip())
    index = cells.index(column)
    times: dict[str, float] = {}
    for line in lines[lines.index(header) + 2 :]:
        row = re.split(r"\s{2,}", line.strip())
        if len(row) != len(cells):
            continue
        value = re.fullmatch(r"([\d.]+)(us|ms|s)", row[index])
        if value:
            times[row[0]] = float(value.group(1)) * UNITS_US[value.group(2)]
    return times


# Kernel names -> what they are, first match wins (cuBLAS's nvjet/cutlass matmuls, flash attention, fused AdamW's
# multi-tensor kernels, inductor's triton kernels, the copies, ATen's elementwise kernels).
KERNEL_KINDS = (
    ("matmul", ("nvjet", "cutlass", "gemm", "xmma")),
    ("attention", ("flash",)),
    ("optimizer", ("multi_tensor",)),
    ("triton", ("triton",)),
    ("copy", ("Memcpy", "Memset", "chunk_cat", "split_with_sizes", "CatArray")),
    ("elementwise", ("elementwise", "reduce_kernel")),
)
DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


def kernel_kind(name: str) -> str:
    return next((kind for kind, keys in KERNEL_KINDS if any(k in name for k in keys)), "other")


def trace_summary(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per profiled step, from a trace's events: the device's kernel time by kind, its busy time (the union of the
    kernels' intervals, all streams) against the span from the first kernel to the last, and for the step loop's
    `forward` and `update` ranges as the device saw them, each window and the kernel time inside it (the backward
    runs on autograd's own thread, so its range holds no kernel: it is the rest of the span). Busy well below the
    span means the GPU waited for the host. Empty without a GPU (no kernel events)."""
    kernels = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") in DEVICE_EVENTS)
    if not kernels:
        return {}
    kinds: dict[str, float] = {}
    busy, (start, end, _) = 0.0, kernels[0]
    for a, b, name in kernels:
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + (b - a)
        if a > end:
            busy, start = busy + end - start, a
        end = max(end, b)
    busy += end - start
    phases: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "gpu_user_annotation" and e["name"] in ("forward", "update"):
            inside = sum(max(0.0, min(b, e["ts"] + e["dur"]) - max(a, e["ts"])) for a, b, _ in kernels)
            window = phases.setdefault(e["name"], [0.0, 0.0])
            window[0], window[1] = window[0] + e["dur"], window[1] + inside
    ms = lambda us: round(us / 1e3 / steps, 2)  # noqa: E731
    return {
        "span_ms": ms(kernels[-1][1] - kernels[0][0]),
        "busy_ms": ms(busy),
        "kernel_ms": {kind: ms(t) for kind, t in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "phases_ms": {name: {"window": ms(w), "kernels": ms(k)} for name, (w, k) in phases.items()},
    }


def keep(run_dir: Path, out: Path) -> None:
    """Rank 0's table and gzipped trace under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(run_dir / "profile" / "rank0.txt", out / "rank0.txt")
    with open(run_dir / "profile" / "rank0.json", "rb") as src, gzip.open(out / "rank0.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)


def launch(
    work: Path, dataset: Path, model: Path, p: dict[str, Any], name: str, mode: str, flags: tuple[str, ...]
) -> Path:
    """One fsdp_train.py run of bench_peft's setting `p` with `--peft mode` and `flags`, steps PROFILED profiled;
    its folder (kept, unlike bench_peft.run_mode's)."""
    args = [*bench_peft.trainer_args(work, dataset, model, p, name, mode), "--profile-steps", PROFILED, *flags]
    torchrun(REPO_ROOT / "fsdp_train.py", args, p["nproc"])
    return work / "outputs" / name


def main(argv: list[str] | None = None) -> int:
    parser = bench_arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="--compile on and activation checkpointing off (gpu_check's speed setting) instead of bench_peft's",
    )
    parser.add_argument("--batch", type=int, default=0, help="micro-batch size (default: bench_peft's)")
    parser.add_argument(
        "--modes", default="", help="runs, comma-separated, full and lora among them (default: all; --quick: full,lora)"
    )
    args = parser.parse_args(argv)
    chosen = (args.modes or ("full,lora" if args.quick else ",".join(m[0] for m in MODES))).split(",")
    if not {"full", "lora"} <= set(chosen) or not set(chosen) <= {m[0] for m in MODES}:
        parser.error(f"--modes {args.modes}: give full and lora, and optionally lora_peft")
    import torch

    gpu = torch.cuda.is_available() and not args.quick
    p: dict[str, Any] = dict(bench_peft.GPU_FULL) if gpu else {**bench_peft.CPU_QUICK, "nproc": 1, "precision": "fp32"}
    p.update(steps=10, log_freq=2)
    p["batch"] = args.batch or p["batch"]
    compiled = ("--compile", "on") if args.compiled else ()
    if args.compiled:
        p["activation_checkpointing"] = "off"
    modes = [m for m in MODES if m[0] in chosen]
    column = "Self CUDA" if gpu else "Self CPU"
    runs: dict[str, dict[str, Any]] = {}
    with work_folder(args, "profile_peft_") as work, gpus_hidden(not gpu):
        docs = make_corpus(bench_peft.CORPUS_CHARS["quick"])
        dataset = save_text_dataset(docs, work / "dataset")
        if gpu:
            model = bench_peft.init_model(work, dataset, p, "model")
        else:
            model = make_llama_folder(work / "model", docs[:200], p["hidden"], p["layers"], p["vocab"], 512, "bfloat16")
        for name, mode, extra in modes:
            run_dir = launch(work, dataset, model, p, name, mode, (*extra, *compiled))
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            rows = [row for row in rows if "tokens_per_s" in row and row["step"] in UNPROFILED]
            phases = {k: round(median([row[k] for row in rows]), 1) for k in rows[-1] if k.startswith("time_")}
            tokens_per_s = median([row["tokens_per_s"] for row in rows])
            table = (run_dir / "profile" / "rank0.txt").read_text()
            events = json.loads((run_dir / "profile" / "rank0.json").read_text())["traceEvents"]
            device = trace_summary(events, PROFILED_STEPS)
            ops = operator_times(table, column)
            runs[name] = {"tokens_per_s": tokens_per_s, "phases": phases, "ops": ops, "device": device}
            keep(run_dir, args.results_dir / "profile_peft" / name)
            shutil.rmtree(run_dir)  # its checkpoint and export (for 1B, ~10 GB) are not needed
            print(f"{name}: {tokens_per_s:,.0f} tokens/s (steps 3-6, 9-10), phases per step {phases}", flush=True)
            print(table, flush=True)
            if device:
                print(f"{name}: per profiled step, device {device}", flush=True)
    full, lora = runs["full"]["ops"], runs["lora"]["ops"]
    diffs = sorted(set(full) | set(lora), key=lambda op: -abs(lora.get(op, 0.0) - full.get(op, 0.0)))
    print_table(
        ["operator", f"full {column} (ms, 2 steps)", "LoRA (ms)", "LoRA, peft's modules (ms)", "LoRA - full (ms)"],
        [
            [
                op[:60],
                f"{full.get(op, 0.0) / 1e3:.1f}",
                f"{lora.get(op, 0.0) / 1e3:.1f}",
                f"{runs['lora_peft']['ops'].get(op, 0.0) / 1e3:.1f}" if "lora_peft" in runs else "-",
                f"{(lora.get(op, 0.0) - full.get(op, 0.0)) / 1e3:+.1f}",
            ]
            for op in diffs[:25]
        ],
    )
    results = {name: {**r, "ops": dict(sorted(r["ops"].items(), key=lambda kv: -kv[1]))} for name, r in runs.items()}
    write_results(args.results_dir, "profile_peft", {"machine": machine_info(), "setting": p, "runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
