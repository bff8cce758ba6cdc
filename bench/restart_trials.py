"""Restart trials: does `torchrun --max-restarts` bring a run back after a rank is killed, to the same losses?

    python bench/restart_trials.py              # 12 trials, ~6 minutes on 2 cores
    python bench/restart_trials.py --trials 4   # the first 4 moments only

One uninterrupted run (2 processes, gloo, a small Llama, 30 steps, a checkpoint every 5), then one trial per moment:
the same command under `torchrun --standalone --max-restarts=2`, with rank 1 killed (SIGKILL) either from outside
once a given step is logged (mid-step) or by the trainer's fault injection inside a checkpoint save (during DCP's
write, before or after the folder's rename; fsdp_lib/faults.py fires only in a launch's first attempt). A trial
passes when torchrun exits 0 and every step's loss equals the uninterrupted run's, bit for bit. Not a timing
benchmark: the figure is how many trials passed. Results: bench/results/restart_trials.json.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import REPO_ROOT, bench_arg_parser, machine_info, work_folder, write_results
from inputs import make_train_inputs

sys.path.insert(0, str(REPO_ROOT))
from fsdp_lib.testing import kill_tree, launch_env, torchrun_command, worker_pid  # noqa: E402

SIZES = {"hidden": 64, "layers": 2, "vocab": 512}
RUN = ["--max-steps", "30", "--ckpt-freq", "5", "-b", "2", "--seq-length", "64", "--precision", "fp32"]
RUN += ["--lr", "1e-3", "--lr-schedule", "constant", "--log-freq", "1", "--seed", "3"]
# (how, where): a step number to kill rank 1 at from outside, or a fault spec (point@rank:step)
MOMENTS: list[tuple[str, str]] = [
    ("mid-step", "3"),
    ("mid-step", "7"),
    ("mid-step", "13"),
    ("mid-step", "18"),
    ("mid-step", "24"),
    ("mid-step", "28"),
    ("checkpoint", "kill_during_write@1:10"),
    ("checkpoint", "kill_before_rename@1:15"),
    ("checkpoint", "kill_after_rename@0:20"),
    ("checkpoint", "kill_during_write@0:25"),
    ("mid-step", "11"),
    ("mid-step", "21"),
]


def losses(exp: Path) -> dict[int, float]:
    path = exp / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def launch(work: Path, name: str, moment: tuple[str, str] | None, timeout: float = 400) -> dict[str, Any]:
    args = ["-e", name, "-d", str(work / "dataset"), "-m", str(work / "model"), "--save-dir", str(work / "out"), *RUN]
    command = torchrun_command(REPO_ROOT / "fsdp_train.py", args, 2)
    command.insert(command.index("--standalone") + 1, "--max-restarts=2")
    env = {"FSDP_TRAIN_STEP_DELAY_S": "0.2"}
    if moment and moment[0] == "checkpoint":
        env["FSDP_TRAIN_FAULT"] = moment[1]
    log_path = work / f"{name}.log"
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=launch_env(env), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        kill_at = int(moment[1]) if moment and moment[0] == "mid-step" else None
        while proc.poll() is None:
            if kill_at is not None and max(losses(work / "out" / name), default=0) >= kill_at:
                pid = worker_pid(proc.pid, 1)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    kill_at = None
            if time.monotonic() - start > timeout:
                kill_tree(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.05)
    text = log_path.read_text()
    return {
        "returncode": proc.returncode,
        "seconds": round(time.monotonic() - start, 1),
        "timed_out": time.monotonic() - start > timeout,
        "restarts": text.count("failed (exitcode:"),
        "resumed": text.count("resumed from"),
        "losses": losses(work / "out" / name),
    }


def main() -> int:
    parser = bench_arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=len(MOMENTS), help="how many of the moments to try, in order")
    args = parser.parse_args()
    moments = MOMENTS[: max(1, min(args.trials, len(MOMENTS)))] if not args.quick else MOMENTS[:1]
    results: dict[str, Any] = {"machine": machine_info(), "trials": []}
    with work_folder(args, "restart_trials_") as work:
        make_train_inputs(work, SIZES, 400_000)
        reference = launch(work, "reference", None)
        if reference["returncode"] != 0:
            print(f"the uninterrupted run failed; see {work / 'reference.log'}")
            return 1
        for i, moment in enumerate(moments, 1):
            trial = launch(work, f"trial{i}", moment)
            trial["moment"] = list(moment)
            trial["bit_identical"] = trial["losses"] == reference["losses"]
            trial["passed"] = trial["returncode"] == 0 and trial["bit_identical"] and trial["restarts"] >= 1
            print(
                f"trial {i}: rank killed {moment[0]} ({moment[1]}): exit {trial['returncode']}, "
                f"{trial['restarts']} restart(s), {trial['seconds']}s, losses bit-identical: {trial['bit_identical']}"
                f"{'' if trial['passed'] else '  <- FAILED (log: ' + str(work / f'trial{i}.log') + ')'}",
                flush=True,
            )
            results["trials"].append({k: v for k, v in trial.items() if k != "losses"})
    passed = sum(t["passed"] for t in results["trials"])
    print(f"{passed} of {len(moments)} trials passed")
    results["passed"] = passed
    write_results(args.results_dir, "restart_trials", results)
    return 0 if passed == len(moments) else 1


if __name__ == "__main__":
    sys.exit(main())
