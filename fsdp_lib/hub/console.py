"""How model_download.py's parts talk to the user: ToolError, a failure the user can fix (main prints it as one
`error:` line and exits 1), and log, one line on stdout flushed at once so that it keeps its place among
huggingface_hub's and transformers' own output."""

from __future__ import annotations


class ToolError(Exception):
    """A failure the user can fix; the message names the flag, file or action."""


def log(message: str) -> None:
    print(message, flush=True)
