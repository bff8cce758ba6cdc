"""The micro-batch the training forward takes, as the data modules build it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Batch:
    """One micro-batch: inputs, targets (-100 = no loss) and, with document masking, per-document positions."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None
    # Preference pairs (preference.PairBlocks): each token's sequence in the micro-batch (-1 = none), the sequences'
    # indices in the split, and their reference log-probabilities when precomputed.
    sequence_ids: torch.Tensor | None = None
    sequences: torch.Tensor | None = None
    reference: torch.Tensor | None = None
    # --objective grpo (grpo.completion_batch): each sequence's advantage.
    advantages: torch.Tensor | None = None
    # --objective kto (PairBlocks of unpaired.py's examples): whether each example (sequence 2k) is desirable.
    desirable: torch.Tensor | None = None
    # Batches with sequence ids (DPO, KTO, GRPO): the flat positions that have a target, found on the host (set by
    # `to`), so that picking them out on a GPU does not wait for it.
    targets: torch.Tensor | None = None
    # Where the packed documents start, read from the position ids on the host (set by `with_documents`).
    documents: Documents | None = None

    def to(self, device: torch.device) -> Batch:
        """On `device`, with what the host knows computed first (the documents, the targets' positions): the
        copies are non-blocking, from pinned memory where they go to a GPU, so none waits for the work queued
        before it."""
        to_gpu = torch.device(device).type == "cuda"
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        pinned = lambda t: t.pin_memory() if to_gpu and not t.is_pinned() else t  # noqa: E731
        documents, targets = self.with_documents().documents, self.targets
        on_host = self.labels.device.type == "cpu"
        if documents is not None:
            documents = dataclasses.replace(documents, cu_seqlens=move(pinned(documents.cu_seqlens)))
        if targets is None and self.sequence_ids is not None and on_host:
            targets = pinned((self.labels.reshape(-1) != -100).nonzero().squeeze(1))
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "documents"}
        fields["targets"] = targets
        return Batch(**{name: move(t) for name, t in fields.items()}, documents=documents)

    def with_documents(self, pin: bool = False) -> Batch:
        """This batch with its documents read from host position ids (once: the data plan's prefetch thread does it,
        with `pin` for a GPU, and `to` and the MFU's attended_positions then read them); itself where they are known
        or cannot be."""
        if self.documents is None and self.position_ids is not None and self.position_ids.device.type == "cpu":
            documents = Documents.of(self.position_ids.numpy())
            if pin:
                documents = dataclasses.replace(documents, cu_seqlens=documents.cu_seqlens.pin_memory())
            return dataclasses.replace(self, documents=documents)
        return self

    def tensors(self) -> list[torch.Tensor | None]:
        """The tensor fields in order (dataclasses.astuple would deep-copy every tensor)."""
        return [getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "documents"]


@dataclass(frozen=True)
class Documents:
    """The packed documents of a micro-batch, flattened row after row: bounds[i]:bounds[i+1] is document i (host
    ints, for slicing without a device sync); cu_seqlens the same as int32 on the batch's device; longest the
    longest document; row_length T. A new row always starts a document."""

    bounds: tuple[int, ...]
    cu_seqlens: torch.Tensor
    longest: int
    row_length: int

    @staticmethod
    def whole_rows(rows: int, length: int, device: torch.device) -> Documents:
        """Each row one document (rows without position ids)."""
        bounds = tuple(range(0, rows * length + 1, length))
        cu = torch.tensor(bounds, dtype=torch.int32).to(device, non_blocking=True)
        return Documents(bounds, cu, length, length)

    @staticmethod
    def of(position_ids: np.ndarray) -> Documents:
        """From [B x T] positions that restart at 0 where a document starts."""
        rows, length = position_ids.shape
        starts = np.union1d(np.flatnonzero(position_ids.reshape(-1) == 0), np.arange(rows) * length)
        bounds = np.append(starts, rows * length)
        cu = torch.from_numpy(bounds.astype(np.int32))
        return Documents(tuple(bounds.tolist()), cu, int(np.diff(bounds).max()), length)


def stack_blocks(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]) -> Batch:
    """A Batch of blocks given as (inputs, labels, position ids or None)."""
    inputs, labels = (torch.from_numpy(np.stack([p[k] for p in parts])) for k in (0, 1))
    positions = None if parts[0][2] is None else torch.from_numpy(np.stack([p[2] for p in parts]))
    return Batch(inputs, labels, positions)


def attended_positions(batches: list[Batch]) -> tuple[int, int]:
    """(the sum over documents of their length squared, the tokens) of host micro-batches: under causal attention a
    token attends over its document (whole rows without position ids), so the first over the second is the mean
    span a token attends over, the T of the model-FLOPs count."""
    squares = tokens = 0
    for batch in batches:
        rows, length = batch.input_ids.shape
        documents = batch.with_documents().documents
        lengths = np.diff(documents.bounds) if documents is not None else np.full(rows, length)
        squares += int(np.square(lengths, dtype=np.int64).sum())
        tokens += rows * length
    return squares, tokens
