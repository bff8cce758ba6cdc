"""Ctrl-C and SIGTERM in the helper tools: both arrive as a KeyboardInterrupt where the tool is, so its own clean-up
runs (temporaries removed, finished files kept), and end with one line and the shell's exit code, 130 or 143. The
trainer has its own rule (runtime.StopRequest: a checkpoint, then exit 0). No torch."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

EXIT_CTRL_C, EXIT_SIGTERM = 130, 143  # 128 + SIGINT, 128 + SIGTERM, as the shell reports them


def _raise_on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt("SIGTERM")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM (a scheduler's, or `kill`) raises KeyboardInterrupt("SIGTERM") like Ctrl-C."""
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupt_exit_code(interrupt: KeyboardInterrupt) -> int:
    """143 for SIGTERM (sigterm_as_interrupt), 130 for Ctrl-C."""
    return EXIT_SIGTERM if interrupt.args == ("SIGTERM",) else EXIT_CTRL_C
