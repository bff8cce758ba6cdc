"""AdamW without weight decay on norms and biases, the learning-rate schedule (a pure function of the step), and
the guard that skips steps with a non-finite loss or gradient (and keeps fp16's dynamic loss scale)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from fsdp_lib.config import TrainConfig
from fsdp_lib.errors import TrainError
from fsdp_lib.state import TrainState


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms and biases (1-D tensors). Fused where available: the fused kernel
    also skips a step on device when `found_inf` is set, so skipping a bad step needs no host sync."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, foreach=True)


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): a pure function of the step, so resume is exact."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    if cfg.lr_schedule == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


class BadStepGuard:
    """Tracks non-finite steps on the device (no sync per step) and the fp16 dynamic loss scale."""

    def __init__(self, state: TrainState, device: torch.device, precision: str, max_bad_steps: int):
        self.dynamic = precision == "fp16"
        self.max_bad_steps = max_bad_steps
        self.scale = torch.tensor(state.loss_scale if self.dynamic else 1.0, device=device)
        if self.dynamic and state.step == 0:
            self.scale.fill_(2.0**16)
        self.good_steps = torch.tensor(state.scale_good_steps, device=device)
        self.skipped = torch.tensor(state.skipped_steps, device=device)
        self.streak = torch.tensor(state.bad_streak, device=device)
        self.worst_streak = self.streak.clone()

    def update(self, found_inf: torch.Tensor) -> None:
        found_inf = found_inf.to(self.skipped.device)
        self.skipped += found_inf.long()
        self.streak = (self.streak + 1) * found_inf.long()
        self.worst_streak = torch.maximum(self.worst_streak, self.streak)
        if self.dynamic:  # halve on overflow; double after 2000 clean steps (torch.amp.GradScaler's rule)
            self.good_steps = (self.good_steps + 1) * (1 - found_inf.long())
            grow = self.good_steps >= 2000
            self.scale = torch.where(
                found_inf.bool(), self.scale * 0.5, torch.where(grow, self.scale * 2.0, self.scale)
            )
            self.good_steps = torch.where(grow, torch.zeros_like(self.good_steps), self.good_steps)

    def sync(self, state: TrainState) -> int:
        """Copy device counters into the state (a host sync: only at log and checkpoint time); stop if too many."""
        state.skipped_steps, state.bad_streak = int(self.skipped.item()), int(self.streak.item())
        state.loss_scale, state.scale_good_steps = float(self.scale.item()), int(self.good_steps.item())
        worst = int(self.worst_streak.item())
        self.worst_streak = self.streak.clone()
        if worst >= self.max_bad_steps:
            raise TrainError(
                f"{worst} consecutive steps had a non-finite loss or gradient norm (--max-bad-steps "
                f"{self.max_bad_steps}); lower --lr, use --precision bf16/fp32, or check the data"
            )
        return state.skipped_steps
