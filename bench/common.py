"""Helpers shared by the bench/ scripts: command line, machine facts, the results table and JSON, interleaved
repetitions. The other shared modules: inputs.py (a generated corpus, datasets and model folders), launch.py
(torchrun, the trainer's worker, metric windows), ratios.py (the sides' ratios and their goals) and trl_style.py
(the TRL-style baselines' FSDP2 model, process group, log-probabilities and optimizer).

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
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
if str(REPO_ROOT) not in sys.path:  # so workers can import fsdp_train and fsdp_lib
    sys.path.insert(0, str(REPO_ROOT))
DEFAULT_RESULTS_DIR = BENCH_DIR / "results"


# --- Command line and results -----------------------------------------------------------------------------


@contextlib.contextmanager
def env_set(extra: dict[str, str | None]) -> Iterator[None]:
    """os.environ with `extra` set (None: the variable unset), inherited by the launches below; restored after."""

    def apply(values: dict[str, str | None]) -> None:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    saved = {k: os.environ.get(k) for k in extra}
    try:
        apply(extra)
        yield
    finally:
        apply(saved)


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


def last_loss(records: list[dict[str, Any]]) -> float:
    """The last logged training loss, NaN when none: a window in which no token was trained logs loss null."""
    return next((float(r["loss"]) for r in reversed(records) if r.get("loss") is not None), float("nan"))


class Stopwatch:
    """Wall-clock and process CPU time (all threads, so the Rust tokenizer's pool counts) of a block."""

    def __enter__(self) -> Stopwatch:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu

    def result(self, **counts: int) -> dict[str, Any]:
        return {"seconds": self.wall, "cpu_seconds": self.cpu, **counts}


def fresh_dir(parent: Path, name: str) -> Path:
    """parent/name, removed if it is there (for a repetition to create anew)."""
    shutil.rmtree(parent / name, ignore_errors=True)
    return parent / name


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def drop_page_cache() -> bool:
    """Write dirty pages and drop the page cache, so a read is from the disk. Needs root; False if refused."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True
