"""What a folder is, told by the marker each tool leaves in the folders it writes: a dataset (data_hf.py's summary, or
datasets' save_to_disk files), split folders (organize_data.py's manifest), a training experiment (fsdp_train.py's
checkpoints, lock, metrics or state), a model (an HF config with a model type) or the token cache. A tool replaces
only a folder of its own kind and names any other kind when it refuses; no torch."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASET_SUMMARY = "data_hf_summary.json"  # data_hf.py's run summary, saved in the dataset folder
SPLITS_MANIFEST = ".organize_manifest.json"  # organize_data.py's plan, in --dst-root
EXPERIMENT_LOCK = "run.lock"  # fsdp_train.py: one run per experiment
EXPERIMENT_STATE = "state.json"  # fsdp_train.py: the newest checkpoint of an experiment
# model_download.py: written into a model folder only after verification passes (its weight files and their sizes);
# removed before any re-download
VERIFICATION_RECORD = "model_download_verified.json"
# model_download.py: written into a model folder (a --local-dir or a cache snapshot) or a dataset's cache snapshot
# before the first file is fetched, removed when the download is complete and verified; holds the command to rerun
INCOMPLETE_DOWNLOAD = ".model_download_incomplete"
TOKEN_CACHE = ".token_cache"  # fsdp_train.py: tokenised datasets, under --save-dir beside the experiments
STEP_DIR = re.compile(r"step_(\d+)")  # fsdp_train.py: a complete checkpoint, EXP/checkpoint/step_N
# Everything fsdp_train.py writes in an experiment folder (besides its temporaries, named .NAME.tmp... or .NAME.old):
# a folder holding anything else is the user's, and a run does not write into it.
EXPERIMENT_ENTRIES = frozenset(
    {
        "checkpoint", "config.yaml", "final", "final-merged", "loss.png", "loss.png.tmp.png", "metrics.jsonl",
        "profile", EXPERIMENT_LOCK, "samples.jsonl", EXPERIMENT_STATE, "tensorboard", "wandb",
    }
)  # fmt: skip


# Folders their tool owns whole (it replaces, prunes or rewrites them): no other tool's output may live inside one.
WHOLE_FOLDER_KINDS = ("dataset", "split folders", "experiment", "token cache")


@dataclass(frozen=True)
class FolderKind:
    kind: str  # "dataset", "split folders", "experiment", "model" or "token cache"
    evidence: str  # the file or folder that says so

    @property
    def what(self) -> str:
        return {
            "dataset": "a dataset (data_hf.py or save_to_disk)",
            "split folders": "split folders of organize_data.py",
            "experiment": "a training experiment of fsdp_train.py",
            "model": "a model folder",
            "token cache": "fsdp_train.py's token cache",
        }[self.kind]

    def describe(self, folder: Path) -> str:
        return f"{folder} is {self.what} ({self.evidence})"

    def describe_inside(self, folder: Path) -> str:
        """For a path under `folder`: "inside FOLDER, a dataset (...) (evidence)"."""
        return f"inside {folder}, {self.what} ({self.evidence})"


def unfinished_splits(folder: Path) -> Path | None:
    """The manifest of split folders that organize_data.py began and has not finished (interrupted, or rerunning
    with another plan), when `folder` is those split folders or a folder at any depth inside them; else None. Some
    files are still missing from them, or still in their earlier places."""
    for candidate in (folder, *folder.absolute().parents):
        manifest = candidate / SPLITS_MANIFEST
        try:
            value: Any = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(value, dict) and value.get("complete") is False:
            return manifest
    return None


def unfinished_download(folder: Path) -> str | None:
    """The command that finishes an interrupted model_download.py download into `folder` (a model folder or a cache
    snapshot), or None when none was interrupted there: its files may be missing, cut short or from two commits."""
    try:
        value: Any = json.loads((folder / INCOMPLETE_DOWNLOAD).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "model_download.py (the same command as before)"
    return str(value.get("command")) if isinstance(value, dict) else "model_download.py (the same command as before)"


def copied_from(folder: Path, within: Path) -> Path | None:
    """The --src-dir under `within` whose files split folders `folder` hold copies (or hard links) of, by their
    finished manifest, while it still holds every one of them; None for other folders, a source elsewhere,
    unfinished splits, --mode move and a source that lost files since (the copies are then the only ones). A folder
    that holds both the source and its splits holds every file twice."""
    try:
        value: Any = json.loads((folder / SPLITS_MANIFEST).read_text(encoding="utf-8"))
        settings, files = value["settings"], value["files"]
        if value.get("complete") is not True or settings.get("mode") not in ("copy", "link"):
            return None
        source = Path(settings["src_dir"])
        if not source.is_dir() or not source.resolve().is_relative_to(within.resolve()):
            return None
        return source if all((source / entry["source"]).is_file() for entry in files.values()) else None
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _json_keys(path: Path) -> set[str]:
    try:
        value: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    return set(value) if isinstance(value, dict) else set()


def folder_kind(folder: Path) -> FolderKind | None:
    """The kind of `folder` by its markers, or None for a folder no tool of ours wrote, no folder, or one that cannot
    be read (the caller's own read then says why)."""
    try:
        return _kind_by_markers(folder)
    except OSError:  # a folder without read or search permission
        return None


def enclosing_folder(path: Path, kinds: tuple[str, ...] | None = None) -> str | None:
    """ "inside FOLDER, a dataset (...)" for the nearest folder above `path` that a tool of ours wrote (of one of
    `kinds`, default any), or None: that tool would delete or misread what another tool put inside it."""
    for parent in path.absolute().parents:
        if (kind := folder_kind(parent)) is not None and (kinds is None or kind.kind in kinds):
            return kind.describe_inside(parent)
    return None


def _kind_by_markers(folder: Path) -> FolderKind | None:
    if not folder.is_dir():
        return None
    if folder.name == TOKEN_CACHE:
        return FolderKind("token cache", folder.name)
    if (folder / EXPERIMENT_LOCK).is_file():
        return FolderKind("experiment", EXPERIMENT_LOCK)
    if "latest_checkpoint" in _json_keys(folder / EXPERIMENT_STATE):
        return FolderKind("experiment", EXPERIMENT_STATE)
    if (folder / "checkpoint").is_dir() and any(p.name.startswith("step_") for p in (folder / "checkpoint").iterdir()):
        return FolderKind("experiment", "checkpoint/")
    if (folder / "config.yaml").is_file() and (folder / "metrics.jsonl").is_file():
        return FolderKind("experiment", "config.yaml, metrics.jsonl")
    if (folder / SPLITS_MANIFEST).is_file():
        return FolderKind("split folders", SPLITS_MANIFEST)
    if (folder / DATASET_SUMMARY).is_file():
        return FolderKind("dataset", DATASET_SUMMARY)
    if "splits" in _json_keys(folder / "dataset_dict.json"):
        return FolderKind("dataset", "dataset_dict.json")
    if "_data_files" in _json_keys(folder / "state.json"):
        return FolderKind("dataset", "state.json")
    model_files = ("*.safetensors", "pytorch_model*.bin", "tokenizer.json", "tokenizer_config.json")
    if _json_keys(folder / "config.json") & {"model_type", "architectures"} and any(
        next(folder.glob(pattern), None) for pattern in model_files
    ):
        return FolderKind("model", "config.json")
    return None


def step_of(folder: Path) -> int:
    """The step a checkpoint folder is named for (STEP_DIR)."""
    return int(folder.name[len("step_") :])


def step_dirs(root: Path) -> list[Path]:
    """fsdp_train.py's complete checkpoints in `root` (EXP/checkpoint), oldest first: only folders named exactly
    step_ + digits, so a folder moved aside (step_00000020.bad, corrupt_step_00000020) or a temporary
    (.tmp_step_...) is never resumed from. Not yet verified (train/checkpoint_verify.py)."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir()), key=step_of)
