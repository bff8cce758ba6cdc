#!/usr/bin/env python3
"""Spread raw text-like files over N balanced split folders, so N workers can preprocess them in parallel.

    python organize_data.py --src_dir ./raw_text --dst_root ./splits --num_dirs 20
    python organize_data.py --src-dir ./raw_text --dst-root ./splits --num-dirs 8 --balance bytes --mode link
    python organize_data.py --src-dir ./raw_text --dst-root ./splits --dry-run

Every matching file under --src-dir (searched recursively; hidden files and folders, and folders a tool
wrote such as a model or a dataset, are skipped, and symlinked folders are not followed) lands in exactly
one of dst_root/split_00 ... split_NN under its
path relative to --src-dir, so same-named files from different folders never collide.
dst_root/.organize_manifest.json records destination -> source and the settings used: rerunning the same
command changes nothing (or finishes an interrupted run), and a different plan is refused unless --overwrite.
"""

from __future__ import annotations

import argparse
import errno
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from fsdp_lib.arguments import JoinRepeats, OneValueParser
from fsdp_lib.errors import broken_link, file_above, name_sample, unreadable
from fsdp_lib.interrupts import exit_without_teardown, interrupt_exit_code, sigterm_as_interrupt
from fsdp_lib.markers import folder_kind
from fsdp_lib.organize.place import (
    check_destination,
    device_of_nearest_existing,
    is_in_place,
    place_file,
    read_manifest,
    remove_path,
    split_lock,
    write_json_atomic,
)
from fsdp_lib.organize.plan import (
    BALANCES,
    DEFAULT_EXTENSIONS,
    EXIT_IO_ERROR,
    EXIT_REFUSED,
    MANIFEST_NAME,
    MAX_SPLITS,
    MODES,
    OrganizeError,
    Settings,
    SourceFile,
    build_manifest,
    find_source_files,
    format_plan,
    format_summary,
    overlap_problem,
    parse_extensions,
    plan_split,
    settings_flags,
)


def folder_path(value: str) -> Path:
    """A folder flag's value; an empty one (an unset shell variable) is refused, not read as the current folder."""
    if not value.strip():
        raise argparse.ArgumentTypeError("is empty; pass a folder path (use . for the current folder)")
    return Path(value)


def build_parser() -> argparse.ArgumentParser:
    parser = OneValueParser(
        prog="organize_data.py",
        description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 done (or nothing to do), 1 a file operation failed (rerun resumes), "
        "2 refused (bad flags or destination; nothing written).",
    )
    parser.add_argument(
        "--src_dir",
        "--src-dir",
        dest="src_dir",
        type=folder_path,
        required=True,
        help="folder with the raw files, searched recursively",
    )
    parser.add_argument(
        "--dst_root",
        "--dst-root",
        dest="dst_root",
        type=folder_path,
        required=True,
        help="where split_00 ... split_NN and the manifest are written (outside --src-dir)",
    )
    parser.add_argument(
        "--num_dirs", "--num-dirs", dest="num_dirs", type=int, default=20, help="number of split folders (default: 20)"
    )
    parser.add_argument(
        "--extensions",
        nargs="+",
        action=JoinRepeats,
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
        help="replace a different earlier split in --dst-root: deletes only the files it placed (never a split made "
        "with --mode move; files you added to a split folder are refused by name)",
    )
    parser.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dry_run",
        action="store_true",
        help="print the plan (files and bytes per split) and write nothing",
    )
    return parser


def path_problems(src_arg: Path, dst_arg: Path) -> list[str]:
    """What is wrong with --src-dir and --dst-root as paths, before anything is read or written."""
    flags = (("--src-dir", src_arg), ("--dst-root", dst_arg))
    if broken := [
        f"{flag} {path} {why}; fix the link, or pass another path" for flag, path in flags if (why := broken_link(path))
    ]:
        return broken
    src_dir, dst_root = src_arg.resolve(), dst_arg.resolve()
    problems = []
    if why := unreadable(src_dir):
        problems.append(f"--src-dir {src_arg} cannot be read ({why}); fix its permissions, or run as a user who can")
    elif not src_dir.is_dir():
        what = "is not a folder" if src_dir.exists() else "does not exist"
        problems.append(f"--src-dir {src_arg} {what}; point --src-dir at the folder with your raw files")
    elif (kind := folder_kind(src_dir)) is not None and kind.kind != "split folders":
        problems.append(f"--src-dir {kind.describe(src_arg)}, not raw files; point --src-dir at the folder with them")
    elif overlap := overlap_problem(src_dir, dst_root):
        problems.append(overlap)
    if dst_root.exists() and not dst_root.is_dir():
        problems.append(f"--dst-root {dst_arg} is a file; choose a folder path for --dst-root")
    elif (kind := folder_kind(dst_root)) is not None and kind.kind != "split folders":
        problems.append(
            f"--dst-root {kind.describe(dst_arg)}; organize_data.py does not write split folders into another tool's "
            "folder, even with --overwrite: choose another --dst-root"
        )
    return problems


def validate_args(args: argparse.Namespace) -> Settings:
    """Check every flag before touching the disk; report all problems at once."""
    problems = []
    if not 1 <= args.num_dirs <= MAX_SPLITS:
        problems.append(
            f"--num-dirs must be between 1 and {MAX_SPLITS:,} (got {args.num_dirs:,}): one split folder per "
            "worker that preprocesses them"
        )
    try:
        extensions = parse_extensions(args.extensions)
    except OrganizeError as exc:
        problems.append(str(exc))
        extensions = []
    problems += path_problems(args.src_dir, args.dst_root)
    if problems:
        raise OrganizeError("\n  ".join(problems))
    src_dir, dst_root = args.src_dir.resolve(), args.dst_root.resolve()
    if args.mode == "link" and src_dir.stat().st_dev != device_of_nearest_existing(dst_root):
        problems.append(
            "--mode link needs --src-dir and --dst-root on the same filesystem (hard links cannot cross "
            "filesystems); use --mode copy or --mode symlink"
        )
    if problems:
        raise OrganizeError("\n  ".join(problems))
    if blocker := file_above(dst_root):  # exit 1, as the OS error it prevents (tests pin it)
        raise OrganizeError(
            f"--dst-root {args.dst_root} is under {blocker}, which is a file (Not a directory); choose a folder "
            "path for --dst-root, then rerun",
            EXIT_IO_ERROR,
        )
    return Settings(str(src_dir), args.num_dirs, args.balance, args.mode, extensions)


def gather_files(src_dir: Path, dst_root: Path, settings: Settings, earlier: dict | None) -> list[SourceFile]:
    """The files of this run's plan: what is under --src-dir, plus, when finishing an earlier --mode move,
    the files that run already moved out of --src-dir (known only from its manifest)."""
    scan = find_source_files(src_dir, settings.extensions)
    if scan.skipped:
        print(
            f"organize_data.py: note: skipped {len(scan.skipped)} path(s): {name_sample(scan.skipped, 3)}",
            file=sys.stderr,
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
                f"{earlier['settings'].get('src_dir')}, which moved its files out; to finish or check it, rerun with "
                f"that split's flags: {settings_flags(earlier['settings'])} --dst-root {shlex.quote(str(dst_root))}"
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
    if args.dry_run:
        if args.dst_root.is_dir():
            split_lock(args.dst_root).check_free()
        return organize(args, settings, started)
    with split_lock(args.dst_root).held(unless_read_only=True):  # a finished split on a read-only mount reruns
        return organize(args, settings, started)


def organize(args: argparse.Namespace, settings: Settings, started: float) -> int:
    """Plan the split against --dst-root's earlier manifest, then place what is not in place yet."""
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
    if earlier is not None and earlier.get("complete") and not state.resuming and state.to_delete:
        write_json_atomic(dst_root / MANIFEST_NAME, {**earlier, "complete": False})  # its files are going now
    for path in state.to_delete:
        try:
            remove_path(path)
        except OSError as exc:  # rmtree names a file relative to the folder it was in: name the whole path
            raise OrganizeError(
                f"could not delete {path} ({exc.strerror or exc}{': ' + str(exc.filename) if exc.filename else ''}); "
                "fix the cause and rerun the same command",
                EXIT_IO_ERROR,
            ) from exc
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
        with sigterm_as_interrupt():
            return run(args)
    except KeyboardInterrupt as interrupt:  # every placed file landed whole, by a rename
        print(
            "organize_data.py: interrupted; the files placed so far are complete: rerun the same command to finish",
            file=sys.stderr,
        )
        return interrupt_exit_code(interrupt)
    except OrganizeError as exc:
        print(f"organize_data.py: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # e.g. no permission to create --dst-root: say so plainly, no traceback
        said = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else str(exc)
        print(f"organize_data.py: error: {said}; fix the cause and rerun the same command", file=sys.stderr)
        return EXIT_IO_ERROR


if __name__ == "__main__":
    exit_without_teardown(main())
