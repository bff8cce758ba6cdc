"""How model_download.py's parts talk to the user: ToolError, a failure the user can fix (main prints it as one
`error:` line and exits 1), and log, one line on stdout flushed at once so that it keeps its place among
huggingface_hub's and transformers' own output; interruptible, long work that Ctrl-C stops at once."""

from __future__ import annotations

import threading
from collections.abc import Callable


class ToolError(Exception):
    """A failure the user can fix; the message names the flag, file or action."""


def log(message: str) -> None:
    print(message, flush=True)


def interruptible(work: Callable[[], None]) -> None:
    """Run `work` in a worker thread while this one waits: Ctrl-C or SIGTERM raise here at once, where inside the
    Rust BPE trainer's merges they waited for it to finish (5-9 s of a 56 MB corpus at a 32,000-token vocabulary;
    minutes on a large one), and inside huggingface_hub's download pool for the files in flight (minutes of a large
    shard on a slow link, looking hung). The abandoned thread ends with the process."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the waiting thread
            failure.append(exc)

    worker = threading.Thread(target=run, name="tool-work", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if failure:
        raise failure[0]
