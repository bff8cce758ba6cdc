"""Finding and planning the work: the input files under --data_folder (hidden ones skipped, link loops cut), the
text files a record format does not read, and the tasks the workers run: small files grouped, large text and JSON
Lines files cut into pieces, large JSON and YAML files streamed. Options are what every task is read with."""

from __future__ import annotations

import os
import stat
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from fsdp_lib.convert.extraction import RECORD_FORMATS, Extraction
from fsdp_lib.convert.reading import file_kind, unicode_file
from fsdp_lib.convert.results import Problem
from fsdp_lib.markers import SPLITS_MANIFEST, copied_from, folder_kind, unfinished_splits

# Small files are grouped into tasks of about this much input so that per-task overhead stays negligible.
TASK_BYTES = 2 << 20
TASK_FILES = 256
# Endings of compressed files: data_hf.py reads text, so these are named (".jsonl.gz") and the fix is to decompress.
COMPRESSED_ENDINGS = frozenset({".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip", ".7z", ".tar", ".tgz"})
# Endings of files that are no text however they are read: the fix is to convert them first.
NOT_TEXT_ENDINGS = frozenset({".parquet", ".arrow", ".pdf", ".docx"})


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


class InputScan(NamedTuple):
    files: list[tuple[Path, int]]  # (path, size), sorted by path
    problems: list[Problem]  # folders and files that cannot be read, folders a tool wrote
    other_endings: dict[str, int]  # files not read because --extensions does not list their ending, by ending


def file_ending(name: str) -> str:
    """A file name's ending as the run counts it: ".jsonl.gz" for a compressed file, else the last one (".csv"), or
    "" for a name without one (Spark's part-00000)."""
    suffixes = [suffix.lower() for suffix in Path(name).suffixes]
    if len(suffixes) > 1 and suffixes[-1] in COMPRESSED_ENDINGS:
        return "".join(suffixes[-2:])
    return suffixes[-1] if suffixes else ""


def is_compressed(ending: str) -> bool:
    """Whether a file ending (".jsonl.gz", ".zst") is that of a compressed file."""
    return Path(f"x{ending}").suffix.lower() in COMPRESSED_ENDINGS


def ending_fix(ending: str) -> str:
    """What to do about files of an ending --extensions does not list."""
    if is_compressed(ending):
        return "decompress them first (gunzip -k, unzstd, ...)"
    if ending in NOT_TEXT_ENDINGS:
        return "convert them to .jsonl or text first (they are no text)"
    if not ending:
        return "give them an ending such as .txt"
    return "pass --extensions to read them as text"


def has_ending(name: str, extensions: Iterable[str]) -> bool:
    """Whether a file name ends in one of `extensions` (case-insensitive; ".jsonl" and a two-part ".tar.txt" alike)."""
    return name.lower().endswith(tuple(extensions))


def find_input_files(root: Path, extensions: Iterable[str], exclude: Iterable[Path] = ()) -> InputScan:
    """Every file under `root` whose name ends in one of `extensions`, sorted by path, the problems met, and how
    many other files there were by ending (so a folder of .jsonl.gz files is not silently an empty run).

    Hidden files and folders (name starting with ".") are skipped; symlinks are followed, but each folder is
    entered once, so link loops end. Folders in `exclude` (the output) are never entered, and folders a tool wrote
    (a dataset, an experiment, a model) are skipped with a not_raw_data problem.
    """
    wanted = tuple(extensions)
    if root.is_file():
        return InputScan([(root, root.stat().st_size)], [], {})
    problems: list[Problem] = []
    excluded = {(s.st_dev, s.st_ino) for s in (_stat_or_none(p) for p in exclude) if s is not None}
    visited: set[tuple[int, int]] = set()
    found: list[tuple[Path, int]] = []
    other: Counter[str] = Counter()

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
                if (problem := _tool_output(Path(folder, name)) or _copy_of(Path(folder, name), root)) is None:
                    keep.append(name)
                else:
                    problems.append(problem)
        subfolders[:] = keep
        for name in names:
            if name.startswith("."):
                continue
            if not has_ending(name, wanted):
                other[file_ending(name)] += 1
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
    by_count = sorted(other.items(), key=lambda item: (-item[1], item[0] or "~"))  # no ending last among equals
    return InputScan(found, problems, dict(by_count))


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


def _copy_of(folder: Path, root: Path) -> Problem | None:
    """Split folders holding copies of files that `root` also holds (organize_data.py --src-dir raw --dst-root
    splits, then data_hf.py on the folder above both): read once, from the source, not twice."""
    if (source := copied_from(folder, root)) is None:
        return None
    detail = (
        f"split folders of organize_data.py copying {source}, which --data_folder also holds; read once, from there"
    )
    return Problem(str(folder), "not_raw_data", detail)


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
