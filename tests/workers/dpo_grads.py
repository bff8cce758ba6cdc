"""Run under torchrun with fsdp_train.py's flags: the trainer's set-up (data, model, DPO objective with its stored
reference), the stored reference shifted by known offsets so that policy != reference, then the first optimizer
step's forward_backward only. Rank 0 saves to $DPO_GRADS_OUT: the step's loss (mean over the global batch's pairs),
every parameter's full gradient, and the step's pairs as token ids + trained masks with their shifted reference
(None for a reference-free loss), chosen then rejected, for the test to recompute on the unsharded model.
--objective kto: the "pairs" are each example and its KL sequence, saved with the examples' labels and the step's
reference point z."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # fsdp_train.py, a script at the repository root
import fsdp_train  # noqa: E402
from fsdp_lib.config import load_config, resolve_precision  # noqa: E402
from fsdp_lib.data.plan import build_data  # noqa: E402
from fsdp_lib.interrupts import exit_without_teardown  # noqa: E402
from fsdp_lib.model.anatomy import clean_fqn  # noqa: E402
from fsdp_lib.model.build import build_model  # noqa: E402
from fsdp_lib.offline import resolve_model_dir  # noqa: E402
from fsdp_lib.runtime import setup_distributed  # noqa: E402
from fsdp_lib.state import TrainState  # noqa: E402
from fsdp_lib.train.metrics import PhaseTimer  # noqa: E402
from fsdp_lib.train.objective import build_objective  # noqa: E402
from fsdp_lib.train.optim import BadStepGuard  # noqa: E402


def main() -> None:
    cfg = load_config(sys.argv[1:])
    precision = resolve_precision(cfg)
    d = setup_distributed(cfg)
    data = build_data(cfg, resolve_model_dir(cfg.model_name), d)
    bundle = build_model(cfg, precision, d)
    objective, _ = build_objective(cfg, bundle, data, precision, d)
    blocks = data.train.blocks
    if blocks.reference is not None:  # None: a reference-free loss (simpo, orpo)
        shift = np.sin(np.arange(len(blocks.reference)) * 1.7) * 3.0  # known, different per sequence
        blocks.reference = blocks.reference + shift

    plan = data.train
    order = plan.epoch_order(0)
    micro = plan.micro_batches(order, 0)
    trained = plan.trained_tokens(order, 0)
    micro, trained = objective.begin_step(micro, trained, 0)  # KTO: the step's reference point z
    guard = BadStepGuard(TrainState(), d.device, precision, cfg.max_bad_steps)
    loss_sum, _ = fsdp_train.forward_backward(objective, micro, trained, guard, d, PhaseTimer(d.device))
    total = loss_sum.detach().clone()
    torch.distributed.all_reduce(total)
    grads = {}
    for name, param in bundle.model.named_parameters():
        grads[clean_fqn(name)] = param.grad.full_tensor().cpu() if hasattr(param.grad, "full_tensor") else param.grad
    if d.is_main:
        sequences = []
        for block in plan.step_blocks(order, 0):
            for s in blocks.sequences(block):
                a, n = int(blocks.starts[s]), int(blocks.lengths[s])
                sequences.append((s, blocks.tokens[a : a + n].tolist(), blocks.trained[a : a + n].tolist()))
        sequences.sort()  # pairs in split order: chosen (2p) then rejected (2p + 1)
        torch.save(
            {
                "loss": total.item() / trained,
                "grads": grads,
                "sequences": [(ids, mask) for _, ids, mask in sequences],
                "reference": None
                if blocks.reference is None
                else [float(blocks.reference[s]) for s, _, _ in sequences],
                "desirable": None
                if blocks.desirable is None
                else [bool(blocks.desirable[s // 2]) for s, _, _ in sequences[0::2]],
                "kl": float(objective.kl) if hasattr(objective, "kl") else None,
            },
            os.environ["DPO_GRADS_OUT"],
        )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
