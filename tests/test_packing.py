"""--packing whole (the default for conversations): every document whole in one block, best fit, padding that
carries no loss; its trained targets are exactly the stream's, only without the ones that crossed a block
boundary, and the packing is the one DPO's pairs always had (the same blocks, so their resumes hold)."""

from __future__ import annotations

import bisect

import numpy as np
import pytest

from fsdp_lib.data.cache import PackedBlocks
from fsdp_lib.data.packing import WholeBlocks, best_fit_decreasing, straddling


def reference_best_fit(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """The best fit decreasing DPO's pairs were packed with before 2026-11-28 (preference.pack_pairs, a sorted list
    of free spaces), kept here so a change to the shared one cannot move a pair run's blocks unnoticed."""
    order = np.argsort(-lengths, kind="stable")
    free: list[tuple[int, int]] = []
    blocks: list[list[int]] = []
    for item in order.tolist():
        need = int(lengths[item])
        at = bisect.bisect_left(free, (need, -1))
        if at < len(free):
            left, block = free.pop(at)
        else:
            left, block = capacity, len(blocks)
            blocks.append([])
        blocks[block].append(item)
        bisect.insort(free, (left - need, block))
    return [sorted(b) for b in blocks]


@pytest.mark.parametrize("capacity", [7, 64, 128, 1000])
def test_best_fit_is_the_packing_pairs_always_had(capacity):
    rng = np.random.default_rng(capacity)
    for n in (1, 5, 300, 2000):
        lengths = rng.integers(1, capacity + 1, size=n)
        lengths[: n // 4] = lengths[0]  # ties
        blocks = best_fit_decreasing(lengths, capacity)
        assert blocks == reference_best_fit(lengths, capacity)
        assert sorted(i for b in blocks for i in b) == list(range(n))
        assert all(lengths[b].sum() <= capacity for b in blocks)
    with pytest.raises(ValueError, match="an item of 8 tokens cannot be packed into blocks of 7"):
        best_fit_decreasing(np.array([3, 8]), 7)


def documents(lengths: list[int], seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A token stream of documents of these lengths (token = 1000 x document + position), its ends, and a trained
    mask marking the second half of each document (an "answer")."""
    tokens = np.concatenate([1000 * d + np.arange(n) for d, n in enumerate(lengths)]).astype(np.int64)
    ends = np.cumsum(lengths).astype(np.int64)
    trained = np.concatenate([(np.arange(n) >= n // 2).astype(np.uint8) for n in lengths])
    return tokens, ends, trained


def trained_pairs(blocks, count: int) -> list[tuple[int, int]]:
    """Every (input, target) pair that carries loss, over all blocks."""
    found = []
    for i in range(count):
        inputs, labels, _ = blocks.block(i)
        found += [(int(a), int(b)) for a, b in zip(inputs, labels) if b != -100]
    return sorted(found)


def test_every_document_is_whole_in_one_block_and_trains_what_the_stream_trains():
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 40, size=60).tolist()
    tokens, ends, trained = documents(lengths)
    L = 48
    whole = WholeBlocks(tokens, L, trained, ends, pad_id=-1)
    assert whole.documents == 60 and whole.split == 0 and len(whole) < len(tokens) // L + 10
    seen = []
    for i in range(len(whole)):
        inputs, labels, positions = whole.block(i)
        starts = np.flatnonzero(positions == 0)
        for a, b in zip(starts, [*starts[1:], L]):
            if inputs[a] == -1:  # the padding: no loss, after every document of the block
                assert (inputs[a:b] == -1).all() and (labels[a:b] == -100).all() and b == L
                continue
            doc = int(inputs[a]) // 1000
            assert (inputs[a:b] == 1000 * doc + np.arange(b - a)).all(), "whole, in order, from its first token"
            seen.append(doc)
    assert sorted(seen) == list(range(60)), "each document exactly once"
    # its trained targets are the stream's (document masking on), less those a block boundary cut off there
    stream = PackedBlocks(tokens, L, trained, ends)
    streamed = trained_pairs(stream, len(stream))
    packed = trained_pairs(whole, len(whole))
    assert set(streamed) <= set(packed) and len(packed) == len(set(packed))
    expected = sorted((1000 * d + k, 1000 * d + k + 1) for d, n in enumerate(lengths) for k in range(n // 2 - 1, n - 1))
    assert packed == sorted(p for p in expected)
    assert whole.trained_tokens(list(range(len(whole)))) == len(packed)
    assert straddling(ends, L) > 0 and len(streamed) < len(packed)
    assert WholeBlocks(tokens, L, trained, ends, pad_id=-1).block_items.tolist() == whole.block_items.tolist()
    # blocks in data order (each block's first document): --eval-max-blocks took the longest conversations first
    firsts = [int(whole.block_items[whole.block_ptr[i]]) for i in range(len(whole))]
    assert firsts == sorted(firsts)


def test_a_document_longer_than_a_block_is_cut_into_pieces_and_counted():
    tokens, ends, _ = documents([10, 100, 5])
    whole = WholeBlocks(tokens, 32, None, ends, pad_id=0, restart_positions=False)
    assert whole.split == 1 and sorted(whole.lengths.tolist()) == [4, 5, 10, 32, 32, 32]
    inputs, labels, positions = whole.block(0)
    assert positions is None  # --document-masking off: one causal row
    assert "1 documents (33.3%) are longer than a block" in whole.describe("documents")
    assert "3 documents packed whole into" in whole.describe("documents")
    # conversations the chat template made one sample per assistant turn: the documents counted are samples
    per_turn = WholeBlocks(tokens, 32, None, ends, pad_id=0, per_turn=1).describe("conversations")
    assert per_turn.startswith("3 samples (1 of the conversations made one sample per assistant turn) packed whole")
    assert "WARNING: 1 samples (33.3%) are longer than a block" in per_turn
    every = trained_pairs(whole, len(whole))
    # every next-token pair of each document, the ones across a cut too (a piece's last token had no target: one
    # trained token lost per cut)
    assert every == sorted((1000 * d + k, 1000 * d + k + 1) for d, n in enumerate([10, 100, 5]) for k in range(n - 1))
    assert whole.trained_tokens(list(range(len(whole)))) == len(every)
    tokens, ends, trained = documents([10, 100, 5])  # answers (the second halves) only: the cut at 64 is in one
    answers = WholeBlocks(tokens, 32, trained, ends, pad_id=0)
    expected = sorted(
        (1000 * d + k, 1000 * d + k + 1) for d, n in enumerate([10, 100, 5]) for k in range(n // 2 - 1, n - 1)
    )
    assert trained_pairs(answers, len(answers)) == expected


def test_straddling_counts_documents_a_stream_cuts():
    assert straddling(np.array([4, 8, 12]), 4) == 0
    assert straddling(np.array([3, 9, 12]), 4) == 1
    assert straddling(np.array([10]), 4) == 1


@pytest.mark.parametrize("masking", [False, True])
def test_a_validation_split_keeps_its_last_partial_block(masking):
    """A validation stream of 2.5 blocks was evaluated over 2: the targets after the last full block (up to
    --seq-length - 1 of them, a large share of a small split) were never counted. Kept (`tail`), padded: every
    target of the stream is counted exactly once, as a training epoch counts the full blocks', and the padding
    carries no loss and is its own document."""
    tokens, ends, trained = documents([30, 17, 34])  # 81 tokens, 80 targets: blocks of 32 leave 16 over
    for mask in (None, trained):
        train = PackedBlocks(tokens, 32, mask, ends if masking else None)
        held_out = PackedBlocks(tokens, 32, mask, ends if masking else None, tail=True)
        assert len(train) == 2 and len(held_out) == 3
        every = trained_pairs(held_out, 3)
        assert trained_pairs(train, 2) == [pair for pair in every if pair[0] in tokens[:64]]
        want = [(int(a), int(b)) for k, (a, b) in enumerate(zip(tokens[:-1], tokens[1:]))
                if (not masking or a // 1000 == b // 1000) and (mask is None or mask[k + 1])]  # fmt: skip
        assert every == sorted(want) and held_out.trained_tokens([0, 1, 2]) == len(want)
        inputs, labels, positions = held_out.block(2)
        assert len(inputs) == 32 and (labels[17:] == -100).all() and inputs[16] == tokens[-1]
        if masking:
            assert positions[17:].tolist() == list(range(15))  # the padding: a document of its own
