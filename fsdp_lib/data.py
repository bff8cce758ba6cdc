"""Data: tokenising each split once into a token cache (tokens, document ends, trained mask), packing it into blocks
of --seq-length with per-document position ids, the DataPlan that says which blocks every global batch holds
(independent of the process count, so a resume is exact anywhere), and the prefetcher that gathers them."""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fsdp_lib.batch import Batch, stack_blocks
from fsdp_lib.chat import ChatEncoder, chat_encoder, chat_template_hash, uses_tools
from fsdp_lib.config import TrainConfig, changed_dpo_flags, parse_data_slice, parse_data_weights
from fsdp_lib.dataset import load_text_dataset
from fsdp_lib.errors import TrainError
from fsdp_lib.integrity import commit_files, recorded_problems, staged, staged_writes
from fsdp_lib.mixture import MixedBlocks, Mixture, short_names
from fsdp_lib.preference import PairBlocks, PairEncoder, is_preference_split, tokenize_pairs_to_file
from fsdp_lib.runtime import Dist, log


def tokenizer_hash(model_dir: Path) -> str:
    """A hash of the tokenizer files: a changed tokenizer changes the data."""
    h = hashlib.sha256()
    for name in sorted(
        (
            "tokenizer.json",
            "tokenizer_config.json",
            "tokenizer.model",
            "vocab.json",
            "merges.txt",
            "special_tokens_map.json",
        )
    ):
        if (model_dir / name).is_file():
            h.update(name.encode())
            h.update((model_dir / name).read_bytes())
    return h.hexdigest()[:16]


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def encode_batch(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids with the tokenizer's own special tokens (e.g. BOS). The Rust backend's encode_batch_fast gives
    the same ids as tokenizer(texts) without computing character offsets: ~15% faster (bench/bench_tokenize.py)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=True)]
    return tokenizer(texts, add_special_tokens=True)["input_ids"]


def _stream_paths(tokens_path: Path) -> dict[str, Path]:
    """A token stream's files: token ids, document end offsets, and (chat) the per-token trained mask."""
    return {
        "tokens": tokens_path,
        "docs": tokens_path.with_suffix(".docs"),
        "mask": tokens_path.with_suffix(".mask"),
        "skips": tokens_path.with_suffix(".skips.json"),
        "sums": tokens_path.with_suffix(".sums.json"),  # size and CRC-32 of each file above (integrity.commit_files)
    }


def tokenize_to_file(
    dataset: Any, tokenizer: Any, out_path: Path, batch_rows: int = 1000, chat: ChatEncoder | None = None
) -> int:
    """Tokenise a split into one flat token stream plus its document end offsets (and, for conversations, a
    trained-token mask). Text rows get EOS after each document; conversations end as their template ends them.

    Streams in row batches (memory stays flat) and writes under temporary names, renamed at the end with the
    token file last after their sizes and CRC-32s are recorded (.sums.json), so a reader that sees the token file
    sees complete side files, and load_token_stream can tell a damaged cache. Returns the number of tokens.
    """
    eos = tokenizer.eos_token_id
    dtype = _token_dtype(len(tokenizer))
    tokenizer.model_max_length = sys.maxsize  # documents are packed into blocks later; silence the length warning
    paths = _stream_paths(out_path)
    names = ("docs", "mask", "tokens") if chat is not None else ("docs", "tokens")
    total, skipped, first_skipped, rows = 0, {}, {}, 0
    with staged_writes({k: paths[k] for k in names}) as (handles, tmp):
        for batch in dataset.iter(batch_size=batch_rows):
            if chat is not None:
                in_batch: dict[str, int] = {}
                encoded = chat.encode(batch["messages"], skipped, in_batch, batch.get("tools"))
                for reason, row in in_batch.items():
                    first_skipped.setdefault(reason, rows + row)
                rows += len(batch["messages"])
                pieces = [np.asarray(ids, dtype=dtype) for ids, _ in encoded]
                if encoded:
                    np.concatenate([mask for _, mask in encoded]).tofile(handles["mask"])
            else:
                encoded_text = encode_batch(tokenizer, batch["text"])
                pieces = [
                    np.asarray(ids + [eos] if not ids or ids[-1] != eos else ids, dtype=dtype) for ids in encoded_text
                ]
            if pieces:
                np.concatenate(pieces).tofile(handles["tokens"])
                (total + np.cumsum([p.size for p in pieces], dtype=np.int64)).tofile(handles["docs"])
                total += sum(p.size for p in pieces)
    if chat is not None:  # read with every use of the cache: load_token_stream reports and checks them
        skips = {"conversations": rows, "expanded": chat.expanded, "skipped": skipped, "first_row": first_skipped}
        tmp["skips"] = staged(paths["skips"])
        tmp["skips"].write_text(json.dumps(skips, indent=1))
    # the token file last: its presence means the stream and its checksums are complete
    commit_files({tmp[k]: paths[k] for k in sorted(tmp, key=lambda k: k == "tokens")}, paths["sums"])
    return total


@dataclass
class PackedBlocks:
    """Blocks of seq_length+1 tokens over a flat token stream, with stride seq_length.

    Block i gives inputs tokens[i*L : i*L+L] and targets tokens[i*L+1 : i*L+L+1], so every token
    transition in the stream is trained on exactly once per epoch. `trained` (conversations) marks the tokens
    that carry loss as targets. With `doc_ends` (document masking), position ids restart at 0 at each document
    start and at the block start, so the attention of one document never sees another, and the transition into
    a new document's first token (unpredictable from the previous document) carries no loss.
    """

    tokens: np.ndarray
    seq_length: int
    trained: np.ndarray | None = None  # uint8 per token: 1 = a target that carries loss (None = all)
    doc_ends: np.ndarray | None = None  # end offset (exclusive) of every document; None = no document masking

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_length)

    def block(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(inputs, labels, position ids or None) of block i."""
        L, start = self.seq_length, i * self.seq_length
        window = np.asarray(self.tokens[start : start + L + 1], dtype=np.int64)
        labels = window[1:].copy()
        if self.trained is not None:
            labels[np.asarray(self.trained[start + 1 : start + L + 1]) == 0] = -100
        if self.doc_ends is None:
            return window[:-1], labels, None
        lo, hi = np.searchsorted(self.doc_ends, [start, start + L], side="right")
        doc_starts = np.asarray(self.doc_ends[lo:hi], dtype=np.int64) - start  # in (0, L]: where a new doc begins
        labels[doc_starts - 1] = -100
        restart = np.zeros(L, dtype=np.int64)
        inside = doc_starts[doc_starts < L]
        restart[inside] = inside
        positions = np.arange(L, dtype=np.int64) - np.maximum.accumulate(restart)
        return window[:-1], labels, positions

    def gather(self, indices: list[int]) -> Batch:
        return stack_blocks([self.block(i) for i in indices])

    def trained_tokens(self, indices: list[int]) -> int:
        """Targets that carry loss in these blocks: what the loss of a global batch is averaged over."""
        if self.trained is None and self.doc_ends is None:
            return len(indices) * self.seq_length
        return int(sum((self.block(i)[1] != -100).sum() for i in indices))


def load_token_stream(
    split: Any,
    split_name: str,
    tokenizer: Any,
    cache_key: str,
    cfg: TrainConfig,
    d: Dist,
    chat: ChatEncoder | None,
    pairs: PairEncoder | None = None,
) -> PackedBlocks | PairBlocks:
    """Tokenise once per node into a cache keyed by dataset fingerprint, tokenizer and chat settings, then
    memory-map it as packed blocks of --seq-length.

    The cache holds the flat token stream, so any --seq-length reuses it. Local rank 0 builds it;
    the others poll for the file instead of waiting in a collective, which would time out on a large corpus.
    """
    fingerprint = getattr(split, "_fingerprint", None) or str(len(split))
    version = f"docs-v2|chat-v{ChatEncoder.VERSION}" if chat is not None else "docs-v2"
    if pairs is not None:  # prompts are cut to fit a block: the sequences depend on --seq-length
        version = f"pairs-v{PairEncoder.VERSION}|chat-v{ChatEncoder.VERSION}|fit-{pairs.max_tokens}"
    key = hashlib.sha256(f"{fingerprint}|{cache_key}|{version}".encode()).hexdigest()[:20]
    cache_dir = Path(cfg.save_dir) / ".token_cache" / key
    paths = _stream_paths(cache_dir / f"{split_name}.tokens")
    failed_path = cache_dir / f"{split_name}.failed"
    if d.local_rank == 0 and paths["tokens"].exists():
        discard_if_damaged(paths, split_name)
    dist.barrier(group=d.cpu_group)  # nobody takes a damaged token file for a finished one (checking takes seconds)
    if d.local_rank == 0 and not paths["tokens"].exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        failed_path.unlink(missing_ok=True)
        log(f"tokenising {split_name} split ({len(split)} rows) into {paths['tokens']}")
        start = time.perf_counter()
        try:
            if pairs is not None:
                count = tokenize_pairs_to_file(split, pairs, paths, _token_dtype(len(tokenizer)))
            else:
                count = tokenize_to_file(split, tokenizer, paths["tokens"], chat=chat)
        except BaseException as exc:
            failed_path.write_text(repr(exc))
            raise
        log(f"tokenised {count:,} {'pairs' if pairs else 'tokens'} in {time.perf_counter() - start:.1f}s")
    deadline = time.monotonic() + cfg.collective_timeout_s
    while not paths["tokens"].exists():
        if failed_path.exists():
            raise TrainError(f"tokenisation failed on local rank 0: {failed_path.read_text()}")
        if time.monotonic() > deadline:
            raise TrainError(f"waited {cfg.collective_timeout_s}s for {paths['tokens']}; raise --collective-timeout-s")
        time.sleep(0.5)
    dist.barrier(group=d.cpu_group)  # every node's cache is complete before anyone maps it

    def mapped(path: Path, dtype: Any) -> np.ndarray:
        return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype=dtype)

    tokens = mapped(paths["tokens"], _token_dtype(len(tokenizer)))
    if pairs is not None:
        report_skipped(json.loads(paths["skips"].read_text()), split_name, cfg.max_skipped_fraction, "pairs")
        blocks = PairBlocks(
            tokens,
            mapped(paths["mask"], np.uint8),
            mapped(paths["docs"], np.int64),
            cfg.seq_length,
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            cache_path=paths["tokens"],
        )
        return blocks
    trained = mapped(paths["mask"], np.uint8) if chat is not None else None
    doc_ends = mapped(paths["docs"], np.int64) if cfg.document_masking == "on" else None
    if chat is not None:
        report_skipped(json.loads(paths["skips"].read_text()), split_name, cfg.max_skipped_fraction)
    return PackedBlocks(tokens, cfg.seq_length, trained, doc_ends)


def discard_if_damaged(paths: dict[str, Path], split_name: str) -> None:
    """A token cache whose files are not what was written (size or CRC-32 against its .sums.json, or no record: a
    cache of an older version) is deleted with a message, so it is rebuilt, never trained on."""
    start = time.perf_counter()
    problems = recorded_problems(paths["sums"])
    if not problems:
        seconds = time.perf_counter() - start
        log(f"token cache of the {split_name} split verified ({paths['tokens'].parent}, {seconds:.1f}s)")
        return
    found = "\n".join(f"  {p}" for p in problems)
    log(f"WARNING: the token cache of the {split_name} split is damaged or unverifiable:\n{found}\nrebuilding it")
    try:
        for path in paths.values():  # the token file first: without it the cache is absent, not half there
            path.unlink(missing_ok=True)
    except OSError as exc:
        raise TrainError(
            f"the token cache {paths['tokens'].parent} must be rebuilt but cannot be deleted ({exc}); make --save-dir "
            f"writable or delete that folder"
        ) from exc


def report_skipped(skips: dict, split_name: str, max_fraction: float, unit: str = "conversations") -> None:
    """Every run (also from the cache): what became of a split's conversations. More than 1% skipped is a loud
    warning at the start; more than --max-skipped-fraction stops the run."""
    total, skipped = skips["conversations"], sum(skips["skipped"].values())
    if skips["expanded"]:
        log(
            f"{skips['expanded']} conversation(s) of {split_name} are rendered by the chat template with earlier turns "
            f"differing from the last (e.g. Qwen3's <think> blocks): each is trained as one sample per assistant "
            f"turn, that turn rendered as the template renders a final one"
        )
    for reason, count in sorted(skips["skipped"].items()):
        log(f"skipped {count} {unit[:-1]}(s) of {split_name}: {reason} (first: row {skips['first_row'][reason]})")
    fraction = skipped / max(1, total)
    if fraction <= 0.01:
        return
    summary = f"{skipped} of {total} {unit} ({fraction:.1%}) of the {split_name} split are skipped"
    if fraction > max_fraction:
        raise TrainError(
            f"{summary}, more than --max-skipped-fraction {max_fraction} (reasons above). Fix the data or the chat "
            f"template (--chat-template), or raise --max-skipped-fraction to train on the rest."
        )
    log(f"WARNING: {summary}; they are not trained (reasons and first rows above)")


@dataclass
class DataPlan:
    """Where every global batch comes from. Independent of the number of processes.

    Epoch e is a permutation of the packed blocks seeded by (seed, e); the global batch at step k of
    an epoch is blocks perm[k*G : (k+1)*G], G = world x batch x grad-accum. So the data position is
    just (epoch, samples consumed), and a final partial global batch is always dropped.
    """

    blocks: PackedBlocks | MixedBlocks
    seed: int
    global_batch: int
    micro_batch: int
    world_size: int
    rank: int
    mixture: Mixture | None = None  # several datasets (fsdp_lib/mixture.py): their proportions define the epoch

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
        if self.pin:
            batches = [Batch(*(None if t is None else t.pin_memory() for t in b.tensors())) for b in batches]
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
    objective: str = "lm"  # lm or dpo (--objective, resolved against the dataset)


@dataclass
class Source:
    """One -d dataset, tokenised and packed."""

    name: str  # as given with -d
    train: PackedBlocks | PairBlocks
    validation: PackedBlocks | PairBlocks | None
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
    dataset's blocks in a seeded permutation per epoch, or a mixture's in their proportions (fsdp_lib/mixture.py)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise TrainError(
            f"--model-name {cfg.model_name}: the tokenizer has no EOS token, needed between packed documents"
        )
    tok_hash = tokenizer_hash(model_dir)
    sources = [load_source(cfg, name, tokenizer, tok_hash, d) for name in cfg.dataset_name]
    global_batch = d.world_size * cfg.batch_size * cfg.grad_accum_steps
    if len(sources) == 1:
        source = sources[0]
        plan = DataPlan(source.train, cfg.seed, global_batch, cfg.batch_size, d.world_size, d.rank)
        validation, fingerprint, data_format = source.validation, source.fingerprint, source.data_format
    else:
        plan, validation = mixture_plan(cfg, sources, global_batch, d)
        fingerprint = "|".join(source.fingerprint for source in sources)
        data_format = f"mixture[{'; '.join(s.data_format for s in sources)}]:weights-{plan.mixture.weights}"
    if plan.steps_per_epoch == 0:
        raise TrainError(
            f"--dataset-name {cfg.datasets_label}: {plan.epoch_blocks} packed blocks of {cfg.seq_length} tokens per "
            f"epoch are fewer than one global batch of {global_batch} (processes x --batch-size x --grad-accum-steps); "
            f"lower --seq-length, --batch-size or --grad-accum-steps"
        )
    log(
        f"data: {plan.epoch_blocks:,} train blocks of {cfg.seq_length} tokens per epoch, global batch {global_batch} "
        f"({d.world_size} x {cfg.batch_size} x {cfg.grad_accum_steps}), {plan.steps_per_epoch} steps/epoch, "
        f"{len(validation) if validation else 0} validation blocks, document masking {cfg.document_masking}"
    )
    data_format += f":document-masking-{cfg.document_masking}"
    return TrainData(plan, validation, tokenizer, tok_hash, fingerprint, data_format, sources[0].objective)


def load_source(cfg: TrainConfig, name: str, tokenizer: Any, tok_hash: str, d: Dist) -> Source:
    """One dataset: its splits read, its kind resolved (text, conversations, preference pairs), tokenised once
    into the token cache and packed."""
    try:
        train_split, val_split = load_text_dataset(name, cfg.text_column or None)
    except ValueError as exc:
        raise TrainError(f"--dataset-name: {exc}") from exc
    if cfg.data_slice:
        train_split = slice_rows(train_split, cfg.data_slice)
    objective = resolve_objective(cfg, train_split.column_names, name)
    if objective == "dpo" and len(cfg.dataset_name) > 1:
        raise TrainError(
            f"--dataset-name {name} holds preference pairs, which train alone (--objective dpo); give -d once"
        )
    columns = ["messages"] if objective == "dpo" else train_split.column_names  # pairs need the template too
    tools = objective != "dpo" and any(uses_tools(split) for split in (train_split, val_split) if split is not None)
    chat = chat_encoder(cfg, tokenizer, columns, tools, name)
    pairs = None
    if objective == "dpo":
        pairs, chat = PairEncoder(ChatEncoder(tokenizer, "assistant"), cfg.seq_length), None
    data_format = f"chat:{chat_template_hash(tokenizer)}:loss-on-{cfg.loss_on}" if chat else "text"
    if pairs is not None:
        data_format = f"pairs:{chat_template_hash(tokenizer)}"
    key = f"{tok_hash}|{data_format}"
    train_blocks = load_token_stream(train_split, "train", tokenizer, key, cfg, d, chat, pairs)
    validation = None
    if val_split is not None and len(val_split):
        validation = load_token_stream(val_split, "validation", tokenizer, key, cfg, d, chat, pairs)
        if len(validation) == 0:
            log(f"the validation split of {name} is shorter than one block; its validation is skipped")
            validation = None
    if pairs is not None:
        used = float(np.sum(train_blocks.lengths)) / max(1, len(train_blocks) * cfg.seq_length)
        log(
            f"--objective dpo{' (auto: the dataset has chosen and rejected columns)' if cfg.objective == 'auto' else ''}"
            f": {train_blocks.num_pairs:,} train pairs packed whole into {len(train_blocks):,} blocks ({used:.1%} of "
            f"their tokens used, the rest padding), ~{train_blocks.num_pairs / max(1, len(train_blocks)):.1f} pairs "
            f"per block; chat template {chat_template_hash(tokenizer)}, loss on the responses' assistant turns"
        )
    if chat is not None:
        share = float(np.mean(train_blocks.trained)) if len(train_blocks.trained) else 0.0
        log(
            f"SFT on conversations (a 'messages' column) of {name}: chat template {chat_template_hash(tokenizer)}, "
            f"loss on {cfg.loss_on} tokens ({share:.1%} of all tokens carry loss)"
        )
    fingerprint = f"{getattr(train_split, '_fingerprint', '')}/{getattr(val_split, '_fingerprint', '')}"
    tokens = len(train_blocks.tokens) if isinstance(train_blocks, PackedBlocks) else int(np.sum(train_blocks.lengths))
    return Source(name, train_blocks, validation, len(train_split), tokens, fingerprint, data_format, objective)


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
        MixedBlocks([s.train for s in sources], names), cfg.seed, global_batch, cfg.batch_size, d.world_size, d.rank,
        mixture,
    )  # fmt: skip
    lines = [
        f"  {name}: {source.name}, {source.rows:,} rows, {source.tokens:,} tokens, {size:,} blocks, weight "
        f"{weight:.3f} -> {count:,} blocks per epoch ({count / size:.2f} passes)"
        for name, source, size, weight, count in zip(names, sources, sizes, mixture.weights, mixture.counts)
    ]
    log(f"mixture of {len(sources)} datasets (--data-weights {cfg.data_weights or 'by size'}):\n" + "\n".join(lines))
    held_out = [(name, source.validation) for name, source in zip(names, sources) if source.validation is not None]
    validation = MixedBlocks([v for _, v in held_out], [n for n, _ in held_out]) if held_out else None
    return plan, validation


def describe_datasets(cfg: TrainConfig) -> None:
    """--dry-run: each -d dataset's splits, rows and kind, and a mixture's weights (its tokens and blocks are
    counted when the run tokenises them)."""
    weights = parse_data_weights(cfg.data_weights) if cfg.data_weights else None
    lines = []
    for i, name in enumerate(cfg.dataset_name):
        try:
            train_split, val_split = load_text_dataset(name, cfg.text_column or None)
        except ValueError as exc:
            raise TrainError(f"--dataset-name: {exc}") from exc
        kind = "preference pairs" if is_preference_split(train_split.column_names) else (
            "conversations" if "messages" in train_split.column_names else "text"
        )  # fmt: skip
        held_out = f", {len(val_split):,} validation rows" if val_split is not None else ""
        share = f", weight {weights[i] / sum(weights):.3f}" if weights else ""
        lines.append(f"  {name}: {kind}, {len(train_split):,} train rows{held_out}{share}")
    mixture = " (a mixture: shares by --data-weights, else by size in blocks)" if len(lines) > 1 else ""
    log(f"data{mixture}:\n" + "\n".join(lines))


def resolve_objective(cfg: TrainConfig, columns: list[str], name: str = "") -> str:
    """--objective as lm or dpo: auto follows the dataset; an explicit choice must fit it."""
    name = name or cfg.datasets_label
    preference = is_preference_split(columns)
    if cfg.objective == "dpo" and not preference:
        raise TrainError(
            f"--objective dpo: --dataset-name {name} has the columns {columns}, not prompt, chosen and "
            f"rejected; convert preference pairs with: python data_hf.py --format preference ..."
        )
    if cfg.objective == "lm" and preference:
        raise TrainError(
            f"--objective lm: --dataset-name {name} holds preference pairs (prompt, chosen, rejected); "
            f"train them with --objective dpo (or auto), or convert the chosen conversations with --format chat"
        )
    if not preference:
        if changed_dpo_flags(cfg):
            raise TrainError(
                f"{', '.join(changed_dpo_flags(cfg))} apply to preference data; --dataset-name {name} "
                f"has the columns {columns}"
            )
        return "lm"
    if cfg.document_masking == "off":
        raise TrainError(
            f"--dataset-name {name} holds preference pairs: --objective dpo packs a pair's sequences as "
            f"separate documents and needs --document-masking on"
        )
    if cfg.loss_on != "assistant":
        raise TrainError(
            f"--loss-on {cfg.loss_on}: --dataset-name {name} holds preference pairs, whose log-probabilities "
            f"are those of the responses' assistant turns; leave --loss-on at its default"
        )
    return "dpo"


def evaluation_shares(count: int, batch_size: int, d: Dist) -> list[list[int]]:
    """This rank's micro-batches of blocks 0..count-1 for a pass without gradients (blocks rank, rank + world, ...):
    as many on every rank, since FSDP's forward all-gathers must line up; a rank with fewer real blocks gets shorter
    or empty lists and pads them itself."""
    mine = list(range(d.rank, count, d.world_size))
    steps = math.ceil(math.ceil(count / d.world_size) / batch_size)
    return [mine[i * batch_size : (i + 1) * batch_size] for i in range(steps)]


def total_steps(cfg: TrainConfig, plan: DataPlan) -> int:
    steps = plan.steps_per_epoch * cfg.num_epochs
    return min(steps, cfg.max_steps) if cfg.max_steps else steps
