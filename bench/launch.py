"""Launching what a benchmark measures, shared by the bench/ scripts: torchrun on one node or several, a failed
launch turned into a result, fsdp_train.py's metric windows, and the worker side of a launch: the trainer run
through `main()` noting its resident set, the ranks' RSS figures, and the GPUs hidden from CPU rows.

A launch that fails or hangs raises LaunchError (its processes killed), so a broken benchmark never reports a
figure and a hung one never outlives the benchmark.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import REPO_ROOT

GIB = 2**30
LOG_KEPT = 12_000  # characters of a failed launch's output kept: the worker's traceback comes before torchrun's banner
OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "out of memory")


# --- Launching ------------------------------------------------------------------------------------------------


class LaunchError(RuntimeError):
    """A torchrun launch that failed or ran past its time limit; `output` holds the end of its log."""

    def __init__(self, message: str, output: str):
        super().__init__(f"{message}:\n{output}")
        self.output = output


def torchrun(script: Path, args: list[str], nproc: int, timeout: float = 900) -> subprocess.CompletedProcess:
    """`torchrun --standalone` on CPU (gloo), one OpenMP thread per process so processes x threads = cores.
    Raises LaunchError when the run fails or hangs (then every process below it is killed)."""
    from fsdp_lib.testing import torchrun_command

    env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return run_launcher(torchrun_command(script, args, nproc), env, timeout, script.name)


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
        raise LaunchError(f"{name} hung: killed after {timeout:.0f}s", (stdout + stderr)[-LOG_KEPT:]) from None
    if proc.returncode != 0:
        raise LaunchError(
            f"{name} exited {proc.returncode} after {time.perf_counter() - start:.0f}s", (stdout + stderr)[-LOG_KEPT:]
        )
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def failed_launch(exc: LaunchError) -> dict[str, Any]:
    """A launch's result when it failed: status "OOM" if the log says the device ran out of memory, else
    "failed" with the worker's error: the last line naming an Error other than torchrun's own ChildFailedError
    (which only says that a worker failed), with torchrun's exit code or signal line when it has one."""
    if any(marker in exc.output for marker in OOM_MARKERS):
        return {"status": "OOM"}
    lines = exc.output.splitlines()
    errors = [line for line in lines if "Error" in line and "ChildFailedError" not in line]
    exits = [line.strip() for line in lines if line.strip().startswith(("exitcode", "error_file")) or "Signal " in line]
    error = "; ".join(([errors[-1][-300:]] if errors else []) + exits[-2:]) or (lines[-1:] or [str(exc)])[0][:300]
    return {"status": "failed", "error": error, "log_tail": exc.output[-LOG_KEPT:]}


def report_failures(results: dict[str, dict[str, Any]]) -> int:
    """Print the error and the log's last lines of every configuration whose status is "failed"; the exit code: 1
    if any failed, else 0."""
    failed = [key for key, r in results.items() if r["status"] == "failed"]
    for key in failed:
        print(f"{key} failed: {results[key]['error']}")
        tail = results[key].get("log_tail", "").splitlines()[-40:]
        print("\n".join(f"  | {line}" for line in tail))
    return 1 if failed else 0


# --- fsdp_train.py runs and their metric windows ----------------------------------------------------------------


def take_metric_windows(exp_dir: Path) -> list[dict[str, Any]]:
    """The records of exp_dir/metrics.jsonl that have a throughput (tokens_per_s), in file order; then removes
    exp_dir: its checkpoint and export are not needed (and for a 1B model are ~17 GB)."""
    metrics = exp_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    shutil.rmtree(exp_dir, ignore_errors=True)
    return [r for r in map(json.loads, lines) if "tokens_per_s" in r]


@dataclass
class TrainerRun:
    """One fsdp_train.py launch: its log, its metric windows, and `failure` (failed_launch's result) if it failed."""

    log: str
    windows: list[dict[str, Any]]
    failure: dict[str, Any] | None


def run_trainer(
    script: Path, args: list[str], nproc: int, exp_dir: Path, timeout: float = 1800, nnodes: int = 1
) -> TrainerRun:
    """torchrun `script` (fsdp_train.py, or a bench running it as a worker) writing to exp_dir; with nnodes > 1,
    fsdp_train.py on this node through multinode_launch (rendezvous id: exp_dir's name). Its windows are taken
    (take_metric_windows: exp_dir is removed) whether it succeeded or not."""
    try:
        if nnodes > 1:
            proc = multinode_launch(args, nnodes, nproc, rdzv_id=exp_dir.name, timeout=timeout)
        else:
            proc = torchrun(script, args, nproc, timeout=timeout)
    except LaunchError as exc:
        return TrainerRun("", take_metric_windows(exp_dir), failed_launch(exc))
    return TrainerRun(proc.stdout + proc.stderr, take_metric_windows(exp_dir), None)


# --- The worker side: resident memory ----------------------------------------------------------------------------


def status_bytes(key: str) -> int:
    """A /proc/self/status figure (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


class WindowPeaks:
    """A baseline worker's peak memory per window, measured as fsdp_train.py's metrics measure it: on CPU the
    process's VmHWM (peak RSS), reset at every window start (/proc/self/clear_refs); on a GPU
    torch.cuda.max_memory_allocated, reset the same way. `idle` is the RSS when it is made (after the imports);
    `run_peak` the highest VmHWM over the run, each read just before its reset."""

    def __init__(self, device: Any):
        self.device, self.cuda = device, device.type == "cuda"
        self.idle = status_bytes("VmRSS")
        self.peaks = [self.idle]

    def reset(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peaks.append(status_bytes("VmHWM"))
            Path("/proc/self/clear_refs").write_text("5")

    def now(self) -> float:
        """This window's peak so far, bytes."""
        import torch

        return torch.cuda.max_memory_allocated(self.device) if self.cuda else status_bytes("VmHWM")

    def run_peak(self) -> int:
        self.peaks.append(status_bytes("VmHWM"))
        return max(self.peaks)


def write_worker_figures(out_prefix: str, rank: int, peaks: WindowPeaks, windows: list[dict], **extra: Any) -> None:
    """The end of a baseline worker: this rank's RSS figures (and `extra`) to <out_prefix>.rank<R>.json, which
    rank_figures reads, and on rank 0 the windows to <out_prefix>.windows.json."""
    figures = {"idle_rss_bytes": peaks.idle, "run_peak_rss_bytes": peaks.run_peak(), "code": 0, **extra}
    Path(f"{out_prefix}.rank{rank}.json").write_text(json.dumps(figures))
    if rank == 0:
        Path(f"{out_prefix}.windows.json").write_text(json.dumps(windows))


def trainer_worker(out_prefix: str, argv: list[str]) -> int:
    """fsdp_train.main(argv); writes <out_prefix>.rank<R>.json: this rank's RSS after importing fsdp_train (the
    runtime every mode pays) and its peak RSS over the whole run. fsdp_train resets the peak (VmHWM) at every
    metric window, so the peak is read just before each reset and at exit (ru_maxrss alone would miss a peak
    before the last reset)."""
    import fsdp_train as ft
    from fsdp_lib.train import metrics

    idle = status_bytes("VmRSS")
    peaks = [idle]
    reset = metrics.reset_peak_memory

    def noting_reset(device: Any) -> None:
        peaks.append(status_bytes("VmHWM"))
        reset(device)

    metrics.reset_peak_memory = noting_reset
    code = 1
    try:
        code = ft.main(argv)
    finally:
        peaks += [status_bytes("VmHWM"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]
        figures = {"idle_rss_bytes": idle, "run_peak_rss_bytes": max(peaks), "code": code}
        Path(f"{out_prefix}.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(figures))
    return code


def rank_figures(work: Path, prefix: str, nproc: int) -> tuple[float, float]:
    """(highest idle RSS, highest whole-run peak RSS) over the ranks' work/<prefix>.rank<R>.json, GiB."""
    ranks = [json.loads(f.read_text()) for f in sorted(work.glob(f"{prefix}.rank*.json"))]
    if len(ranks) != nproc:
        raise RuntimeError(f"{prefix}: {len(ranks)} of {nproc} ranks wrote their RSS")
    return max(r["idle_rss_bytes"] for r in ranks) / GIB, max(r["run_peak_rss_bytes"] for r in ranks) / GIB


@contextlib.contextmanager
def gpus_hidden(hide: bool) -> Iterator[None]:
    """With `hide`, the launches below see no GPU (CUDA_VISIBLE_DEVICES=""), so the CPU rows run on the CPU on a
    machine that has one too."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hide:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if hide and saved is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        elif hide:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
