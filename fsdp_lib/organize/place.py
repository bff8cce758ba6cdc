"""Placing files into the split folders: the destination checked against an earlier run's manifest (resume, refuse, or --overwrite of our own files only), the manifest written atomically, and each file copied, linked or moved under a temporary name and renamed into place, so a killed run never leaves a truncated file under a real name."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from fsdp_lib.errors import name_sample
from fsdp_lib.lock import FolderLock
from fsdp_lib.organize.plan import (
    LOCK_NAME,
    MANIFEST_NAME,
    SPLIT_DIR_PATTERN,
    TMP_SUFFIX,
    OrganizeError,
    describe_mismatch,
    settings_flags,
)


@dataclass
class DestinationState:
    resuming: bool  # dst_root already holds this exact plan (maybe unfinished)
    to_delete: list[Path]  # earlier split folders (--overwrite), or our stale temp files


def read_manifest(dst_root: Path) -> dict | None:
    path = dst_root / MANIFEST_NAME
    if not path.is_file():
        return None
    unreadable = (
        f"--dst-root {dst_root}: {path.name} is not a manifest this version of organize_data.py can read, so "
        f"nothing records what its split folders hold; if {dst_root} holds nothing you need, delete it, else "
        "choose another --dst-root"
    )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OrganizeError(f"{unreadable} ({exc})") from exc
    if not (
        isinstance(manifest, dict)
        and isinstance(manifest.get("settings"), dict)
        and isinstance(manifest.get("files"), dict)
        and isinstance(manifest.get("splits"), dict)
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


def _holds_anything(path: Path) -> bool:
    """Whether a split folder's name holds something to keep: any file, link or folder that is not empty."""
    return path.is_symlink() or not path.is_dir() or bool(os.listdir(path))


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
            continue  # check_destination refuses a split folder that no manifest lists
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
    ours = {MANIFEST_NAME, MANIFEST_NAME + TMP_SUFFIX, LOCK_NAME}
    entries = sorted(n for n in os.listdir(dst_root) if n not in ours and not n.startswith(f".{LOCK_NAME}."))
    split_dirs = [name for name in entries if SPLIT_DIR_PATTERN.fullmatch(name)]
    if earlier is None:
        if not entries:
            return DestinationState(resuming=False, to_delete=[])
        if not overwrite:
            raise OrganizeError(
                f"--dst-root {dst_root} is not empty and has no {MANIFEST_NAME} from an earlier split "
                f"(it holds {name_sample(entries, 3)}); choose an empty or new --dst-root, or pass --overwrite to "
                "write the split beside those files (they are left untouched)"
            )
        if split_dirs:
            raise OrganizeError(
                f"--dst-root {dst_root} holds {name_sample(split_dirs, 3)} but no {MANIFEST_NAME}, so nothing records "
                "what they contain (they may be the only copies of moved files); --overwrite does not delete "
                "them: remove or rename them yourself, or choose another --dst-root"
            )
        return DestinationState(resuming=False, to_delete=[])
    if unlisted := [name for name in split_dirs if name not in earlier["splits"] and _holds_anything(dst_root / name)]:
        raise OrganizeError(
            f"--dst-root {dst_root} holds {name_sample(unlisted, 3)}, which its {MANIFEST_NAME} does not account for "
            "(it may hold the only copies of moved files); organize_data.py does not delete it, even with "
            "--overwrite: remove or rename it yourself, or choose another --dst-root"
        )
    problems = describe_mismatch(earlier, planned)
    strays, stale = find_strays(dst_root, earlier if problems else planned)
    if strays:
        _refuse_strays(dst_root, strays, bool(problems) and overwrite)
    if problems:
        if not overwrite:
            same_flags = earlier["settings"] == planned["settings"]  # the sources changed, not the flags
            keep = (
                "Restore --src-dir's files to keep it"
                if same_flags
                else f"Rerun with the earlier flags ({settings_flags(earlier['settings'])}) to keep it"
            )
            if earlier["settings"].get("mode") != "move":  # a moved split is never replaced (below)
                keep += ", pass --overwrite to replace it" + (
                    " with a split of the files there now" if same_flags else ""
                )
            raise OrganizeError(
                f"--dst-root {dst_root} holds a different earlier split: {'; '.join(problems)}. {keep}, or choose "
                "another --dst-root"
            )
        if earlier["settings"].get("mode") == "move":
            raise OrganizeError(
                f"--dst-root {dst_root} holds a split made with --mode move: its files are the only copies of "
                "the moved sources, so --overwrite will not delete them. Choose another --dst-root, or move the "
                f"files back first ({MANIFEST_NAME} maps every destination to its source path)"
            )
        return DestinationState(resuming=False, to_delete=[dst_root / name for name in split_dirs])
    return DestinationState(resuming=True, to_delete=stale)


def _refuse_strays(dst_root: Path, strays: list[Path], replacing: bool) -> None:
    """Files in the split folders that no run of ours placed are the user's: never deleted, even by --overwrite."""
    shown = [p.relative_to(dst_root).as_posix() for p in strays]
    why = (
        "--overwrite would replace the split folders, and organize_data.py deletes only the files it placed"
        if replacing
        else "the next tool would read them as data"
    )
    raise OrganizeError(
        f"--dst-root {dst_root} holds {len(strays)} file(s) in its split folders that are not part of the split "
        f"in {MANIFEST_NAME}: {name_sample(shown, 3)}; {why}. Move them out of the split folders (or delete them), "
        "then rerun"
    )


def split_lock(dst_root: Path) -> FolderLock:
    """One organize_data.py run per --dst-root at a time (`with split_lock(dst_root).held():`): a second one would
    plan against a folder the first is changing (and an --overwrite would delete its files under it)."""
    return FolderLock(dst_root, LOCK_NAME, f"--dst-root {dst_root}", "choose another --dst-root", OrganizeError)


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
    # NAME_MAX counts bytes (a name in any encoding): a long source name must not make its temp name unusable
    if len(os.fsencode(name)) > 255:
        name = f".{hashlib.sha1(os.fsencode(dest.name)).hexdigest()}{TMP_SUFFIX}"
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
    try:
        if mode == "symlink":
            os.symlink(source, tmp)
        elif mode == "link":
            os.link(source, tmp)
        else:  # copy, or a move across filesystems / of a symlinked file (its content moves, the link goes)
            shutil.copy2(source, tmp)
        os.replace(tmp, dest)
    except BaseException:  # a full disk or Ctrl-C mid-copy: the partial copy does not stay on the disk
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if mode == "move":
        source.unlink()  # only after the content is safely at dest: a crash before this just repeats the copy


def device_of_nearest_existing(path: Path) -> int:
    while not path.exists():
        path = path.parent
    return path.stat().st_dev
