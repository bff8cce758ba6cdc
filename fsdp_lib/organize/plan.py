"""The plan of a balanced split: which source files exist (hidden files and symlinked folders skipped), which split folder each goes to (greedy by count or bytes, deterministic), the manifest that records it, and the texts that describe a plan, a mismatch with an earlier run, and a finished run. Pure logic and one directory walk; no torch."""

from __future__ import annotations

import heapq
import os
import re
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from fsdp_lib.errors import name_sample
from fsdp_lib.markers import SPLITS_MANIFEST, copied_from, folder_kind

DEFAULT_EXTENSIONS = (".txt", ".md", ".json", ".jsonl", ".yaml", ".yml")


BALANCES = ("count", "bytes")


MODES = ("copy", "link", "symlink", "move")


# Hidden, so that data tools crawling dst_root (which skip hidden files) never read it as training text.
MANIFEST_NAME = SPLITS_MANIFEST
MAX_SPLITS = 10_000  # a bound checked before any work: a typo of 1e9 folders would plan for hours


MANIFEST_FORMAT = 1


# Files are written under a hidden temporary name and renamed into place: a killed run never leaves a
# truncated file under the real name, which a rerun would otherwise take as done.
TMP_SUFFIX = ".organize-tmp"
# In --dst-root while a run writes there (lock.FolderLock; its temporaries are ..organize.lock.*).
LOCK_NAME = ".organize.lock"


SPLIT_DIR_PATTERN = re.compile(r"split_\d+")


EXIT_IO_ERROR = 1  # a file operation failed part-way; rerunning the same command resumes


EXIT_REFUSED = 2  # bad flags or a destination we will not touch; nothing was written


FLAG_NAMES = {
    "src_dir": "--src-dir",
    "num_dirs": "--num-dirs",
    "balance": "--balance",
    "mode": "--mode",
    "extensions": "--extensions",
}


class OrganizeError(Exception):
    """A problem the user has to fix; the message names the flag or file and the fix."""

    def __init__(self, message: str, exit_code: int = EXIT_REFUSED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class SourceFile:
    rel_path: str  # POSIX path relative to --src-dir; also the file's path inside its split folder
    num_bytes: int


@dataclass(frozen=True)
class Settings:
    """Everything that decides the split; a rerun with different settings is a different plan."""

    src_dir: str  # absolute, resolved
    num_dirs: int
    balance: str
    mode: str
    extensions: list[str]


@dataclass
class SourceScan:
    files: list[SourceFile]
    skipped: list[str]  # symlinked folders and broken links, reported to the user rather than dropped silently


def parse_extensions(values: Sequence[str]) -> list[str]:
    """Accept "txt,md", ".txt .md" or several arguments; return sorted lowercase ".ext" entries."""
    extensions = set()
    for value in values:
        for item in re.split(r"[,\s]+", value.strip()):
            if any(c in item for c in "*?[]/"):  # a shell pattern or a path: it would match no file name ending
                raise OrganizeError(
                    f"--extensions {item!r} is not a file ending (no wildcards or paths); use e.g. --extensions txt,md"
                )
            if item and item != ".":
                extensions.add("." + item.lower().lstrip("."))
    if not extensions:
        raise OrganizeError(f"--extensions {' '.join(values)!r} names no extension; use e.g. --extensions txt,md,json")
    return sorted(extensions)


def split_names(num_dirs: int) -> list[str]:
    """split_00 ... split_19; the zero padding widens past 100 folders so names still sort in order."""
    width = max(2, len(str(num_dirs - 1)))
    return [f"split_{index:0{width}d}" for index in range(num_dirs)]


def plan_split(files: Sequence[SourceFile], num_dirs: int, balance: str) -> list[list[SourceFile]]:
    """Assign every file to exactly one of num_dirs splits; each split's files are sorted by path.

    Largest file first onto the currently lightest split (the LPT greedy rule): with balance="bytes",
    "lightest" is the fewest bytes, which bounds the heaviest split by mean + largest file. With
    balance="count" it is the fewest files (ties to fewest bytes), so counts differ by at most one and
    the bytes come out roughly even as well.
    """
    if num_dirs < 1:
        raise ValueError(f"num_dirs must be >= 1, got {num_dirs}")
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    counts = [0] * num_dirs
    loads = [0] * num_dirs
    splits: list[list[SourceFile]] = [[] for _ in range(num_dirs)]
    heap = [(0, 0, index) for index in range(num_dirs)]  # (primary, secondary, split index), smallest first
    for source in sorted(files, key=lambda f: (-f.num_bytes, f.rel_path)):
        _, _, index = heapq.heappop(heap)
        splits[index].append(source)
        counts[index] += 1
        loads[index] += source.num_bytes
        key = (counts[index], loads[index]) if balance == "count" else (loads[index], counts[index])
        heapq.heappush(heap, (*key, index))
    return [sorted(split, key=lambda f: f.rel_path) for split in splits]


def build_manifest(settings: Settings, plan: Sequence[Sequence[SourceFile]], complete: bool) -> dict:
    """The JSON record of a split: settings, per-split totals and destination -> source for every file."""
    names = split_names(len(plan))
    files = {}
    for name, split in zip(names, plan, strict=True):
        for source in split:
            files[f"{name}/{source.rel_path}"] = {"source": source.rel_path, "bytes": source.num_bytes}
    return {
        "format": MANIFEST_FORMAT,
        "written_by": "organize_data.py",
        "complete": complete,
        "settings": asdict(settings),
        "total": {"files": len(files), "bytes": sum(f.num_bytes for split in plan for f in split)},
        "splits": {
            name: {"files": len(split), "bytes": sum(f.num_bytes for f in split)}
            for name, split in zip(names, plan, strict=True)
        },
        "files": files,
    }


def flag_value(value: object) -> str:
    """A setting as it is typed on the command line (--extensions .txt .md, not a list; a path with a space quoted)."""
    return " ".join(shlex.quote(str(v)) for v in (value if isinstance(value, list) else [value]))


def settings_flags(settings: dict) -> str:
    """The flags that make a split with these (a manifest's) settings, for a message to quote."""
    return " ".join(f"{flag} {flag_value(settings[key])}" for key, flag in FLAG_NAMES.items() if key in settings)


def describe_mismatch(earlier: dict, planned: dict) -> list[str]:
    """Why an earlier manifest is not the plan of this run; empty when it is the same plan."""
    if earlier.get("format") != planned["format"]:
        return [f"its manifest format is {earlier.get('format')!r}, this version writes {planned['format']}"]
    problems = []
    for key, flag in FLAG_NAMES.items():
        before, now = earlier["settings"].get(key), planned["settings"][key]
        if before != now:
            problems.append(f"it used {flag} {flag_value(before)} (this run: {flag_value(now)})")
    sources_before = {entry["source"]: entry["bytes"] for entry in earlier["files"].values()}
    sources_now = {entry["source"]: entry["bytes"] for entry in planned["files"].values()}
    added = sorted(set(sources_now) - set(sources_before))
    removed = sorted(set(sources_before) - set(sources_now))
    resized = sorted(s for s in set(sources_now) & set(sources_before) if sources_now[s] != sources_before[s])
    for label, items in (("added to", added), ("gone from", removed), ("changed size in", resized)):
        if items:
            problems.append(f"{len(items)} file(s) {label} --src-dir since: {name_sample(items, 3)}")
    if not problems and earlier["files"] != planned["files"]:
        problems.append("its files are assigned to different split folders")
    return problems


def overlap_problem(src_dir: Path, dst_root: Path) -> str | None:
    """src and dst must be disjoint: a split inside the source would be read back as source data next run."""
    if src_dir == dst_root:
        return f"--dst-root {dst_root} is the same folder as --src-dir; choose a separate --dst-root"
    if src_dir in dst_root.parents:
        return (
            f"--dst-root {dst_root} is inside --src-dir {src_dir}, so the next run would read the split "
            "back as source data; choose a --dst-root outside --src-dir"
        )
    if dst_root in src_dir.parents:
        return f"--src-dir {src_dir} is inside --dst-root {dst_root}; choose a --dst-root that does not contain it"
    return None


def format_bytes(num_bytes: int) -> str:
    size, unit = float(num_bytes), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{num_bytes} B" if unit == "B" else f"{size:.1f} {unit}"


def format_plan(manifest: dict, dst_root: Path) -> str:
    settings = manifest["settings"]
    lines = [
        f"plan: {manifest['total']['files']:,} files ({format_bytes(manifest['total']['bytes'])}) from "
        f"{settings['src_dir']} -> {dst_root}, {settings['num_dirs']} splits, "
        f"--balance {settings['balance']}, --mode {settings['mode']}"
    ]
    for name, totals in manifest["splits"].items():
        lines.append(f"  {name}  {totals['files']:>9,} files  {format_bytes(totals['bytes']):>11}")
    return "\n".join(lines)


def format_summary(manifest: dict, dst_root: Path, placed: int, elapsed_s: float) -> str:
    per_split = manifest["splits"].values()
    counts = [s["files"] for s in per_split]
    loads = [s["bytes"] for s in per_split]
    total = manifest["total"]
    return (
        f"organize_data.py: {total['files']:,} files, {format_bytes(total['bytes'])} -> {len(counts)} splits in "
        f"{dst_root} (per split {min(counts):,}-{max(counts):,} files, "
        f"{format_bytes(min(loads))}-{format_bytes(max(loads))}); mode {manifest['settings']['mode']}; "
        f"{placed:,} placed, {total['files'] - placed:,} already in place; {elapsed_s:.1f} s"
    )


def find_source_files(src_dir: Path, extensions: Sequence[str]) -> SourceScan:
    """Every non-hidden file under src_dir whose name ends in one of extensions (case-insensitive), by path.

    Symlinked folders are not followed: one can point back up the tree (an endless loop) or at a folder
    already scanned (every file twice). Symlinked files are data like any other and are kept. Folders a tool wrote
    (a model, a dataset, an experiment) are skipped and reported: spread over the splits, their metadata files would
    no longer be known for what they are, and data_hf.py would convert them into text.
    """
    suffixes = tuple(ext.lower() for ext in extensions)
    files, skipped = [], []
    pending = [""]  # folders still to read, relative to src_dir; a stack, so deep trees cannot hit the recursion limit
    while pending:
        rel_dir = pending.pop()
        folder = src_dir / rel_dir
        try:
            with os.scandir(folder) as listing:
                entries = sorted(listing, key=lambda entry: entry.name)
        except OSError as exc:
            raise OrganizeError(
                f"cannot read folder {folder} under --src-dir: {exc.strerror}; fix its permissions or move it out",
                EXIT_IO_ERROR,
            ) from exc
        for entry in entries:
            if entry.name.startswith("."):
                continue
            rel_path = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if entry.is_dir(follow_symlinks=False):
                kind, source = folder_kind(Path(entry.path)), copied_from(Path(entry.path), src_dir)
                if source is not None:
                    skipped.append(f"{rel_path}/ (split folders copying {source}, also under --src-dir: not twice)")
                elif kind is None or kind.kind == "split folders":
                    pending.append(rel_path)
                else:  # its files spread over splits would no longer be known as its own, and become text rows
                    skipped.append(f"{rel_path}/ ({kind.what}, {kind.evidence}: a tool's output, not raw files)")
            elif entry.is_symlink() and entry.is_dir():
                skipped.append(f"{rel_path}/ (symlinked folder, not followed)")
            elif not entry.name.lower().endswith(suffixes):
                continue
            elif entry.is_file():
                files.append(SourceFile(rel_path, entry.stat().st_size))
            elif entry.is_symlink() and not os.path.exists(entry.path):
                skipped.append(f"{rel_path} (broken symlink)")
            else:  # a named pipe, socket or device: reading one could block forever
                skipped.append(f"{rel_path} (not a regular file)")
    files.sort(key=lambda f: f.rel_path)
    return SourceScan(files, skipped)
