"""Online RL with verifiable rewards (--objective grpo): each step, every prompt of the global batch gets
--num-generations completions sampled on the sharded model (rollout.py), scored by the --reward functions
(rewards.py); the rewards are normalised within each prompt's group into advantages, and the step takes the
clipped policy-gradient loss of Shao et al. 2024, with an optional KL term to the reference (--grpo-beta).

The loss normalisations (--grpo-loss), over the whole global batch at any process count or accumulation:
  grpo:    each completion's mean token loss, averaged over completions (the GRPO paper);
  dapo:    the token losses summed over every completion, divided by their tokens (DAPO, Yu et al. 2025; the
           default: a long completion's tokens weigh as much as a short one's);
  dr_grpo: the token losses summed, divided by completions x --max-new-tokens, and advantages not divided by the
           group's standard deviation (Dr. GRPO, Liu et al. 2025: neither length nor difficulty bias).
Clipping: ratio clamped to [1 - --epsilon, 1 + --epsilon-high] (DAPO's clip-higher when --epsilon-high > --epsilon).
One optimizer step per generation batch, so the ratio is 1 in value (the old policy is the current one) and only its
gradient acts; the clip matters once several steps reuse a batch, which this version does not do."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fsdp_lib.config import TrainConfig
from fsdp_lib.data.batch import Batch
from fsdp_lib.data.plan import TrainData, evaluation_shares
from fsdp_lib.data.prompts import PromptBatch, PromptSet, end_of_turn_ids
from fsdp_lib.errors import TrainError
from fsdp_lib.model.build import ModelBundle
from fsdp_lib.model.loss import CausalLMLoss, context_columns
from fsdp_lib.objective_flags import reward_timeout
from fsdp_lib.runtime import Dist, StopRequest, eagerly, evaluation_cut_short, log
from fsdp_lib.train.dpo import (
    context_share,
    disable_dropout,
    frozen_copy,
    reference_token_log_probs,
    reference_weights,
    sequence_lengths,
    sequence_sums,
)
from fsdp_lib.train.rewards import (
    RewardError,
    RewardFunction,
    column_problems,
    combine,
    completion_text,
    load_rewards,
    score,
)
from fsdp_lib.train.rollout import Completions, generate, keep_layers_gathered, sampling_uniforms
from fsdp_lib.train.samples import stop_ids

# The figures a step sums per rank (then over the window and the ranks), then one triple per reward function.
GRPO_STATS = (
    "completions",
    "reward",
    "reward_sq",
    "prompt_tokens",
    "completion_tokens",
    "stopped",
    "groups",
    "zero_std_groups",
    "entropy",
    "generation_s",
    "clipped_tokens",
    "kl",
)
STD_EPS = 1e-4  # added to a group's standard deviation (as TRL), so a group of equal rewards gives advantages of 0
VALIDATION_EPOCH = -1  # the sampling streams of the held-out prompts: apart from every training epoch's


@dataclass
class Scored:
    """A micro-batch's sampled completions (token rows, as strings or messages) and rewards."""

    rows: list[list[int]]  # each completion's prompt ids (a prompt's --num-generations rows next to each other)
    done: Completions
    completions: list[Any]
    scores: np.ndarray  # [reward functions x completions], NaN where a function returned None
    rewards: np.ndarray  # combined
    error: str | None  # a reward function's failure, raised once every rank has generated


def context_rows(rows: int, size: int, rank: int) -> tuple[int, int]:
    """The contiguous rows [start, stop) of a micro-batch's completions that context rank `rank` of `size` samples
    and scores (balanced: the shares differ by at most one row; empty where there are fewer rows than ranks)."""
    return rows * rank // size, rows * (rank + 1) // size


@dataclass
class Share:
    """One rank's share of a micro-batch's completions, sampled and scored (GRPOObjective.sample_share)."""

    done: Completions
    completions: list[Any]
    scores: np.ndarray
    error: str | None

    @staticmethod
    def joined(shares: list[Share], own: Share) -> Share:
        """The context group's shares in rank order as one; the decoding forwards and seconds are this rank's, and
        so is the error (a reward function failing on another rank's share is that rank's to report, so the
        message names the rank it failed on)."""
        done = Completions(
            [t for s in shares for t in s.done.tokens],
            [b for s in shares for b in s.done.stopped],
            sum(s.done.entropy_sum for s in shares),
            own.done.forwards,
            own.done.seconds,
        )
        completions = [c for s in shares for c in s.completions]
        return Share(done, completions, np.concatenate([s.scores for s in shares], axis=1), own.error)


def group_advantages(rewards: np.ndarray, group: int, scale: bool) -> np.ndarray:
    """(reward - its group's mean), divided by the group's standard deviation (unbiased) + STD_EPS when `scale`.
    rewards: [prompts x group] flattened, a prompt's completions next to each other."""
    grouped = rewards.reshape(-1, group)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    if scale:
        centred = centred / (grouped.std(axis=1, ddof=1, keepdims=True) + STD_EPS)
    return centred.reshape(-1)


def token_losses(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    epsilon: float,
    epsilon_high: float,
    beta: float = 0.0,
    reference: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, clipped mask, per-token KL or zeros). -min(r A, clip(r, 1 - eps, 1 + eps_high) A) with
    r = exp(logp - old logp), + beta x the k3 estimator exp(ref - logp) - (ref - logp) - 1 (Schulman 2020)."""
    ratio = torch.exp(logps - old_logps)
    clipped_ratio = ratio.clamp(1.0 - epsilon, 1.0 + epsilon_high)
    losses = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    clipped = ((ratio < 1.0 - epsilon) & (advantages < 0)) | ((ratio > 1.0 + epsilon_high) & (advantages > 0))
    kl = torch.zeros_like(losses)
    if beta and reference is not None:
        delta = reference - logps
        kl = torch.exp(delta) - delta - 1.0
        losses = losses + beta * kl
    return losses, clipped, kl


def completion_batch(
    prompts: list[list[int]], completions: list[list[int]], advantages: np.ndarray, pad_id: int, multiple: int = 1
) -> Batch:
    """Rows prompt + completion (right-padded to a multiple of `multiple`: --context-parallel splits them), labels
    on the completion tokens only, each row its own sequence."""
    length = -(-max(len(p) + len(c) for p, c in zip(prompts, completions)) // multiple) * multiple
    rows = len(prompts)
    ids = torch.full((rows, length), pad_id, dtype=torch.int64)
    labels = torch.full((rows, length), -100, dtype=torch.int64)
    owner = torch.full((rows, length), -1, dtype=torch.int64)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        ids[i, : len(p) + len(c)] = torch.as_tensor(p + c)
        labels[i, len(p) - 1 : len(p) + len(c) - 1] = torch.as_tensor(c)
        owner[i, len(p) - 1 : len(p) + len(c) - 1] = i
    return Batch(ids, labels, None, owner, torch.arange(rows), None, torch.as_tensor(advantages, dtype=torch.float32))


class GRPOObjective:
    """The training step's objective for --objective grpo. `rollout` turns this rank's prompt micro-batches into
    completion batches (and the global normaliser); then, per micro-batch, the call returns (the summed loss, the
    router loss or None), which forward_backward scales by processes / normaliser."""

    def __init__(
        self,
        cfg: TrainConfig,
        policy: CausalLMLoss,
        rewards: list[RewardFunction],
        tokenizer: Any,
        prompts: PromptSet,
        d: Dist,
        reference: str,
        frozen: CausalLMLoss | None,
        keep_gathered: bool,
    ):
        self.cfg, self.policy, self.rewards, self.d = cfg, policy, rewards, d
        self.tokenizer, self.prompts = tokenizer, prompts
        self.reference, self.frozen, self.keep_gathered = reference, frozen, keep_gathered
        self.group = cfg.num_generations
        self.epsilon_high = cfg.epsilon_high or cfg.epsilon
        self.stops = stop_ids(policy.model, tokenizer)
        if prompts.conversational:  # a templated prompt's completion ends with the template's end of turn
            self.stops |= end_of_turn_ids(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.host_stats = np.zeros(len(GRPO_STATS) + 3 * len(rewards))
        self.device_stats: torch.Tensor | None = None
        self.samples: list[dict] = []
        self.last_rewards: list[float] = []  # the last rollout's combined rewards on this rank, in row order
        self.updates = cfg.num_iterations  # optimizer updates per rollout
        self.update = 0  # which of them the step's micro-batches are running (next_update)
        self.calls = 0  # micro-batches of this update so far
        self.old_log_probs: list[torch.Tensor] = []  # per micro-batch: of the policy that sampled (update 0's)
        self.references: list[torch.Tensor] = []  # per micro-batch: the reference's, with --grpo-beta
        self.unapplied: set[str] = set()  # the reward functions already warned about applying to no completion

    def set_requires_gradient_sync(self, flag: bool) -> None:
        self.policy.set_requires_gradient_sync(flag)

    # -- generation and rewards -------------------------------------------------------------------------------------

    phase = "generate"
    forwards_without_gradient = 0  # the model flops count the training forward and backward, not generation
    reward_failed = False  # a reward function failed on this rank in this rollout: the rest is not scored

    def begin_step(self, batches: list[PromptBatch], trained: int, epoch: int) -> tuple[list[Batch], int]:
        """The step's micro-batches of prompts become their sampled completions (rollout)."""
        return self.rollout(batches, epoch)

    def rollout(self, batches: list[PromptBatch], epoch: int) -> tuple[list[Batch], int]:
        """This rank's completion batches and the global batch's normaliser (completions for grpo, completion
        tokens for dapo, completions x --max-new-tokens for dr_grpo). Every rank generates every micro-batch even
        after a reward function failed on it (the ranks' forwards must line up); then all stop with its message."""
        out, error = [], None
        tokens = sequences = 0
        self.last_rewards, self.reward_failed = [], False
        self.update, self.calls, self.old_log_probs, self.references = 0, 0, [], []
        with eagerly():
            for k, prompts in enumerate(batches):
                batch, problem = self.rollout_one(prompts, epoch, first=k == 0)
                error = error or problem
                out.append(batch)
                sequences += len(batch.sequences)
                tokens += int((batch.sequence_ids >= 0).sum())
        self.raise_if_failed(error)
        if self.d.context_rank:  # the ranks of a context group sampled the same completions: the first counts them
            sequences = tokens = 0
        counts = torch.tensor([sequences, tokens], dtype=torch.int64)
        dist.all_reduce(counts, group=self.d.cpu_group)
        sequences, tokens = counts.tolist()
        normaliser = {"grpo": sequences, "dapo": tokens, "dr_grpo": sequences * self.cfg.max_new_tokens}
        return out, max(1, normaliser[self.cfg.grpo_loss])

    def sample_and_score(self, prompts: PromptBatch, epoch: int, stand_in: bool = False) -> Scored:
        """--num-generations completions of each prompt, sampled with the streams of `epoch`, and their rewards.
        Under --context-parallel the ranks of a context group hold the same prompts: each samples and scores its
        share of the completions (context_rows), then they exchange them, so every rank holds all of them.
        stand_in: `prompts` only keep this rank's forwards in line with the others' (nothing sampled is kept, no
        reward function runs)."""
        g, size = self.group, self.d.context_size
        rows = [ids for ids in prompts.ids for _ in range(g)]
        keys = np.repeat(np.asarray(prompts.indices, dtype=np.int64), g)
        generations = np.tile(np.arange(g, dtype=np.int64), len(prompts.ids))
        repeated = [p for p in prompts.prompts for _ in range(g)]
        columns = {name: [v for v in values for _ in range(g)] for name, values in prompts.columns.items()}
        start, stop = (0, 0) if stand_in else context_rows(len(rows), size, self.d.context_rank)
        own = self.sample_share(rows, keys, generations, repeated, columns, epoch, start, stop)
        if size > 1:
            shares: list[Any] = [None] * size
            dist.all_gather_object(shares, own, group=self.d.context_group)
            own = Share.joined(shares, own)
        return Scored(rows, own.done, own.completions, own.scores, combine(own.scores, self.rewards), own.error)

    def sample_share(
        self, rows: list[list[int]], keys: np.ndarray, generations: np.ndarray, repeated: list, columns: dict,
        epoch: int, start: int, stop: int,
    ) -> Share:  # fmt: skip
        """Rows start..stop sampled and scored. An empty share samples row 0 as a stand-in, ended from its first
        token (every rank runs the same decoding forwards), and keeps nothing of it."""
        cfg = self.cfg
        pick = slice(start, stop) if stop > start else slice(0, 1)
        uniforms = sampling_uniforms(cfg.seed, epoch, keys[pick], generations[pick], cfg.max_new_tokens)
        done = generate(
            self.policy, rows[pick], uniforms, cfg.max_new_tokens, cfg.temperature, cfg.top_p, self.stops,
            self.pad_id, self.d.device, self.keep_gathered, stand_in=stop == start,
        )  # fmt: skip
        if stop == start:
            done = Completions([], [], 0.0, done.forwards, done.seconds)
        texts = [
            self.tokenizer.decode(t[:-1] if stopped else t, skip_special_tokens=True)
            for t, stopped in zip(done.tokens, done.stopped)
        ]
        completions: list[Any] = texts
        if self.prompts.conversational:
            completions = [[{"role": "assistant", "content": text}] for text in texts]
        error, scores = None, np.zeros((len(self.rewards), len(completions) if self.reward_failed else 0))
        # a reward function never sees an empty batch, nor another one once it failed (a hung grader would cost
        # --reward-timeout-s per micro-batch before every rank stops)
        if completions and not self.reward_failed:
            try:
                scores = score(
                    self.rewards, repeated[start:stop], completions, {k: v[start:stop] for k, v in columns.items()},
                    reward_timeout(cfg),
                )  # fmt: skip
            except RewardError as exc:
                error, scores = str(exc), np.zeros((len(self.rewards), len(completions)))
                self.reward_failed = True
        return Share(done, completions, scores, error)

    def rollout_one(self, prompts: PromptBatch, epoch: int, first: bool) -> tuple[Batch, str | None]:
        g = self.group
        got = self.sample_and_score(prompts, epoch)
        self.last_rewards += got.rewards.tolist()
        advantages = group_advantages(got.rewards, g, scale=self.cfg.grpo_loss != "dr_grpo")
        batch = completion_batch(got.rows, got.done.tokens, advantages, self.pad_id, self.d.context_size)
        self.count(got.rows, got.done, got.rewards, got.scores)
        if first:
            self.samples = [
                {"prompt": shown, "completion": completion_text(c), "reward": float(r),
                 "rewards": {f.label: (None if math.isnan(s) else float(s)) for f, s in zip(self.rewards, column)}}
                for shown, c, r, column in zip(
                    [self.tokenizer.decode(got.rows[0])] * g, got.completions[:g], got.rewards[:g], got.scores[:, :g].T
                )
            ]  # fmt: skip
        return batch, got.error

    @torch.no_grad()
    def evaluate(
        self, prompts: PromptSet, cfg: TrainConfig, d: Dist, stop: StopRequest | None = None
    ) -> dict[str, float]:
        """The held-out prompts' mean reward (combined and per function) and completion length, --num-generations
        completions each, sampled with the validation streams (the same numbers at every evaluation, so the figures
        of two evaluations differ by the model only); {} when a stop request cut it short. Every rank runs as many
        generations (a rank without a prompt left decodes a stand-in that ends at once, scores nothing and counts
        nothing): the forwards must line up."""
        count = len(prompts) if not cfg.eval_max_blocks else min(len(prompts), cfg.eval_max_blocks)
        sums = np.zeros(3 + 2 * len(self.rewards))  # completions, reward, completion tokens, per function: sum, count
        error, self.reward_failed = None, False
        with eagerly():
            for idx in evaluation_shares(count, cfg.batch_size, d):
                if evaluation_cut_short(stop, d):
                    return {}
                got = self.sample_and_score(prompts.gather(idx or [0]), VALIDATION_EPOCH, stand_in=not idx)
                error = error or got.error
                real = len(idx) * self.group
                sums[:3] += [real, got.rewards[:real].sum(), sum(len(t) for t in got.done.tokens[:real])]
                for k, row in enumerate(got.scores[:, :real]):
                    sums[3 + 2 * k : 5 + 2 * k] += [np.nansum(row), (~np.isnan(row)).sum()]
        self.raise_if_failed(error)
        totals = torch.from_numpy(sums * context_share(self.policy)).to(d.device)
        dist.all_reduce(totals)
        values = totals.cpu().numpy()
        n = max(1.0, values[0])
        figures = {
            "val_reward": values[1] / n,
            "val_completion_length": values[2] / n,
            "val_completions": int(values[0]),
        }
        for k, reward in enumerate(self.rewards):
            total, applies = values[3 + 2 * k : 5 + 2 * k]
            if applies:
                figures[f"val_rewards/{reward.label}"] = total / applies
        return figures

    def raise_if_failed(self, error: str | None) -> None:
        """Every rank stops, with the first failing rank's message, when a reward function failed on any."""
        gathered: list[Any] = [None] * self.d.world_size
        dist.all_gather_object(gathered, error, group=self.d.cpu_group)
        failed = [(rank, e) for rank, e in enumerate(gathered) if e]
        if failed:
            rank, message = failed[0]
            raise TrainError(
                f"{message} (rank {rank}); fix the reward function and rerun the same command to resume (with "
                "--force-resume if you edit its file: a resume pins the reward files' contents)"
            )

    def count(self, rows: list[list[int]], done: Any, rewards: np.ndarray, scores: np.ndarray) -> None:
        grouped = rewards.reshape(-1, self.group)
        figures = [
            len(rows),
            rewards.sum(),
            (rewards**2).sum(),
            sum(len(r) for r in rows),
            sum(len(t) for t in done.tokens),
            sum(done.stopped),
            grouped.shape[0],
            int((grouped.std(axis=1) == 0).sum()),
            done.entropy_sum,
            done.seconds,
            0.0,
            0.0,
        ]
        for row in scores:
            applies = ~np.isnan(row)
            figures += [np.nansum(row), np.nansum(row**2), applies.sum()]
        self.host_stats += np.asarray(figures, dtype=np.float64)

    # -- the loss ---------------------------------------------------------------------------------------------------

    def __call__(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the summed token losses, the router loss). Under --context-parallel the log-probabilities are of this
        rank's part of every row, and so is everything here but the completions' lengths."""
        local_ids = context_columns(batch.sequence_ids, self.policy.context)
        ids = local_ids.flatten()
        mask = ids >= 0
        reference = None
        if self.cfg.grpo_beta:  # the reference first: its activations are gone before the policy's exist
            # the reference does not change: its log-probabilities are kept across the step's updates
            reference = self.kept(
                self.references,
                lambda: reference_token_log_probs(self.policy, self.frozen, batch, self.cfg.temperature),
            )
        logps, aux = self.policy(batch, per_token=True, temperature=self.cfg.temperature)  # the sampled distribution
        advantages = batch.advantages[ids.clamp(min=0)]
        old = self.kept(self.old_log_probs, logps.detach)  # of the policy that sampled: update 0's
        self.calls += 1
        losses, clipped, kl = token_losses(
            logps, old, advantages, self.cfg.epsilon, self.epsilon_high, self.cfg.grpo_beta, reference
        )
        losses = losses * mask
        if self.cfg.grpo_loss == "grpo":
            count = len(batch.sequences)
            lengths = sequence_lengths(batch.sequence_ids, count).clamp_min(1)
            loss_sum = (sequence_sums(losses, local_ids, count) / lengths).sum()
        else:
            loss_sum = losses.sum()
        figures = torch.stack([(clipped & mask).sum().double(), (kl.detach() * mask).sum().double()])
        self.device_stats = figures if self.device_stats is None else self.device_stats + figures
        return loss_sum, aux

    def kept(self, store: list[torch.Tensor], value: Callable[[], torch.Tensor]) -> torch.Tensor:
        """At the step's first update: value(), kept in `store` for the next updates (--num-iterations); at a later
        one: what the first computed for this micro-batch."""
        if self.update == 0:
            computed = value()
            if self.updates > 1:
                store.append(computed)
            return computed
        return store[self.calls]

    def next_update(self) -> None:
        """The step's micro-batches run again (--num-iterations), their ratio taken to the sampling policy."""
        self.update, self.calls = self.update + 1, 0

    # -- metrics and samples ----------------------------------------------------------------------------------------

    def take_stats(self) -> torch.Tensor:
        """The step's sums: the completions' figures from the first rank of each context group (its ranks hold the
        same completions), the clipped tokens and KL from every rank (each holds its part of the tokens)."""
        stats = torch.from_numpy(self.host_stats * context_share(self.policy)).to(self.d.device)
        if self.device_stats is not None:  # clipped tokens and KL: means over the step's updates
            at = GRPO_STATS.index("clipped_tokens")
            stats[at : at + 2] += self.device_stats.to(stats.device) / (self.update + 1)
        self.host_stats[:] = 0
        self.device_stats = None
        return stats

    def take_samples(self) -> list[dict]:
        samples, self.samples = self.samples, []
        return samples if self.d.is_main else []

    def window_figures(self, totals: torch.Tensor, elapsed: float) -> dict[str, float]:
        """The log record's GRPO figures from the window's sums over the ranks."""
        values = totals.double().cpu().numpy()
        base = dict(zip(GRPO_STATS, values[: len(GRPO_STATS)].tolist()))
        n = max(1.0, base["completions"])
        tokens = max(1.0, base["completion_tokens"])
        mean = base["reward"] / n
        record = {
            "reward": mean,
            "reward_std": math.sqrt(max(0.0, base["reward_sq"] / n - mean**2)),
            "completion_length": base["completion_tokens"] / n,
            "completions/truncated": 1.0 - base["stopped"] / n,
            "frac_reward_zero_std": base["zero_std_groups"] / max(1.0, base["groups"]),
            "entropy": base["entropy"] / tokens,  # one sampling distribution per completion token
            "clip_ratio": base["clipped_tokens"] / tokens,
            # generation seconds summed over one rank per context group
            "generation_tokens_per_s": base["completion_tokens"] / max(1e-9, base["generation_s"] / self.d.data_world),
            # trained once per update (--num-iterations)
            "trained_tokens": int(base["completion_tokens"]) * self.updates,
            "trained_tokens_per_s": base["completion_tokens"] * self.updates / elapsed,
            "tokens_per_s": (base["prompt_tokens"] + base["completion_tokens"]) * self.updates / elapsed,
        }
        if self.cfg.grpo_beta:
            record["kl"] = base["kl"] / tokens
        for k, reward in enumerate(self.rewards):
            total, squares, count = values[len(GRPO_STATS) + 3 * k : len(GRPO_STATS) + 3 * k + 3]
            if count:
                m = total / count
                record[f"rewards/{reward.label}"] = m
                record[f"rewards/{reward.label}_std"] = math.sqrt(max(0.0, squares / count - m**2))
            elif base["completions"] and reward.name not in self.unapplied:
                self.unapplied.add(reward.name)
                log(
                    f"WARNING: --reward {reward.name} returned None for all {int(base['completions']):,} completions "
                    "since the last log line: it applies to none of them, adds nothing to their rewards and has no "
                    f"rewards/{reward.label} figure (warned once)"
                )
        return record


def check_reward_fit(cfg: TrainConfig, data: TrainData) -> None:
    """--objective grpo: every --reward takes the prompts' columns (and the accuracy built-in finds a reference
    among them); raises TrainError before the model loads."""
    if data.objective != "grpo":
        return
    train = data.train.blocks.columns if isinstance(data.train.blocks, PromptSet) else ()
    held_out = data.validation.columns if isinstance(data.validation, PromptSet) else ()
    try:
        functions = load_rewards(cfg.reward, cfg.reward_weights, cfg.reward_pattern)
        problems = column_problems(functions, tuple(sorted({*train, *held_out})), train)
    except ValueError as exc:
        raise TrainError(str(exc)) from exc
    if problems:
        raise TrainError(f"--dataset-name {cfg.datasets_label}: " + "; ".join(problems))


def build_grpo(
    cfg: TrainConfig, bundle: ModelBundle, data: TrainData, precision: str, d: Dist
) -> tuple[GRPOObjective, dict]:
    """(the GRPO objective, what a resume must agree with), before any checkpoint is loaded (a frozen reference copy
    is the starting model)."""
    try:
        rewards = load_rewards(cfg.reward, cfg.reward_weights, cfg.reward_pattern)
    except ValueError as exc:
        raise TrainError(str(exc)) from exc
    dropped = disable_dropout(bundle.model)
    if dropped:
        log(f"--objective grpo: dropout off in {dropped} module(s), so the log-probs are those that sampled")
    reference, frozen = "none", None
    if cfg.grpo_beta:
        reference = "adapters-off" if bundle.peft is not None else "copy"
        if reference == "copy":
            frozen = frozen_copy(cfg, precision, d)
    keep = keep_layers_gathered(cfg.rollout_unshard, bundle.num_params, cfg.precision, d.device)
    weights = ", ".join(f"{r.name} x {r.weight:g}" for r in rewards)
    log(
        f"--objective grpo: {cfg.num_generations} completions per prompt (<= {cfg.max_new_tokens} tokens, temperature "
        f"{cfg.temperature}, top-p {cfg.top_p}), rewards {weights}; --grpo-loss {cfg.grpo_loss}, clip "
        f"[{1 - cfg.epsilon:g}, {1 + (cfg.epsilon_high or cfg.epsilon):g}], KL beta {cfg.grpo_beta}"
        + (f" to {'the model with adapters off' if reference == 'adapters-off' else 'a frozen copy'}" if cfg.grpo_beta
           else " (no reference model)")
        + f"; generation keeps the layers gathered: {'yes' if keep else 'no, one layer at a time'}"
    )  # fmt: skip
    fingerprint = {
        "objective": "grpo",
        "loss": cfg.grpo_loss,
        "num_generations": cfg.num_generations,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "epsilon": [cfg.epsilon, cfg.epsilon_high or cfg.epsilon],
        "beta": cfg.grpo_beta,
        "rewards": [[r.identity, r.weight] for r in rewards],
        "reference": reference,
    }
    if cfg.num_iterations > 1:  # only then: the fingerprints of earlier runs stay as they were
        fingerprint["num_iterations"] = cfg.num_iterations
    fingerprint = reference_weights(fingerprint, reference, bundle)
    prompts = data.train.blocks
    assert isinstance(prompts, PromptSet)
    objective = GRPOObjective(cfg, bundle.train_forward, rewards, data.tokenizer, prompts, d, reference, frozen, keep)
    return objective, fingerprint
