"""Helpers shared by the bench/ scripts: command line, interleaved repetitions, machine facts, the results
table and JSON, a generated corpus, model folders and a torchrun launcher.

Every benchmark reports a ratio against a baseline measured in the same run on the same machine, because the
machines these run on are shared and noisy: baseline and candidate repetitions alternate (ABBA order) and the
median of the repetitions is what is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if str(REPO_ROOT) not in sys.path:  # so workers can import fsdp_train and fsdp_lib
    sys.path.insert(0, str(REPO_ROOT))
DEFAULT_RESULTS_DIR = BENCH_DIR / "results"


# --- Command line and results -----------------------------------------------------------------------------


def bench_arg_parser(description: str) -> argparse.ArgumentParser:
    """The flags every benchmark takes; each script adds its own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repetitions: proves it still runs")
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=DEFAULT_RESULTS_DIR,
        help="where <name>.json is written (default: %(default)s)",
    )
    parser.add_argument("--reps", type=int, default=0, help="repetitions per side (0 = the benchmark's default)")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="folder for generated data (default: a temporary folder, removed)"
    )
    return parser


@contextlib.contextmanager
def work_folder(args: argparse.Namespace, prefix: str) -> Iterator[Path]:
    """--workdir (created, kept) or a temporary folder named `prefix`..., removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        yield work


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge a figure: when, where, which versions, and how busy the machine was."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_avg_1m_at_start": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "argv": sys.argv,
    }


def write_results(results_dir: Path, name: str, payload: dict[str, Any]) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {path}")
    return path


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A markdown table, so it pastes into BENCHMARKS.md as it is."""

    def cell(value: Any) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join(lines)


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    print(format_table(headers, rows))


# --- Interleaved repetitions --------------------------------------------------------------------------------


def interleaved(
    reps: int, sides: dict[str, Callable[[], Any]], summary: Callable[[Any], str] = str
) -> dict[str, list[Any]]:
    """Run every side `reps` times in ABBA order (A B, B A, A B, ...), so a slow spell of the shared
    machine lands on both sides rather than on one. Returns each side's results in run order;
    prints `summary(result)` after each run."""
    results: dict[str, list[Any]] = {name: [] for name in sides}
    names = list(sides)
    for rep in range(reps):
        for name in names if rep % 2 == 0 else reversed(names):
            results[name].append(sides[name]())
            print(f"  rep {rep + 1}/{reps} {name}: {summary(results[name][-1])}", flush=True)
    return results


def median(values: list[float]) -> float:
    return float(statistics.median(values))


class Stopwatch:
    """Wall-clock and process CPU time (all threads, so the Rust tokenizer's pool counts) of a block."""

    def __enter__(self) -> Stopwatch:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu

    def result(self, **counts: int) -> dict[str, Any]:
        return {"seconds": self.wall, "cpu_seconds": self.cpu, **counts}


def wall_cpu_tokens(result: dict[str, Any]) -> str:
    """interleaved()'s summary of a Stopwatch result that counts tokens."""
    return f"wall {result['seconds']:.2f}s, CPU {result['cpu_seconds']:.2f}s, {result['tokens']:,} tokens"


def route_table(
    runs: dict[str, list[dict[str, Any]]], baseline: str, ours: str, labels: dict[str, str], amount: float, extra: str
) -> tuple[dict[str, float], dict[str, float], dict[str, float], list[list[Any]]]:
    """Median wall and CPU seconds of every side's Stopwatch results, baseline / ours for each, and a table row
    per side in `labels` (name -> label): median wall, `amount` per second, median CPU, the last run's tokens and
    `extra` count ("-" if it has none), and every repetition's wall time."""
    seconds = {name: median([r["seconds"] for r in rs]) for name, rs in runs.items()}
    cpu = {name: median([r["cpu_seconds"] for r in rs]) for name, rs in runs.items()}
    ratio = {"wall": seconds[baseline] / seconds[ours], "cpu": cpu[baseline] / cpu[ours]}
    rows = []
    for name, label in labels.items():
        last = runs[name][-1]
        rows.append(
            [
                label,
                seconds[name],
                amount / seconds[name],
                cpu[name],
                f"{last['tokens']:,}",
                f"{last[extra]:,}" if extra in last else "-",
                ", ".join(f"{r['seconds']:.1f}" for r in runs[name]),
            ]
        )
    return seconds, cpu, ratio, rows


def print_goal(ratio: dict[str, float], what: str, goal: float) -> None:
    for key, label in (("wall", "wall-clock"), ("cpu", "CPU time")):
        print(f"{what}, {label}: {ratio[key]:.2f} (goal >= {goal}: {'met' if ratio[key] >= goal else 'NOT met'})")


def fresh_dir(parent: Path, name: str) -> Path:
    """parent/name, removed if it is there (for a repetition to create anew)."""
    shutil.rmtree(parent / name, ignore_errors=True)
    return parent / name


def report_failures(results: dict[str, dict[str, Any]]) -> int:
    """Print the error of every configuration whose status is "failed"; the exit code: 1 if any failed, else 0."""
    failed = [key for key, r in results.items() if r["status"] == "failed"]
    for key in failed:
        print(f"{key} failed: {results[key]['error']}")
    return 1 if failed else 0


def drop_page_cache() -> bool:
    """Write dirty pages and drop the page cache, so a read is from the disk. Needs root; False if refused."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


# --- Generated inputs ---------------------------------------------------------------------------------------


def make_corpus(total_chars: int, seed: int = 0, mean_doc_chars: int = 3000) -> list[str]:
    """Pseudo-prose documents: words of a 30k-word synthetic vocabulary drawn with Zipf frequencies (as in
    natural text), capitalised sentences, commas and some numbers; document lengths are log-normal."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    letter_p = 1.0 / np.arange(1, 27) ** 0.8
    lengths = rng.integers(2, 11, size=30_000)
    vocab = ["".join(rng.choice(letters, size=n, p=letter_p / letter_p.sum())) for n in lengths]
    vocab[:20] = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it"] + [str(i) for i in range(10)]
    word_cdf = np.cumsum(1.0 / np.arange(1, len(vocab) + 1))
    word_cdf /= word_cdf[-1]
    docs, total = [], 0
    while total < total_chars:
        n_words = max(8, int(rng.lognormal(np.log(mean_doc_chars / 6.5), 0.8)))
        words = [vocab[i] for i in np.searchsorted(word_cdf, rng.random(n_words))]
        sentences, start = [], 0
        for end in np.cumsum(rng.integers(6, 25, size=n_words // 6 + 1)):
            chunk = words[start : min(end, n_words)]
            if not chunk:
                break
            if len(chunk) > 8:
                chunk[len(chunk) // 2] += ","
            sentences.append(chunk[0].capitalize() + " " + " ".join(chunk[1:]) + ".")
            start = end
        doc = " ".join(sentences)
        docs.append(doc)
        total += len(doc)
    return docs


def save_text_dataset(docs: list[str], folder: Path) -> Path:
    """A saved `datasets.Dataset` with a `text` column: the layout data_hf.py writes and fsdp_train.py reads."""
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(folder))
    return folder


def make_llama_folder(
    folder: Path,
    texts: list[str],
    hidden: int,
    layers: int,
    vocab: int,
    max_positions: int = 2048,
    weights_dtype: str | None = None,
) -> Path:
    """A Llama model folder (fsdp_lib.testing.make_model at llama_sizes(hidden, layers)): a byte-level BPE tokenizer
    trained on `texts`, config.json, and with `weights_dtype` ("bfloat16", "float32") random weights as safetensors
    (else fsdp_train.py initialises from scratch)."""
    from fsdp_lib.testing import llama_sizes, make_model

    sizes = llama_sizes(hidden, layers, max_positions)
    weights = {"with_weights": bool(weights_dtype), "dtype": weights_dtype or "float32", "fill_stored": False}
    return make_model(folder, texts=texts, vocab_size=vocab, sizes=sizes, seed=0, **weights)


def make_train_inputs(work: Path, p: dict[str, Any], corpus_chars: int) -> list[str]:
    """What a training benchmark starts from: a generated corpus of `corpus_chars`, saved as work/dataset, and
    work/model, a Llama of p["hidden"], p["layers"] and p["vocab"] whose tokenizer is trained on its first 200
    documents. Returns the documents."""
    docs = make_corpus(corpus_chars)
    make_llama_folder(work / "model", docs[:200], p["hidden"], p["layers"], p["vocab"])
    save_text_dataset(docs, work / "dataset")
    return docs


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# --- Launching ------------------------------------------------------------------------------------------------


class LaunchError(RuntimeError):
    """A torchrun launch that failed or ran past its time limit; `output` holds the end of its log."""

    def __init__(self, message: str, output: str):
        super().__init__(f"{message}:\n{output}")
        self.output = output


def torchrun(script: Path, args: list[str], nproc: int, timeout: float = 900) -> subprocess.CompletedProcess:
    """`torchrun --standalone` on CPU (gloo), one OpenMP thread per process so processes x threads = cores.
    Raises LaunchError when the run fails or hangs (then every process below it is killed), so a broken
    benchmark never reports a figure and a hung one never outlives the benchmark."""
    from fsdp_lib.testing import torchrun_command

    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return run_launcher(torchrun_command(script, args, nproc), env, timeout, script.name)


OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "out of memory")


def failed_launch(exc: LaunchError) -> dict[str, Any]:
    """A launch's result when it failed: status "OOM" if the log says the device ran out of memory, else
    "failed" with the last line naming an Error (or the log's last line)."""
    if any(marker in exc.output for marker in OOM_MARKERS):
        return {"status": "OOM"}
    errors = [line for line in exc.output.splitlines() if "Error" in line] or exc.output.splitlines()[-1:]
    return {"status": "failed", "error": errors[-1][-300:] if errors else str(exc)[:300]}


def take_metric_windows(exp_dir: Path) -> list[dict[str, Any]]:
    """The records of exp_dir/metrics.jsonl that have a throughput (tokens_per_s), in file order; then removes
    exp_dir: its checkpoint and export are not needed (and for a 1B model are ~17 GB)."""
    metrics = exp_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    shutil.rmtree(exp_dir, ignore_errors=True)
    return [r for r in map(json.loads, lines) if "tokens_per_s" in r]


def multinode_launch(args: list[str], nnodes: int, nproc: int, rdzv_id: str, timeout: float = 900) -> Any:
    """fsdp_train.py on this node of an `nnodes`-node run through scripts/multinode_launch.sh (c10d rendezvous at
    MASTER_ADDR:MASTER_PORT from the environment): the same call must run on every node, with the same `rdzv_id`."""
    cmd = ["bash", str(REPO_ROOT / "scripts" / "multinode_launch.sh"), *args]
    env = {"NNODES": str(nnodes), "NPROC_PER_NODE": str(nproc), "RDZV_ID": rdzv_id, "PYTHON": sys.executable}
    env |= {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return run_launcher(cmd, env, timeout, "fsdp_train.py")


def run_launcher(cmd: list[str], env: dict[str, str], timeout: float, name: str) -> subprocess.CompletedProcess:
    """Run a launcher command from the repository root with `env` added; LaunchError on failure or timeout."""
    from fsdp_lib.testing import kill_tree

    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise LaunchError(f"{name} hung: killed after {timeout:.0f}s", (stdout + stderr)[-4000:]) from None
    if proc.returncode != 0:
        raise LaunchError(
            f"{name} exited {proc.returncode} after {time.perf_counter() - start:.0f}s", (stdout + stderr)[-4000:]
        )
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
