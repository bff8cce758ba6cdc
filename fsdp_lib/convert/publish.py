"""The output folder: the run writes into a hidden temporary folder beside --save_dir, and publish renames it into
place only when complete (an existing dataset is moved aside first and deleted last, so a complete dataset exists at
every instant). clean_stale_temporaries deals with what a killed run left: it restores a dataset moved aside and
removes unfinished outputs, leaving alone the folders of runs still alive or made on another host."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

from fsdp_lib.errors import name_sample
from fsdp_lib.markers import DATASET_SUMMARY, folder_kind
from fsdp_lib.processes import process_alive

SUMMARY_NAME = DATASET_SUMMARY  # the run summary, saved in the dataset folder: it marks the folder as ours
# The temporary folders beside --save_dir: .NAME<tag><host>-<pid>-<random>, so a later run can tell whose they are.
TMP_TAG = ".data_hf-tmp-"
OLD_TAG = ".data_hf-old-"


def occupied(save_dir: Path) -> bool:
    """True if something is at `save_dir` that writing there would replace (an empty folder does not count)."""
    if save_dir.is_dir() and not save_dir.is_symlink():
        return any(save_dir.iterdir())
    return save_dir.exists() or save_dir.is_symlink()


def replace_problem(save_dir: Path) -> str | None:
    """Why --overwrite may not replace the folder `save_dir`, or None when it is empty or a dataset (data_hf.py's or
    save_to_disk's). An experiment, a model, split folders or an unknown folder are never replaced."""
    kind = folder_kind(save_dir)
    if not any(save_dir.iterdir()):
        return None
    if kind is not None and kind.kind == "dataset":
        if foreign := not_dataset_files(save_dir):
            return (
                f"--save_dir {save_dir} is a dataset that also holds {name_sample(foreign)}, which --overwrite would "
                "delete with it: move them out or choose another --save_dir"
            )
        return None
    if kind is not None:
        return (
            f"--save_dir {kind.describe(save_dir)}; data_hf.py replaces only a dataset, even with --overwrite: "
            "choose another --save_dir"
        )
    return (
        f"--save_dir {save_dir} is not a dataset written by data_hf.py (no {SUMMARY_NAME}, dataset_dict.json or "
        "datasets' state.json); refusing to delete it even with --overwrite: choose another --save_dir"
    )


# What a saved dataset holds (save_to_disk's files, a DatasetDict's split folders, data_hf.py's summary): anything
# else in the folder is the user's.
_DATASET_FILES = frozenset({"state.json", "dataset_info.json", "dataset_dict.json", SUMMARY_NAME})


def not_dataset_files(folder: Path, prefix: str = "") -> list[str]:
    """The entries of the dataset folder `folder` (and of its split folders) that are not the dataset's, as paths
    relative to it; a folder is named with a trailing slash."""
    try:
        splits = json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8")).get("splits", [])
    except (OSError, ValueError, AttributeError):
        splits = []
    foreign = []
    for entry in sorted(folder.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            if entry.name in splits:
                foreign += not_dataset_files(entry, f"{prefix}{entry.name}/")
            else:
                foreign.append(f"{prefix}{entry.name}/")
        elif entry.is_symlink() or not (entry.name in _DATASET_FILES or entry.suffix == ".arrow"):
            foreign.append(f"{prefix}{entry.name}")
    return foreign


def _owner_pid(name: str, prefix: str, host: str) -> int | None:
    """The pid in a temporary folder name made by this host, else None (another host's run: leave it alone)."""
    parts = name[len(prefix) :].rsplit("-", 2)
    if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
        return None
    return int(parts[1])


def clean_stale_temporaries(save_dir: Path) -> list[str]:
    """Deal with the folders a killed run left beside `save_dir`: a dataset that an interrupted --overwrite had
    moved aside is moved back if `save_dir` is missing, and unfinished outputs are deleted. Folders of runs
    still alive, or made on another host, are left alone. Returns what was done."""
    parent, host, notes = save_dir.parent, socket.gethostname(), []
    if not parent.is_dir():
        return notes
    for tag in (OLD_TAG, TMP_TAG):  # old first: restoring beats deleting a complete new output
        prefix = f".{save_dir.name}{tag}"
        for name in sorted(n for n in os.listdir(parent) if n.startswith(prefix)):
            pid = _owner_pid(name, prefix, host)
            if pid is None or process_alive(pid):
                continue
            stale = parent / name
            if tag == OLD_TAG and not (save_dir.exists() or save_dir.is_symlink()):
                stale.rename(save_dir)
                notes.append(f"restored {save_dir} from {name}, moved aside by an interrupted --overwrite run")
            else:
                remove_path(stale)
                notes.append(f"removed {name}, left by an interrupted run (pid {pid})")
    return notes


def remove_path(path: Path) -> None:
    """Delete a file, a link or a folder, whichever `path` is; a missing path is no error."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def publish(tmp: Path, save_dir: Path, run_id: str) -> None:
    """Move the finished `tmp` to `save_dir`. An existing dataset is moved aside first and deleted only after the
    new one is in place, so at every instant a complete dataset exists (or is restored by the next run)."""
    if not (save_dir.exists() or save_dir.is_symlink()):
        os.rename(tmp, save_dir)
        return
    aside = save_dir.parent / f".{save_dir.name}{OLD_TAG}{run_id}"
    os.rename(save_dir, aside)
    try:
        os.rename(tmp, save_dir)
    except BaseException:
        os.rename(aside, save_dir)
        raise
    remove_path(aside)
