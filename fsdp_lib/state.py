"""TrainState: the counters besides model and optimizer that an exact resume restores (saved as JSON in every
training checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """Everything besides model and optimizer that an exact resume needs."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    samples_in_epoch: int = 0  # packed blocks consumed in the current epoch (a multiple of the global batch)
    skipped_steps: int = 0  # steps whose optimizer update was skipped (non-finite loss or gradient)
    bad_streak: int = 0  # consecutive skipped steps up to now
    loss_scale: float = 1.0  # fp16 dynamic loss scale
    scale_good_steps: int = 0
    # the open log window at the save (Metrics.carried_window: its sums over the ranks), so a resumed run's next log
    # line covers the steps the uninterrupted run's does; None when the save falls on a logged step
    log_window: dict | None = None

    def fit_epoch(self, global_batch: int, steps_per_epoch: int) -> str | None:
        """A saved position at or past the end of this data's epoch (--force-resume onto fewer blocks; it crashed
        gathering an empty step) moves to the next epoch's start; returns what to say, None when it fits."""
        size = steps_per_epoch * global_batch
        if self.samples_in_epoch < size:
            return None
        said = (
            f"WARNING: the checkpoint's data position, {self.samples_in_epoch} samples into epoch {self.epoch}, is "
            f"past the end of this data's epoch ({size} samples per epoch now: the data changed since, resumed with "
            f"--force-resume); going on at the start of epoch {self.epoch + 1}"
        )
        self.epoch, self.samples_in_epoch = self.epoch + 1, 0
        return said

    def advance(self, global_batch: int, steps_per_epoch: int) -> None:
        self.step += 1
        self.samples_in_epoch += global_batch
        if self.samples_in_epoch >= steps_per_epoch * global_batch:
            self.epoch += 1
            self.samples_in_epoch = 0
