"""The preference and RL objectives never make the host wait for the device inside a micro-batch (issue 32, item 9).

A GPU cannot be used here, so the test watches the operators instead: those whose result the host must read
before it can go on (nonzero and boolean indexing, item/tolist, bincount, a tensor made from host data inside the
step) are the syncs a GPU run would pay. Each is attributed to the innermost frame outside torch, so a failure
names the line."""

from __future__ import annotations

import traceback
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_lib.data.batch import Batch
from fsdp_lib.model import varlen
from fsdp_lib.model.loss import CausalLMLoss
from fsdp_lib.testing import tiny_config
from fsdp_lib.train.dpo import DPOObjective
from fsdp_lib.train.grpo import GRPOObjective
from fsdp_lib.train.kto import KTOObjective

aten = torch.ops.aten
SYNCING = {
    aten.nonzero.default,
    aten._local_scalar_dense.default,  # .item(), .tolist(), int(t), bool(t)
    aten.is_nonzero.default,
    aten.bincount.default,
    aten.masked_select.default,
    aten.lift_fresh.default,  # torch.tensor / from_numpy of host data: a copy from the host on a GPU
    aten._unique2.default,
    aten.repeat_interleave.Tensor,
}


# Host data that is copied to the device pinned and non-blocking (no wait): varlen's document groups, made once per
# micro-batch from the host's document bounds.
PINNED_COPIES = {"_to_device"}


class SyncWatch(TorchDispatchMode):
    """Records where each host-syncing operator was called from."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        boolean_index = func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])
        )
        if func in SYNCING or boolean_index:
            frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename]
            where = frames[-2] if len(frames) > 1 else frames[-1]  # [-1] is this method
            if func == aten.lift_fresh.default and where.name in PINNED_COPIES:
                return func(*args, **kwargs)
            self.found.append(f"{func} at {where.filename.split('/')[-1]}:{where.lineno} ({where.line})")
        return func(*args, **kwargs)


@pytest.fixture(scope="module")
def policy() -> CausalLMLoss:
    """A tiny Llama with varlen attention (packed documents without a mask and without a sync), the chunked head."""
    from transformers import AutoModelForCausalLM

    varlen.register()
    config = tiny_config("llama", 64, 0)
    config.use_cache = False
    torch.manual_seed(0)
    model = CausalLMLoss(AutoModelForCausalLM.from_config(config, attn_implementation=varlen.NAME), 8)
    model.document_masking = "varlen"
    return model


def pair_batch(kto: bool = False) -> Batch:
    """Two rows of 2 pairs (4 sequences each: prompt, response), padding at the end, as PairBlocks.gather makes
    them; on the host, then moved by Batch.to, which finds documents and targets there."""
    ids = torch.randint(1, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    lengths = [5, 6, 4, 7]  # tokens per sequence; each trains its last 3 targets
    labels, owner, positions = torch.full_like(ids, -100), torch.full_like(ids, -1), torch.zeros_like(ids)
    for row in range(2):
        at = 0
        for k, n in enumerate(lengths):
            positions[row, at : at + n] = torch.arange(n)
            labels[row, at + n - 4 : at + n - 1] = ids[row, at + n - 3 : at + n]
            owner[row, at + n - 4 : at + n - 1] = 4 * row + k
            at += n
        positions[row, at:] = torch.arange(24 - at)
    reference = torch.linspace(-9.0, -7.0, 8, dtype=torch.float64)
    batch = Batch(ids, labels, positions, owner, torch.arange(8), reference)
    if kto:
        batch.desirable = torch.tensor([True, False, True, False])
    return batch.to(torch.device("cpu"))


def watched(step) -> list[str]:
    with SyncWatch() as watch:
        loss, _ = step()
        loss.backward()
    return watch.found


@pytest.mark.parametrize("loss", ["sigmoid", "simpo", "orpo"])
def test_dpo_micro_batch_has_no_host_sync(policy, loss):
    cfg = SimpleNamespace(dpo_beta=0.1, dpo_loss=loss, simpo_gamma=0.5, dpo_label_smoothing=0.0, sft_weight=0.1)
    objective = DPOObjective(cfg, policy, "precomputed" if loss == "sigmoid" else "none")
    batch = pair_batch()
    assert watched(lambda: objective(batch)) == []
    assert objective.take_stats()[0] == 4  # it did run: 4 pairs


def test_kto_micro_batch_has_no_host_sync(policy):
    cfg = SimpleNamespace(
        dpo_beta=0.1, dpo_loss="sigmoid", simpo_gamma=0.0, dpo_label_smoothing=0.0, sft_weight=0.0,
        kto_desirable_weight=1.0, kto_undesirable_weight=1.0,
    )  # fmt: skip
    objective = KTOObjective(cfg, policy, "precomputed", torch.device("cpu"))
    objective.kl = torch.tensor(0.25, dtype=torch.float64)
    batch = pair_batch(kto=True)
    assert watched(lambda: objective(batch)) == []


@pytest.mark.parametrize("normalisation", ["grpo", "dapo"])
def test_grpo_micro_batch_has_no_host_sync(policy, normalisation):
    objective = GRPOObjective.__new__(GRPOObjective)  # the loss alone: no rollout, no process group
    objective.cfg = SimpleNamespace(grpo_beta=0.0, temperature=0.9, epsilon=0.2, grpo_loss=normalisation)
    objective.policy, objective.frozen, objective.epsilon_high = policy, None, 0.28
    objective.update, objective.calls, objective.updates, objective.device_stats = 0, 0, 1, None
    objective.old_log_probs, objective.references = [], []
    batch = pair_batch()
    batch.advantages = torch.linspace(-1.0, 1.0, 8)
    assert watched(lambda: objective(batch)) == []


def test_the_watch_sees_what_the_code_used_to_do():
    """The watch is not blind: the old sequence_sums (boolean selection) and bincount are reported."""
    ids = torch.tensor([0, -1, 1, 1])
    with SyncWatch() as watch:
        keep = ids >= 0
        torch.zeros(2).index_add(0, ids[keep], torch.ones(4)[keep])
        torch.bincount(ids[keep], minlength=2)
        torch.tensor(1.0)
    ops = [f.split(" at ")[0] for f in watch.found]
    assert ops == ["aten.index.Tensor"] * 3 + ["aten.bincount.default", "aten.lift_fresh.default"], watch.found
    assert all("test_host_syncs.py" in f for f in watch.found), watch.found


def test_sft_micro_batch_has_no_host_sync(policy):
    """The plain loss too (chunked head, packed documents through varlen)."""
    pairs = pair_batch()
    batch = Batch(pairs.input_ids, pairs.labels, pairs.position_ids).to(torch.device("cpu"))
    assert watched(lambda: policy(batch)) == []
