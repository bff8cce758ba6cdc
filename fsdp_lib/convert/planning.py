"""Finding and planning the work: the input files under --data_folder (hidden ones skipped, link loops cut), the
text files a record format does not read, and the tasks the workers run: small files grouped, large text and JSON
Lines files cut into pieces, large JSON and YAML files streamed. Options are what every task is read with."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fsdp_lib.convert.extraction import RECORD_FORMATS, Extraction
from fsdp_lib.convert.reading import file_kind, unicode_file
from fsdp_lib.convert.results import Problem
from fsdp_lib.markers import SPLITS_MANIFEST, folder_kind, unfinished_splits

# Small files are grouped into tasks of about this much input so that per-task overhead stays negligible.
TASK_BYTES = 2 << 20
TASK_FILES = 256


@dataclass(frozen=True)
class Piece:
    """One file, or one byte range of a large text/JSON Lines file (end None: to the end of the file)."""

    path: str
    size: int
    start: int = 0
    end: int | None = None
    index: int = 0
    count: int = 1


@dataclass(frozen=True)
class Task:
    """Pieces read together by one worker. A streamed task (one large JSON/YAML file, or a UTF-16/32 one) runs in
    the parent so its
    rows are written as they are parsed instead of being collected in a worker."""

    pieces: tuple[Piece, ...]
    streamed: bool = False


@dataclass(frozen=True)
class Options:
    """What every task is read with: the run's flags."""

    max_chars: int
    min_chars: int
    val_fraction: float
    data_format: str = "text"  # --format
    json_mode: str = "strings"  # --json-mode

    @property
    def extraction(self) -> Extraction:
        """What a parsed value gives under these flags."""
        return Extraction(self.data_format, self.json_mode, self.max_chars)


def normalize_extensions(values: Iterable[str]) -> tuple[str, ...]:
    """ ".txt", "txt", "txt,md" -> lower-case suffixes with a dot, duplicates dropped, order kept."""
    found: dict[str, None] = {}
    for value in values:
        for part in value.split(","):
            part = part.strip().lower()
            if part:
                found["." + part.lstrip(".")] = None
    return tuple(found)


def find_input_files(
    root: Path, extensions: Iterable[str], exclude: Iterable[Path] = ()
) -> tuple[list[tuple[Path, int]], list[Problem]]:
    """(path, size) of every file under `root` with one of `extensions`, sorted by path, and the problems met.

    Hidden files and folders (name starting with ".") are skipped; symlinks are followed, but each folder is
    entered once, so link loops end. Folders in `exclude` (the output) are never entered, and folders a tool wrote
    (a dataset, an experiment, a model) are skipped with a not_raw_data problem.
    """
    wanted = set(extensions)
    if root.is_file():
        return [(root, root.stat().st_size)], []
    problems: list[Problem] = []
    excluded = {(s.st_dev, s.st_ino) for s in (_stat_or_none(p) for p in exclude) if s is not None}
    visited: set[tuple[int, int]] = set()
    found: list[tuple[Path, int]] = []

    def on_error(err: OSError) -> None:
        problems.append(Problem(str(err.filename), "read_error", f"folder not readable: {err.strerror}"))

    for folder, subfolders, names in os.walk(root, followlinks=True, onerror=on_error):
        identity = _stat_or_none(Path(folder))
        if identity is None or (identity.st_dev, identity.st_ino) in visited:
            subfolders[:] = []  # a link loop, or a folder already reached through another link
            continue
        visited.add((identity.st_dev, identity.st_ino))
        keep = []
        for name in sorted(subfolders):
            sub = _stat_or_none(Path(folder, name))
            if not name.startswith(".") and (sub is None or (sub.st_dev, sub.st_ino) not in excluded):
                if (problem := _tool_output(Path(folder, name))) is None:
                    keep.append(name)
                else:
                    problems.append(problem)
        subfolders[:] = keep
        for name in names:
            if name.startswith(".") or Path(name).suffix.lower() not in wanted:
                continue
            path = Path(folder, name)
            try:
                info = path.stat()
            except OSError as err:
                problems.append(Problem(str(path), "read_error", f"{err.strerror} (a broken link?)"))
                continue
            if not stat.S_ISREG(info.st_mode):
                problems.append(Problem(str(path), "read_error", "not a regular file"))
                continue
            found.append((path, info.st_size))
    found.sort(key=lambda item: item[0].relative_to(root).parts)
    return found, problems


def _tool_output(folder: Path) -> Problem | None:
    """A folder a tool wrote (a dataset, an experiment, a model, the token cache), never read as raw data: its
    metadata, tokenizer and state files would become text rows. Split folders are raw files and are read."""
    kind = folder_kind(folder)
    if kind is not None and kind.kind == "split folders" and unfinished_splits(folder) == folder / SPLITS_MANIFEST:
        detail = f"{kind.describe(folder)} that it has not finished; not read: rerun organize_data.py to finish them"
        return Problem(str(folder), "not_raw_data", detail)
    if kind is None or kind.kind == "split folders":
        return None
    return Problem(str(folder), "not_raw_data", f"{kind.describe(folder)}; not read as raw files")


def _stat_or_none(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


def plan_tasks(files: Iterable[tuple[Path, int]], piece_bytes: int) -> list[Task]:
    """Group small files into tasks of about TASK_BYTES, cut large text and JSON Lines files into pieces of
    `piece_bytes`, and stream large JSON and YAML files. File order is kept, so the output order is too."""
    tasks: list[Task] = []
    group: list[Piece] = []
    group_bytes = 0
    for path, size in files:
        if size <= piece_bytes:
            group.append(Piece(str(path), size))
            group_bytes += size
            if group_bytes >= TASK_BYTES or len(group) >= TASK_FILES:
                tasks.append(Task(tuple(group)))
                group, group_bytes = [], 0
            continue
        if group:
            tasks.append(Task(tuple(group)))
            group, group_bytes = [], 0
        if file_kind(path) in ("json", "yaml") or unicode_file(path):  # UTF-16/32: decoded as a stream, not cut
            tasks.append(Task((Piece(str(path), size),), streamed=True))
            continue
        count = -(-size // piece_bytes)
        for index in range(count):
            end = None if index == count - 1 else (index + 1) * piece_bytes
            tasks.append(Task((Piece(str(path), size, index * piece_bytes, end, index, count),)))
    if group:
        tasks.append(Task(tuple(group)))
    return tasks


def record_inputs(files: list[tuple[Path, int]], data_format: str) -> tuple[list[tuple[Path, int]], list[Problem]]:
    """With --format chat, preference or prompts, text files are not read (they cannot hold such records): each is
    a skipped file."""
    if data_format not in RECORD_FORMATS:
        return files, []
    what = {"chat": "conversations", "preference": "preference pairs", "prompts": "prompts"}[data_format]
    skipped = [
        Problem(str(path), f"text_file_in_{data_format}_run", f"{what} are read from .json/.jsonl/.ndjson/.yaml/.yml "
                "files only; convert text files with --format text")
        for path, _ in files if file_kind(path) == "text"
    ]  # fmt: skip
    return [(path, size) for path, size in files if file_kind(path) != "text"], skipped
