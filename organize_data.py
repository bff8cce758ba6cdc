#!/usr/bin/env python3
"""Spread raw text-like files over N balanced split folders, so N workers can preprocess them in parallel.

    python organize_data.py --src_dir ./raw_text --dst_root ./splits --num_dirs 20
    python organize_data.py --src-dir ./raw_text --dst-root ./splits --num-dirs 8 --balance bytes --mode link
    python organize_data.py --src-dir ./raw_text --dst-root ./splits --dry-run

Every matching file under --src-dir (searched recursively; hidden files and folders are skipped and
symlinked folders are not followed) lands in exactly one of dst_root/split_00 ... split_NN under its
path relative to --src-dir, so same-named files from different folders never collide.
dst_root/.organize_manifest.json records destination -> source and the settings used: rerunning the same
command changes nothing (or finishes an interrupted run), and a different plan is refused unless --overwrite.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import heapq
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

DEFAULT_EXTENSIONS = (".txt", ".md", ".json", ".jsonl", ".yaml", ".yml")
BALANCES = ("count", "bytes")
MODES = ("copy", "link", "symlink", "move")
# Hidden, so that data tools crawling dst_root (which skip hidden files) never read it as training text.
MANIFEST_NAME = ".organize_manifest.json"
MANIFEST_FORMAT = 1
# Files are written under a hidden temporary name and renamed into place: a killed run never leaves a
# truncated file under the real name, which a rerun would otherwise take as done.
TMP_SUFFIX = ".organize-tmp"
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


@dataclass
class DestinationState:
    resuming: bool  # dst_root already holds this exact plan (maybe unfinished)
    to_delete: list[Path]  # earlier split folders (--overwrite), stray files in split folders, stale temp files


# --------------------------------------------------------------------------------------------------------
# Pure logic
# --------------------------------------------------------------------------------------------------------


def parse_extensions(values: Sequence[str]) -> list[str]:
    """Accept "txt,md", ".txt .md" or several arguments; return sorted lowercase ".ext" entries."""
    extensions = set()
    for value in values:
        for item in re.split(r"[,\s]+", value.strip()):
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


def _examples(items: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" (+{len(items) - limit} more)" if len(items) > limit else "")


def describe_mismatch(earlier: dict, planned: dict) -> list[str]:
    """Why an earlier manifest is not the plan of this run; empty when it is the same plan."""
    if earlier.get("format") != planned["format"]:
        return [f"its manifest format is {earlier.get('format')!r}, this version writes {planned['format']}"]
    problems = []
    for key, flag in FLAG_NAMES.items():
        before, now = earlier["settings"].get(key), planned["settings"][key]
        if before != now:
            problems.append(f"it used {flag} {before} (this run: {now})")
    sources_before = {entry["source"]: entry["bytes"] for entry in earlier["files"].values()}
    sources_now = {entry["source"]: entry["bytes"] for entry in planned["files"].values()}
    added = sorted(set(sources_now) - set(sources_before))
    removed = sorted(set(sources_before) - set(sources_now))
    resized = sorted(s for s in set(sources_now) & set(sources_before) if sources_now[s] != sources_before[s])
    for label, items in (("added to", added), ("gone from", removed), ("changed size in", resized)):
        if items:
            problems.append(f"{len(items)} file(s) {label} --src-dir since: {_examples(items)}")
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


# --------------------------------------------------------------------------------------------------------
# File system
# --------------------------------------------------------------------------------------------------------


def find_source_files(src_dir: Path, extensions: Sequence[str]) -> SourceScan:
    """Every non-hidden file under src_dir whose name ends in one of extensions (case-insensitive), by path.

    Symlinked folders are not followed: one can point back up the tree (an endless loop) or at a folder
    already scanned (every file twice). Symlinked files are data like any other and are kept.
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
                pending.append(rel_path)
            elif entry.is_symlink() and entry.is_dir():
                skipped.append(f"{rel_path}/ (symlinked folder, not followed)")
            elif not entry.name.lower().endswith(suffixes):
                continue
            elif entry.is_file():
                files.append(SourceFile(rel_path, entry.stat().st_size))
            elif entry.is_symlink():
                skipped.append(f"{rel_path} (broken symlink)")
    files.sort(key=lambda f: f.rel_path)
    return SourceScan(files, skipped)


def read_manifest(dst_root: Path) -> dict | None:
    path = dst_root / MANIFEST_NAME
    if not path.is_file():
        return None
    unreadable = (
        f"{path} is not a manifest this version of organize_data.py can read; if dst_root holds nothing you "
        "need, delete it, else choose another --dst-root"
    )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OrganizeError(f"{unreadable} ({exc})") from exc
    if not (
        isinstance(manifest, dict)
        and isinstance(manifest.get("settings"), dict)
        and isinstance(manifest.get("files"), dict)
        and all(isinstance(v, dict) and {"source", "bytes"} <= v.keys() for v in manifest["files"].values())
    ):
        raise OrganizeError(unreadable)
    return manifest


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())  # the manifest is what makes a rerun safe: it must not be lost in a crash
    os.replace(tmp, path)


def _is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TMP_SUFFIX)


def find_strays(dst_root: Path, manifest: dict) -> tuple[list[Path], list[Path]]:
    """Entries in split folders that the manifest does not list: (user-visible strays, our stale temp files).

    Stray files would be read as data by the next tool, so a resumed run must not leave them unnoticed.
    """
    planned_files = set(manifest["files"])
    strays, stale = [], []
    for name in sorted(os.listdir(dst_root)):
        if not SPLIT_DIR_PATTERN.fullmatch(name):
            continue  # anything else beside the splits was there before and is left alone
        if name not in manifest["splits"]:
            strays.append(dst_root / name)
            continue
        for root, dirnames, filenames in os.walk(dst_root / name):
            strays += [Path(root) / d for d in sorted(dirnames) if os.path.islink(os.path.join(root, d))]
            for filename in sorted(filenames):
                path = Path(root) / filename
                if _is_temp_name(filename):
                    stale.append(path)
                elif path.relative_to(dst_root).as_posix() not in planned_files:
                    strays.append(path)
    return strays, stale


def check_destination(dst_root: Path, earlier: dict | None, planned: dict, overwrite: bool) -> DestinationState:
    """Decide whether dst_root may receive this plan and what has to go first; raise OrganizeError if not."""
    if not dst_root.exists():
        return DestinationState(resuming=False, to_delete=[])
    if not dst_root.is_dir():
        raise OrganizeError(f"--dst-root {dst_root} is a file; choose a folder path for --dst-root")
    ours = {MANIFEST_NAME, MANIFEST_NAME + TMP_SUFFIX}
    entries = sorted(name for name in os.listdir(dst_root) if name not in ours)
    split_dirs = [name for name in entries if SPLIT_DIR_PATTERN.fullmatch(name)]
    if earlier is None:
        if not entries:
            return DestinationState(resuming=False, to_delete=[])
        if not overwrite:
            raise OrganizeError(
                f"--dst-root {dst_root} is not empty and has no {MANIFEST_NAME} from an earlier split "
                f"(it holds {_examples(entries)}); choose an empty or new --dst-root, or pass --overwrite to "
                "write the split beside those files (they are left untouched)"
            )
        if split_dirs:
            raise OrganizeError(
                f"--dst-root {dst_root} holds {_examples(split_dirs)} but no {MANIFEST_NAME}, so nothing records "
                "what they contain (they may be the only copies of moved files); --overwrite does not delete "
                "them: remove or rename them yourself, or choose another --dst-root"
            )
        return DestinationState(resuming=False, to_delete=[])
    problems = describe_mismatch(earlier, planned)
    if problems:
        if not overwrite:
            raise OrganizeError(
                f"--dst-root {dst_root} holds a different earlier split: {'; '.join(problems)}. Rerun with the "
                "earlier flags to keep it, pass --overwrite to replace it, or choose another --dst-root"
            )
        if earlier["settings"].get("mode") == "move":
            raise OrganizeError(
                f"--dst-root {dst_root} holds a split made with --mode move: its files are the only copies of "
                "the moved sources, so --overwrite will not delete them. Choose another --dst-root, or move the "
                f"files back first ({MANIFEST_NAME} maps every destination to its source path)"
            )
        return DestinationState(resuming=False, to_delete=[dst_root / name for name in split_dirs])
    strays, stale = find_strays(dst_root, planned)
    if strays and not overwrite:
        shown = [p.relative_to(dst_root).as_posix() for p in strays]
        raise OrganizeError(
            f"--dst-root {dst_root} holds {len(strays)} file(s) in its split folders that are not part of the "
            f"split in {MANIFEST_NAME}: {_examples(shown)}; the next tool would read them as data. Remove them, "
            "or pass --overwrite to delete them"
        )
    return DestinationState(resuming=True, to_delete=strays + stale)


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)  # never follows symlinks: link targets (e.g. --mode symlink sources) survive
    else:
        path.unlink()


def is_in_place(source: Path, dest: Path, mode: str) -> bool:
    """Whether an earlier run already finished this file (anything unfinished has no file at dest)."""
    if mode == "move":
        return not os.path.lexists(source) and os.path.lexists(dest)
    if mode == "symlink":
        return dest.is_symlink() and os.readlink(dest) == str(source)
    if dest.is_symlink() or not dest.is_file() or not source.exists():
        return False
    if mode == "link":
        return os.path.samefile(source, dest)
    # copy2 carries size and mtime over; a source edited since (same size) shows a newer mtime.
    source_stat, dest_stat = source.stat(), dest.stat()
    return source_stat.st_size == dest_stat.st_size and abs(source_stat.st_mtime - dest_stat.st_mtime) < 1.0


def temp_path_for(dest: Path) -> Path:
    """Hidden sibling of dest: never a planned name (hidden sources are skipped) and ignored by data tools."""
    name = f".{dest.name}{TMP_SUFFIX}"
    if len(name.encode()) > 255:  # NAME_MAX: a long source name must not make its temp name unusable
        name = f".{hashlib.sha1(dest.name.encode()).hexdigest()}{TMP_SUFFIX}"
    return dest.with_name(name)


def place_file(source: Path, dest: Path, mode: str) -> None:
    """Copy / hard-link / symlink / move source to dest, landing only by an atomic rename."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_for(dest)
    if os.path.lexists(tmp):
        tmp.unlink()
    if mode == "move" and not source.is_symlink():
        try:
            os.replace(source, dest)  # same filesystem: one atomic rename, nothing copied
            return
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
    if mode == "symlink":
        os.symlink(source, tmp)
    elif mode == "link":
        os.link(source, tmp)
    else:  # copy, or a move across filesystems / of a symlinked file (its content moves, the link goes)
        shutil.copy2(source, tmp)
    os.replace(tmp, dest)
    if mode == "move":
        source.unlink()  # only after the content is safely at dest: a crash before this just repeats the copy


def _device_of_nearest_existing(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return path.stat().st_dev


# --------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="organize_data.py",
        description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 done (or nothing to do), 1 a file operation failed (rerun resumes), "
        "2 refused (bad flags or destination; nothing written).",
    )
    parser.add_argument(
        "--src_dir",
        "--src-dir",
        dest="src_dir",
        type=Path,
        required=True,
        help="folder with the raw files, searched recursively",
    )
    parser.add_argument(
        "--dst_root",
        "--dst-root",
        dest="dst_root",
        type=Path,
        required=True,
        help="where split_00 ... split_NN and the manifest are written (outside --src-dir)",
    )
    parser.add_argument(
        "--num_dirs", "--num-dirs", dest="num_dirs", type=int, default=20, help="number of split folders (default: 20)"
    )
    parser.add_argument(
        "--extensions",
        nargs="+",
        default=list(DEFAULT_EXTENSIONS),
        help=f"file endings to pick up, e.g. 'txt,md' or '.txt .md' (default: {' '.join(DEFAULT_EXTENSIONS)})",
    )
    parser.add_argument(
        "--balance", choices=BALANCES, default="count", help="even out file counts (default) or total bytes per split"
    )
    parser.add_argument(
        "--mode",
        choices=MODES,
        default="copy",
        help="copy (default, keeps mtimes), link (hard link), symlink, or move the files",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a different earlier split in --dst-root (never one made with --mode move)",
    )
    parser.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="print the plan (files and bytes per split) and write nothing",
    )
    return parser


def validate_args(args: argparse.Namespace) -> Settings:
    """Check every flag before touching the disk; report all problems at once."""
    problems = []
    if args.num_dirs < 1:
        problems.append(f"--num-dirs must be at least 1 (got {args.num_dirs})")
    try:
        extensions = parse_extensions(args.extensions)
    except OrganizeError as exc:
        problems.append(str(exc))
        extensions = []
    src_dir, dst_root = args.src_dir.resolve(), args.dst_root.resolve()
    if not src_dir.is_dir():
        what = "is not a folder" if src_dir.exists() else "does not exist"
        problems.append(f"--src-dir {args.src_dir} {what}; point --src-dir at the folder with your raw files")
    elif overlap := overlap_problem(src_dir, dst_root):
        problems.append(overlap)
    if args.mode == "link" and not problems and src_dir.stat().st_dev != _device_of_nearest_existing(dst_root):
        problems.append(
            "--mode link needs --src-dir and --dst-root on the same filesystem (hard links cannot cross "
            "filesystems); use --mode copy or --mode symlink"
        )
    if problems:
        raise OrganizeError("\n  ".join(problems))
    return Settings(str(src_dir), args.num_dirs, args.balance, args.mode, extensions)


def gather_files(src_dir: Path, dst_root: Path, settings: Settings, earlier: dict | None) -> list[SourceFile]:
    """The files of this run's plan: what is under --src-dir, plus, when finishing an earlier --mode move,
    the files that run already moved out of --src-dir (known only from its manifest)."""
    scan = find_source_files(src_dir, settings.extensions)
    if scan.skipped:
        print(
            f"organize_data.py: note: skipped {len(scan.skipped)} path(s): {_examples(scan.skipped)}", file=sys.stderr
        )
    files = scan.files
    if earlier is not None and settings.mode == "move" and earlier["settings"] == asdict(settings):
        found = {f.rel_path for f in files}
        for dest, entry in earlier["files"].items():
            moved_away = not os.path.lexists(src_dir / entry["source"]) and os.path.lexists(dst_root / dest)
            if entry["source"] not in found and moved_away:
                files.append(SourceFile(entry["source"], entry["bytes"]))
        files.sort(key=lambda f: f.rel_path)
    if not files:
        message = (
            f"--src-dir {src_dir} holds no files ending in {' '.join(settings.extensions)} (hidden files and "
            "folders are skipped); check --src-dir, or choose other endings with --extensions"
        )
        if earlier is not None and earlier["settings"].get("mode") == "move":
            message += (
                f". Note: --dst-root {dst_root} holds an earlier --mode move split of "
                f"{earlier['settings'].get('src_dir')}, which moved its files out; rerun with that split's flags"
            )
        raise OrganizeError(message)
    return files


def place_all(todo: list[tuple[Path, Path, int]], mode: str) -> None:
    with tqdm(
        total=sum(n for _, _, n in todo),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        desc=f"organize ({mode})",
    ) as progress:
        for source, dest, num_bytes in todo:
            try:
                place_file(source, dest, mode)
            except OSError as exc:
                hint = (
                    "hard links cannot cross filesystems; use --mode copy or --mode symlink"
                    if exc.errno == errno.EXDEV
                    else "fix the cause and rerun the same command: finished files are kept"
                )
                raise OrganizeError(
                    f"--mode {mode} of {source} -> {dest} failed: {exc}; {hint}", EXIT_IO_ERROR
                ) from exc
            progress.update(num_bytes)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    settings = validate_args(args)
    src_dir, dst_root = Path(settings.src_dir), args.dst_root
    earlier = read_manifest(dst_root) if dst_root.is_dir() else None
    files = gather_files(src_dir, dst_root, settings, earlier)
    plan = plan_split(files, settings.num_dirs, settings.balance)
    manifest = build_manifest(settings, plan, complete=False)
    state = check_destination(dst_root, earlier, manifest, args.overwrite)
    if len(files) < settings.num_dirs:
        print(
            f"organize_data.py: note: only {len(files)} files for {settings.num_dirs} splits; "
            f"{settings.num_dirs - len(files)} split folders stay empty",
            file=sys.stderr,
        )
    todo = [
        (src_dir / entry["source"], dst_root / dest, entry["bytes"])
        for dest, entry in manifest["files"].items()
        if not (state.resuming and is_in_place(src_dir / entry["source"], dst_root / dest, settings.mode))
    ]
    if settings.mode == "move":
        # Symlinked files first: one whose target is also under --src-dir would dangle once the target moved.
        todo.sort(key=lambda item: not item[0].is_symlink())

    if args.dry_run:
        print(format_plan(manifest, dst_root))
        for path in state.to_delete:
            print(f"would delete {path}")
        print(
            f"dry run: {len(todo):,} files to {settings.mode}, {len(files) - len(todo):,} already in place; "
            "nothing written"
        )
        return 0

    dst_root.mkdir(parents=True, exist_ok=True)
    for path in state.to_delete:
        remove_path(path)
    # Record the plan before the first file moves, so a killed run (even --mode move) can be finished.
    if todo and earlier != manifest:
        write_json_atomic(dst_root / MANIFEST_NAME, manifest)
    for name in manifest["splits"]:
        (dst_root / name).mkdir(exist_ok=True)
    place_all(todo, settings.mode)
    finished = {**manifest, "complete": True}
    if earlier != finished:
        write_json_atomic(dst_root / MANIFEST_NAME, finished)
    print(format_summary(finished, dst_root, len(todo), time.perf_counter() - started))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on bad flags; callers of main() get the code
        return exc.code if isinstance(exc.code, int) else EXIT_REFUSED
    try:
        return run(args)
    except OrganizeError as exc:
        print(f"organize_data.py: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # e.g. no permission to create --dst-root: say so plainly, no traceback
        print(f"organize_data.py: error: {exc}; fix the cause and rerun the same command", file=sys.stderr)
        return EXIT_IO_ERROR


if __name__ == "__main__":
    sys.exit(main())
