"""Run under torchrun with fsdp_train.py's flags (--objective grpo): the trainer's set-up, then, for each --grpo-loss,
the first step's rollout (generation, rewards, advantages) and forward_backward only; then, for --num-iterations 2,
the second update of the dapo loss after every parameter moved by a known amount. Rank 0 saves to
$GRPO_GRADS_OUT, per loss: the step's loss (over the global batch), every parameter's full gradient, and every
completion of the global batch (prompt ids, completion ids, combined reward), grouped by prompt, for the test to
recompute on the unsharded model in float64."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # fsdp_train.py, a script at the repository root
import fsdp_train  # noqa: E402
from fsdp_lib.config import load_config, resolve_precision  # noqa: E402
from fsdp_lib.data.plan import build_data  # noqa: E402
from fsdp_lib.interrupts import exit_without_teardown  # noqa: E402
from fsdp_lib.model.anatomy import clean_fqn  # noqa: E402
from fsdp_lib.model.build import build_model  # noqa: E402
from fsdp_lib.offline import resolve_model_dir  # noqa: E402
from fsdp_lib.runtime import reshard_all, setup_distributed  # noqa: E402
from fsdp_lib.state import TrainState  # noqa: E402
from fsdp_lib.train.grpo import GRPO_STATS  # noqa: E402
from fsdp_lib.train.metrics import PhaseTimer  # noqa: E402
from fsdp_lib.train.objective import build_objective  # noqa: E402
from fsdp_lib.train.optim import BadStepGuard  # noqa: E402
from fsdp_lib.train.rollout import gathered_view  # noqa: E402


def perturbation(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A parameter's known move between the two updates (tests/test_fsdp_train_grpo.py adds the same)."""
    numel = 1
    for size in shape:
        numel *= size
    phase = sum(map(ord, name)) % 97
    return 0.05 * torch.sin(torch.arange(numel, dtype=torch.float64) * 0.37 + phase).view(shape)


def loss_and_grads(objective, batches, normaliser, guard, model, d) -> tuple:  # noqa: ANN001
    """forward_backward over the micro-batches: (the global batch's summed loss, every parameter's full gradient),
    the gradients then cleared."""
    loss_sum, _ = fsdp_train.forward_backward(objective, batches, normaliser, guard, d, PhaseTimer(d.device))
    total = loss_sum.detach().clone()
    dist.all_reduce(total)
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        grads[clean_fqn(name)] = grad.detach().cpu().clone()
        param.grad = None
    return total, grads


def main() -> None:
    cfg = load_config(sys.argv[1:])
    precision = resolve_precision(cfg)
    d = setup_distributed(cfg)
    data = build_data(cfg, resolve_model_dir(cfg.model_name), d)
    bundle = build_model(cfg, precision, d)
    objective, _ = build_objective(cfg, bundle, data, precision, d)
    plan = data.train
    order = plan.epoch_order(0)
    results = {}
    for loss in ("grpo", "dapo", "dr_grpo"):
        objective.cfg = dataclasses.replace(cfg, grpo_loss=loss)
        batches, normaliser = objective.rollout(plan.micro_batches(order, 0), 0)
        guard = BadStepGuard(TrainState(), d.device, precision, cfg.max_bad_steps)
        total, grads = loss_and_grads(objective, batches, normaliser, guard, bundle.model, d)
        rows = []
        for batch in batches:  # each row: its tokens, where its completion starts and its reward
            for i in range(len(batch.sequences)):
                trained = (batch.sequence_ids[i] >= 0).nonzero().flatten()
                start, end = int(trained[0]) + 1, int(trained[-1]) + 2
                rows.append((batch.input_ids[i, :start].tolist(), batch.input_ids[i, start:end].tolist()))
        mine = (rows, objective.last_rewards)
        gathered: list = [None] * d.world_size
        dist.all_gather_object(gathered, mine)
        objective.take_stats()
        results[loss] = {"loss": total.item() / normaliser, "grads": grads, "parts": gathered}
    # --num-iterations 2 (dapo): the first update keeps the sampling policy's log-probabilities; every parameter
    # then moves by a known amount (as an optimizer step would) and the second update's ratio is taken to them
    objective.cfg, objective.updates = dataclasses.replace(cfg, grpo_loss="dapo"), 2
    batches, normaliser = objective.rollout(plan.micro_batches(order, 0), 0)
    guard = BadStepGuard(TrainState(), d.device, precision, cfg.max_bad_steps)
    fsdp_train.forward_backward(objective, batches, normaliser, guard, d, PhaseTimer(d.device))
    with torch.no_grad():
        for name, param in bundle.model.named_parameters():
            param.grad = None
            full = perturbation(clean_fqn(name), tuple(param.shape)).to(param.dtype)
            param.add_(
                distribute_tensor(full, param.device_mesh, param.placements) if hasattr(param, "placements") else full
            )
    objective.next_update()
    total, grads = loss_and_grads(objective, batches, normaliser, guard, bundle.model, d)
    stats = objective.take_stats()
    results["second_update"] = {
        "loss": total.item() / normaliser,
        "grads": grads,
        "clipped": float(stats[GRPO_STATS.index("clipped_tokens")]),
    }
    # the same rollout decoded through FSDP's hooks, one layer gathered at a time, instead of the gathered view
    objective.keep_gathered = False
    hooked, _ = objective.rollout(plan.micro_batches(order, 0), 0)
    objective.keep_gathered = True
    fast, _ = objective.rollout(plan.micro_batches(order, 0), 0)
    same = all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(hooked, fast))
    for module in bundle.train_forward.modules():
        if hasattr(module, "unshard") and hasattr(module, "reshard"):
            module.unshard()
    results["view"] = {"used": gathered_view(bundle.train_forward) is not None, "same_tokens_hooked": same}
    reshard_all(bundle.train_forward)
    if d.is_main:
        torch.save(results, os.environ["GRPO_GRADS_OUT"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
