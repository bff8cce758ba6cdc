"""Ctrl-C and SIGTERM in the helper tools: both arrive as a KeyboardInterrupt where the tool is, so its own clean-up
runs (temporaries removed, finished files kept), and end with one line and the shell's exit code, 130 or 143. The
trainer has its own rule (runtime.StopRequest: a checkpoint, then exit 0). And how every tool ends once it has
returned its exit code (exit_without_teardown). No torch."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import NoReturn

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


_BEFORE_LOADING: list = []  # SIGINT's handler before stop_while_loading replaced it


def stop_while_loading(tool: str) -> None:
    """Until loading_done(): Ctrl-C ends the process at once with one line and exit 130. Installed before a tool
    imports torch and transformers (seconds), where a KeyboardInterrupt would print their import traceback; a
    process started with SIGINT ignored (a background job) keeps ignoring it."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return

    def stop(signum: int, frame: object) -> None:
        os.write(2, f"{tool}: stopped by Ctrl-C while loading its libraries; nothing was written\n".encode())
        os._exit(EXIT_CTRL_C)

    _BEFORE_LOADING.append(signal.signal(signal.SIGINT, stop))


def loading_done() -> None:
    """Give Ctrl-C back to the handler it had before stop_while_loading (Python's KeyboardInterrupt)."""
    if _BEFORE_LOADING:
        signal.signal(signal.SIGINT, _BEFORE_LOADING.pop())


def interrupt_exit_code(interrupt: KeyboardInterrupt) -> int:
    """143 for SIGTERM (sigterm_as_interrupt), 130 for Ctrl-C."""
    return EXIT_SIGTERM if interrupt.args == ("SIGTERM",) else EXIT_CTRL_C


ABANDONED: set[threading.Thread] = set()  # threads a timed-out reward function left running (rewards.score)


def exit_without_teardown(code: int | None) -> NoReturn:
    """End the process with `code` after what Python's own exit does that anyone can observe: no thread but daemons
    left (else the normal exit, which waits for them), the atexit handlers run (logging's flush, libraries' helper
    processes), stdout and stderr flushed. What it skips is the interpreter freeing every module and object one by
    one: ~1 s per process with torch and transformers loaded (0.4 s for torch alone), which every run paid after
    its last line (the test suite launches the tools several hundred times)."""
    code = 0 if code is None else code  # what sys.exit(None) means
    # a hung reward function's threads (a thread pool's workers) are not waited for: the exit would hang on them
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and t not in ABANDONED]
    if not isinstance(code, int) or any(t.is_alive() and not t.daemon for t in others):
        sys.exit(code)
    atexit._run_exitfuncs()  # CPython's own exit runs these; no public API runs them early
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
