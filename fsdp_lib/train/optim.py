"""AdamW without weight decay on norms and biases, the learning-rate schedule (a pure function of the step), and
the guard that skips steps with a non-finite loss or gradient (and keeps fp16's dynamic loss scale)."""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
import torch.distributed as dist
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
        return LocalShardAdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
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


def _locals(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local shard (the tensor itself otherwise), read as the attribute DTensor keeps it in.
    to_local() is an autograd call where grad mode is on (~6 us on CPU: the gradient norm's 224 calls over LoRA's
    tensors, 1.3 ms) and costs 0.2-1.7 us under no_grad (the step's ~900); the attribute costs nothing. For
    tensors outside autograd (gradients, the step's in-place updates), where the two are the same tensor. One
    import per list, not per tensor: the import statement alone cost ~0.4 us a tensor."""
    from torch.distributed.tensor import DTensor

    return [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of the whole model's gradient from each rank's local shards: one foreach norm over the local
    tensors and one all-reduce of the squared sum over the mesh dimension they are sharded on (replicas of a
    shard, --sharding hybrid or none, hold the same numbers and are not added again). Gradients that are not
    sharded count once. Computed in fp32; a device tensor (no host sync)."""
    from torch.distributed.tensor import DTensor

    dtensors = [g for g in grads if isinstance(g, DTensor)]
    plain = [g for g in grads if not isinstance(g, DTensor)]
    total = torch.zeros((), dtype=torch.float32, device=_locals((dtensors or plain)[:1])[0].device)
    if dtensors:
        sharded_on = [i for i, placement in enumerate(dtensors[0].placements) if placement.is_shard()]
        local = [g._local_tensor for g in dtensors]
        total = total + torch.stack(torch._foreach_norm(local)).float().pow(2).sum()
        if sharded_on:
            dist.all_reduce(total, group=dtensors[0].device_mesh.get_group(sharded_on[0]))
    if plain:
        total = total + torch.stack(torch._foreach_norm(plain)).float().pow(2).sum()
    return total.sqrt()


class _GroupTensors:
    """One param group's local tensors, listed once for the fused kernel: parameters, moments and step counters
    (the same tensors every step: the kernel updates them in place). Valid while the group, its parameter list
    (the same tensors in the same order) and the optimizer's state mapping are the ones it was made from;
    load_state_dict replaces all of them (and a hook drops the lists), so a resumed optimizer lists its loaded
    tensors again. Another state held in place of a parameter's (optimizer.state[p] = {...}) is not noticed."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: dict[str, Any]):
        self.group, self.state = group, optimizer.state
        self.params = tuple(group["params"])
        self.ids = tuple(map(id, self.params))
        states = [optimizer.state[p] for p in self.params]
        self.local_params = _locals(list(self.params))
        self.exp_avgs = _locals([s["exp_avg"] for s in states])
        self.exp_avg_sqs = _locals([s["exp_avg_sq"] for s in states])
        self.steps = [s["step"] for s in states]
        device, dtype = self.local_params[0].device, self.local_params[0].dtype
        # torch's _fused_adam groups the lists by (device, dtype) and runs the kernel once per group; cached
        # lists cover the common case of a single group, with step counters where fused AdamW keeps them
        self.usable = all(p.device == device and p.dtype == dtype for p in self.local_params) and all(
            s.device == device and s.dtype == torch.float32 and s.dim() == 0 for s in self.steps
        )

    def valid_for(self, optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
        return group is self.group and optimizer.state is self.state and tuple(map(id, group["params"])) == self.ids


_group_tensors: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[_GroupTensors]] = weakref.WeakKeyDictionary()


def _cached_group_tensors(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> _GroupTensors | None:
    """The group's cached lists (made again when stale), or None where the plain path must run: a parameter
    without a gradient, a parameter without state yet, or lists the kernel cannot take in one call."""
    if optimizer not in _group_tensors:  # load_state_dict drops the lists, so they never keep the old state alive
        optimizer.register_load_state_dict_post_hook(lambda opt: _group_tensors.pop(opt, None))
    cached = _group_tensors.setdefault(optimizer, [])
    entry = next((c for c in cached if c.group is group), None)
    if entry is None or not entry.valid_for(optimizer, group):
        if not group["params"] or not all(optimizer.state.get(p) for p in group["params"]):
            return None
        cached[:] = [c for c in cached if c.group is not group and any(c.group is g for g in optimizer.param_groups)]
        entry = _GroupTensors(optimizer, group)
        cached.append(entry)
    return entry if entry.usable else None


@torch.no_grad()
def fused_adamw_on_local_shards(
    optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor, found_inf: torch.Tensor
) -> None:
    """optimizer.step() of a fused AdamW, run on the parameters' local shards: torch's own fused kernel
    (torch._fused_adamw_, decoupled weight decay) over plain tensors, so nothing dispatches through DTensor per
    tensor (the host cost that dominates a step over many small tensors, e.g. LoRA's). The state is created and
    kept as torch's AdamW keeps it (DTensors like the parameters, a device step counter), so checkpoints and a
    plain optimizer.step() read it unchanged. Gradients are divided by `grad_scale` inside the kernel (the loss
    scale and the clip, folded into the step); with `found_inf` set the step is skipped on the device."""
    for group in optimizer.param_groups:
        entry = _cached_group_tensors(optimizer, group)
        grads = [p.grad for p in entry.params] if entry is not None else []
        hyper = (group["lr"], *group["betas"])
        if entry is None or any(g is None for g in grads) or any(isinstance(h, torch.Tensor) for h in hyper):
            _adamw_group(optimizer, group, grad_scale, found_inf)
            continue
        _fused_adamw_step(entry, _locals(grads), group, grad_scale, found_inf)


def _fused_adamw_step(
    entry: _GroupTensors,
    grads: list[torch.Tensor],
    group: dict[str, Any],
    grad_scale: torch.Tensor,
    found_inf: torch.Tensor,
) -> None:
    """What torch.optim.adam._fused_adam does for one (device, dtype) group (torch 2.11-2.13), without its
    per-step grouping and with one step-counter update instead of two: torch adds 1 to every counter, runs the
    kernel (which does nothing when found_inf is 1) and subtracts found_inf; adding 1 - found_inf gives the same
    counters (whole numbers in fp32) in one foreach call with a tensor list (~4x cheaper on CPU than a foreach
    add of the Python scalar 1). The hyperparameters are read from the group every step (lr_at sets the lr)."""
    device = entry.local_params[0].device
    grad_scale, found_inf = grad_scale.to(device, non_blocking=True), found_inf.to(device, non_blocking=True)
    torch._foreach_add_(entry.steps, [1 - found_inf] * len(entry.steps))
    beta1, beta2 = group["betas"]
    torch._fused_adamw_(
        entry.local_params,
        grads,
        entry.exp_avgs,
        entry.exp_avg_sqs,
        [],
        entry.steps,
        amsgrad=False,
        lr=group["lr"],
        beta1=beta1,
        beta2=beta2,
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )


def _adamw_group(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], grad_scale: torch.Tensor, found_inf: torch.Tensor
) -> None:
    """One group's step through torch's functional adam (fused): the path for what the cached lists do not
    cover (first step, parameters without gradients, tensor hyperparameters, mixed devices or dtypes)."""
    from torch.optim.adam import adam

    params = [p for p in group["params"] if p.grad is not None]
    if not params:
        return
    for p in params:
        state = optimizer.state[p]
        if not state:  # as AdamW._init_group does for fused=True
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    states = [optimizer.state[p] for p in params]
    beta1, beta2 = group["betas"]
    adam(
        _locals(params),
        _locals([p.grad for p in params]),
        _locals([s["exp_avg"] for s in states]),
        _locals([s["exp_avg_sq"] for s in states]),
        [],
        [s["step"] for s in states],
        fused=True,
        grad_scale=grad_scale,
        found_inf=found_inf,
        decoupled_weight_decay=True,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=False,
    )


class LocalShardAdamW(torch.optim.AdamW):
    """AdamW(fused=True) whose step() runs on the local shards (fused_adamw_on_local_shards), with the loss
    scale and the clip folded in: set `grad_scale` (gradients are divided by it) and `found_inf` (1 skips the
    step) before calling step(), as torch's AMP does for fused optimizers. A subclass, so step hooks still run."""

    grad_scale: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("LocalShardAdamW.step takes no closure")
        grad_scale, found_inf = self.grad_scale, self.found_inf
        if grad_scale is None or found_inf is None:  # a plain step(): no scale, nothing to skip
            device = next(p.device for group in self.param_groups for p in group["params"])
            grad_scale = torch.ones((), device=device) if grad_scale is None else grad_scale
            found_inf = torch.zeros((), device=device) if found_inf is None else found_inf
        fused_adamw_on_local_shards(self, grad_scale, found_inf)
