"""The data plan: each dataset loaded and tokenised once (each of a mixture's on its own), the DataPlan that says which
blocks every global batch holds (independent of the process count, so a resume is exact anywhere), and the prefetcher
that gathers them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fsdp_lib.arguments import parse_data_slice, parse_data_weights
from fsdp_lib.config import TrainConfig, packs_whole
from fsdp_lib.data.batch import Batch
from fsdp_lib.data.cache import PackedBlocks, load_token_stream, tokenizer_hash
from fsdp_lib.data.chat import (
    ChatEncoder,
    chat_encoder,
    chat_template_hash,
    reasoning_keys,
    refuse_new_run,
    use_template_file,
    uses_tools,
    warn_unused_template,
)
from fsdp_lib.data.mixture import MixedBlocks, Mixture, short_names
from fsdp_lib.data.objective import check_mixture_kinds, objective_of
from fsdp_lib.data.packing import straddling
from fsdp_lib.data.preference import PairBlocks, PairEncoder
from fsdp_lib.data.prompts import PromptSet, load_prompts
from fsdp_lib.data.unpaired import ExampleEncoder
from fsdp_lib.errors import TrainError
from fsdp_lib.experiment_dir import PACKED_WHOLE, resumes
from fsdp_lib.objective_flags import PREFERENCE_OBJECTIVES
from fsdp_lib.records.dataset import load_text_dataset
from fsdp_lib.records.schema import dataset_kind
from fsdp_lib.runtime import Dist, log


@dataclass
class DataPlan:
    """Where every global batch comes from. Independent of the number of processes.

    Epoch e is a permutation of the packed blocks seeded by (seed, e); the global batch at step k of
    an epoch is blocks perm[k*G : (k+1)*G], G = world x batch x grad-accum. So the data position is
    just (epoch, samples consumed), and a final partial global batch is always dropped.
    """

    blocks: PackedBlocks | MixedBlocks | PromptSet  # a PromptSet's "blocks" are prompts (--objective grpo)
    seed: int
    global_batch: int
    micro_batch: int
    world_size: int
    rank: int
    mixture: Mixture | None = None  # several datasets (fsdp_lib/data/mixture.py): their proportions define the epoch

    @property
    def epoch_blocks(self) -> int:
        return sum(self.mixture.counts) if self.mixture else len(self.blocks)

    @property
    def steps_per_epoch(self) -> int:
        return self.epoch_blocks // self.global_batch

    def epoch_order(self, epoch: int) -> torch.Tensor:
        if self.mixture is not None:
            return self.mixture.epoch_order(self.seed, epoch)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.blocks), generator=g)

    def step_sources(self, order: torch.Tensor, step_in_epoch: int) -> list[int] | None:
        """A mixture's global batch: how many blocks come from each dataset (None for one dataset)."""
        return self.mixture.sources(self.step_blocks(order, step_in_epoch)) if self.mixture else None

    def step_blocks(self, order: torch.Tensor, step_in_epoch: int) -> list[int]:
        start = step_in_epoch * self.global_batch
        return order[start : start + self.global_batch].tolist()

    def micro_batches(self, order: torch.Tensor, step_in_epoch: int) -> list[Batch]:
        """This rank's micro-batches for one optimizer step: slot (a * world + rank) of the global batch."""
        step_blocks = self.step_blocks(order, step_in_epoch)
        accum = self.global_batch // (self.world_size * self.micro_batch)
        out = []
        for a in range(accum):
            slot = (a * self.world_size + self.rank) * self.micro_batch
            out.append(self.blocks.gather(step_blocks[slot : slot + self.micro_batch]))
        return out

    def trained_tokens(self, order: torch.Tensor, step_in_epoch: int) -> int:
        """Targets carrying loss in the whole global batch (all ranks): every rank computes the same number from
        the deterministic plan, so the loss can be normalised by it without a collective."""
        return self.blocks.trained_tokens(self.step_blocks(order, step_in_epoch))


class Prefetcher:
    """Gathers the micro-batches of step k+1 in a background thread while step k runs. On CUDA they are put in
    pinned memory, so Batch.to(device) copies them asynchronously. Any (epoch, step) can be asked for (a resume,
    the first step); a step that was not the prefetched one is gathered on the spot, so the batches are always
    exactly those of DataPlan."""

    def __init__(self, plan: DataPlan, pin: bool):
        self.plan, self.pin = plan, pin
        self.pending: tuple[tuple[int, int], Any] | None = None
        self.orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self.orders:
            self.orders = {e: o for e, o in self.orders.items() if e >= epoch - 1}  # at most the current two
            self.orders[epoch] = self.plan.epoch_order(epoch)
        return self.orders[epoch]

    def _load(self, epoch: int, step: int) -> tuple[list[Batch], int]:
        order = self._order(epoch)
        batches = self.plan.micro_batches(order, step)
        if self.pin and all(isinstance(b, Batch) for b in batches):  # prompts (GRPO) are not tensors yet
            batches = [Batch(*(None if t is None else t.pin_memory() for t in b.tensors())) for b in batches]
        batches = [b.with_documents(self.pin) if isinstance(b, Batch) else b for b in batches]  # off the step loop
        return batches, self.plan.trained_tokens(order, step)

    def sources(self, epoch: int, step: int) -> list[int] | None:
        """A mixture's global batch at (epoch, step in epoch): blocks per dataset (None for one dataset)."""
        return self.plan.step_sources(self._order(epoch), step) if self.plan.mixture else None

    def get(self, epoch: int, step: int) -> tuple[list[Batch], int]:
        """This rank's micro-batches of (epoch, step in epoch) and the global batch's trained-token count."""
        if self.pending is not None and self.pending[0] == (epoch, step):
            result = self.pending[1].result()
        else:
            if self.pending is not None:
                self.pending[1].result()  # never two threads in _load at once
            result = self._load(epoch, step)
        following = (epoch, step + 1) if step + 1 < self.plan.steps_per_epoch else (epoch + 1, 0)
        self.pending = (following, self._in_background(*following))
        return result

    def _in_background(self, epoch: int, step: int) -> Any:
        """A daemon thread (an exit or a crash never waits for it) whose result is a Future."""
        import threading
        from concurrent.futures import Future

        future: Future = Future()

        def work() -> None:
            try:
                future.set_result(self._load(epoch, step))
            except BaseException as exc:  # noqa: BLE001 - re-raised by get() in the training thread
                future.set_exception(exc)

        threading.Thread(target=work, name="prefetch", daemon=True).start()
        return future


@dataclass
class TrainData:
    train: DataPlan
    validation: PackedBlocks | MixedBlocks | None  # a mixture's: its datasets' validation blocks, reported apart
    tokenizer: Any
    tokenizer_hash: str
    dataset_fingerprint: str
    data_format: str  # what turns rows into trained tokens: text or chat (template, --loss-on), document masking
    objective: str = "lm"  # lm, dpo or grpo (--objective, resolved against the dataset)


@dataclass
class Source:
    """One -d dataset, tokenised and packed."""

    name: str  # as given with -d
    train: PackedBlocks | PairBlocks | PromptSet
    validation: PackedBlocks | PairBlocks | PromptSet | None
    rows: int
    tokens: int
    fingerprint: str
    data_format: str
    objective: str


def slice_rows(split: Any, text: str) -> Any:
    """Rows START:END of the train split. The slice changes the split's fingerprint, hence the token cache key and
    the resume check."""
    start, end = parse_data_slice(text) or (0, None)
    end = len(split) if end is None else min(end, len(split))
    if start >= end:
        raise TrainError(f"--data-slice {text}: the train split has {len(split)} rows, so it selects none")
    log(f"--data-slice {text}: training on rows {start}..{end - 1} of {len(split)}")
    return split.select(range(start, end))


def build_data(cfg: TrainConfig, model_dir: Path, d: Dist) -> TrainData:
    """The tokenizer, every -d dataset tokenised into its cache and packed, and the plan of global batches: one
    dataset's blocks in a seeded permutation per epoch, or a mixture's in their proportions (fsdp_lib/data/mixture.py)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise TrainError(
            f"--model-name {cfg.model_name}: the tokenizer has no EOS token, needed between packed documents"
        )
    tok_hash = tokenizer_hash(model_dir)
    check_mixture_kinds(cfg)
    sources = [load_source(cfg, name, tokenizer, tok_hash, d) for name in cfg.dataset_name]
    check_ids_fit(sources, tokenizer, model_dir)
    warn_unused_template(cfg, any(source.data_format != "text" for source in sources))
    global_batch = d.data_world * cfg.batch_size * cfg.grad_accum_steps  # the ranks of a context group share theirs
    if len(sources) == 1:
        source = sources[0]
        plan = DataPlan(source.train, cfg.seed, global_batch, cfg.batch_size, d.data_world, d.data_rank)
        validation, fingerprint, data_format = source.validation, source.fingerprint, source.data_format
    else:
        plan, validation = mixture_plan(cfg, sources, global_batch, d)
        fingerprint = "|".join(source.fingerprint for source in sources)
        data_format = f"mixture[{'; '.join(s.data_format for s in sources)}]:weights-{plan.mixture.weights}"
    unit = f"prompts (x {cfg.num_generations} completions)" if sources[0].objective == "grpo" else "blocks"
    if plan.steps_per_epoch == 0:
        raise TrainError(
            f"--dataset-name {cfg.datasets_label}: {plan.epoch_blocks} train {unit.split()[0]} per epoch are fewer "
            f"than one global batch of {global_batch} (processes x --batch-size x --grad-accum-steps); "
            f"{too_few_blocks_fix(cfg, sources[0].objective, skipped=sum(s.rows for s in sources) > plan.epoch_blocks)}"
        )
    log(
        f"data: {plan.epoch_blocks:,} train {unit} of {cfg.seq_length} tokens per epoch, global batch {global_batch} "
        f"({d.data_world} x {cfg.batch_size} x {cfg.grad_accum_steps}), {plan.steps_per_epoch} steps/epoch, "
        f"{len(validation) if validation else 0} validation {unit.split()[0]}, document masking {cfg.document_masking}"
    )
    if cfg.eval_freq and not validation:
        log(
            f"WARNING: --eval-freq {cfg.eval_freq}: --dataset-name {cfg.datasets_label} has no validation data (no "
            "validation split, or one that is empty or shorter than a block), so nothing is evaluated; make one with "
            "data_hf.py --val-fraction (0.01 is usual; a larger fraction where it came out empty)"
        )
    data_format += f":document-masking-{cfg.document_masking}"
    return TrainData(plan, validation, tokenizer, tok_hash, fingerprint, data_format, sources[0].objective)


def too_few_blocks_fix(cfg: TrainConfig, objective: str, skipped: bool = True) -> str:
    """What gives a run with fewer train blocks (prompts) than one global batch at least one step (`skipped`:
    GRPO skipped prompts, so room for them would help)."""
    smaller = "--global-batch-size" if cfg.global_batch_size else "--batch-size or --grad-accum-steps"
    wider = f", or a wider --data-slice than {cfg.data_slice}" if cfg.data_slice else ""
    if objective == "grpo" and not skipped:  # every prompt is in: only a smaller batch or more prompts help
        return f"lower {smaller}{wider}"
    if objective == "grpo":  # skipped: an empty prompt, one the template refuses, one that leaves no room to answer
        return (
            "the skipped prompts are listed above with their reasons (one longer than --seq-length minus "
            f"--max-new-tokens is skipped: raise --seq-length or lower --max-new-tokens), or lower {smaller}{wider}"
        )
    if objective in PREFERENCE_OBJECTIVES:  # a pair (KTO: an example) is packed whole
        return f"lower {smaller} (each pair or example is packed whole: a shorter --seq-length adds none){wider}"
    return f"lower --seq-length or {smaller}{wider}"


def check_ids_fit(sources: list[Source], tokenizer: Any, model_dir: Path) -> None:
    """Token ids the data holds must have embedding rows. The model-folder check (before the process group) covers
    the base vocabulary and the special tokens the trainer inserts; a tokenizer with added tokens beyond the
    embedding is checked here, against the tokenised data (a scan of the token cache, only in that case): such an id
    would fail at its first forward (on a GPU as a device-side assert)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    rows = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "vocab_size", None)
    if not rows or len(tokenizer) <= rows:
        return
    for source in sources:
        for blocks in (source.train, source.validation):
            if isinstance(blocks, PromptSet):  # prompts: checked as they are tokenised (load_prompts)
                continue
            highest = int(blocks.tokens.max()) if blocks is not None and blocks.tokens.size else -1
            if highest >= rows:
                raise TrainError(
                    f"--dataset-name {source.name}: the data holds token id {highest:,} "
                    f"({tokenizer.convert_ids_to_tokens(highest)!r}), an added token of the tokenizer, but the model's "
                    f"embedding has {rows:,} rows (config.json vocab_size in {model_dir}); it would fail at its first "
                    "step. Resize the embedding to the tokenizer (model.resize_token_embeddings(len(tokenizer))) and "
                    "save the model, or remove that token from the data"
                )


def load_source(cfg: TrainConfig, name: str, tokenizer: Any, tok_hash: str, d: Dist) -> Source:
    """One dataset: its splits read, its kind resolved (text, conversations, preference pairs), tokenised once
    into the token cache and packed."""
    try:
        train_split, val_split = load_text_dataset(name, cfg.text_column or None)
    except ValueError as exc:
        raise TrainError(f"--dataset-name: {exc}") from exc
    if cfg.data_slice:
        train_split = slice_rows(train_split, cfg.data_slice)
    if len(train_split) == 0:
        raise TrainError(
            f"--dataset-name {name}: the train split has 0 rows; make it again with data_hf.py (a smaller "
            "--val-fraction leaves rows to train on)"
        )
    objective = objective_of(cfg, train_split.column_names, name)
    if cfg.packing == "stream" and objective != "lm":
        raise TrainError(
            f"--packing stream: --dataset-name {name} trains --objective {objective}, whose "
            f"{'prompts' if objective == 'grpo' else 'pairs (KTO: examples)'} are always whole; leave --packing out"
        )
    if objective == "grpo":
        return prompt_source(cfg, name, train_split, val_split, tokenizer)
    preference = objective in PREFERENCE_OBJECTIVES
    splits = [split for split in (train_split, val_split) if split is not None]
    tools = not preference and any(uses_tools(split) for split in splits)
    reasoning = set().union(*(reasoning_keys(split) for split in splits)) if not preference else set()
    chat = chat_encoder(cfg, tokenizer, train_split.column_names, tools, name, preference, reasoning)
    pairs: PairEncoder | ExampleEncoder | None = None
    if preference:
        pairs, chat = PairEncoder(ChatEncoder(tokenizer, "assistant"), cfg.seq_length), None
        if objective == "kto":
            pairs = ExampleEncoder(pairs)
    data_format = f"chat:{chat_template_hash(tokenizer)}:loss-on-{cfg.loss_on}" if chat else "text"
    if pairs is not None:
        data_format = f"pairs:{chat_template_hash(tokenizer)}"
    key = f"{tok_hash}|{data_format}"
    whole = pairs is None and packs_whole(cfg, chat is not None)
    if whole:  # after the cache key: the token cache does not depend on the packing, the blocks do
        data_format += PACKED_WHOLE
    train_blocks = load_token_stream(train_split, "train", tokenizer, key, cfg, d, chat, pairs, name)
    validation = None
    if val_split is not None and len(val_split):
        validation = load_token_stream(val_split, "validation", tokenizer, key, cfg, d, chat, pairs, name)
        if len(validation) == 0:
            log(f"the validation split of {name} is shorter than one block; its validation is skipped")
            validation = None
    if isinstance(pairs, ExampleEncoder):
        log_kto_examples(cfg, train_blocks, dataset_kind(train_split.column_names), tokenizer)
    elif pairs is not None:
        used = float(np.sum(train_blocks.lengths)) / max(1, len(train_blocks) * cfg.seq_length)
        log(
            f"--objective dpo{' (auto: the dataset has chosen and rejected columns)' if cfg.objective == 'auto' else ''}"
            f": {train_blocks.num_pairs:,} train pairs packed whole into {len(train_blocks):,} blocks ({used:.1%} of "
            f"their tokens used, the rest padding), ~{train_blocks.num_pairs / max(1, len(train_blocks)):.1f} pairs "
            f"per block; chat template {chat_template_hash(tokenizer)}, loss on the responses' assistant turns"
        )
    if chat is not None:
        share = float(np.mean(train_blocks.trained)) if len(train_blocks.trained) else 0.0
        if share == 0.0:
            template = f"--chat-template {cfg.chat_template}" if cfg.chat_template else "the tokenizer's own"
            raise TrainError(
                f"--dataset-name {name}: no token carries loss: the chat template "
                f"({template}) renders no assistant turn that --loss-on "
                f"{cfg.loss_on} can find (its output lacks the assistant replies, or its generation markers); fix the "
                "template, or pass --loss-on all"
            )
        log(
            f"SFT on conversations (a 'messages' column) of {name}: chat template {chat_template_hash(tokenizer)}, "
            f"loss on {cfg.loss_on} tokens ({share:.1%} of all tokens carry loss)"
        )
    if whole:
        unit = "conversations" if chat is not None else "documents"
        log(f"--packing whole{' (auto)' if cfg.packing == 'auto' else ''}: {train_blocks.describe(unit)} (train)")
    elif (
        chat is not None
        and train_blocks.doc_ends is not None
        and (cut := straddling(train_blocks.doc_ends, cfg.seq_length))
    ):
        log(
            f"--packing stream: {cut:,} conversations of {name} ({cut / max(1, len(train_blocks.doc_ends)):.1%}) start in "
            "one block and end in the next, their end trained without their start; --packing whole keeps each whole"
        )
    fingerprint = f"{getattr(train_split, '_fingerprint', '')}/{getattr(val_split, '_fingerprint', '')}"
    tokens = len(train_blocks.tokens) if isinstance(train_blocks, PackedBlocks) else int(np.sum(train_blocks.lengths))
    return Source(name, train_blocks, validation, len(train_split), tokens, fingerprint, data_format, objective)


def log_kto_examples(cfg: TrainConfig, blocks: PairBlocks, kind: str | None, tokenizer: Any) -> None:
    used = float(np.sum(blocks.lengths)) / max(1, len(blocks) * cfg.seq_length)
    desirable = int(np.sum(blocks.desirable))
    auto = " (auto: the dataset has prompt, completion and label columns)" if cfg.objective == "auto" else ""
    unpaired = ", unpaired from the dataset's pairs" if kind == "preference" else ""
    log(
        f"--objective kto{auto}: {blocks.num_pairs:,} train examples ({desirable:,} desirable, "
        f"{blocks.num_pairs - desirable:,} undesirable{unpaired}), each with its KL sequence, packed into "
        f"{len(blocks):,} blocks ({used:.1%} of their tokens used); chat template {chat_template_hash(tokenizer)}, "
        "loss on the completions' assistant turns"
    )
    if desirable in (0, blocks.num_pairs):
        kind_of = "desirable" if desirable else "undesirable"
        log(
            f"WARNING: --objective kto: all {blocks.num_pairs:,} train examples are {kind_of} (label "
            f"{bool(desirable)}); KTO weighs each kind against the other, so check the labels (the figures of the "
            "missing kind are not logged)"
        )


def prompt_source(cfg: TrainConfig, name: str, train_split: Any, val_split: Any, tokenizer: Any) -> Source:
    """--objective grpo's dataset: its train and validation prompts tokenised (each at most --seq-length -
    --max-new-tokens tokens); a validation evaluates to the held-out prompts' mean reward."""
    use_template_file(cfg, tokenizer)  # as for conversations, prompts of either kind
    longest = cfg.seq_length - cfg.max_new_tokens
    prompts = load_prompts(train_split, tokenizer, longest, name, "train", cfg.max_skipped_fraction)
    validation = None
    if val_split is not None and len(val_split):
        validation = load_prompts(val_split, tokenizer, longest, name, "validation", cfg.max_skipped_fraction)
        # every one skipped (with --max-skipped-fraction 1): nothing to evaluate, no zeros
        validation = validation if len(validation) else None
    template = chat_template_hash(tokenizer) if prompts.conversational else "text"
    log(
        f"--objective grpo{' (auto: the dataset has a prompt column)' if cfg.objective == 'auto' else ''}: "
        f"{len(prompts):,} {'conversational' if prompts.conversational else 'plain-text'} prompts of {name}, other "
        f"columns for the rewards: {list(prompts.columns)}"
    )
    fingerprint = f"{getattr(train_split, '_fingerprint', '')}/{getattr(val_split, '_fingerprint', '')}"
    tokens = sum(len(ids) for ids in prompts.ids)
    return Source(name, prompts, validation, len(train_split), tokens, fingerprint, f"prompts:{template}", "grpo")


def check_mixture_counts(cfg: TrainConfig, mixture: Mixture) -> None:
    """A dataset whose positive weight rounds to no block of an epoch would never be trained: refused (a run that
    began so is warned, as its resume must keep its data). Of several datasets of the highest weight the first
    listed sets the epoch's length (an epoch ends when it has been drawn once): said where the others' sizes
    differ, since their order then decides how much of each an epoch draws."""
    counts, sizes, names = mixture.counts, mixture.sizes, mixture.names
    if never := [name for name, count in zip(names, counts) if count == 0]:
        said = (
            f"--data-weights {cfg.data_weights}: {', '.join(never)} get(s) none of an epoch's {sum(counts):,} blocks "
            f"(a weight below 1/{sum(counts):,} of the total rounds to 0), so would never be trained; raise its "
            "weight or leave it out"
        )
        refuse_new_run(said, resumes(cfg))
    heaviest = max(mixture.weights)
    top = [i for i, w in enumerate(mixture.weights) if math.isclose(w, heaviest, rel_tol=1e-9)]
    if len(top) > 1 and len({sizes[i] for i in top}) > 1:
        drawn = ", ".join(f"{names[i]} {counts[i] / sizes[i]:.2f}" for i in top[1:])
        log(
            f"note: of the datasets of the highest weight, {names[top[0]]} (listed first) sets the epoch: it is drawn "
            f"once per epoch, {drawn} times; list another of them first to end the epoch when it has been drawn once"
        )


def mixture_plan(
    cfg: TrainConfig, sources: list[Source], global_batch: int, d: Dist
) -> tuple[DataPlan, MixedBlocks | None]:
    """The plan of a mixture and its validation blocks (the datasets that have a validation split), logged per
    dataset: rows, tokens, blocks, weight, blocks per epoch and how often each block is seen per epoch."""
    names = short_names([source.name for source in sources])
    sizes = [len(source.train) for source in sources]
    empty = [source.name for source, size in zip(sources, sizes) if size == 0]
    if empty:
        raise TrainError(f"--dataset-name {', '.join(empty)}: shorter than one block of --seq-length {cfg.seq_length}")
    raw = parse_data_weights(cfg.data_weights) if cfg.data_weights else [float(size) for size in sizes]
    mixture = Mixture(names, sizes, [w / sum(raw) for w in raw])
    plan = DataPlan(
        MixedBlocks([s.train for s in sources], names), cfg.seed, global_batch, cfg.batch_size, d.data_world, d.data_rank,
        mixture,
    )  # fmt: skip
    lines = [
        f"  {name}: {source.name}, {source.rows:,} rows, {source.tokens:,} tokens, {size:,} blocks, weight "
        f"{weight:.3f} -> {count:,} blocks per epoch ({count / size:.2f} passes), "
        + (f"{len(source.validation):,} validation blocks" if source.validation is not None else "no validation")
        for name, source, size, weight, count in zip(names, sources, sizes, mixture.weights, mixture.counts)
    ]
    log(f"mixture of {len(sources)} datasets (--data-weights {cfg.data_weights or 'by size'}):\n" + "\n".join(lines))
    check_mixture_counts(cfg, mixture)
    held_out = [(name, source.validation) for name, source in zip(names, sources) if source.validation is not None]
    if held_out and len(held_out) < len(sources):  # val_loss would read as the whole mixture's
        log(
            f"note: the validation loss covers {', '.join(n for n, _ in held_out)} only: "
            f"{', '.join(n for n, s in zip(names, sources) if s.validation is None)} has no validation data (no "
            "validation split, or one shorter than a block; data_hf.py --val-fraction makes one); each dataset's own "
            "is logged as val_loss/NAME"
        )
    validation = MixedBlocks([v for _, v in held_out], [n for n, _ in held_out]) if held_out else None
    return plan, validation


def describe_datasets(cfg: TrainConfig, model_dir: Path) -> None:
    """--dry-run: each -d dataset's splits, rows and kind, and a mixture's weights (its tokens and blocks are
    counted when the run tokenises them); what the run would refuse about the data before tokenising it (the
    objective the data and flags resolve to, a chat template for conversations and pairs) is refused here too."""
    weights = parse_data_weights(cfg.data_weights) if cfg.data_weights else None
    check_mixture_kinds(cfg)
    lines = []
    templated, paired = None, False  # a dataset whose rows the chat template renders; whether it holds pairs
    prompted = False  # GRPO's prompts: rendered with the template when they are conversations (plan.prompt_source)
    for i, name in enumerate(cfg.dataset_name):
        try:
            train_split, val_split = load_text_dataset(name, cfg.text_column or None)
        except ValueError as exc:
            raise TrainError(f"--dataset-name: {exc}") from exc
        objective = objective_of(cfg, train_split.column_names, name)
        if not templated and (
            objective in PREFERENCE_OBJECTIVES or dataset_kind(train_split.column_names) == "messages"
        ):
            templated, paired = name, objective in PREFERENCE_OBJECTIVES
        kind = {
            "preference": "preference pairs",
            "unpaired": "unpaired preference examples",
            "messages": "conversations",
            "prompts": "prompts",
        }.get(dataset_kind(train_split.column_names), "text")
        prompted = prompted or kind == "prompts"
        held_out = f", {len(val_split):,} validation rows" if val_split is not None else ""
        share = f", weight {weights[i] / sum(weights):.3f}" if weights else ""
        lines.append(f"  {name}: {kind}, {len(train_split):,} train rows{held_out}{share}")
    mixture = " (a mixture: shares by --data-weights, else by size in blocks)" if len(lines) > 1 else ""
    log(f"data{mixture}:\n" + "\n".join(lines))
    warn_unused_template(cfg, templated is not None or prompted)
    if templated:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        chat_encoder(cfg, tokenizer, ["messages"], False, templated, pairs=paired)


def evaluation_shares(count: int, batch_size: int, d: Dist) -> list[list[int]]:
    """This rank's micro-batches of blocks 0..count-1 for a pass without gradients (blocks rank, rank + world, ...):
    as many on every rank, since FSDP's forward all-gathers must line up; a rank with fewer real blocks gets shorter
    or empty lists and pads them itself. The ranks of a context group (--context-parallel) share their blocks."""
    mine = list(range(d.data_rank, count, d.data_world))
    steps = math.ceil(math.ceil(count / d.data_world) / batch_size)
    return [mine[i * batch_size : (i + 1) * batch_size] for i in range(steps)]


def total_steps(cfg: TrainConfig, plan: DataPlan) -> int:
    steps = plan.steps_per_epoch * cfg.num_epochs
    return min(steps, cfg.max_steps) if cfg.max_steps else steps
