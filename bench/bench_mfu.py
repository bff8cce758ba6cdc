"""Tokens/s, MFU, peak memory and phase times of fsdp_train.py on one GPU: a ~1B Llama at seq 2048 in bf16,
swept over micro-batch x activation checkpointing x compile.

    python bench/bench_mfu.py                                  # one GPU: the 1B preset, seq 2048, bf16
    python bench/bench_mfu.py --micro-batches 4,8 --steps 40   # a narrower sweep, longer runs
    python bench/bench_mfu.py --quick                          # CPU, seconds: the tiny preset, nominal MFU

Inputs are made here, nothing is downloaded: a generated pseudo-prose corpus saved as a `datasets.Dataset`
(the layout data_hf.py writes; fsdp_train.py packs it into --seq-length blocks itself), and a model folder from
`model_download.py --init 1B --tokenizer-from <corpus>` (Llama-3.2-1B shapes, a BPE tokenizer trained on the
corpus, no weight files: fsdp_train.py initialises random weights on the shards).

Every setting is one `torchrun --nproc_per_node 1 fsdp_train.py` launch for --steps optimizer steps, the metric
line every --log-freq steps. The figures are fsdp_train.py's own from metrics.jsonl: the first window (warm-up,
compilation) is skipped and the median of the others reported for tokens_per_s, mfu and the time_*_ms phase
timers; peak memory is the highest mem_peak_alloc_gb of those windows (CUDA: the allocator's peak; CPU: VmHWM).
MFU is fsdp_train.py's: (6N + 12*L*H*Q*T) x tokens/s over the device's peak (its built-in table, or
--peak-tflops). A setting that runs out of memory is reported as OOM and the sweep goes on.

With --quick (CPU, fp32, the tiny preset, seq 64) the peak is a nominal 1 TFLOP/s (--peak-tflops 1.0), so its
MFU column is labelled nominal: it proves the plumbing, not a figure.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

from common import REPO_ROOT, bench_arg_parser, last_loss, machine_info, median, print_table, work_folder, write_results
from inputs import corpus_and_model
from launch import report_failures, run_trainer

FULL = {
    "preset": "1B",
    "seq": 2048,
    "precision": "bf16",
    "micro_batches": (2, 4, 8),
    "activation_checkpointing": ("on", "off"),
    "compile": ("off", "on"),
    "steps": 30,
    "log_freq": 10,
    "corpus_chars": 12_000_000,
    "peak_tflops": 0.0,  # 0: fsdp_train.py's table for the GPU it runs on
}
QUICK = {
    "preset": "tiny",
    "seq": 64,
    "precision": "fp32",
    "micro_batches": (2,),
    "activation_checkpointing": ("on",),  # one launch: the plumbing, not a comparison
    "compile": ("off",),
    "steps": 4,
    "log_freq": 2,
    "corpus_chars": 300_000,
    "peak_tflops": 1.0,  # nominal: a CPU has no meaningful datasheet peak here
}
PHASES = ("data", "forward", "backward", "update")


def flops_per_token(model_dir: Path, seq: int) -> tuple[float, float]:
    """fsdp_train.py's own estimate for whole rows of `seq` tokens and without attention, on a meta-device model
    (nothing allocated); its MFU counts attention over each token's document, between the two with packed
    documents kept apart."""
    from fsdp_lib.model.build import build_model_skeleton, flops_per_token

    model = build_model_skeleton(model_dir)
    per_token = flops_per_token(model, model.config)
    return per_token(seq), per_token(0)


def run_setting(
    work: Path, dataset: Path, model_dir: Path, p: dict[str, Any], micro_batch: int, ac: str, compile_: str
) -> dict[str, Any]:
    """One fsdp_train.py launch; its steady-state figures from metrics.jsonl, or status "OOM" or "failed"."""
    exp = f"mfu_b{micro_batch}_ac{ac}_compile{compile_}"
    args = ["-e", exp, "-d", str(dataset), "-m", str(model_dir), "--save-dir", str(work / "outputs")]
    args += ["--seq-length", str(p["seq"]), "--precision", p["precision"], "-b", str(micro_batch)]
    args += ["--max-steps", str(p["steps"]), "--num-epochs", "1000", "--log-freq", str(p["log_freq"])]
    args += ["--activation-checkpointing", ac, "--compile", compile_, "--ckpt-freq", "0", "--lr", "1e-4"]
    if p["peak_tflops"]:
        args += ["--peak-tflops", str(p["peak_tflops"])]
    run = run_trainer(REPO_ROOT / "fsdp_train.py", args, 1, work / "outputs" / exp)
    if run.failure:
        return run.failure
    records = run.windows
    steady = records[1:]
    if not steady:
        raise RuntimeError(f"{exp}: {len(records)} metric windows; need --steps >= 2 x --log-freq")
    result = {
        "status": "ok",
        "windows": len(steady),
        "tokens_per_s": median([r["tokens_per_s"] for r in steady]),
        "mfu": median([r["mfu"] for r in steady]) if all("mfu" in r for r in steady) else None,
        "mem_peak_alloc_gb": max(r["mem_peak_alloc_gb"] for r in steady),
        "last_loss": last_loss(records),
    }
    result |= {f"time_{n}_ms": median([r[f"time_{n}_ms"] for r in steady]) for n in PHASES}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = bench_arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batches", default="", help="comma-separated micro-batch sizes (default: 2,4,8)")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps per setting (default: 30)")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for MFU (default: fsdp_train's)")
    args = parser.parse_args(argv)
    p = dict(QUICK if args.quick else FULL)
    if args.micro_batches:
        p["micro_batches"] = tuple(int(b) for b in args.micro_batches.split(","))
    p["steps"] = args.steps or p["steps"]
    p["peak_tflops"] = args.peak_tflops or p["peak_tflops"]
    mfu_label = "MFU (nominal 1 TFLOP/s peak)" if args.quick else "MFU"
    info = machine_info()
    import torch

    info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results: dict[str, dict[str, Any]] = {}
    with work_folder(args, "bench_mfu_") as work:
        dataset, model_dir = corpus_and_model(work, p["corpus_chars"], p["preset"])
        fpt, dense = flops_per_token(model_dir, p["seq"])
        sweep = itertools.product(p["micro_batches"], p["activation_checkpointing"], p["compile"])
        for micro_batch, ac, compile_ in sweep:
            key = f"b{micro_batch} ac={ac} compile={compile_}"
            results[key] = {"micro_batch": micro_batch, "activation_checkpointing": ac, "compile": compile_}
            results[key] |= run_setting(work, dataset, model_dir, p, micro_batch, ac, compile_)
            r = results[key]
            print(
                f"  {key}: " + (f"{r['tokens_per_s']:.0f} tokens/s" if r["status"] == "ok" else r["status"]), flush=True
            )
    rows = []
    for r in results.values():
        head = [r["micro_batch"], r["activation_checkpointing"], r["compile"]]
        if r["status"] != "ok":
            rows.append([*head, r["status"], "-", "-", *("-" for _ in PHASES)])
            continue
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a (no peak known: --peak-tflops)"
        phases = [r[f"time_{n}_ms"] for n in PHASES]
        rows.append([*head, round(r["tokens_per_s"]), mfu, r["mem_peak_alloc_gb"], *phases])
    print(
        f"{p['preset']} preset, seq {p['seq']}, {p['precision']}, {p['steps']} steps per setting, "
        f"{fpt / 1e9:.3g} GFLOP per token (6N + 12*L*H*Q*T; the MFU counts T as each token's document's length, "
        f"{dense / 1e9:.3g} GFLOP without attention), device {info['device']}"
    )
    print_table(
        ["micro-batch", "act. ckpt", "compile", "tokens/s", mfu_label, "peak mem (GB)"] + [f"{n} (ms)" for n in PHASES],
        rows,
    )
    ok = [r for r in results.values() if r["status"] == "ok" and r["mfu"] is not None]
    best = max(ok, key=lambda r: r["mfu"], default=None)
    if best is not None:
        print(
            f"best: micro-batch {best['micro_batch']}, activation checkpointing {best['activation_checkpointing']}, "
            f"compile {best['compile']}: {100 * best['mfu']:.1f}% {mfu_label}"
        )
    write_results(
        args.results_dir,
        "mfu",
        {
            "machine": info,
            "params": p,
            "flops_per_token": fpt,
            "flops_per_token_without_attention": dense,
            "mfu_is_nominal": bool(args.quick),
            "results": results,
            "best": best,
        },
    )
    return report_failures(results)


if __name__ == "__main__":
    sys.exit(main())
