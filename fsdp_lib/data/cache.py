"""The token cache: each split tokenised once into stream files (tokens, document ends, trained mask) with their
checksums, verified at every start, and packed into blocks of --seq-length with per-document position ids."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist

from fsdp_lib.config import TrainConfig, packs_whole
from fsdp_lib.data.batch import Batch, stack_blocks
from fsdp_lib.data.chat import ChatEncoder
from fsdp_lib.data.packing import WholeBlocks
from fsdp_lib.data.preference import PairBlocks, PairEncoder, tokenize_pairs_to_file
from fsdp_lib.data.unpaired import ExampleEncoder
from fsdp_lib.errors import TrainError, name_sample
from fsdp_lib.integrity import (
    commit_files,
    recorded_problems,
    remove_stale_staged,
    staged,
    staged_writes,
)
from fsdp_lib.markers import TOKEN_CACHE
from fsdp_lib.processes import process_alive
from fsdp_lib.runtime import Dist, log, raise_if_stopped


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


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def encode_batch(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids with the tokenizer's own special tokens (e.g. BOS). The Rust backend's encode_batch_fast gives
    the same ids as tokenizer(texts) without computing character offsets: ~15% faster (bench/bench_tokenize.py)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=True)]
    return tokenizer(texts, add_special_tokens=True)["input_ids"]


def stream_paths(tokens_path: Path) -> dict[str, Path]:
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
    limit, tokenizer.model_max_length = tokenizer.model_max_length, sys.maxsize  # packed into blocks later: the
    try:  # length warning is noise; the tokenizer is exported with the run, so its own limit comes back after
        return _tokenize_to_file(dataset, tokenizer, out_path, batch_rows, chat)
    finally:
        tokenizer.model_max_length = limit


def _tokenize_to_file(dataset: Any, tokenizer: Any, out_path: Path, batch_rows: int, chat: ChatEncoder | None) -> int:
    eos = tokenizer.eos_token_id
    dtype = token_dtype(len(tokenizer))
    paths = stream_paths(out_path)
    names = ("docs", "mask", "tokens") if chat is not None else ("docs", "tokens")
    total, skipped, first_skipped, rows = 0, {}, {}, 0
    with staged_writes({k: paths[k] for k in names}) as (handles, tmp):
        for batch in dataset.iter(batch_size=batch_rows):
            raise_if_stopped()
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
    tail: bool = False  # a validation split: its last, partial block too, padded (the padding carries no loss)

    def __len__(self) -> int:
        targets = len(self.tokens) - 1
        return max(0, -(-targets // self.seq_length) if self.tail else targets // self.seq_length)

    def block(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(inputs, labels, position ids or None) of block i."""
        L, start = self.seq_length, i * self.seq_length
        window = np.asarray(self.tokens[start : start + L + 1], dtype=np.int64)
        real = len(window) - 1  # the block's targets: L, except in the last block of a split kept whole (tail)
        if real < L:  # after the stream's last token: padding, its own document, no target
            window = np.concatenate([window, np.zeros(L - real, dtype=np.int64)])
        labels = window[1:].copy()
        labels[real:] = -100
        if self.trained is not None:
            labels[:real][np.asarray(self.trained[start + 1 : start + real + 1]) == 0] = -100
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
            targets = len(self.tokens) - 1
            return sum(min(self.seq_length, targets - i * self.seq_length) for i in indices)
        return int(sum((self.block(i)[1] != -100).sum() for i in indices))


def load_token_stream(
    split: Any,
    split_name: str,
    tokenizer: Any,
    cache_key: str,
    cfg: TrainConfig,
    d: Dist,
    chat: ChatEncoder | None,
    pairs: PairEncoder | ExampleEncoder | None = None,
    name: str = "",
) -> PackedBlocks | WholeBlocks | PairBlocks:
    """Tokenise once per node into a cache keyed by dataset fingerprint, tokenizer and chat settings, then
    memory-map it as packed blocks of --seq-length (--packing: whole documents, or the stream cut into blocks).

    The cache holds the flat token stream, so any --seq-length reuses it. Local rank 0 builds it;
    the others poll for the file instead of waiting in a collective, which would time out on a large corpus.
    `name`: the dataset's, in what the log says of its skipped rows (in a mixture, which dataset they are in).
    """
    split_of = f"the {split_name} split of {name}" if name else f"the {split_name} split"
    fingerprint = getattr(split, "_fingerprint", None) or str(len(split))
    version = f"docs-v2|chat-v{ChatEncoder.VERSION}" if chat is not None else "docs-v2"
    if pairs is not None:  # DPO's pairs, or KTO's examples with their KL sequences
        version = pairs.version
    key = hashlib.sha256(f"{fingerprint}|{cache_key}|{version}".encode()).hexdigest()[:20]
    cache_dir = Path(cfg.save_dir) / TOKEN_CACHE / key
    paths = stream_paths(cache_dir / f"{split_name}.tokens")
    # this launch's own marker: a failure of another launch's tokenisation (a preempted run, an experiment stopped
    # beside this one on the same cache) stopped this launch's waiting ranks with a failure of their rank 0
    failed_path = cache_dir / f"{split_name}.failed.{_tokenising_process(d)}"
    if d.local_rank == 0:  # its own name's marker is stale (a restarted container can reuse a PID): before anyone looks
        failed_path.unlink(missing_ok=True)
    if d.local_rank == 0 and paths["tokens"].exists():
        discard_if_damaged(paths, split_name)
    dist.barrier(group=d.cpu_group)  # nobody takes a damaged token file for a finished one (checking takes seconds)
    if d.local_rank == 0 and not paths["tokens"].exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        for marker in cache_dir.glob(f"{split_name}.failed.*.{socket.gethostname()}"):
            if not process_alive(int(marker.name.split(".")[2])):  # of a launch that is gone
                marker.unlink(missing_ok=True)
        if stale := remove_stale_staged(cache_dir):
            log(f"removed {len(stale)} partial file(s) a killed tokenisation left in {cache_dir}: {name_sample(stale)}")
        log(f"tokenising {split_name} split ({len(split)} rows) into {paths['tokens']}")
        start = time.perf_counter()
        try:
            if pairs is not None:
                count = tokenize_pairs_to_file(split, pairs, paths, token_dtype(len(tokenizer)))
            else:
                count = tokenize_to_file(split, tokenizer, paths["tokens"], chat=chat)
        except BaseException as exc:
            failed_path.write_text(repr(exc))
            raise
        log(f"tokenised {count:,} {pairs.unit if pairs else 'tokens'} in {time.perf_counter() - start:.1f}s")
    deadline = time.monotonic() + cfg.collective_timeout_s
    while not paths["tokens"].exists():
        raise_if_stopped()
        if failed_path.exists():
            raise TrainError(f"tokenisation failed on local rank 0: {failed_path.read_text()}")
        if time.monotonic() > deadline:
            raise TrainError(f"waited {cfg.collective_timeout_s}s for {paths['tokens']}; raise --collective-timeout-s")
        time.sleep(0.02)  # a stat() 50 times a second; local rank 0 waits in the barrier below meanwhile
    dist.barrier(group=d.cpu_group)  # every node's cache is complete before anyone maps it

    def mapped(path: Path, dtype: Any) -> np.ndarray:
        return np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype=dtype)

    tokens = mapped(paths["tokens"], token_dtype(len(tokenizer)))
    if pairs is not None:
        report_skipped(json.loads(paths["skips"].read_text()), split_of, cfg.max_skipped_fraction, pairs.unit)
        blocks = PairBlocks(
            tokens,
            mapped(paths["mask"], np.uint8),
            mapped(paths["docs"], np.int64),
            cfg.seq_length,
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            cache_path=paths["tokens"],
            kto=isinstance(pairs, ExampleEncoder),
        )
        return blocks
    trained = mapped(paths["mask"], np.uint8) if chat is not None else None
    skips = json.loads(paths["skips"].read_text()) if chat is not None else {"expanded": 0}
    if chat is not None:
        report_skipped(skips, split_of, cfg.max_skipped_fraction)
    if packs_whole(cfg, chat is not None):
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        docs = mapped(paths["docs"], np.int64)
        restart = cfg.document_masking == "on"
        return WholeBlocks(tokens, cfg.seq_length, trained, docs, pad_id, restart, per_turn=skips["expanded"])
    doc_ends = mapped(paths["docs"], np.int64) if cfg.document_masking == "on" else None
    # a validation split counts every target once: its last, partial block too (a training epoch leaves it out)
    return PackedBlocks(tokens, cfg.seq_length, trained, doc_ends, tail=split_name == "validation")


def _tokenising_process(d: Dist) -> str:
    """'PID.HOST' of the process that tokenises for this rank: its node's local rank 0 in this launch."""
    mine = (socket.gethostname(), d.local_rank, os.getpid())
    everyone: list[Any] = [None] * d.world_size
    dist.all_gather_object(everyone, mine, group=d.cpu_group)
    pid = next(pid for host, local_rank, pid in everyone if host == mine[0] and local_rank == 0)
    return f"{pid}.{mine[0]}"


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


def report_skipped(skips: dict, split_of: str, max_fraction: float, unit: str = "conversations") -> None:
    """Every run (also from the cache): what became of a split's conversations. More than 1% skipped is a loud
    warning at the start; more than --max-skipped-fraction stops the run. `split_of`: "the train split of NAME"."""
    total, skipped = skips["conversations"], sum(skips["skipped"].values())
    if skips["expanded"]:
        log(
            f"{skips['expanded']} conversation(s) of {split_of} are rendered by the chat template with earlier turns "
            f"differing from the last (e.g. Qwen3's <think> blocks): each is trained as one sample per assistant "
            f"turn, that turn rendered as the template renders a final one"
        )
    for reason, count in sorted(skips["skipped"].items()):
        log(f"skipped {count} {unit[:-1]}(s) of {split_of}: {reason} (first: row {skips['first_row'][reason]})")
    if (cut := skips.get("cut", {})).get("units"):  # pairs and KTO examples: prompts cut from the left to fit
        share = cut["units"] / max(1, total)
        log(
            f"{'WARNING: ' if share > 0.01 else ''}{cut['units']} {unit} ({share:.1%}) of {split_of} lost prompt tokens "
            f"from the left to fit one block of {cut['block']} tokens (--seq-length), {cut['tokens'] / cut['units']:.0f}"
            " per sequence on average; a longer --seq-length keeps more of their prompts"
        )
    fraction = skipped / max(1, total)
    if fraction <= 0.01:
        return
    summary = f"{skipped} of {total} {unit} ({fraction:.1%}) of {split_of} are skipped"
    if fraction > max_fraction:
        reason = max(skips["skipped"], key=skips["skipped"].get)
        rest = (
            "; none is left to train on"
            if skipped >= total
            else ", or raise --max-skipped-fraction to train on the rest"
        )
        raise TrainError(
            f"{summary}, more than --max-skipped-fraction {max_fraction}; the most common reason "
            f"({skips['skipped'][reason]}): {reason}. Fix what it names (the data, the chat template "
            f"(--chat-template) or the flag){rest}."
        )
    log(f"WARNING: {summary}; they are not trained (reasons and first rows above)")
