"""Checkpoint throughput of fsdp_train.py's Checkpointer against the disk, and blocked time of async saves.

    python bench/bench_checkpoint.py            # ~30M-parameter Llama (~350 MB with AdamW state); a few minutes
    python bench/bench_checkpoint.py --quick    # tiny model, one repetition: proves the benchmark still runs

Part 1, throughput (one torchrun launch, 2 processes, gloo): the trainer's model and fused AdamW after one
step (so the optimizer state exists), saved and loaded with `Checkpointer.save` / `Checkpointer.load`:
DCP with fsync, side files, the atomic rename and state.json. The baseline, in the same processes and
interleaved with them (ABBA), is the disk itself: rank 0 writes the checkpoint's byte count as one file in
8 MB chunks and fsyncs it, then reads it back. Before every read the page cache is dropped
(`echo 3 > /proc/sys/vm/drop_caches`, root only); if that is refused the table says reads came from memory.

The save time includes the CRC-32 checksums each rank records of the files it wrote; their share of the save
(the slowest rank's checksum seconds over the save's seconds) is reported on its own line.

Part 2, blocked training (fsdp_train.py end to end): the same model trained with three periodic checkpoints,
reading the trainer's own log lines "checkpoint step N (periodic) saved/queued in X s of blocked training".
The blocked time of an async save includes waiting for the previous one, so it is honest about saves that
come faster than the disk. --async-ckpt off against on, in ABBA order. A run that fails or hangs is reported
as failed, with its error line, rather than stopping the benchmark: a short --collective-timeout-s turns a
deadlock into an error (async saves once deadlocked when their background collectives shared a gloo group
with the training loop's per-step agreement; this benchmark found it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    REPO_ROOT,
    bench_arg_parser,
    drop_page_cache,
    folder_bytes,
    interleaved,
    machine_info,
    median,
    print_table,
    work_folder,
    write_results,
)
from inputs import make_train_inputs
from launch import LaunchError, torchrun

FULL = {"hidden": 512, "layers": 8, "vocab": 8192, "reps": 6, "train_reps": 2, "seq": 128, "ckpt_freq": 5}
QUICK = {"hidden": 64, "layers": 2, "vocab": 512, "reps": 1, "train_reps": 1, "seq": 32, "ckpt_freq": 2}
COLLECTIVE_TIMEOUT_S = {"full": 30, "quick": 15}  # turns a deadlocked run into an error, well before HANG_LIMIT_S
NPROC = 2
CHUNK = 8 * 2**20
SAVE_LINE = re.compile(r"checkpoint step (\d+) \((\w+)\) (saved|queued) in ([\d.]+)s of blocked training")


# --- The disk baseline ---------------------------------------------------------------------------------------


def disk_write(path: Path, nbytes: int) -> float:
    """Sequential write of nbytes in 8 MB chunks, then fsync: what `dd bs=8M conv=fsync` measures."""
    chunk = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8).tobytes()  # incompressible
    start = time.perf_counter()
    with open(path, "wb") as fh:
        left = nbytes
        while left > 0:
            left -= fh.write(chunk[: min(left, CHUNK)])
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - start


def disk_read(path: Path) -> float:
    """Sequential read in 8 MB chunks into one buffer: what `dd bs=8M of=/dev/null` measures."""
    buffer = bytearray(CHUNK)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while fh.readinto(buffer):
            pass
    return time.perf_counter() - start


# --- Part 1 worker: runs under torchrun -------------------------------------------------------------------------


def throughput_worker(model_dir: str, save_dir: str, reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from fsdp_lib.config import TrainConfig
    from fsdp_lib.data.batch import Batch
    from fsdp_lib.model.build import build_model
    from fsdp_lib.runtime import setup_distributed
    from fsdp_lib.state import TrainState
    from fsdp_lib.train.checkpoint import Checkpointer, step_dir_name
    from fsdp_lib.train.optim import build_optimizer

    cfg = TrainConfig(experiment_name="ckpt", save_dir=save_dir, model_name=model_dir, precision="fp32", keep_last=1000)
    cfg.activation_checkpointing = "off"
    d = setup_distributed(cfg)
    bundle = build_model(cfg, "fp32", d)
    optimizer = build_optimizer(bundle.model, cfg)
    inputs = torch.randint(0, bundle.config.vocab_size, (1, 33))
    loss, _ = bundle.train_forward(Batch(inputs[:, :-1], inputs[:, 1:], None))  # the FSDP root
    loss.backward()
    optimizer.step()  # creates AdamW's exp_avg and exp_avg_sq: the checkpoint holds params + 2x state
    checkpointer = Checkpointer(cfg, d, fingerprint={})
    disk_file = Path(save_dir) / "disk_baseline.bin"

    def barrier() -> None:
        dist.barrier(group=d.cpu_group)

    def save(step: int) -> tuple[float, Path]:
        barrier()
        start = time.perf_counter()
        checkpointer.save(bundle.model, optimizer, TrainState(step=step), "bench")
        barrier()
        return time.perf_counter() - start, checkpointer.root / step_dir_name(step)

    def checksum_seconds() -> float:
        """The slowest rank's checksum time inside the last save (ranks checksum their own files in parallel)."""
        seconds = torch.tensor([checkpointer.checksum_s], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=d.cpu_group)
        return float(seconds.item())

    def load(path: Path) -> float:
        barrier()
        start = time.perf_counter()
        checkpointer.load(path, bundle.model, optimizer)
        barrier()
        return time.perf_counter() - start

    _, first = save(1)  # untimed: warms DCP's code paths, as the first save of a run follows training
    nbytes = folder_bytes(first) if d.is_main else 0
    results: dict[str, list] = {
        "ckpt_save_s": [],
        "ckpt_load_s": [],
        "disk_write_s": [],
        "disk_read_s": [],
        "checksum_s": [],
    }
    cold_reads = True
    for rep in range(reps):
        for side in ("checkpoint", "disk") if rep % 2 == 0 else ("disk", "checkpoint"):
            if side == "checkpoint":
                seconds, path = save(rep + 2)
                results["ckpt_save_s"].append(seconds)
                results["checksum_s"].append(checksum_seconds())
                if d.is_main:
                    cold_reads &= drop_page_cache()
                results["ckpt_load_s"].append(load(path))
                if d.is_main:
                    shutil.rmtree(path)
            elif d.is_main:  # the other rank waits at the barrier below
                results["disk_write_s"].append(disk_write(disk_file, nbytes))
                cold_reads &= drop_page_cache()
                results["disk_read_s"].append(disk_read(disk_file))
                disk_file.unlink()
            barrier()
    if d.is_main:
        Path(out).write_text(json.dumps({**results, "bytes": nbytes, "cold_reads": cold_reads}))
    dist.destroy_process_group()


# --- Part 2: end-to-end runs of fsdp_train.py -------------------------------------------------------------------


MODES = {"sync (--async-ckpt off)": "off", "async (--async-ckpt on)": "on"}  # label -> --async-ckpt
HANG_LIMIT_S = 240  # a run that takes longer is deadlocked (the whole run takes well under a minute)


def blocked_seconds(work: Path, p: dict[str, Any], mode: str, rep: int) -> dict[str, Any]:
    """One training run; the blocked seconds of its periodic saves from the trainer's log lines."""
    async_ckpt = MODES[mode]
    exp = f"blocked_{async_ckpt}_{rep}"
    steps = 3 * p["ckpt_freq"] + 1  # three periodic saves, each followed by training, then the final one
    args = [
        *("-e", exp, "--save-dir", str(work / "outputs"), "-d", str(work / "dataset"), "-m", str(work / "model")),
        *("--precision", "fp32", "--seq-length", str(p["seq"]), "-b", "1", "--activation-checkpointing", "off"),
        *("--max-steps", str(steps), "--ckpt-freq", str(p["ckpt_freq"]), "--log-freq", str(p["ckpt_freq"])),
        *("--async-ckpt", async_ckpt, "--keep-last", "1"),
        *("--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S["quick" if p is QUICK else "full"])),
    ]
    start = time.perf_counter()
    try:
        proc = torchrun(REPO_ROOT / "fsdp_train.py", args, NPROC, timeout=HANG_LIMIT_S)
    except LaunchError as exc:
        errors = [line for line in exc.output.splitlines() if "Error:" in line]
        reason = f"{str(exc).splitlines()[0].rstrip(':')}; {errors[0] if errors else 'no error line'}"
        return {"ok": False, "error": reason, "log_tail": exc.output[-2000:]}
    finally:
        shutil.rmtree(work / "outputs" / exp, ignore_errors=True)
    wall = time.perf_counter() - start
    saves = [(int(s), reason, float(t)) for s, reason, _, t in SAVE_LINE.findall(proc.stdout)]
    periodic = [t for _, reason, t in saves if reason == "periodic"]
    if len(periodic) != 3:
        raise RuntimeError(f"expected 3 periodic checkpoint lines in the trainer's log, found {saves}")
    return {"ok": True, "periodic_blocked_s": periodic, "run_wall_s": wall}


def describe_run(r: dict[str, Any]) -> str:
    if not r["ok"]:
        return f"FAILED: {r['error']}"
    return f"blocked {_reps(r['periodic_blocked_s'])} s per periodic save; run {r['run_wall_s']:.0f}s"


def main(argv: list[str] | None = None) -> int:
    args = bench_arg_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    p = QUICK if args.quick else FULL
    reps = args.reps or p["reps"]
    info = machine_info()
    with work_folder(args, "bench_checkpoint_") as work:
        make_train_inputs(work, p, 1_000_000 if not args.quick else 200_000)

        print("part 1: Checkpointer save/load against the disk (one launch, interleaved inside)", flush=True)
        out = work / "throughput.json"
        worker_args = ["--worker", "throughput", str(work / "model"), str(work / "ckpt"), str(reps), str(out)]
        torchrun(Path(__file__), worker_args, NPROC)
        io = json.loads(out.read_text())

        print("part 2: training blocked by periodic saves, sync against async", flush=True)
        counters = {mode: iter(range(1000)) for mode in MODES}
        blocked = interleaved(
            p["train_reps"],
            {mode: (lambda m=mode: blocked_seconds(work, p, m, next(counters[m]))) for mode in MODES},
            summary=describe_run,
        )
    report_throughput(io)
    blocked_summary = report_blocked(blocked)
    write_results(
        args.results_dir,
        "checkpoint",
        {
            "machine": info,
            "params": {**p, "reps": reps, "nproc": NPROC},
            "checkpoint_bytes": io["bytes"],
            "cold_reads": io["cold_reads"],
            "gb_per_s": io["gb_per_s"],
            "save_ratio_to_disk": io["gb_per_s"]["ckpt_save_s"] / io["gb_per_s"]["disk_write_s"],
            "checksum_share_of_save": io["checksum_share_of_save"],
            "load_ratio_to_disk": io["gb_per_s"]["ckpt_load_s"] / io["gb_per_s"]["disk_read_s"],
            "raw_seconds": {k: v for k, v in io.items() if k.endswith("_s")},
            "blocked": blocked_summary,
            "blocked_runs": blocked,
        },
    )
    return 0


def report_throughput(io: dict[str, Any]) -> None:
    gb = io["bytes"] / 1e9
    io["gb_per_s"] = rate = {
        k: gb / median(io[k]) for k in ("ckpt_save_s", "disk_write_s", "ckpt_load_s", "disk_read_s")
    }
    io["checksum_share_of_save"] = median(io["checksum_s"]) / median(io["ckpt_save_s"])
    reads = "cold (page cache dropped before each)" if io["cold_reads"] else "WARM: the page cache could not be dropped"
    print(f"checkpoint: {io['bytes'] / 1e6:.0f} MB (fp32 params + AdamW state, {NPROC} processes); reads {reads}")
    print_table(
        [
            "operation",
            "GB/s (median)",
            "disk GB/s (median)",
            "ratio to disk",
            "Checkpointer per rep (s)",
            "disk per rep (s)",
        ],
        [
            [name, rate[ck], rate[disk], rate[ck] / rate[disk], _reps(io[ck]), _reps(io[disk])]
            for name, ck, disk in (
                ("save: Checkpointer.save vs write+fsync", "ckpt_save_s", "disk_write_s"),
                ("load: Checkpointer.load vs read", "ckpt_load_s", "disk_read_s"),
            )
        ],
    )
    print(
        f"checksums (CRC-32 of every file, slowest rank): {_reps(io['checksum_s'])} s per save = "
        f"{100 * io['checksum_share_of_save']:.1f}% of the median save (goal: <= 10%)"
    )


def report_blocked(blocked: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for mode, runs in blocked.items():
        saves = [t for r in runs if r["ok"] for t in r["periodic_blocked_s"]]
        summary[mode] = {
            "runs_completed": sum(r["ok"] for r in runs),
            "runs": len(runs),
            "blocked_s_median": median(saves) if saves else None,
        }
    sync = summary["sync (--async-ckpt off)"]["blocked_s_median"]
    rows = []
    for mode, s in summary.items():
        if s["blocked_s_median"] is not None:
            s["ratio_to_sync"] = s["blocked_s_median"] / sync
        saves = [t for r in blocked[mode] if r["ok"] for t in r["periodic_blocked_s"]]
        rows.append(
            [
                mode,
                f"{s['runs_completed']}/{s['runs']}",
                s["blocked_s_median"] if saves else "-",
                s.get("ratio_to_sync", "-"),
                _reps(saves) or "-",
            ]
        )
    print_table(
        ["checkpointing", "runs completed", "blocked per save (s, median)", "ratio to sync", "per save (s)"], rows
    )
    for mode, runs in blocked.items():
        for r in runs:
            if not r["ok"]:
                print(f"{mode}: {r['error']}")
    return summary


def _reps(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


if __name__ == "__main__":
    from fsdp_lib.interrupts import exit_without_teardown  # a worker skips the interpreter teardown

    if sys.argv[1:3] == ["--worker", "throughput"]:  # launched by torchrun from main
        throughput_worker(sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6])
        exit_without_teardown(0)
    sys.exit(main())
