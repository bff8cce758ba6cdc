"""The errors a user can fix. main() reports each as one message (no traceback) and exits non-zero:
ConfigError 2, the others 1."""

from __future__ import annotations


class TrainError(RuntimeError):
    """A problem the user can fix; reported as one clear message without a traceback."""


class ConfigError(ValueError):
    """Every problem with the flags, reported together."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


class CheckpointError(TrainError):
    """A training checkpoint that cannot be written, found intact, or resumed from."""


class ExperimentLockedError(TrainError):
    """Another live run holds the experiment's lock."""
