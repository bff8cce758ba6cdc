"""Kahneman-Tversky optimisation (--objective kto, Ethayarajh et al. 2024) on unpaired examples: each example's
completion is desirable or not, with no partner to compare it with. The loss of an example with log-ratio
r = log pi(y|x) - log ref(y|x) (summed over the completion's tokens) is

    desirable:    lambda_D (1 - sigmoid(beta (r - z)))
    undesirable:  lambda_U (1 - sigmoid(beta (z - r)))

where z, the reference point, is the batch's KL estimate: the mean of log pi - log ref over mismatched
prompt/completion sequences (unpaired.py builds one per example), clamped at 0 and without gradient, as TRL's
KTOTrainer computes it. TRL takes z per micro-batch over the processes; here it is taken over the whole global
batch (one pass without gradient before the step's micro-batches), so a step's loss and gradients do not depend
on the process count or the accumulation, and a resume at another process count continues the same run.

The reference is DPO's (dpo.py): precomputed once for both sequences of every example, or live (adapters off with
--peft, else a frozen copy); its log-probabilities are computed once per step, in the pass that measures z."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_lib.config import TrainConfig
from fsdp_lib.data.batch import Batch
from fsdp_lib.data.plan import TrainData, evaluation_shares
from fsdp_lib.data.preference import PairBlocks
from fsdp_lib.model.build import ModelBundle
from fsdp_lib.model.loss import CausalLMLoss
from fsdp_lib.runtime import Dist, StopRequest, evaluation_cut_short, log
from fsdp_lib.train.dpo import (
    DPOObjective,
    context_share,
    empty_batch,
    prepare_reference,
    reference_weights,
    sequence_lengths,
    sequence_totals,
    throughput_record,
)


def kto_losses(
    policy: torch.Tensor,
    reference: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    desirable_weight: float,
    undesirable_weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per example, reward per example): the KTO loss above for summed log-probs `policy` and `reference`,
    labels `desirable` (bool) and reference point `kl`; reward = beta x (log pi - log ref), without gradient."""
    ratio = policy - reference
    good = desirable_weight * (1.0 - torch.sigmoid(beta * (ratio - kl)))
    bad = undesirable_weight * (1.0 - torch.sigmoid(beta * (kl - ratio)))
    return torch.where(desirable, good, bad), beta * ratio.detach()


# --objective kto: the sums KTOObjective keeps per step (over micro-batches; over ranks when a line is written).
KTO_STATS = (
    "examples",
    "loss",
    "desirable",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "kl",
    "response_tokens",
)


def kto_figures(totals: torch.Tensor) -> dict[str, float]:
    """Means of the summed figures: losses, accuracy and KL per example; the chosen (desirable) and rejected
    (undesirable) rewards and log-probs per example of their kind, as TRL logs them, each kind's only where the
    window held an example of it (a mean of none is no figure, not 0; the margin needs both)."""
    v = dict(zip(KTO_STATS, totals.tolist()))
    examples, good = max(1.0, v["examples"]), v["desirable"]
    bad = v["examples"] - good
    out = {
        "loss": v["loss"] / examples,
        "rewards/accuracies": v["rewards/accuracies"] / examples,
        "kl": v["kl"] / examples,
        "examples": v["examples"],
        "desirable_share": good / examples,
        "response_tokens": v["response_tokens"],
    }
    for kind, count in (("chosen", good), ("rejected", bad)):
        if count:
            out[f"rewards/{kind}"] = v[f"rewards/{kind}"] / count
            out[f"logps/{kind}"] = v[f"logps/{kind}"] / count
    if good and bad:
        out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


class KTOObjective(DPOObjective):
    """DPO's objective with KTO's loss: a PairBlocks "pair" is an example (sequence 2k) and its KL sequence
    (2k + 1). begin_step measures the step's reference point z before its micro-batches run."""

    def __init__(
        self, cfg: TrainConfig, policy: CausalLMLoss, reference: str, device: torch.device,
        frozen: CausalLMLoss | None = None,
    ) -> None:  # fmt: skip
        super().__init__(cfg, policy, reference, frozen)
        self.desirable_weight, self.undesirable_weight = cfg.kto_desirable_weight, cfg.kto_undesirable_weight
        self.device = device
        self.kl = torch.zeros((), dtype=torch.float64, device=device)  # the step's z

    def reference_log_probs(self, batch: Batch) -> torch.Tensor:
        """The stored values: precomputed, or those begin_step computed live for this micro-batch."""
        return batch.reference.float() if batch.reference is not None else super().reference_log_probs(batch)

    @torch.no_grad()
    def reference_point(self, micro_batches: list[Batch], examples: int) -> torch.Tensor:
        """z over `micro_batches` on every rank (`examples` of them in all): the mean of log pi - log ref over the
        KL sequences, clamped at 0. A live reference's values are kept in each micro-batch for its loss."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for micro_batch in micro_batches:
            batch = micro_batch.to(self.device)
            reference = self.reference_log_probs(batch)
            if micro_batch.reference is None:
                micro_batch.reference = reference.detach()
            token_logps, _ = self.policy(batch, per_token=True)
            logps = sequence_totals(self.policy, token_logps, batch)
            total += (logps[1::2].double() - reference[1::2].double()).sum() * context_share(self.policy)
        dist.all_reduce(total)
        return (total / max(1, examples)).clamp(min=0.0)

    phase = "reference_point"
    forwards_without_gradient = 1  # the z pass: one forward of every block more per step (model-flops accounting)

    def begin_step(self, micro_batches: list[Batch], trained: int, epoch: int) -> tuple[list[Batch], int]:
        """The step's micro-batches as they are; measures z over them (`trained`: the global batch's examples)."""
        self.kl = self.reference_point(micro_batches, trained)
        return micro_batches, trained

    def pair_losses(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each example's loss (with gradient) and the router loss; adds the examples' figures to self.stats."""
        count = len(batch.sequences)
        reference = self.reference_log_probs(batch)
        token_logps, aux = self.policy(batch, per_token=True)
        logps = sequence_totals(self.policy, token_logps, batch)
        tokens = sequence_lengths(batch.sequence_ids, count)
        desirable = batch.desirable.to(logps.device)
        kl = self.kl.to(logps.dtype)
        losses, rewards = kto_losses(
            logps[0::2], reference[0::2], desirable, kl, self.beta, self.desirable_weight, self.undesirable_weight
        )
        # on the right side of the reference point (the loss below 1/2): a tie counts a half, as DPO's accuracy
        above = (rewards > self.beta * kl).float() + 0.5 * (rewards == self.beta * kl).float()
        right = torch.where(desirable, above, 1.0 - above)
        good, example_logps = desirable.float(), logps[0::2].detach()
        figures = torch.stack(
            [
                torch.full((), float(len(losses)), device=losses.device),
                losses.detach().sum(),
                good.sum(),
                (rewards * good).sum(),
                (rewards * (1 - good)).sum(),
                right.sum(),
                (example_logps * good).sum(),
                (example_logps * (1 - good)).sum(),
                torch.zeros((), device=losses.device),
                tokens[0::2].sum().float(),
            ]
        ).double()
        figures = figures * context_share(self.policy)
        self.stats = figures if self.stats is None else self.stats + figures
        return losses, aux

    def take_stats(self) -> torch.Tensor | None:
        """The step's sums; the KL slot holds z x this rank's examples, so a window's figure is the mean of its
        steps' z weighted by their examples (every rank has the same z)."""
        stats, self.stats = self.stats, None
        if stats is not None:
            stats[KTO_STATS.index("kl")] = self.kl * stats[KTO_STATS.index("examples")]
        return stats

    @staticmethod
    def window_figures(totals: torch.Tensor, elapsed: float) -> dict[str, float]:
        """The log record's figures from KTO_STATS summed over a window and the ranks; the trained tokens of a KTO
        run are its completion tokens."""
        return throughput_record(kto_figures(totals), "examples", elapsed)

    @torch.no_grad()
    def evaluate(
        self, blocks: PairBlocks, cfg: TrainConfig, d: Dist, stop: StopRequest | None = None
    ) -> dict[str, float]:
        """The figures of the validation examples over every rank: a first pass measures z over all of them, a
        second takes their losses; {} when a stop request cut them short. Every rank runs as many micro-batches:
        FSDP's all-gathers must line up."""
        self.policy.eval()
        saved_stats, saved_kl, self.stats = self.stats, self.kl, None
        count = len(blocks) if not cfg.eval_max_blocks else min(len(blocks), cfg.eval_max_blocks)
        shares = evaluation_shares(count, cfg.batch_size, d)
        batches = [blocks.gather(idx) if idx else empty_batch(blocks, d) for idx in shares]
        for batch in batches:
            if batch.desirable is None:  # an empty batch (padding): no example
                batch.desirable = torch.zeros(0, dtype=torch.bool)
        examples = int(sum(int(blocks.pairs_in[i]) for i in range(count)))
        cut = evaluation_cut_short(stop, d)  # before each of the two passes and each micro-batch of the second
        if not cut:
            self.kl = self.reference_point(batches, examples)
        for batch in batches:
            cut = cut or evaluation_cut_short(stop, d)
            if cut:
                break
            self.pair_losses(batch.to(d.device))
        if cut:
            self.stats, self.kl = saved_stats, saved_kl
            self.policy.train()
            return {}
        totals = self.take_stats()
        if totals is None:
            totals = torch.zeros(len(KTO_STATS), dtype=torch.float64)
        totals = totals.to(d.device)
        dist.all_reduce(totals)
        self.stats, self.kl = saved_stats, saved_kl
        self.policy.train()
        return {f"val_{k}": v for k, v in kto_figures(totals).items()}


def build_kto(
    cfg: TrainConfig, bundle: ModelBundle, data: TrainData, precision: str, d: Dist
) -> tuple[KTOObjective, dict]:
    """(the KTO objective, what a resume must agree with); the reference as DPO's (dpo.prepare_reference)."""
    mode, frozen, reference = prepare_reference(cfg, bundle, data, precision, d)
    what = {
        "precomputed": "precomputed once by the starting model for every example and KL sequence",
        "adapters-off": "the same model with its adapters off",
        "copy": "a frozen FSDP-sharded copy of the starting model",
    }[mode]
    log(
        f"--objective kto: beta {cfg.dpo_beta}, weights desirable {cfg.kto_desirable_weight} / undesirable "
        f"{cfg.kto_undesirable_weight}; reference: {what}; the KL reference point z is measured over each global "
        "batch's KL sequences in a pass without gradient before its step (one forward more per step)"
    )
    fingerprint = {
        "loss": "kto",
        "beta": cfg.dpo_beta,
        "desirable_weight": cfg.kto_desirable_weight,
        "undesirable_weight": cfg.kto_undesirable_weight,
        "reference": reference,
    }
    return KTOObjective(cfg, bundle.train_forward, mode, d.device, frozen), reference_weights(fingerprint, mode, bundle)
