"""Files that must be what was written: their size and CRC-32 are recorded when they are written and checked before
they are used (training checkpoints, the token cache); and written files given the mode the user's umask asks for
(safetensors' save_file makes them 0600). No torch: a file-level concern."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import socket
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from fsdp_lib.processes import process_alive


def umask_mode(*paths: Path) -> None:
    """Give files the mode a plain open() would have (0666 less the umask): safetensors' save_file, and with it
    save_pretrained, creates weight files 0600, which another account (a serving one, a colleague) cannot read."""
    umask = _umask()
    for path in paths:
        os.chmod(path, 0o666 & ~umask)


def _umask() -> int:
    """The process's umask, read where Linux shows it (/proc/self/status): setting it to learn it would, for a
    moment, give any file another thread creates (an async checkpoint's) the mode 0666."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    umask = os.umask(0o022)  # no /proc (macOS): the brief set and restore
    os.umask(umask)
    return umask


def file_checksum(path: Path) -> dict:
    """Size and CRC-32 of a file. CRC-32 runs at several GB/s (zlib, without the GIL) and the file is mapped,
    not copied: recorded right after writing, while the file is in the page cache, it is a small part of a save
    (bench_checkpoint.py reports the share)."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:  # an empty file cannot be mapped
            return {"bytes": 0, "crc32": f"{zlib.crc32(b''):08x}"}
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return {"bytes": size, "crc32": f"{zlib.crc32(data):08x}"}


def checksum_problems(folder: Path, names: list[str], recorded: dict) -> list[str]:
    """What is wrong with these files of a folder against their recorded checksums, one line per damaged file."""
    problems = []
    for name in names:
        try:
            actual = file_checksum(folder / name)
        except OSError as exc:
            problems.append(f"{folder / name}: unreadable ({exc.strerror or exc})")
            continue
        expected = recorded[name]
        if actual["bytes"] != expected["bytes"]:
            problems.append(f"{folder / name}: {actual['bytes']} bytes, {expected['bytes']} were written")
        elif actual["crc32"] != expected["crc32"]:
            problems.append(
                f"{folder / name}: checksum mismatch (crc32 {actual['crc32']}, {expected['crc32']} written)"
            )
    return problems


def staged(path: Path) -> Path:
    """The temporary name a file is written under before it is renamed into place: unique per host and process,
    so two nodes writing the same cache on a shared file system (with equal pids in containers) never collide."""
    return path.with_name(f"{path.name}.tmp{os.getpid()}.{socket.gethostname()}")


@contextlib.contextmanager
def staged_writes(final: dict[str, Path]) -> Iterator[tuple[dict[str, BinaryIO], dict[str, Path]]]:
    """Binary files opened under their staged names, as (handles, staged paths) by the keys of `final`; flushed and
    fsynced when the block ends without an error, closed either way. Publish them with commit_files."""
    tmp = {k: staged(path) for k, path in final.items()}
    handles = {k: open(tmp[k], "wb") for k in final}
    written = False
    try:
        yield handles, tmp
        for fh in handles.values():
            fh.flush()
            os.fsync(fh.fileno())
        written = True
    finally:
        for fh in handles.values():
            fh.close()
        if not written:  # an error or Ctrl-C: the partial files are of no use to anyone (and as large as the data)
            for path in tmp.values():
                path.unlink(missing_ok=True)


def remove_stale_staged(folder: Path) -> list[str]:
    """Delete the files in `folder` written under staged names by processes of this host that no longer run (a
    tokenisation killed with -9: partial streams as large as the corpus). Returns their names."""
    pattern = re.compile(rf".+\.tmp(\d+)\.{re.escape(socket.gethostname())}")
    removed = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if (match := pattern.fullmatch(path.name)) and not process_alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed


def commit_files(files: dict[Path, Path], sums_path: Path) -> None:
    """Publish files written under temporary names: record each one's checksum under its final name in sums_path
    (written atomically), then rename them in the given order, so the last one's presence means every file and
    the checksums are complete. files: {temporary path: final path}, all in sums_path's folder."""
    sums = {final.name: file_checksum(tmp) for tmp, final in files.items()}
    tmp_sums = staged(sums_path)
    with open(tmp_sums, "w") as fh:
        json.dump(sums, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp_sums, sums_path)
    for tmp, final in files.items():
        os.replace(tmp, final)


def recorded_problems(sums_path: Path) -> list[str]:
    """What is wrong with the files sums_path records (commit_files); a missing or unreadable record is a problem
    too (files written before checksums were recorded, or a write cut short)."""
    try:
        recorded = json.loads(sums_path.read_text())
    except FileNotFoundError:
        return [f"{sums_path}: missing (no checksums were recorded)"]
    except (OSError, ValueError) as exc:
        return [f"{sums_path}: unreadable ({exc})"]
    return checksum_problems(sums_path.parent, sorted(recorded), recorded)
