"""Fault injection for the crash-safety tests, in one place. Every hook is off unless its environment variable is
set; production code only names the points where a fault may be injected.

- FSDP_TRAIN_FAULT=name[@rank][:step],...: at fault_point(name), SIGKILL this process (names starting with
  "kill") or raise an ENOSPC OSError. Only in a launch's first attempt: the group torchrun --max-restarts starts
  again (TORCHELASTIC_RESTART_COUNT > 0) has inherited the variable but is the recovery under test.
- FSDP_TRAIN_NAN_AT_STEPS=3,4: the training loss of those (1-based) optimizer steps is NaN on rank 0.
- FSDP_TRAIN_STEP_DELAY_S=0.25: every optimizer step sleeps this long, so a test can interrupt a run mid-way.
- FSDP_TRAIN_EVAL_DELAY_S=1: every evaluation micro-batch sleeps this long, so a test can interrupt an evaluation.
- FSDP_TRAIN_SAVE_DELAY_S=3: every checkpoint write sleeps this long first, so a test can interrupt a save.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch.nn as nn

from fsdp_lib.runtime import Dist
from fsdp_lib.state import TrainState


def fault_point(name: str, d: Dist | None = None, step: int | None = None) -> None:
    """Kill this process, or raise ENOSPC, when FSDP_TRAIN_FAULT names this point (and rank, and step)."""
    spec = os.environ.get("FSDP_TRAIN_FAULT", "") if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" else ""
    for item in filter(None, spec.split(",")):
        item, _, at_step = item.partition(":")
        point, _, rank = item.partition("@")
        if point != name or (rank and d is not None and int(rank) != d.rank):
            continue
        if at_step and step is not None and int(at_step) != step:
            continue
        if name.startswith("kill"):
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(28, f"injected fault at {name} (No space left on device)")


def save_delay() -> None:
    """FSDP_TRAIN_SAVE_DELAY_S: sleep inside a checkpoint's write phase."""
    if delay := float(os.environ.get("FSDP_TRAIN_SAVE_DELAY_S", "0") or 0):
        time.sleep(delay)


def install_step_hooks(train_forward: nn.Module, optimizer: Any, state: TrainState, d: Dist) -> None:
    """The per-step hooks: NaN losses (a forward hook on the training forward), a delay after each optimizer step
    (an optimizer step hook) and one after each evaluation forward. Installs nothing when their variables are
    unset."""
    nan_steps = {int(s) for s in os.environ.get("FSDP_TRAIN_NAN_AT_STEPS", "").split(",") if s.strip()}
    if nan_steps and d.rank == 0:

        def poison(module: nn.Module, args: Any, output: tuple) -> tuple | None:
            # state.step counts the steps done, so the step being computed is state.step + 1; evaluation is not hit
            if module.training and state.step + 1 in nan_steps:
                return (output[0] * float("nan"), *output[1:])
            return None

        train_forward.register_forward_hook(poison)
    delay_s = float(os.environ.get("FSDP_TRAIN_STEP_DELAY_S", "0") or 0)
    if delay_s:
        optimizer.register_step_post_hook(lambda *_: time.sleep(delay_s))
    eval_delay_s = float(os.environ.get("FSDP_TRAIN_EVAL_DELAY_S", "0") or 0)
    if eval_delay_s:
        train_forward.register_forward_hook(lambda module, *_: None if module.training else time.sleep(eval_delay_s))
