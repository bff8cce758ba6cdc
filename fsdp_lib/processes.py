"""Whether a process still runs, by pid (and start time where /proc has it, so a reused pid is not taken for the
same process): the experiment lock's holder, the writer of a staged or temporary file. No torch."""

from __future__ import annotations

import os
from pathlib import Path


def process_start_ticks(pid: int) -> str | None:
    """When a process started (field 22 of /proc/PID/stat); None if it is gone or a zombie. A pid reused by
    an unrelated process has another start time."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def process_alive(pid: int, start_ticks: str | None = None) -> bool:
    """The process `pid` runs (and started at `start_ticks`, when given); someone else's process counts."""
    if Path("/proc/self/stat").is_file():
        ticks = process_start_ticks(pid)
        return ticks is not None and (start_ticks is None or ticks == start_ticks)
    try:  # no procfs (macOS): existence only
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
