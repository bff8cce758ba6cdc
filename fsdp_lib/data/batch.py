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

    def to(self, device: torch.device) -> Batch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(*(move(t) for t in self.tensors()))

    def tensors(self) -> list[torch.Tensor | None]:
        """The fields in order (dataclasses.astuple would deep-copy every tensor)."""
        return [getattr(self, f.name) for f in dataclasses.fields(self)]


def stack_blocks(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]) -> Batch:
    """A Batch of blocks given as (inputs, labels, position ids or None)."""
    inputs, labels = (torch.from_numpy(np.stack([p[k] for p in parts])) for k in (0, 1))
    positions = None if parts[0][2] is None else torch.from_numpy(np.stack([p[2] for p in parts]))
    return Batch(inputs, labels, positions)
