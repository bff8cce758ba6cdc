"""--profile-steps START:END: torch.profiler over those optimizer steps (the host's operators and, on a GPU, the
kernels), written per rank to outputs/EXP/profile: a Chrome/Perfetto trace (rankR.json) and a table of the operators
sorted by their own time on the device (on the CPU without one), rankR.txt. The step loop's phases (data, forward,
backward, update and the objectives' own) appear as named ranges in both."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fsdp_lib.arguments import parse_profile_steps
from fsdp_lib.config import TrainConfig
from fsdp_lib.runtime import Dist, log

PROFILE_DIR = "profile"
TABLE_ROWS = 60


class StepProfiler:
    """Started before step START, stopped after step END (1-based optimizer steps, as in metrics.jsonl). A run resumed
    inside the range profiles the rest of it; one resumed after it, nothing (said). A diagnostic: failing to write
    the profile warns and never stops training or hides the error that ended it."""

    def __init__(self, cfg: TrainConfig, d: Dist, next_step: int, last_step: int) -> None:
        steps = parse_profile_steps(cfg.profile_steps) if cfg.profile_steps else None
        self.first, self.last = steps if steps is not None else (0, -1)
        if steps is not None and d.rank == 0 and not (next_step <= self.last and self.first <= last_step):
            log(
                f"WARNING: --profile-steps {cfg.profile_steps}: this launch trains steps {next_step}..{last_step}; "
                "nothing is profiled"
            )
        self.folder = Path(cfg.experiment_dir) / PROFILE_DIR
        self.rank, self.cuda = d.rank, d.device.type == "cuda"
        self.active: profile | None = None

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        try:
            self.finish()
        except Exception as exc:  # noqa: BLE001 - a failing diagnostic must not replace the error that ended the run
            if exc_type is None:
                raise
            log(f"WARNING: --profile-steps: the profile was not written ({type(exc).__name__}: {exc})")

    def step_begins(self, step: int) -> None:
        """Before optimizer step `step` (1-based) runs: starts at START, or at the first step of a run resumed
        inside the range."""
        if self.active is not None or not self.first <= step <= self.last:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.active = profile(activities=activities, record_shapes=True, profile_memory=False)
        self.active.__enter__()

    def step_ended(self, step: int) -> None:
        """After optimizer step `step`: at END (or the last step, when training stops before END) writes the files."""
        if self.active is None or step < self.last:
            return
        self.finish()

    def finish(self) -> None:
        """Stops a profile still running (training ended or stopped inside the range) and writes what it holds; a
        write that fails (a full disk) warns."""
        if self.active is None:
            return
        prof, self.active = self.active, None
        if self.cuda:  # the profiled steps' kernels finish inside the trace, not after it
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        trace, table = self.folder / f"rank{self.rank}.json", self.folder / f"rank{self.rank}.txt"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(trace))
            sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
            table.write_text(prof.key_averages().table(sort_by=sort, row_limit=TABLE_ROWS) + "\n")
        except OSError as exc:
            log(f"WARNING: --profile-steps: rank {self.rank}'s profile was not written to {self.folder} ({exc})")
            return
        if self.rank == 0:
            log(
                f"--profile-steps {self.first}:{self.last}: trace and operator table in {self.folder} "
                f"(rank{{R}}.json opens in Perfetto, ui.perfetto.dev, or chrome://tracing)"
            )
