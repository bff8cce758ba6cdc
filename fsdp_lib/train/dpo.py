"""Direct preference optimisation (--objective dpo): the pair losses (sigmoid = the DPO paper's, with conservative
label smoothing; ipo; and the reference-free simpo and orpo), the reference model's log-probabilities (precomputed once and stored with the token cache,
or live: the same model with its adapters off, or a frozen FSDP copy), the objective the training step calls in
place of the language-model loss, its metrics, and validation on held-out pairs."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lib.config import TrainConfig
from fsdp_lib.data.batch import Batch
from fsdp_lib.data.plan import TrainData, evaluation_shares
from fsdp_lib.data.preference import PairBlocks, read_reference, reference_path, write_reference
from fsdp_lib.errors import TrainError
from fsdp_lib.experiment_dir import reference_refusal
from fsdp_lib.model.build import ModelBundle, build_model, flops_per_token
from fsdp_lib.model.hf_files import weights_identity
from fsdp_lib.model.loss import CausalLMLoss, context_columns
from fsdp_lib.objective_flags import REFERENCE_FREE_LOSSES
from fsdp_lib.runtime import Dist, StopRequest, all_ranks_agree, evaluation_cut_short, log, reshard_all


def pair_losses(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
    kind: str,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss per pair, chosen reward, rejected reward). h = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r));
    sigmoid: -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h) (Rafailov et al. 2023; e > 0: conservative DPO);
    ipo: (h - 1 / (2 beta))^2 (Azar et al. 2023). Rewards: beta x (log pi - log ref), without gradient."""
    chosen = policy_chosen - reference_chosen
    rejected = policy_rejected - reference_rejected
    h = chosen - rejected
    if kind == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    return losses, beta * chosen.detach(), beta * rejected.detach()


def reference_free_losses(
    chosen_mean: torch.Tensor, rejected_mean: torch.Tensor, beta: float, kind: str, gamma: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss per pair, chosen reward, rejected reward) from each response's mean log-probability per token, with no
    reference model. simpo: -log sigmoid(beta (m_c - m_r) - gamma) (Meng et al. 2024); orpo: -m_c - beta log
    sigmoid(log odds_c - log odds_r), odds = p / (1 - p) with p = exp(m) (Hong et al. 2024: the chosen response's
    NLL plus the odds-ratio term). Rewards: beta x the mean log-probability, without gradient, as TRL logs them."""
    if kind == "simpo":
        losses = -F.logsigmoid(beta * (chosen_mean - rejected_mean) - gamma)
    else:
        log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
        losses = -chosen_mean - beta * F.logsigmoid(log_odds)
    return losses, beta * chosen_mean.detach(), beta * rejected_mean.detach()


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (Maechler 2012); x is kept below 0 (a mean log-probability
    of exactly 0 would make the odds infinite)."""
    x = x.clamp(max=-1e-12)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def sequence_sums(token_values: torch.Tensor, sequence_ids: torch.Tensor, count: int) -> torch.Tensor:
    """Per-sequence sums of per-token values (tokens with sequence id -1 belong to none: they are summed into a
    slot that is dropped, so nothing here waits for the device, as selecting them would)."""
    out = torch.zeros(count + 1, dtype=token_values.dtype, device=token_values.device)
    return out.index_add(0, sequence_ids.flatten() + 1, token_values.flatten())[1:]


def sequence_lengths(sequence_ids: torch.Tensor, count: int) -> torch.Tensor:
    """Tokens per sequence (int64), without a host sync (torch.bincount has one)."""
    return sequence_sums(
        torch.ones(sequence_ids.numel(), dtype=torch.int64, device=sequence_ids.device), sequence_ids, count
    )


def sequence_totals(policy: CausalLMLoss, token_values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Per-sequence sums of the per-token values `policy` computed for `batch`. Under --context-parallel each rank
    holds its part of every row: the parts' sums are added over the context group (with gradient, each part's flows
    back to its rank), so every rank of the group holds the whole sequences' sums."""
    count, context = len(batch.sequences), policy.context
    if context is None:
        return sequence_sums(token_values, batch.sequence_ids, count)
    local = sequence_sums(token_values, context_columns(batch.sequence_ids, context), count)
    if local.requires_grad:
        from torch.distributed.nn.functional import all_reduce

        return all_reduce(local, group=context.group)
    dist.all_reduce(local, group=context.group)
    return local


def context_share(policy: CausalLMLoss) -> float:
    """What one rank of a context group counts of figures the whole group holds alike (whole sequences' losses,
    pair counts): 1 on its first rank, 0 on the others, so sums over the ranks count each once."""
    return 1.0 if policy.context is None or policy.context.rank == 0 else 0.0


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """peft's LoRA layers compute the base layer alone (the flag their forward reads; peft's enable_adapters would
    also flip requires_grad, which FSDP's parameters must keep)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


def reference_token_log_probs(
    policy: CausalLMLoss, frozen: CausalLMLoss | None, batch: Batch, temperature: float = 1.0
) -> torch.Tensor:
    """The live reference's log-probability of each target token (of the logits / temperature), without gradient:
    the frozen copy, or (frozen None, --peft) the policy with its adapters off."""
    module = policy if frozen is None else frozen
    off = adapters_off(policy.model) if frozen is None else contextlib.nullcontext()
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), off:
            return module(batch, per_token=True, temperature=temperature)[0]
    finally:
        module.train(was_training)
        if frozen is not None:  # no backward ever reshards the copy: give its gathered layers back now
            reshard_all(frozen)


def frozen_copy(cfg: TrainConfig, precision: str, d: Dist) -> CausalLMLoss:
    """A frozen FSDP-sharded copy of the starting model (the reference without --peft), before any checkpoint is
    loaded into the policy."""
    log("--reference live: building a frozen copy of the starting model (FSDP-sharded, no gradients)")
    copy = build_model(dataclasses.replace(cfg, activation_checkpointing="off"), precision, d)
    copy.model.requires_grad_(False)
    return copy.train_forward


class DPOObjective:
    """What the training step calls for each micro-batch instead of CausalLMLoss: batch -> (the summed loss of its
    pairs, the router loss or None). forward_backward scales the sum by processes / (pairs in the global batch), so
    the gradient is that of the mean pair loss over the whole global batch at any process count or accumulation."""

    def __init__(self, cfg: TrainConfig, policy: CausalLMLoss, reference: str, frozen: CausalLMLoss | None = None):
        # reference: precomputed | adapters-off | copy | none (reference-free losses)
        self.policy, self.frozen, self.reference = policy, frozen, reference
        self.beta, self.kind, self.gamma = cfg.dpo_beta, cfg.dpo_loss, cfg.simpo_gamma
        self.label_smoothing, self.sft_weight = cfg.dpo_label_smoothing, cfg.sft_weight
        self.stats: torch.Tensor | None = None

    phase = ""  # what begin_step does, as the step timer names it ("": nothing)
    updates = 1  # optimizer updates per step (GRPO's --num-iterations)
    forwards_without_gradient = 0  # of the policy per block and step, besides the training forward (KTO: 1)

    def set_requires_gradient_sync(self, flag: bool) -> None:
        self.policy.set_requires_gradient_sync(flag)

    def begin_step(self, micro_batches: list[Batch], trained: int, epoch: int) -> tuple[list[Batch], int]:
        """A step's micro-batches and its normaliser, before they run: DPO's as the data plan made them."""
        return micro_batches, trained

    def next_update(self) -> None:
        """Never called: one update per step."""

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the micro-batch's summed pair losses, the router loss). Under --context-parallel every rank of a group
        holds the same pair losses: each returns its share, and the gradient of their sum is the pairs' own."""
        losses, aux = self.pair_losses(batch)
        share = 1.0 if self.policy.context is None else 1.0 / self.policy.context.size
        return losses.sum() * share, aux

    def reference_log_probs(self, batch: Batch) -> torch.Tensor:
        if self.reference == "precomputed":
            return batch.reference.float()
        token_logps = reference_token_log_probs(self.policy, self.frozen, batch)
        return sequence_totals(self.policy, token_logps, batch)

    def pair_losses(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each pair's loss (with gradient) and the router loss; adds the pairs' figures to self.stats."""
        count = len(batch.sequences)
        # the reference first: its activations are gone before the policy's exist
        reference = None if self.reference == "none" else self.reference_log_probs(batch)
        token_logps, aux = self.policy(batch, per_token=True)
        logps = sequence_totals(self.policy, token_logps, batch)
        tokens = sequence_lengths(batch.sequence_ids, count)
        if reference is None:
            means = logps / tokens.clamp_min(1)
            losses, reward_c, reward_r = reference_free_losses(
                means[0::2], means[1::2], self.beta, self.kind, self.gamma
            )
        else:
            losses, reward_c, reward_r = pair_losses(
                logps[0::2], logps[1::2], reference[0::2], reference[1::2], self.beta, self.kind, self.label_smoothing
            )
        nll = -logps[0::2] / tokens[0::2].clamp_min(1)
        if self.sft_weight:
            losses = losses + self.sft_weight * nll
        margin = (reward_c - reward_r).detach()
        figures = torch.stack(
            [
                torch.full((), float(len(losses)), device=losses.device),  # a fill: no copy from the host
                losses.detach().sum(),
                reward_c.sum(),
                reward_r.sum(),
                ((margin > 0).float() + 0.5 * (margin == 0).float()).sum(),
                logps[0::2].detach().sum(),
                logps[1::2].detach().sum(),
                nll.detach().sum(),
                tokens.sum().float(),
            ]
        ).double()
        figures = figures * context_share(self.policy)
        self.stats = figures if self.stats is None else self.stats + figures
        return losses, aux

    def take_stats(self) -> torch.Tensor | None:
        stats, self.stats = self.stats, None
        return stats

    def take_samples(self) -> list[dict]:
        return []

    @staticmethod
    def window_figures(totals: torch.Tensor, elapsed: float) -> dict[str, float]:
        """The log record's pair figures from PAIR_STATS summed over a window and the ranks; the trained tokens of
        a preference run are its response tokens."""
        return throughput_record(pair_figures(totals), "pairs", elapsed)

    @torch.no_grad()
    def evaluate(
        self, blocks: PairBlocks, cfg: TrainConfig, d: Dist, stop: StopRequest | None = None
    ) -> dict[str, float]:
        """The figures of the validation pairs, over every rank (padding blocks hold no pair); {} when a stop
        request cut the pass short. Every rank runs the same number of micro-batches: FSDP's all-gathers must line
        up."""
        self.policy.eval()
        saved, self.stats = self.stats, None
        count = len(blocks) if not cfg.eval_max_blocks else min(len(blocks), cfg.eval_max_blocks)
        for idx in evaluation_shares(count, cfg.batch_size, d):
            if evaluation_cut_short(stop, d):
                self.stats = saved
                self.policy.train()
                return {}
            self.pair_losses(blocks.gather(idx).to(d.device) if idx else empty_batch(blocks, d))
        totals = self.stats if self.stats is not None else torch.zeros(len(PAIR_STATS), dtype=torch.float64)
        totals = totals.to(d.device)
        dist.all_reduce(totals)
        self.stats = saved
        self.policy.train()
        return {f"val_{k}": v for k, v in pair_figures(totals).items()}


def empty_batch(blocks: PairBlocks, d: Dist) -> Batch:
    """A block of padding with no pair: keeps a rank's forward count in step with the others."""
    L = blocks.seq_length
    ids = torch.full((1, L), blocks.pad_id, dtype=torch.int64)
    reference = None if blocks.reference is None else torch.zeros(0, dtype=torch.float64)
    return Batch(
        ids, torch.full_like(ids, -100), torch.arange(L)[None], torch.full_like(ids, -1),
        torch.zeros(0, dtype=torch.int64), reference,
    ).to(d.device)  # fmt: skip


def sequence_log_probs(module: CausalLMLoss, batch: Batch) -> torch.Tensor:
    """The summed response log-probabilities of a micro-batch's sequences (no gradient wanted by the caller)."""
    token_logps, _ = module(batch, per_token=True)
    return sequence_totals(module, token_logps, batch)


# -- the precomputed reference ----------------------------------------------------------------------------------


def reference_key(cfg: TrainConfig, model_identity: str, adapter: str, precision: str, attention: str) -> str:
    """What the stored reference log-probabilities depend on besides the data (the cache folder already keys that):
    the starting weights (or, from scratch, the seed), the starting adapter's hash, the compute dtype and kernel."""
    start = model_identity if model_identity != "none" else f"init-seed-{cfg.seed}"
    text = f"{start}|peft-{cfg.peft}|adapter-{adapter}|{precision}|{attention}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def attach_reference(module: CausalLMLoss, blocks: PairBlocks, name: str, key: str, cfg: TrainConfig, d: Dist) -> None:
    """Sets blocks.reference: read from beside the token cache when stored there intact, else computed by the
    starting model (sharded over the ranks like training) and stored with its checksum. Called before any
    checkpoint is loaded, so the model is the starting one; a rerun reads the file and computes nothing."""
    path = reference_path(blocks.cache_path, key)
    count = 2 * blocks.num_pairs
    unit = "examples and KL sequences" if blocks.kto else "pairs"
    found = read_reference(path, count)
    if found is None and path.exists():
        log(f"WARNING: the stored reference log-probabilities {path} are damaged or incomplete: recomputing them")
    if all_agree_found(found is not None, d):
        blocks.reference = found
        log(f"reference log-probabilities of the {name} {unit}: read from {path} (checksum verified)")
        return
    start = time.perf_counter()
    values = torch.zeros(count, dtype=torch.float64, device=d.device)
    was_training = module.training
    module.eval()
    with torch.no_grad():
        for idx in evaluation_shares(len(blocks), cfg.batch_size, d):
            if not idx:
                sequence_log_probs(module, empty_batch(blocks, d))
                continue
            batch = blocks.gather(idx).to(d.device)
            values[batch.sequences] = sequence_log_probs(module, batch).double() * context_share(module)
    module.train(was_training)
    reshard_all(module)
    dist.all_reduce(values)  # each sequence was computed by exactly one rank (context group); the others hold 0
    blocks.reference = values.cpu().numpy()
    if not np.isfinite(blocks.reference).all():
        raise TrainError(f"the starting model's log-probabilities of some {name} pairs are not finite; check the model")
    if d.local_rank == 0:
        try:
            write_reference(path, blocks.reference)
        except OSError as exc:  # a cache: training goes on with the values in memory; a rerun computes them again
            log(f"WARNING: could not store the reference log-probabilities in {path} ({exc}); a rerun recomputes them")
    dist.barrier(group=d.cpu_group)
    log(
        f"reference log-probabilities of the {name} {unit}: computed by the starting model in "
        f"{time.perf_counter() - start:.1f}s ({blocks.num_pairs:,} {'examples' if blocks.kto else 'pairs'}), "
        f"stored in {path}"
    )


def all_agree_found(found: bool, d: Dist) -> bool:
    """True only when every rank has the stored file (a node without it makes all compute)."""
    t = torch.tensor([1 if found else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=d.cpu_group)
    return bool(t.item())


def reference_mode(cfg: TrainConfig) -> str:
    """precomputed, adapters-off (--peft, the same model with its adapters switched off), copy (a frozen copy), or
    none for the reference-free losses (simpo, orpo)."""
    if cfg.dpo_loss in REFERENCE_FREE_LOSSES:
        return "none"
    if cfg.reference == "precomputed" or (cfg.reference == "auto" and (cfg.peft == "none" or cfg.adapter)):
        return "precomputed"
    return "adapters-off" if cfg.peft != "none" else "copy"


def dpo_summary(cfg: TrainConfig, mode: str) -> str:
    what = {
        "precomputed": "precomputed once by the starting model (no second model in memory)",
        "adapters-off": "the same model with its adapters off (one extra forward per micro-batch, no extra memory)",
        "copy": "a frozen FSDP-sharded copy of the starting model (one extra forward per micro-batch)",
        "none": "none (reference-free: nothing is computed or built for a reference)",
    }[mode]
    smoothing = f", label smoothing {cfg.dpo_label_smoothing}" if cfg.dpo_label_smoothing else ""
    sft = f", + {cfg.sft_weight} x chosen NLL per token" if cfg.sft_weight else ""
    gamma = f", gamma {cfg.simpo_gamma}" if cfg.dpo_loss == "simpo" else ""
    orpo = " (the chosen NLL per token + beta x the odds-ratio loss)" if cfg.dpo_loss == "orpo" else ""
    return f"--dpo-loss {cfg.dpo_loss}, beta {cfg.dpo_beta}{gamma}{orpo}{smoothing}{sft}; reference: {what}"


def build_dpo(
    cfg: TrainConfig, bundle: ModelBundle, data: TrainData, precision: str, d: Dist
) -> tuple[DPOObjective, dict]:
    """(the DPO objective, what a resume must agree with). Before any checkpoint is loaded: a precomputed reference
    is the starting model's."""
    mode, frozen, reference = prepare_reference(cfg, bundle, data, precision, d)
    log(f"--objective dpo: {dpo_summary(cfg, mode)}")
    fingerprint = {
        "loss": cfg.dpo_loss,
        "beta": cfg.dpo_beta,
        "label_smoothing": cfg.dpo_label_smoothing,
        "sft_weight": cfg.sft_weight,
        "reference": reference,
    }
    if cfg.dpo_loss == "simpo":  # only then: the fingerprints of earlier runs stay as they were
        fingerprint["simpo_gamma"] = cfg.simpo_gamma
    return DPOObjective(cfg, bundle.train_forward, mode, frozen), reference_weights(fingerprint, mode, bundle)


def prepare_reference(
    cfg: TrainConfig, bundle: ModelBundle, data: TrainData, precision: str, d: Dist
) -> tuple[str, CausalLMLoss | None, str]:
    """The reference of --objective dpo or kto, before any checkpoint is loaded: (its mode, the frozen copy or None,
    the mode as a resume must agree with it). Dropout goes off; a precomputed reference is computed (or read) for
    every sequence of both splits."""
    mode = reference_mode(cfg)
    frozen = None
    dropped = disable_dropout(bundle.model)
    if dropped:
        log(
            f"--objective {data.objective}: dropout off in {dropped} module(s), so the policy's log-probs compare "
            "with the reference's"
        )
    if mode == "precomputed":
        adapter = bundle.peft.start if bundle.peft is not None else "none"
        attention = bundle.config._attn_implementation
        key = reference_key(cfg, weights_identity(bundle.model_dir), adapter, precision, attention)
        problem = reference_refusal(cfg, data.objective, f"precomputed-{key}")
        if all_ranks_agree(problem is not None, d):  # before the pass over the data, which may take long
            raise TrainError(problem or "another process found the checkpoint's reference differs; see its message")
        attach_reference(bundle.train_forward, data.train.blocks, "train", key, cfg, d)
        if data.validation is not None:
            attach_reference(bundle.train_forward, data.validation, "validation", key, cfg, d)
        return mode, None, f"precomputed-{key}"
    if mode == "copy":
        frozen = frozen_copy(cfg, precision, d)
    return mode, frozen, mode


def reference_weights(fingerprint: dict, mode: str, bundle: ModelBundle) -> dict:
    """A live frozen reference ("copy") is read from the model folder again by every resume: its weights' identity
    joins the resume fingerprint, so a folder whose weights changed since the run started is refused (the reference
    would be another model, silently)."""
    return {**fingerprint, "reference_weights": weights_identity(bundle.model_dir)} if mode == "copy" else fingerprint


def disable_dropout(model: nn.Module) -> int:
    """Dropout off everywhere (nn.Dropout, LoRA's included, and attention dropout), as TRL does for DPO: the
    reference is computed without it, so a policy with it would not start at ln 2. Returns how many were on."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            module.p, count = 0.0, count + 1
        if isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0:
            module.attention_dropout, count = 0.0, count + 1
    return count


def step_flops_per_token(bundle: ModelBundle, mode: str, policy_forwards: int = 0) -> Callable[[float], float]:
    """The training forward and backward's model FLOPs per token (bundle.flops_per_token, of the positions a token
    attends over), plus a live reference's forward (a third of 6N + attention; a precomputed reference or none
    adds nothing) and `policy_forwards` more forwards without gradient (KTO's z pass), a third each."""
    forwards = policy_forwards + (0 if mode in ("precomputed", "none") else 1)
    if not forwards:
        return bundle.flops_per_token
    forward = flops_per_token(bundle.model, bundle.config)
    return lambda span: bundle.flops_per_token(span) + forwards * forward(span) / 3


# --objective dpo: the sums dpo.DPOObjective keeps per step (over micro-batches; over ranks when a line is written).
PAIR_STATS = (
    "pairs",
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "sft_nll",
    "response_tokens",
)


def throughput_record(figures: dict[str, float], unit: str, elapsed: float) -> dict[str, float]:
    """A preference objective's log record of a window: its figures less the loss (the loop logs it) and the
    counts, plus `unit`s (pairs, examples) per second and the trained tokens, which are the responses'."""
    record = {k: v for k, v in figures.items() if k not in ("loss", unit, "response_tokens")}
    record[f"{unit}_per_s"] = figures[unit] / elapsed
    record["trained_tokens"] = int(figures["response_tokens"])
    record["trained_tokens_per_s"] = figures["response_tokens"] / elapsed
    return record


def pair_figures(totals: torch.Tensor) -> dict[str, float]:
    """Means per pair of the summed figures; the chosen/rejected log-probs are per sequence sums, as TRL logs."""
    values = dict(zip(PAIR_STATS, totals.tolist()))
    pairs = max(1.0, values["pairs"])
    out = {k: values[k] / pairs for k in PAIR_STATS if k not in ("pairs", "response_tokens")}
    out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    out["pairs"] = values["pairs"]
    out["response_tokens"] = values["response_tokens"]
    return out
