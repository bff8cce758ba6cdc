"""Full fine-tuning against LoRA and QLoRA (`fsdp_train.py --peft none|lora|qlora`): peak memory per rank, tokens/s
and the frozen base's resident bytes, on CPU with 2 processes and, when a GPU is lent, on one GPU.

    python bench/bench_peft.py                   # CPU: a 125M Llama, bf16, seq 512, 2 processes, 3 repetitions
    python bench/bench_peft.py --precision fp32  # the CPU default precision instead of bf16
    python bench/bench_peft.py --quick           # hidden 256, 2 layers, 4 steps: proves the benchmark still runs

The default run takes ~8 minutes on a quiet 2-core machine (~12 with another job on it), of which each of the 9
launches spends ~35 s starting, loading and saving; --quick ~1.5 minutes (3 launches, ~25 s each, nearly all
start-up). With a GPU the 1B rows add 6 launches.

Inputs are made here, nothing is downloaded: a generated pseudo-prose corpus saved as a `datasets.Dataset`, and a
model folder from `model_download.py --init 125M --hidden-size 768 --num-layers 16 --num-heads 12 --num-kv-heads 4
--intermediate-size 2048 --with-weights --dtype bfloat16 --tokenizer-from <corpus>`: 125,264,640 parameters with
the 32000-token BPE tokenizer trained on the corpus, random weights written as safetensors (QLoRA quantises a
pretrained base, so it refuses a folder without weight files). The 125M preset's own shape (SmolLM-135M's: 576
wide, 30 layers) cannot hold QLoRA's NF4 at any process count: a 576 x 576 q_proj has 331,776 weights, not a
multiple of one 64 x 256-weight double-quantisation block, and every rank's part of every decoder Linear weight
must hold whole blocks. So the preset is widened to 768 (BERT/GPT-2-small width, 64-wide heads, GQA 12/4) and cut
to 16 layers, which keeps its 125M parameters and lets each of 2 ranks hold whole blocks. With --quick: a Llama
of hidden 256, 2 layers, vocab 1024 (fsdp_lib.testing.make_model, bf16 weights), also wide enough for NF4.

Every run is one `torchrun --nproc_per_node 2 fsdp_train.py` launch (gloo, one OpenMP thread per process) of
--steps optimizer steps at the same per-process batch, sequence length, precision, data and seed; the LoRA and
QLoRA runs add `--peft lora|qlora --lora-rank 16` (adapters on every attention and MLP Linear of the decoder
layers: --lora-target-modules auto). The three modes alternate in ABBA order (full lora qlora, qlora lora full,
...), --reps repetitions each, medians reported. fsdp_train.py runs unchanged through `main()` from a worker
(launch.trainer_worker) that only notes its process's resident set size (RSS) before and after. Measures per run:

- tokens/s: fsdp_train.py's own `tokens_per_s` from metrics.jsonl, median of the logging windows of --log-freq
  steps after the first (warm-up) window.
- peak per rank: the highest `mem_peak_alloc_gb` of those windows. On CPU that is the process's VmHWM (peak RSS),
  reset at the start of every window (/proc/self/clear_refs), taken as the maximum over the ranks: a real per-rank
  peak of the steady training steps (forward, backward, optimizer step). On CUDA it is the allocator's peak
  (torch.cuda.max_memory_allocated), reset the same way.
- peak above runtime (CPU): that peak less the highest of the ranks' RSS right after `import fsdp_train` (torch,
  transformers, datasets: ~0.27 GiB that any of the three modes pays before it builds anything).
- whole-run peak RSS (CPU): the process's highest VmHWM over the whole run, maximum over the ranks: loading,
  start-up checks, the final checkpoint and the export included. fsdp_train.py resets VmHWM at every window, so
  the worker reads it just before each reset and at exit (`ru_maxrss` alone would miss a peak before the last
  reset: on Linux it follows the same counter).
- frozen base, rank 0: the bytes rank 0 holds for the frozen base weights, from the trainer's log line
  `--peft ...: frozen base stored as <dtypes>, <size> on this rank` (its shard's storage; NF4's codes, scales and
  factors included). The embedding and the norms are not NF4 under QLoRA (only decoder-layer Linear weights are),
  so the table also derives the decoder Linear weights' own share: the measured base less the non-Linear
  parameters' bytes (counted on the meta model, in the compute dtype, divided by the processes).

Precision: bf16 by default, on CPU too. LoRA stores its frozen base in the compute dtype, so at fp32 (the CPU
default) it holds 4 bytes per frozen weight where on a GPU it holds 2: a comparison no GPU run would see. This CPU
has AVX512-BF16 and AMX, so bf16 runs and is faster here than fp32 (full fine-tuning of this model: ~140-200 vs
~80-100 tokens/s). Full fine-tuning keeps fp32 weights, gradients and AdamW moments either way (bf16 is its compute
dtype). --precision fp32 measures the CPU default instead. Activation checkpointing is off: at seq 512 a 125M
model's activations are a small part of the peak (checking it on moved the peaks by < 5%) and it would cost every
mode a recomputed forward.

GPU rows (when torch.cuda is available and not --quick): the 1B preset (`model_download.py --init 1B
--with-weights`, Llama-3.2-1B shapes) in bf16 on one GPU, seq 2048, micro-batch 4, activation checkpointing on,
the same three modes, measures and order. Without a GPU they read "not measured (no GPU lent)".

Goals (issue): LoRA's peak <= 0.40x full fine-tuning's at the same batch (CPU); QLoRA's resident base weights
<= 0.35x LoRA's; LoRA's tokens/s >= 0.95x full fine-tuning's. Ratios are of the medians; the per-repetition
ratios (repetition i of each mode ran next to each other) are printed too.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from common import (
    bench_arg_parser,
    interleaved,
    last_loss,
    machine_info,
    median,
    print_table,
    work_folder,
    write_results,
)
from inputs import init_model_folder, make_corpus, make_llama_folder, save_text_dataset
from launch import gpus_hidden, rank_figures, report_failures, run_trainer, trainer_worker
from ratios import device_results, failure_text, mode_figures, mode_ratios, numbered_runs, print_goal_ratios

# 125M preset widened to 768 so that NF4 blocks split over 2 ranks (see the docstring): 125,264,640 parameters
WIDE_125M = ["--hidden-size", "768", "--num-layers", "16", "--num-heads", "12", "--num-kv-heads", "4"]
WIDE_125M += ["--intermediate-size", "2048"]
CPU_FULL = {
    "label": "CPU, 2 processes",
    "preset": "125M",
    "overrides": WIDE_125M,
    "nproc": 2,
    "seq": 512,
    "batch": 1,
    "steps": 6,
    "log_freq": 2,
    "precision": "bf16",
    "activation_checkpointing": "off",
    "lora_rank": 16,
    "reps": 3,
}
CPU_QUICK = {
    "label": "CPU, 2 processes (quick)",
    "hidden": 256,
    "layers": 2,
    "vocab": 1024,
    "nproc": 2,
    "seq": 64,
    "batch": 2,
    "steps": 4,
    "log_freq": 2,
    "precision": "bf16",
    "activation_checkpointing": "off",
    "lora_rank": 8,
    "reps": 1,
}
GPU_FULL = {
    "label": "1 GPU",
    "preset": "1B",
    "overrides": [],
    "nproc": 1,
    "seq": 2048,
    "batch": 4,
    "steps": 20,
    "log_freq": 5,
    "precision": "bf16",
    "activation_checkpointing": "on",
    "lora_rank": 16,
    "reps": 2,
}
CORPUS_CHARS = {"full": 3_000_000, "quick": 300_000}
MODES = ("none", "lora", "qlora")
NAMES = {"none": "full fine-tuning", "lora": "LoRA", "qlora": "QLoRA"}
GOALS = {  # ratio key -> (comparison, bound, description)
    "lora_over_full_peak": ("<=", 0.40, "LoRA / full fine-tuning, peak memory per rank"),
    "qlora_over_lora_base": ("<=", 0.35, "QLoRA / LoRA, resident frozen base weights"),
    "lora_over_full_tokens_per_s": (">=", 0.95, "LoRA / full fine-tuning, tokens/s"),
}
UNITS = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}  # fsdp_lib.model.memory_plan.format_bytes: powers of 1000
BASE_LINE = re.compile(r"frozen base stored as (\S+), ([\d.]+) (B|KB|MB|GB|TB) on this rank")
PEFT_LINE = re.compile(r"--peft \w+: ([\d,]+) trainable of ([\d,]+) parameters")
MODEL_LINE = re.compile(r"model \S+: ([\d,]+) parameters")


# --- Inputs ------------------------------------------------------------------------------------------------------


def init_model(work: Path, dataset: Path, p: dict[str, Any], name: str) -> Path:
    """model_download.py --init <preset> [overrides] --with-weights (bf16 safetensors), tokenizer trained on the corpus."""
    flags = [*p["overrides"], "--tokenizer-from", str(dataset), "--with-weights", "--dtype", "bfloat16"]
    return init_model_folder(work / name, p["preset"], flags)


def prepare(work: Path, quick: bool, gpu: bool) -> tuple[Path, Path, Path | None]:
    """The saved corpus, the CPU model folder and, with `gpu`, the 1B one."""
    docs = make_corpus(CORPUS_CHARS["quick" if quick else "full"])
    dataset = save_text_dataset(docs, work / "dataset")
    if quick:
        q = CPU_QUICK
        cpu_model = make_llama_folder(
            work / "model_cpu", docs[:200], q["hidden"], q["layers"], q["vocab"], 512, "bfloat16"
        )
    else:
        cpu_model = init_model(work, dataset, CPU_FULL, "model_cpu")
    return dataset, cpu_model, init_model(work, dataset, GPU_FULL, "model_gpu") if gpu else None


def non_linear_params(model_dir: Path) -> tuple[int, int]:
    """(all parameters, those outside the decoder layers' Linear weights: embedding, norms, an untied head), counted
    on the meta model. QLoRA stores only the decoder Linear weights as NF4."""
    import torch.nn as nn

    from fsdp_lib.model.anatomy import find_decoder_layers
    from fsdp_lib.model.build import build_model_skeleton

    model = build_model_skeleton(model_dir)
    total = sum(p.numel() for p in model.parameters())
    linear = sum(
        m.weight.numel() for layer in find_decoder_layers(model) for m in layer.modules() if type(m) is nn.Linear
    )
    return total, total - linear


# --- One run ------------------------------------------------------------------------------------------------------


def parse_log(text: str) -> dict[str, Any]:
    """Rank 0's frozen base (dtypes, bytes) and the trainable / total parameter counts from the trainer's log."""
    found: dict[str, Any] = {}
    if m := BASE_LINE.search(text):
        found["base_dtypes"], found["base_bytes"] = m.group(1), float(m.group(2)) * UNITS[m.group(3)]
    if m := PEFT_LINE.search(text):
        found["trainable"], found["total"] = (int(g.replace(",", "")) for g in m.groups())
    elif m := MODEL_LINE.search(text):
        found["trainable"] = found["total"] = int(m.group(1).replace(",", ""))
    return found


def trainer_args(work: Path, dataset: Path, model_dir: Path, p: dict[str, Any], exp: str, mode: str) -> list[str]:
    """fsdp_train.py's flags for experiment `exp` (under work/outputs) at setting `p` with `--peft mode`."""
    args = ["-e", exp, "-d", str(dataset), "-m", str(model_dir), "--save-dir", str(work / "outputs")]
    args += ["--seq-length", str(p["seq"]), "-b", str(p["batch"]), "--precision", p["precision"]]
    args += ["--max-steps", str(p["steps"]), "--num-epochs", "1000", "--log-freq", str(p["log_freq"])]
    args += ["--activation-checkpointing", p["activation_checkpointing"], "--ckpt-freq", "0", "--lr", "1e-4"]
    args += ["--peft", mode]
    return args + (["--lora-rank", str(p["lora_rank"])] if mode != "none" else [])


def run_mode(
    work: Path, dataset: Path, model_dir: Path, p: dict[str, Any], mode: str, rep: int, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One fsdp_train.py launch of `mode` (with `extra` flags); its figures, or status "OOM"/"failed"."""
    on_cpu = p["label"] != GPU_FULL["label"]
    exp = f"{'cpu' if on_cpu else 'gpu'}_{mode}_{rep}"
    args = [*trainer_args(work, dataset, model_dir, p, exp, mode), *extra]
    prefix = work / f"{exp}.rss"
    run = run_trainer(Path(__file__), ["--worker", str(prefix), *args], p["nproc"], work / "outputs" / exp)
    if run.failure:
        return run.failure
    records = run.windows
    steady = [r for r in records[1:] if r["step"] % p["log_freq"] == 0]
    if not steady:
        raise RuntimeError(f"{exp}: {len(records)} metric windows; need --steps >= 2 x --log-freq")
    idle, run_peak = rank_figures(work, prefix.name, p["nproc"])
    peak = max(r["mem_peak_alloc_gb"] for r in steady)
    return {
        "status": "ok",
        "tokens_per_s": median([r["tokens_per_s"] for r in steady]),
        "windows_tokens_per_s": [r["tokens_per_s"] for r in records],
        "peak_gib": peak,
        "windows_peak_gib": [r["mem_peak_alloc_gb"] for r in records],
        "idle_rss_gib": idle,
        "peak_above_runtime_gib": peak - idle if on_cpu else None,
        "run_peak_rss_gib": run_peak,
        "last_loss": last_loss(records),
        **parse_log(run.log),
    }


def summary(r: dict[str, Any]) -> str:
    if (failed := failure_text(r)) is not None:
        return failed
    base = f", base {r['base_bytes'] / 1e6:.1f} MB" if "base_bytes" in r else ""
    return (
        f"{r['tokens_per_s']:.1f} tokens/s (windows {', '.join(f'{t:.0f}' for t in r['windows_tokens_per_s'])}), "
        f"peak {r['peak_gib']:.3f} GiB/rank{base}, loss {r['last_loss']:.4g}"
    )


# --- The comparison -------------------------------------------------------------------------------------------


def summarise(runs: dict[str, list[dict[str, Any]]], p: dict[str, Any], params: tuple[int, int]) -> dict[str, Any]:
    """Medians per mode, the goal ratios (of medians, and per repetition), and the decoder Linear weights' share."""
    keys = ("tokens_per_s", "peak_gib", "peak_above_runtime_gib", "run_peak_rss_gib", "base_bytes", "last_loss")
    fig = mode_figures(runs, keys, ("trainable", "total", "base_dtypes"))
    pairs = {
        "lora_over_full_peak": ("lora", "none", "peak_gib"),
        "qlora_over_lora_base": ("qlora", "lora", "base_bytes"),
        "lora_over_full_tokens_per_s": ("lora", "none", "tokens_per_s"),
        "qlora_over_full_peak": ("qlora", "none", "peak_gib"),
        "qlora_over_full_tokens_per_s": ("qlora", "none", "tokens_per_s"),
        "lora_over_full_peak_above_runtime": ("lora", "none", "peak_above_runtime_gib"),
        "qlora_over_full_peak_above_runtime": ("qlora", "none", "peak_above_runtime_gib"),
    }
    ratios, per_rep = mode_ratios(fig, runs, pairs)
    out = {"figures": fig, "ratios": ratios, "ratios_per_rep": per_rep}
    total, non_linear = params
    dtype_bytes = {"bf16": 2, "fp16": 2, "fp32": 4}[p["precision"]]
    non_linear_bytes = non_linear * dtype_bytes / p["nproc"]
    if "base_bytes" in fig["lora"] and "base_bytes" in fig["qlora"]:
        lora_linear = fig["lora"]["base_bytes"] - non_linear_bytes
        qlora_linear = fig["qlora"]["base_bytes"] - non_linear_bytes
        out["decoder_linear"] = {
            "params": total - non_linear,
            "non_linear_params": non_linear,
            "non_linear_bytes_per_rank": non_linear_bytes,
            "lora_bytes_per_rank": lora_linear,
            "qlora_bytes_per_rank": qlora_linear,
            "qlora_bytes_per_weight": qlora_linear * p["nproc"] / (total - non_linear),
            "qlora_over_lora": qlora_linear / lora_linear,
        }
    return out


def table_rows(label: str, s: dict[str, Any], runs: dict[str, list[dict[str, Any]]], p: dict[str, Any]) -> list[list]:
    rows = []
    for mode in MODES:
        f = s["figures"][mode]
        if "tokens_per_s" not in f:
            statuses = ", ".join(r["status"] for r in runs[mode])
            rows.append([label, NAMES[mode], statuses, *["-"] * 7])
            continue
        above = f.get("peak_above_runtime_gib")
        rows.append(
            [
                label,
                NAMES[mode],
                f["tokens_per_s"],
                ", ".join(f"{r['tokens_per_s']:.1f}" for r in runs[mode] if r["status"] == "ok"),
                f["peak_gib"],
                "-" if above is None else above,
                f["run_peak_rss_gib"],
                f"{f['base_bytes'] / 1e6:.2f} ({f['base_dtypes']})" if "base_bytes" in f else "- (all trains)",
                f"{f['trainable']:,} of {f['total']:,}" if "trainable" in f else "-",
                f["last_loss"],
            ]
        )
    return rows


def print_ratios(label: str, s: dict[str, Any]) -> None:
    print_goal_ratios(label, s, GOALS)
    ratios = s["ratios"]
    for key in sorted(set(ratios) - set(GOALS)):
        print(f"{label}: {key.replace('_', ' ')}: {ratios[key]:.3f} (reported)")
    if "decoder_linear" in s:
        d = s["decoder_linear"]
        print(
            f"{label}: decoder Linear weights alone (derived: base less {d['non_linear_params']:,} embedding/norm "
            f"parameters = {d['non_linear_bytes_per_rank'] / 1e6:.2f} MB per rank, not NF4 in either): QLoRA "
            f"{d['qlora_bytes_per_rank'] / 1e6:.2f} MB / LoRA {d['lora_bytes_per_rank'] / 1e6:.2f} MB = "
            f"{d['qlora_over_lora']:.3f} ({d['qlora_bytes_per_weight']:.3f} bytes per NF4 weight)"
        )


def measure(work: Path, dataset: Path, model_dir: Path, p: dict[str, Any], reps: int) -> tuple[dict, dict]:
    print(f"{p['label']}: {model_dir.name}, seq {p['seq']}, micro-batch {p['batch']}, {p['precision']}:", flush=True)
    counters = {mode: iter(range(reps)) for mode in MODES}
    sides = {mode: (lambda m=mode: run_mode(work, dataset, model_dir, p, m, next(counters[m]))) for mode in MODES}
    with gpus_hidden(p is not GPU_FULL):
        runs = interleaved(reps, sides, summary=summary)
    return runs, summarise(runs, p, non_linear_params(model_dir))


def main(argv: list[str] | None = None) -> int:
    parser = bench_arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="", help="CPU compute dtype (default: bf16)")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps per CPU run (default: 6; quick: 4)")
    args = parser.parse_args(argv)
    import torch

    p = dict(CPU_QUICK if args.quick else CPU_FULL)
    p["precision"] = args.precision or p["precision"]
    p["steps"] = args.steps or p["steps"]
    reps = args.reps or p["reps"]
    gpu = torch.cuda.is_available() and not args.quick
    gpu_note = "not measured (--quick)" if args.quick else "not measured (no GPU lent)"
    info = machine_info()
    results: dict[str, Any] = {"machine": info, "params": {"cpu": {**p, "reps": reps}}}
    with work_folder(args, "bench_peft_") as work:
        dataset, cpu_model, gpu_model = prepare(work, args.quick, gpu)
        cpu_runs, cpu_summary = measure(work, dataset, cpu_model, p, reps)
        results["cpu"] = device_results(cpu_runs, cpu_summary, GOALS)
        if gpu_model is not None:
            g = {**GPU_FULL, "reps": args.reps or GPU_FULL["reps"]}
            results["params"]["gpu"] = g
            gpu_runs, gpu_summary = measure(work, dataset, gpu_model, GPU_FULL, g["reps"])
            results["gpu"] = device_results(gpu_runs, gpu_summary, GOALS)
        else:
            results["gpu"] = gpu_note
    rows = table_rows(p["label"], cpu_summary, cpu_runs, p)
    if gpu_model is not None:
        rows += table_rows("1 GPU, 1B, bf16", gpu_summary, gpu_runs, GPU_FULL)
    else:
        rows += [["1 GPU, 1B, bf16", NAMES[mode], gpu_note, *["-"] * 7] for mode in MODES]
    print_table(
        [
            "device",
            "mode",
            "tokens/s",
            "tokens/s per rep",
            "peak per rank (GiB)",
            "peak above runtime (GiB)",
            "whole-run peak RSS (GiB)",
            "frozen base, rank 0 (MB)",
            "trainable params",
            "last loss",
        ],
        rows,
    )
    print_ratios(p["label"], cpu_summary)
    if gpu_model is not None:
        print_ratios("1 GPU", gpu_summary)
    else:
        print(f"1 GPU, 1B, bf16: {gpu_note}")
    write_results(args.results_dir, "peft", results)
    all_runs = numbered_runs("cpu", cpu_runs)
    if gpu_model is not None:
        all_runs |= numbered_runs("gpu", gpu_runs)
    return report_failures(all_runs)


if __name__ == "__main__":
    from fsdp_lib.interrupts import exit_without_teardown  # a worker skips the interpreter teardown

    if sys.argv[1:2] == ["--worker"]:  # launched by torchrun from run_mode
        exit_without_teardown(trainer_worker(sys.argv[2], sys.argv[3:]))
    sys.exit(main())
