"""The errors a user can fix. main() reports each as one message (no traceback) and exits non-zero:
ConfigError 2, the others 1. Also what a failed read or write says: the OS error in words, with the path, and a
sample of the names a message lists."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

# Below this much free space after a failed write, a full disk is the likely cause (the larger of the two).
LOW_DISK_BYTES, LOW_DISK_FRACTION = 256 * 2**20, 0.01


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


def broken_link(path: Path) -> str | None:
    """How a path leads nowhere through a symbolic link, itself or one of the folders above it ("is a symbolic link
    to X, which does not exist", "is under L, a symbolic link that leads back to itself"), or None when no link on
    its way is broken (a path that simply does not exist yet is None)."""
    for link in (path, *path.parents):
        if not link.is_symlink() or link.exists():
            continue
        where = "is" if link == path else f"is under {link},"
        try:
            link.resolve(strict=True)
        except FileNotFoundError:
            return f"{where} a symbolic link to {os.readlink(link)}, which does not exist"
        except (RuntimeError, OSError):  # a loop: RuntimeError up to Python 3.12, OSError (ELOOP) from 3.13
            pass
        return f"{where} a symbolic link that leads back to itself (a loop through {os.readlink(link)})"
    return None


def unreadable(path: Path) -> str | None:
    """Why `path` cannot be read, as the OS says it with the path ("Permission denied: /data/raw"), or None when it
    can: a folder must list, a regular file must open. A path that does not exist (or is a pipe or a device) is None:
    callers say that themselves."""
    try:
        if path.is_dir():
            with os.scandir(path):
                pass
        elif path.is_file():  # a regular file only: opening a named pipe would wait for a writer
            with open(path, "rb"):
                pass
    except OSError as exc:
        return f"{exc.strerror}: {exc.filename or path}"
    return None


def file_above(path: Path) -> Path | None:
    """The nearest existing ancestor of `path` when it is not a folder (nothing can be made under it: the write
    would fail with "Not a directory"), else None."""
    for parent in path.parents:
        if parent.exists():
            return parent if not parent.is_dir() else None
    return None


def underlying_errors(error: BaseException) -> list[BaseException]:
    """The errors the ranks hit, from torch.distributed.checkpoint's CheckpointException (its `failures`, in rank
    order; its str() is every rank's traceback, not a message), else the error itself."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):
        found = [pair[0] for _, pair in sorted(failures.items()) if pair and isinstance(pair[0], BaseException)]
        if found:
            return found
    return [error]


def describe_error(error: BaseException) -> str:
    """An exception as "Type: message", one per distinct error the ranks hit (see underlying_errors)."""
    return "; ".join(dict.fromkeys(f"{type(e).__name__}: {e}" for e in underlying_errors(error)))


def _os_error_in_chain(error: BaseException) -> OSError | None:
    """The first OSError with an errno in the exception's chain (causes and contexts)."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno:
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def explain_write_error(error: BaseException, folder: Path) -> str:
    """A failed write in words: the OS error anywhere in the exception's chain (or in a rank's error that a
    checkpoint exception gathered) as its strerror and path ("No space left on device: /ckpt/x"); a library that
    lost the errno (torch's zip writer says "unexpected pos 704 vs 598") is explained by the free space of `folder`'s
    file system when it is nearly full."""
    for root in underlying_errors(error):
        if (os_error := _os_error_in_chain(root)) is not None:
            limit = " (a file-size limit: ulimit -f)" if os_error.errno == errno.EFBIG else ""
            return (
                f"{os.strerror(os_error.errno)}{limit}: {os_error.filename or folder} ({type(root).__name__}: {root})"
            )
    text = f"{describe_error(error)} (writing under {folder})"
    if "requested and" in text and "written" in text:  # numpy's tofile: a short write, its errno lost
        text += "; a short write: the disk is full, or a file-size limit is set (ulimit -f)"
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return text
    if usage.free < max(LOW_DISK_BYTES, LOW_DISK_FRACTION * usage.total):
        text += (
            f"; only {usage.free / 2**20:,.0f} MiB are free on the file system of {folder}: no space left on device?"
        )
    return text


def name_sample(names: list[str], limit: int = 5) -> str:
    """The first `limit` names, and how many more there are."""
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def not_utf8(exc: UnicodeDecodeError) -> str:
    """Where a file stops being UTF-8, in words: "not UTF-8 text (byte 18 is 0xe9)"."""
    return f"not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x})"
