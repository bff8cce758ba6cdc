"""Hub datasets for offline training (`model_download.py --dataset ORG/NAME`): every file of the dataset repository
fetched into the HF_HOME cache with the model download's machinery, then loaded as fsdp_train.py -d will, in a fresh
interpreter with the offline switches set, and reported split by split. No torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from fsdp_lib.hub.console import ToolError, log
from fsdp_lib.hub.download import (
    HubSnapshot,
    bound_hub_requests,
    cache_snapshot_folder,
    check_free_space,
    free_disk_bytes,
    listed_checksums,
    mark_incomplete,
    note_partial_files,
    offline_mode_message,
)
from fsdp_lib.model.memory_plan import format_bytes
from fsdp_lib.records.schema import dataset_kind

REPO_ROOT = Path(__file__).resolve().parents[2]
"""Put on the checking interpreter's sys.path, so that it imports this checkout's fsdp_lib."""

DATASET_CHECK = """
import json, sys
sys.path.insert(0, sys.argv[1])
from fsdp_lib.records.dataset import load_hub_dataset_dict
try:
    loaded = load_hub_dataset_dict(sys.argv[2], sys.argv[3])
except ValueError as exc:
    sys.exit(str(exc))
print(json.dumps({name: {"rows": len(split), "columns": split.column_names} for name, split in loaded.items()}))
"""


def download_dataset(
    repo_id: str, revision: str, token: str | None, force: bool, rerun: str
) -> tuple[Path, HubSnapshot]:
    """Fetch every file of a hub dataset repository into the HF_HOME cache; return its snapshot folder, marked
    incomplete (mark_incomplete, with `rerun`) while files are fetched into it until the caller has checked and
    loaded it, and the snapshot (what it fetched).

    The same machinery as download_model: a free-space check up front, complete files skipped on a rerun,
    interrupted files resumed by huggingface_hub."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        raise ToolError(offline_mode_message(repo_id))
    bound_hub_requests()
    info = HfApi(token=token).dataset_info(repo_id, revision=revision, files_metadata=True)
    sizes = {sibling.rfilename: sibling.size or 0 for sibling in info.siblings or []}
    if not sizes:
        raise ToolError(f"dataset repository {repo_id} @ {revision} has no files; check --dataset and --revision")
    snapshot = HubSnapshot(
        repo_id, revision, None, token, force, info.sha or revision, sizes, "dataset", listed_checksums(info.siblings)
    )
    needed = sum(size for name, size in sizes.items() if force or not snapshot.is_present(name))
    target = Path(constants.HF_HUB_CACHE)
    check_free_space(needed, free_disk_bytes(target), target)
    log(f"dataset {repo_id} @ {revision} (commit {info.sha}): fetching {len(sizes)} file(s), {format_bytes(needed)}")
    incomplete = bool(snapshot.to_fetch(sorted(sizes)))  # a rerun that fetches nothing leaves the folder as it was
    if incomplete and info.sha:
        mark_incomplete(cache_snapshot_folder(repo_id, "dataset", info.sha), rerun)
    folder = snapshot.fetch(sorted(sizes))
    if incomplete:
        mark_incomplete(folder, rerun)
    note_partial_files(folder)
    return folder, snapshot


def verify_dataset(repo_id: str, revision: str) -> dict[str, dict[str, Any]]:
    """Load the cached dataset as fsdp_train.py -d will, in a fresh interpreter with HF_DATASETS_OFFLINE=1 and
    HF_HUB_OFFLINE=1 (both are read at import); {split: {"rows", "columns"}}."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", DATASET_CHECK, str(REPO_ROOT), repo_id, revision],
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ToolError(
            f"--dataset {repo_id}: downloaded, but it does not load offline (HF_DATASETS_OFFLINE=1): {detail}\n"
            "  fix: rerun with --force-download if a file is corrupt; the files must be parquet, json/jsonl, csv or"
            " text that the datasets library reads"
        )
    return json.loads(result.stdout.strip().splitlines()[-1])


def report_dataset(repo_id: str, revision: str, splits: dict[str, dict[str, Any]]) -> None:
    """The verified splits, what fsdp_train.py -d would miss in them, and how to use the cache offline."""
    log(f"verified offline: dataset {repo_id} @ {revision} loads with HF_DATASETS_OFFLINE=1")
    for name, split in splits.items():
        log(f"  {name}: {split['rows']:,} rows, columns {', '.join(split['columns'])}")
    columns = set(splits.get("train", {}).get("columns", []))
    if "train" not in splits:
        log("  note: no 'train' split; fsdp_train.py -d needs one")
    elif dataset_kind(columns) is None:
        log(
            "  note: no 'text' or 'messages' column, nor 'prompt', 'chosen' and 'rejected'; train with "
            "fsdp_train.py -d ... --text-column NAME"
        )
    hf_home = os.environ.get("HF_HOME", "~/.cache/huggingface")
    log(f"offline use: export HF_HOME={hf_home}, then fsdp_train.py -d {repo_id}")
    if revision != "main":
        log(
            f"  note: fsdp_train.py -d {repo_id} reads the cached 'main' revision only; fetch it too (no"
            " --revision) to train on this dataset"
        )
