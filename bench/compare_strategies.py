"""Which sharding setting to train with: the same short fsdp_train.py run under each strategy (the
DDP-vs-FSDP comparison users asked for), with tokens/s, peak memory per rank and final loss side by side, and a
recommendation.

    python bench/compare_strategies.py -m models/llama-1b -d hf_datasets/my_corpus --nproc 8 --steps 20
    python bench/compare_strategies.py -m models/tiny -d hf_datasets/my_corpus --memory-budget-gb 20
    python bench/compare_strategies.py --quick       # CPU, under a minute: a tiny model and corpus made here

Settings, each with --activation-checkpointing on and off:
    none           --sharding none: every rank holds the whole model, gradients all-reduced (DDP-like)
    grad-op        --sharding grad-op: parameters stay gathered from forward to backward (ZeRO-2)
    full           --sharding full: parameters resharded after forward (ZeRO-3)
    full+offload   --sharding full --cpu-offload on: shards, gradients and optimizer state in host memory
    hybrid         --sharding hybrid: shard within a node, replicate across nodes; only with more than one node
                   (--nnodes, else NNODES or SLURM_NNODES). Then run this same command on every node (MASTER_ADDR
                   set, as for scripts/multinode_launch.sh, which launches each setting); node 0 writes the report.

Every setting is one launch of --steps optimizer steps with identical data, seed and batch, so the final losses
should agree (sharding and checkpointing change memory and speed, not the math). The figures are fsdp_train.py's
own metrics.jsonl: tokens/s is the median of the metric windows after the first (warm-up); peak memory is the
highest `mem_peak_alloc_gb` (already the maximum over ranks: CUDA allocator peak, or on CPU the process's VmHWM,
which includes ~0.3 GB of imports). With --reps > 1 the settings alternate (ABBA) and medians are reported.

Recommendation rule: the fastest setting whose peak memory per rank fits under --memory-budget-gb (default: the
GPU's memory on CUDA; on CPU the machine's RAM divided by the processes per node), and of the settings that fit
within 5% of that speed, the one with the least memory (headroom for longer sequences or larger batches). If none
fits, the one with the least memory, flagged as over the budget.

Writes <results-dir>/compare_strategies.json, .md (the table, the rule and the recommendation) and .png (bars).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import (
    REPO_ROOT,
    bench_arg_parser,
    format_table,
    interleaved,
    last_loss,
    machine_info,
    median,
    work_folder,
    write_results,
)
from inputs import corpus_and_model
from launch import report_failures, run_trainer

FULL = {"steps": 20, "log_freq": 5, "seq": 256, "batch": 4, "nproc": 2, "lr": 3e-4}
# --quick: the tiny preset on a generated corpus; 4 steps, 2 metric windows (the first is warm-up)
QUICK = {"steps": 4, "log_freq": 2, "seq": 64, "batch": 2, "nproc": 2, "lr": 3e-4, "corpus_chars": 200_000}
SPEED_TIE = 0.05  # settings within 5% of the fastest that fits count as equally fast


@dataclass(frozen=True)
class Setting:
    name: str
    sharding: str
    cpu_offload: str
    activation_checkpointing: str

    @property
    def key(self) -> str:
        return f"{self.name} ac={self.activation_checkpointing}"

    def trainer_args(self) -> list[str]:
        return [
            "--sharding", self.sharding,
            "--cpu-offload", self.cpu_offload,
            "--activation-checkpointing", self.activation_checkpointing,
        ]  # fmt: skip


def strategy_settings(nnodes: int, quick: bool = False) -> tuple[list[Setting], list[str]]:
    """Every setting to run, and a note for each strategy skipped (and why). --quick (a smoke run of the bench)
    runs `none` with activation checkpointing and `full` with CPU offload without it: the two ends of the memory
    range, and the recomputation switch between them (the full grid runs without --quick)."""
    strategies = [("none", "none", "off"), ("grad-op", "grad-op", "off"), ("full", "full", "off")]
    strategies.append(("full+offload", "full", "on"))
    skipped = []
    if nnodes > 1:
        strategies.append(("hybrid", "hybrid", "off"))
    else:
        skipped.append("hybrid: skipped, one node (it shards within a node and replicates across nodes; pass --nnodes)")
    settings = [Setting(n, s, o, ac) for n, s, o in strategies for ac in ("on", "off")]
    if quick:
        keep = {("none", "on"), ("full+offload", "off")}
        settings = [s for s in settings if (s.name, s.activation_checkpointing) in keep]
        skipped.append(
            "--quick: none with checkpointing and full+offload without it only (the full grid runs without --quick)"
        )
    return settings, skipped


def detect_nnodes(flag: int) -> int:
    """--nnodes, else NNODES (scripts/multinode_launch.sh) or SLURM_NNODES, else 1."""
    if flag:
        return flag
    for name in ("NNODES", "SLURM_NNODES"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def default_memory_budget_gb(nproc: int) -> tuple[float, str]:
    """The memory one rank may use, and where the figure comes from."""
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        return total, f"{torch.cuda.get_device_name()} memory"
    ram_kib = next(
        int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal:")
    )
    return ram_kib / 2**20 / nproc, f"RAM {ram_kib / 2**20:.1f} GiB / {nproc} processes"


def recommend(results: dict[str, dict[str, Any]], budget_gb: float) -> tuple[str | None, str]:
    """The recommended setting's key and the reason, by the rule in the module docstring."""
    ok = {key: r for key, r in results.items() if r["status"] == "ok"}
    if not ok:
        return None, "no setting ran"
    fits = {key: r for key, r in ok.items() if r["mem_peak_alloc_gb"] <= budget_gb}
    if not fits:
        key = min(ok, key=lambda k: ok[k]["mem_peak_alloc_gb"])
        return key, (
            f"no setting fits in {budget_gb:.2f} GiB; {key} needs the least memory"
            f" ({ok[key]['mem_peak_alloc_gb']:.2f} GiB): use more processes, a shorter --seq-length or a smaller -b"
        )
    fastest = max(fits, key=lambda k: fits[k]["tokens_per_s"])
    top = fits[fastest]["tokens_per_s"]
    near = {k: r for k, r in fits.items() if r["tokens_per_s"] >= (1 - SPEED_TIE) * top}
    key = min(near, key=lambda k: near[k]["mem_peak_alloc_gb"])
    reason = (
        f"{len(fits)} of {len(ok)} settings fit in {budget_gb:.2f} GiB per rank; the fastest is {fastest}"
        f" ({top:.0f} tokens/s)"
    )
    if key != fastest:
        reason += f"; {key} is within {SPEED_TIE:.0%} of it with less memory ({near[key]['mem_peak_alloc_gb']:.2f} GiB)"
    return key, reason


# --- Running --------------------------------------------------------------------------------------------------


def run_setting(
    setting: Setting, rep: int, work: Path, dataset: str, model: str, p: dict[str, Any], nnodes: int
) -> dict[str, Any]:
    """One fsdp_train.py launch; its figures from metrics.jsonl, or status "OOM" / "failed" with the error."""
    exp = f"compare_{setting.name}_ac{setting.activation_checkpointing}_rep{rep}".replace("+", "_")
    args = ["-e", exp, "-d", dataset, "-m", model, "--save-dir", str(work / "outputs")]
    args += ["--seq-length", str(p["seq"]), "-b", str(p["batch"]), "--precision", p["precision"]]
    args += ["--max-steps", str(p["steps"]), "--num-epochs", "1000", "--log-freq", str(p["log_freq"])]
    args += ["--ckpt-freq", "0", "--lr", str(p["lr"]), "--seed", "0", *setting.trainer_args()]
    run = run_trainer(REPO_ROOT / "fsdp_train.py", args, p["nproc"], work / "outputs" / exp, p["timeout_s"], nnodes)
    if run.failure:
        return run.failure
    records = run.windows
    if len(records) < 2:
        return {"status": "failed", "error": f"{len(records)} metric windows; need --steps >= 2 x log-freq"}
    return {
        "status": "ok",
        "tokens_per_s": median([r["tokens_per_s"] for r in records[1:]]),
        "mem_peak_alloc_gb": max(r["mem_peak_alloc_gb"] for r in records),
        "final_loss": last_loss(records),
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repetitions; a setting counts as failed if any repetition failed."""
    failed = [r for r in runs if r["status"] != "ok"]
    if failed:
        return {**failed[0], "reps": len(runs)}
    return {
        "status": "ok",
        "reps": len(runs),
        "tokens_per_s": median([r["tokens_per_s"] for r in runs]),
        "mem_peak_alloc_gb": max(r["mem_peak_alloc_gb"] for r in runs),
        "final_loss": median([r["final_loss"] for r in runs]),
    }


# --- Report ---------------------------------------------------------------------------------------------------


def report_rows(settings: list[Setting], results: dict[str, dict[str, Any]], best: str | None) -> list[list[Any]]:
    rows = []
    for s in settings:
        r = results[s.key]
        head = [s.name + (" **(recommended)**" if s.key == best else ""), s.activation_checkpointing]
        if r["status"] != "ok":
            rows.append([*head, r["status"], "-", "-", r.get("error", "")[:80]])
        else:
            rows.append(
                [*head, round(r["tokens_per_s"]), f"{r['mem_peak_alloc_gb']:.3f}", f"{r['final_loss']:.4f}", ""]
            )
    return rows


def plot(settings: list[Setting], results: dict[str, dict[str, Any]], budget_gb: float, path: Path) -> None:
    """Three bar panels (tokens/s, peak memory with the budget line, final loss); failed settings show no bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{s.name}\nac {s.activation_checkpointing}" for s in settings]
    fig, axes = plt.subplots(3, 1, figsize=(max(8, 1.1 * len(settings)), 10), sharex=True)
    panels = [("tokens_per_s", "tokens/s"), ("mem_peak_alloc_gb", "peak memory per rank (GiB)")]
    panels.append(("final_loss", "final loss"))
    for ax, (field, title) in zip(axes, panels):
        values = [results[s.key].get(field, 0.0) if results[s.key]["status"] == "ok" else 0.0 for s in settings]
        bars = ax.bar(
            range(len(settings)), values, color=["C0" if s.activation_checkpointing == "on" else "C1" for s in settings]
        )
        for bar, s in zip(bars, settings):
            if results[s.key]["status"] != "ok":
                ax.text(bar.get_x() + bar.get_width() / 2, 0, results[s.key]["status"], ha="center", va="bottom")
        if field == "mem_peak_alloc_gb" and budget_gb < 2 * max(values + [0.0]):
            ax.axhline(budget_gb, color="red", linestyle="--", label=f"budget {budget_gb:.2f} GiB")
            ax.legend()
        ax.set_ylabel(title)
        ax.grid(axis="y", alpha=0.3)
    axes[-1].set_xticks(range(len(settings)), labels, fontsize=8)
    axes[0].set_title("fsdp_train.py by sharding strategy (blue: activation checkpointing on, orange: off)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> Any:
    parser = bench_arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model-name", help="model folder (as fsdp_train.py -m); not needed with --quick")
    parser.add_argument("-d", "--dataset-name", help="dataset (as fsdp_train.py -d); not needed with --quick")
    parser.add_argument("--nproc", type=int, default=0, help="processes per node (default: 2)")
    parser.add_argument("--nnodes", type=int, default=0, help="nodes (default: NNODES or SLURM_NNODES, else 1)")
    parser.add_argument("--steps", type=int, default=0, help="optimizer steps per setting (default: 20; quick: 4)")
    parser.add_argument("--log-freq", type=int, default=0, help="steps per metric window (default: 5; quick: 2)")
    parser.add_argument("--seq-length", type=int, default=0, help="tokens per block (default: 256; quick: 64)")
    parser.add_argument("-b", "--batch-size", type=int, default=0, help="sequences per process (default: 4)")
    parser.add_argument("--precision", default="auto", help="fsdp_train.py --precision (default: auto)")
    parser.add_argument(
        "--memory-budget-gb",
        type=float,
        default=0.0,
        help="memory one rank may use, for the recommendation (default: the GPU's memory; CPU: RAM / --nproc)",
    )
    parser.add_argument("--timeout-s", type=float, default=1800, help="limit per launch (default: 1800)")
    return parser


def resolve_params(args: Any, parser: Any) -> dict[str, Any]:
    """QUICK or FULL with the flags given on top; exits with a usage error on a bad combination."""
    if not args.quick and not (args.model_name and args.dataset_name):
        parser.error("pass -m MODEL and -d DATASET (or --quick, which makes a tiny model and corpus itself)")
    p = dict(QUICK if args.quick else FULL)
    overrides = {"nproc": args.nproc, "steps": args.steps, "log_freq": args.log_freq, "seq": args.seq_length}
    overrides["batch"] = args.batch_size
    p |= {k: v for k, v in overrides.items() if v}
    p |= {"precision": args.precision, "timeout_s": args.timeout_s, "reps": args.reps or 1}
    if p["steps"] < 2 * p["log_freq"]:
        parser.error(f"--steps {p['steps']} gives fewer than 2 metric windows; use --steps >= 2 x --log-freq")
    return p


def run_all(args: Any, p: dict[str, Any], settings: list[Setting], nnodes: int) -> dict[str, dict[str, Any]]:
    """Every setting, --reps times in ABBA order, summarised per setting."""

    def summary(r: dict[str, Any]) -> str:
        if r["status"] != "ok":
            return f"{r['status']} {r.get('error', '')}"
        return f"{r['tokens_per_s']:.0f} tokens/s, {r['mem_peak_alloc_gb']:.3f} GiB, loss {r['final_loss']:.4f}"

    with work_folder(args, "compare_strategies_") as work:
        work = work.resolve()
        if args.quick:
            # the tiny preset with a tokenizer trained on a generated corpus
            dataset, model = map(str, corpus_and_model(work, p["corpus_chars"], "tiny", timeout=600))
        else:
            # launches run from the repository root: paths given relative to here must still point at the inputs
            dataset, model = (
                str(Path(a).resolve()) if Path(a).exists() else a for a in (args.dataset_name, args.model_name)
            )
        reps_done = {s.key: 0 for s in settings}

        def side(s: Setting) -> Any:
            def run() -> dict[str, Any]:
                reps_done[s.key] += 1
                return run_setting(s, reps_done[s.key], work, dataset, model, p, nnodes)

            return run

        runs = interleaved(p["reps"], {s.key: side(s) for s in settings}, summary)
    results = {key: summarise(r) for key, r in runs.items()}
    for s in settings:
        results[s.key] |= {"sharding": s.sharding, "cpu_offload": s.cpu_offload}
        results[s.key]["activation_checkpointing"] = s.activation_checkpointing
    return results


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    p = resolve_params(args, parser)
    nnodes = detect_nnodes(args.nnodes)
    if nnodes > 1 and not args.workdir:
        parser.error(f"{nnodes} nodes: pass --workdir on a file system all nodes share (checkpoints and metrics)")
    if args.memory_budget_gb:
        budget_gb, budget_source = args.memory_budget_gb, "--memory-budget-gb"
    else:
        budget_gb, budget_source = default_memory_budget_gb(p["nproc"])
    settings, skipped = strategy_settings(nnodes, args.quick)
    info = machine_info() | {"nnodes": nnodes, "nproc_per_node": p["nproc"]}
    results = run_all(args, p, settings, nnodes)
    best, reason = recommend(results, budget_gb)
    headers = ["setting", "act. ckpt", "tokens/s", "peak mem per rank (GiB)", "final loss", "error"]
    rule = (
        f"Rule: the fastest setting whose peak memory per rank fits under the budget ({budget_gb:.2f} GiB: "
        f"{budget_source}); among those within {SPEED_TIE:.0%} of it, the one with the least memory. "
        "If none fits, the one with the least memory."
    )
    recommendation = f"Recommended: {best} ({reason})" if best else f"No recommendation: {reason}"
    heading = (
        f"{nnodes} node(s) x {p['nproc']} processes, {p['steps']} steps, seq {p['seq']}, batch {p['batch']} per process,"
        f" precision {p['precision']}, {p['reps']} rep(s); model {'tiny (--quick)' if args.quick else args.model_name}"
    )
    table = format_table(headers, report_rows(settings, results, best))
    text = "\n\n".join([heading, table, *skipped, rule, recommendation])
    print(text)
    if os.environ.get("NODE_RANK", os.environ.get("SLURM_NODEID", "0")) not in ("", "0"):
        return 0  # node 0 writes the report (every node prints it)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / "compare_strategies.md").write_text(text + "\n")
    plot(settings, results, budget_gb, args.results_dir / "compare_strategies.png")
    print(f"wrote {args.results_dir / 'compare_strategies.md'} and {args.results_dir / 'compare_strategies.png'}")
    payload = {"machine": info, "params": p, "memory_budget_gb": budget_gb, "memory_budget_source": budget_source}
    payload |= {"skipped": skipped, "results": results, "recommended": best, "reason": reason}
    write_results(args.results_dir, "compare_strategies", payload)
    return report_failures(results)


if __name__ == "__main__":
    sys.exit(main())
