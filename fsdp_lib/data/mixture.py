"""Dataset mixtures (-d given several times, --data-weights): several datasets' packed blocks as one index space,
and the epoch order that draws from them in the chosen proportions.

An epoch ends when the most heavily weighted dataset has been drawn once: it has N = round(n_k / w_k) blocks,
n_k that dataset's blocks and w_k its normalised weight, of which dataset i gives c_i = N * w_i (rounded so they
sum to N). A dataset with c_i > n_i repeats within the epoch, one with c_i < n_i continues where it stopped in
the next epoch: each dataset reads its own endless stream of permutations of its blocks (seeded by the run's seed,
the dataset's index and the pass), so every block is drawn as often as its weight says before any is drawn again.
The datasets are interleaved so that every prefix of the epoch holds them in their proportions (within one block:
each dataset's j-th block sits at the (j + 1/2) / c_i point of the epoch), so every global batch has the mixture's
shares. All of it depends only on (seed, epoch), never on the process count: the exact resume and N -> M
guarantees of a single dataset hold unchanged.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from fsdp_lib.data.batch import Batch, stack_blocks


@dataclass
class Mixture:
    """The proportions of a mixture and the per-epoch order of its blocks (global indices, dataset i's block j
    at offsets[i] + j)."""

    names: list[str]  # short names of the datasets, for the log and the metrics
    sizes: list[int]  # blocks per dataset
    weights: list[float]  # normalised, summing to 1

    @property
    def offsets(self) -> list[int]:
        return [0, *np.cumsum(self.sizes).tolist()]

    @property
    def counts(self) -> list[int]:
        """Blocks each dataset gives an epoch (largest remainders, so they sum to the epoch's length)."""
        first = max(range(len(self.weights)), key=lambda i: self.weights[i])
        total = max(1, round(self.sizes[first] / self.weights[first]))
        exact = [total * w for w in self.weights]
        counts = [int(x) for x in exact]
        for i in sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))[: total - sum(counts)]:
            counts[i] += 1
        return counts

    def slots(self) -> np.ndarray:
        """The dataset of every position of an epoch: dataset i's j-th block at time (j + 1/2) / c_i."""
        counts = self.counts
        times = np.concatenate([(np.arange(c) + 0.5) / c for c in counts])
        owners = np.concatenate([np.full(c, i) for i, c in enumerate(counts)])
        return owners[np.argsort(times, kind="stable")]

    def stream(self, seed: int, dataset: int, start: int, count: int) -> np.ndarray:
        """Blocks start..start+count-1 of dataset i's stream: pass p is a permutation seeded by (seed, i, p)."""
        size = self.sizes[dataset]
        first, last = start // size, (start + count - 1) // size
        passes = []
        for p in range(first, last + 1):
            g = torch.Generator().manual_seed((seed * 1_000_003 + dataset) * 1_000_003 + p)
            passes.append(torch.randperm(size, generator=g).numpy())
        joined = np.concatenate(passes)
        return joined[start - first * size : start - first * size + count]

    def epoch_order(self, seed: int, epoch: int) -> torch.Tensor:
        slots, counts, offsets = self.slots(), self.counts, self.offsets
        order = np.empty(len(slots), dtype=np.int64)
        for i, count in enumerate(counts):
            if count:
                order[slots == i] = offsets[i] + self.stream(seed, i, epoch * count, count)
        return torch.from_numpy(order)

    def sources(self, indices: list[int]) -> list[int]:
        """How many of these global block indices come from each dataset."""
        found = np.searchsorted(self.offsets[1:], np.asarray(indices, dtype=np.int64), side="right")
        return np.bincount(found, minlength=len(self.sizes)).tolist()


@dataclass
class MixedBlocks:
    """Several PackedBlocks as one: block offsets[i] + j is part i's block j. Parts may differ in kind (text,
    conversations with their trained-token masks); they share --seq-length and document masking."""

    parts: list  # PackedBlocks
    names: list[str]

    def __post_init__(self) -> None:
        self.offsets = [0, *np.cumsum([len(part) for part in self.parts]).tolist()]

    def __len__(self) -> int:
        return self.offsets[-1]

    def locate(self, index: int) -> tuple[int, int]:
        part = bisect.bisect_right(self.offsets, index) - 1
        return part, index - self.offsets[part]

    def block(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        part, local = self.locate(index)
        return self.parts[part].block(local)

    def gather(self, indices: list[int]) -> Batch:
        return stack_blocks([self.block(i) for i in indices])

    def trained_tokens(self, indices: list[int]) -> int:
        """Each part counts its own blocks (PackedBlocks.trained_tokens, with its shortcut for unmasked text)."""
        local: list[list[int]] = [[] for _ in self.parts]
        for index in indices:
            part, block = self.locate(index)
            local[part].append(block)
        return sum(part.trained_tokens(blocks) for part, blocks in zip(self.parts, local) if blocks)


def short_names(paths: list[str]) -> list[str]:
    """The datasets' folder names (hub ids' last part), numbered where two are the same: metric keys."""
    names = [path.rstrip("/").replace("\\", "/").split("/")[-1] or f"dataset{i}" for i, path in enumerate(paths)]
    return [name if names.count(name) == 1 else f"{name}_{i}" for i, name in enumerate(names)]
