"""How documents fill the --seq-length blocks under --packing whole (the default for conversations): each document
whole in one block, best fit decreasing, the rest padding that carries no loss, so a conversation never straddles
two blocks and its answers always train with their prompt (with --packing stream, cache.PackedBlocks, one token
stream is cut into blocks: a document may start in one and end in the next, the usual way for plain text). The
same best fit packs DPO's pairs (preference.PairBlocks). No torch."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from fsdp_lib.data.batch import Batch, stack_blocks


def document_starts(doc_ends: np.ndarray) -> np.ndarray:
    """Each document's start offset in a token stream, from the end offsets (the token cache's docs file)."""
    return np.concatenate([np.zeros(1, dtype=np.int64), np.asarray(doc_ends[:-1], dtype=np.int64)])


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Items (by length, each 1..capacity) into blocks of `capacity`: each item, longest first (ties in index
    order), goes into the fullest block it still fits (ties: the block opened first), else a new block. Returns
    each block's items in index order. Deterministic and independent of the process count."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    smallest = int(np.min(lengths)) if len(lengths) else 0
    free: list[tuple[int, int]] = []  # (tokens left, block), sorted; a block with less left than any item drops out
    blocks: list[list[int]] = []
    for item in order.tolist():
        need = int(lengths[item])
        if not 0 < need <= capacity:
            raise ValueError(f"an item of {need} tokens cannot be packed into blocks of {capacity}")
        at = bisect.bisect_left(free, (need, -1))
        if at < len(free):
            left, block = free.pop(at)
        else:
            left, block = capacity, len(blocks)
            blocks.append([])
        blocks[block].append(item)
        if left - need >= smallest:  # (the list stays short: it held every block, quadratic in their number)
            bisect.insort(free, (left - need, block))
    return [sorted(b) for b in blocks]


@dataclass
class WholeBlocks:
    """Blocks of seq_length tokens, each holding whole documents (best_fit_decreasing) and padding that carries no
    loss; the DataPlan treats it like cache.PackedBlocks (len, gather, trained_tokens). A document longer than a
    block is cut into pieces of seq_length, each packed like a document: the later pieces train without the start
    of their document (counted: `split`), and a piece's last token has the next piece's first as its target. A
    document's last token has no target (the next one in its block is another document's). The packing depends only on the documents' lengths and seq_length: the same at any
    process count, so a resume finds every block as it was."""

    tokens: np.ndarray
    seq_length: int
    trained: np.ndarray | None  # uint8 per token: 1 = a target that carries loss (None = all)
    doc_ends: np.ndarray  # end offset (exclusive) of every document
    pad_id: int
    restart_positions: bool = True  # --document-masking on: positions restart at each document (and the padding)
    per_turn: int = 0  # conversations the chat template made one sample (document) per assistant turn, for the log

    def __post_init__(self) -> None:
        L = self.seq_length
        ends, starts = np.asarray(self.doc_ends, dtype=np.int64), document_starts(self.doc_ends)
        keep = ends > starts
        starts, ends = starts[keep], ends[keep]
        pieces = -(-(ends - starts) // L)  # per document
        self.documents, self.split = len(starts), int(np.count_nonzero(pieces > 1))
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)  # each piece's document's first piece
        self.starts = np.repeat(starts, pieces) + L * (np.arange(int(pieces.sum()), dtype=np.int64) - first)
        self.lengths = np.minimum(L, np.repeat(ends, pieces) - self.starts)
        # a piece whose document goes on: its last token's target is the next piece's first (not a lost target)
        self.continues = self.starts + self.lengths < np.repeat(ends, pieces)
        # in data order (by each block's first piece), not the longest-first order they were opened in: the first
        # --eval-max-blocks validation blocks held the longest conversations
        packed = sorted(best_fit_decreasing(self.lengths, L), key=lambda block: block[0])
        self.block_items = np.asarray([p for block in packed for p in block], dtype=np.int64)
        self.block_ptr = np.concatenate([[0], np.cumsum([len(block) for block in packed])]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.block_ptr) - 1

    @property
    def fill(self) -> float:
        """The share of the blocks' positions that hold tokens (the rest is padding)."""
        return float(self.lengths.sum()) / max(1, len(self) * self.seq_length)

    def block(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(inputs, labels, position ids or None) of block i."""
        L = self.seq_length
        inputs = np.full(L, self.pad_id, dtype=np.int64)
        labels = np.full(L, -100, dtype=np.int64)
        positions = np.zeros(L, dtype=np.int64)
        at = 0
        for piece in self.block_items[self.block_ptr[i] : self.block_ptr[i + 1]].tolist():
            a, n = int(self.starts[piece]), int(self.lengths[piece])
            ids = np.asarray(self.tokens[a : a + n], dtype=np.int64)
            reach = n + 1 if self.continues[piece] else n  # the targets: this piece's next tokens
            targets = np.asarray(self.tokens[a + 1 : a + reach], dtype=np.int64)
            if self.trained is not None:
                targets = np.where(np.asarray(self.trained[a + 1 : a + reach]) != 0, targets, -100)
            inputs[at : at + n], labels[at : at + reach - 1] = ids, targets
            positions[at : at + n] = np.arange(n)
            at += n
        positions[at:] = np.arange(L - at)  # the padding: a document of its own
        return inputs, labels, positions if self.restart_positions else None

    def gather(self, indices: list[int]) -> Batch:
        return stack_blocks([self.block(i) for i in indices])

    def trained_tokens(self, indices: list[int]) -> int:
        """Targets that carry loss in these blocks: what the loss of a global batch is averaged over."""
        return int(sum((self.block(i)[1] != -100).sum() for i in indices))

    def describe(self, unit: str) -> str:
        """For the run's log: how the documents filled the blocks."""
        counted = unit
        if self.per_turn:  # the documents are samples, not conversations
            unit, counted = f"samples ({self.per_turn:,} of the {unit} made one sample per assistant turn)", "samples"
        said = (
            f"{self.documents:,} {unit} packed whole into {len(self):,} blocks of {self.seq_length} tokens "
            f"({self.fill:.1%} of their positions used, the rest padding)"
        )
        if self.split:
            share = self.split / max(1, self.documents)
            said += (
                f"; {'WARNING: ' if share > 0.01 else ''}{self.split:,} {counted} ({share:.1%}) are longer than a block "
                "and cut into pieces, the later ones trained without their start: a longer --seq-length keeps them whole"
            )
        return said


def straddling(doc_ends: np.ndarray, seq_length: int) -> int:
    """How many documents of a token stream cut into blocks of seq_length (--packing stream) start in one block and
    end in another: those train their end without their start."""
    ends, starts = np.asarray(doc_ends, dtype=np.int64), document_starts(doc_ends)
    return int(np.count_nonzero((starts // seq_length != (ends - 1) // seq_length) & (ends > starts)))
