"""The micro-batch the training forward takes, as the data modules build it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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
