"""One writer per folder: a lock file taken atomically (hard link, also on NFS), refreshed while its holder lives, and
taken over with a message when the holder is gone. fsdp_train.py's outputs/EXP/run.lock (one run per experiment),
organize_data.py's --dst-root, model_download.py --init's --local-dir."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from fsdp_lib.errors import ExperimentLockedError
from fsdp_lib.markers import EXPERIMENT_LOCK
from fsdp_lib.processes import process_alive, process_start_ticks

LOCK_FILE = EXPERIMENT_LOCK


LOCK_REFRESH_S = 30.0  # the holder touches its lock file this often...


LOCK_STALE_S = 600.0  # ...so a lock from another host that nobody touched for this long belongs to a dead run


class FolderLock:
    """One writer per folder: `FOLDER/NAME` names the holder (host, pid, start time).

    It is created complete under a private name and hard-linked into place: link() fails if the lock exists,
    atomically, also on NFS and the parallel filesystems of a cluster. A lock whose holder is gone is taken over
    with a message: on this host when the process no longer exists, from another host when the holder stopped
    refreshing it for LOCK_STALE_S. `what` names the folder in messages (by its flag), `instead` the way out."""

    def __init__(self, folder: Path, name: str, what: str, instead: str, error: type[Exception] = RuntimeError):
        self.path = folder / name
        self.what, self.instead, self.error = what, instead, error
        self.record: dict | None = None
        self._stop_refresh = threading.Event()

    def _announce(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def _read(self, path: Path | None = None) -> dict | None:
        try:
            holder = json.loads((path or self.path).read_text())
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None

    def _alive(self, holder: dict) -> bool:
        if holder.get("host") == socket.gethostname():
            return process_alive(holder["pid"], holder.get("process_start"))
        with contextlib.suppress(OSError):
            return time.time() - self.path.stat().st_mtime < LOCK_STALE_S
        return False

    def _held_message(self, holder: dict) -> str:
        return (
            f"{self.what} is in use by another run: host {holder.get('host')}, pid {holder['pid']}, started "
            f"{holder.get('started_at')} (lock file {self.path}). Wait for that run to finish or stop it, or "
            f"{self.instead}. If that process is really gone (e.g. its node died), delete {self.path}."
        )

    def check_free(self) -> None:
        holder = self._read()
        if holder is not None and self._alive(holder):
            raise self.error(self._held_message(holder))

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "process_start": process_start_ticks(os.getpid()),
            "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
        }
        for _ in range(3):
            try:
                self._link(self.record)
                break
            except FileExistsError:
                self._take_over_if_stale()
        else:
            raise self.error(f"could not take {self.path}: other launches keep racing for it")
        threading.Thread(target=self._refresh, name="experiment-lock", daemon=True).start()

    def _link(self, record: dict) -> None:
        """`record` put in place whole (written under a private name, hard-linked): FileExistsError if a lock is
        there."""
        mine = self.path.with_name(f".{self.path.name}.{socket.gethostname()}.{os.getpid()}")
        try:
            mine.write_text(json.dumps(record))
            os.link(mine, self.path)
        finally:
            mine.unlink(missing_ok=True)

    def _take_over_if_stale(self) -> None:
        holder = self._read()
        if holder is not None and self._alive(holder):
            raise self.error(self._held_message(holder))
        stale = self.path.with_name(f".{self.path.name}.stale.{socket.gethostname()}.{os.getpid()}")
        try:
            os.rename(self.path, stale)
        except FileNotFoundError:
            return  # another launch removed it first; try again
        if self._read(stale) != holder:  # a live run took the lock between our read and the rename: give it back
            with contextlib.suppress(FileExistsError):
                os.link(stale, self.path)
        else:
            what = (
                f"host {holder.get('host')}, pid {holder['pid']}, started {holder.get('started_at')}"
                if holder
                else "unreadable"
            )
            self._announce(f"taking over the lock of a run that is gone ({what}): {self.path}")
        stale.unlink(missing_ok=True)

    def _refresh(self) -> None:
        """Touch the lock while the holder lives. A lock deleted by hand is put back; one that now names another
        run (a user deleted it, and a second launch took it) ends this one: two writers would interleave their
        files (checkpoints, metrics), and the other one started from what is on disk."""
        while not self._stop_refresh.wait(LOCK_REFRESH_S):
            holder, record = self._read(), self.record
            if record is None or self._stop_refresh.is_set():  # released meanwhile
                return
            if holder is None and not os.path.lexists(self.path):
                with contextlib.suppress(OSError):  # FileExistsError: another run took it first (next round)
                    self._link(record)
                    self._announce(f"WARNING: {self.path} was deleted while this run holds it; put back")
            elif holder is not None and holder != record:
                self._lost(holder)
                return
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def _lost(self, holder: dict) -> None:
        self._announce(
            f"ERROR: {self.path} now names another run (host {holder.get('host')}, pid {holder['pid']}, started "
            f"{holder.get('started_at')}): its lock was deleted while this run held it. Two runs must not write "
            f"{self.path.parent} at once, so this one stops now, writing nothing more; the other goes on"
        )
        os._exit(1)

    @contextlib.contextmanager
    def held(self, unless_read_only: bool = False) -> Iterator[None]:
        """The lock for a `with` block; the folders that taking it created are removed again when they are still
        empty at the end (a refused run leaves no empty folder behind). unless_read_only: where the lock cannot be
        written (a read-only mount, another user's folder), the block runs without it once no live holder is seen,
        for a run that then writes nothing there (a rerun of a finished split)."""
        folder = self.path.parent
        created = [f for f in (folder, *folder.parents) if not f.exists()]  # deepest first
        try:
            self.acquire()
        except OSError:
            if not unless_read_only or not folder.is_dir():
                raise
            self.check_free()
            yield
            return
        try:
            yield
        finally:
            self.release()
            for empty in created:
                with contextlib.suppress(OSError):
                    empty.rmdir()  # only an empty one

    def release(self) -> None:
        self._stop_refresh.set()
        if self.record is not None and self._read() == self.record:
            self.path.unlink(missing_ok=True)
        self.record = None


class ExperimentLock(FolderLock):
    """fsdp_train.py's one run per experiment: outputs/EXP/run.lock, held by global rank 0 for the whole run and
    removed on exit."""

    def __init__(self, experiment_dir: Path):
        what = f"experiment {experiment_dir}"
        super().__init__(experiment_dir, LOCK_FILE, what, "use another --experiment-name", ExperimentLockedError)

    def _announce(self, message: str) -> None:
        from fsdp_lib.runtime import log  # the trainer's log line; the lock itself loads no torch

        log(message)
