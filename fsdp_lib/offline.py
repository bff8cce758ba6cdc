"""Names resolved to cached folders, never the network: --model-name as a folder or as a hub id in the HF_HOME cache, a
hub dataset id's snapshot folder, and the offline switches of huggingface_hub and datasets. No torch."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from fsdp_lib.markers import folder_kind


def is_hub_dataset_id(name: str) -> bool:
    """ORG/NAME that is not a local path: exactly one slash, not starting like a path, and no such file here."""
    return (
        name.count("/") == 1
        and not name.startswith((".", "~", "/"))
        and not Path(name).expanduser().exists()
        and not Path(name).parent.is_dir()  # data/typo while data/ exists: a mistyped folder, not a hub id
    )


def download_dataset_command(repo_id: str) -> str:
    return f"python model_download.py --dataset {repo_id}"


def cached_snapshot(repo_id: str, repo_type: str = "model", revision: str | None = None, needs: str = "") -> Path:
    """The cached snapshot folder of a hub repository; never touches the network. A snapshot that lacks files the
    repository lists (huggingface_hub keeps the listing since 2.x and then calls it incomplete) is the one
    model_download.py made, which skips what training never reads (a README, original/, other formats): it is used
    when it holds `needs` (a model's config.json; what else a run needs is checked when it is read)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - LocalEntryNotFoundError and friends
        partial = getattr(exc, "snapshot_path", None)  # IncompleteSnapshotError's
        if partial and Path(partial, needs).exists():
            return Path(partial)
        raise


def hub_dataset_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The cached snapshot folder of a hub dataset repository; never touches the network."""
    try:
        return cached_snapshot(repo_id, "dataset", revision)
    except Exception as exc:  # noqa: BLE001 - LocalEntryNotFoundError and friends
        hf_home = os.environ.get("HF_HOME", "~/.cache/huggingface")
        raise ValueError(
            f"hub dataset {repo_id} is not in the local cache (HF_HOME={hf_home}), nor a folder in {Path.cwd()}; run "
            f"`{download_dataset_command(repo_id)}` on a machine with internet and copy HF_HOME here"
        ) from exc


def set_offline(values: tuple[bool, ...] = (True, True, True)) -> tuple[bool, ...]:
    """Set huggingface_hub's and datasets' offline switches (both read the environment once, at import); returns
    the previous values, to restore."""
    import datasets.config
    import huggingface_hub.constants

    previous = (
        huggingface_hub.constants.HF_HUB_OFFLINE,
        datasets.config.HF_HUB_OFFLINE,
        datasets.config.HF_DATASETS_OFFLINE,
    )
    huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE, datasets.config.HF_DATASETS_OFFLINE = (
        values
    )
    return previous


def resolve_model_dir(model_name: str) -> Path:
    """A local folder, or a hub id resolved from the offline cache; never touches the network."""
    path = Path(model_name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(_no_config(model_name, path))
        return path
    if path.exists():
        raise FileNotFoundError(f"--model-name {model_name}: not a folder")
    no_such_folder = (
        f"--model-name {model_name}: no such folder (relative to {Path.cwd()}); check the path, or give a hub id "
        f"as org/name"
    )
    if model_name.startswith((".", "~", "/")) or model_name.count("/") != 1:
        raise FileNotFoundError(no_such_folder)
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", model_name):
        raise FileNotFoundError(
            f"--model-name {model_name!r}: neither a folder here nor a hub id (org/name: letters, digits, '-', '_', "
            "'.'); check the path"
        )
    try:
        return cached_snapshot(model_name, needs="config.json")
    except Exception as exc:  # noqa: BLE001 - LocalEntryNotFoundError and friends
        if path.parent.is_dir():  # e.g. models/typo while models/ exists: a mistyped folder, not a hub id
            raise FileNotFoundError(no_such_folder) from exc
        raise FileNotFoundError(
            f"--model-name {model_name}: not in the local cache (HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')}). "
            f"Run `python model_download.py --model-name {model_name}` on a machine with internet and copy HF_HOME here."
        ) from exc


def _no_config(model_name: str, path: Path) -> str:
    """A folder without config.json given as the model: say what it is, and what to pass instead."""
    kind = folder_kind(path)
    if kind is not None and kind.kind == "experiment":
        final = path / "final"
        if (final / "adapter_config.json").is_file():  # a LoRA run's export is an adapter: it is no -m either
            return f"--model-name {kind.describe(path)}, not a model; {_no_config(str(final), final)[len('--model-name ') :]}"
        return f"--model-name {kind.describe(path)}, not a model; its exported model is -m {final}" + (
            "" if (final / "config.json").is_file() else " (once exported: rerun it with --export-only)"
        )
    if kind is not None and kind.kind == "token cache":
        return f"--model-name {kind.describe(path)}, not a model: pass the model folder as -m (and the dataset as -d)"
    if kind is not None:
        return f"--model-name {kind.describe(path)}, not a model; pass it as -d if it is your data, and a model as -m"
    if (path / "adapter_config.json").is_file():  # a LoRA run's final/: the adapter, not a model
        base = ""
        try:
            base = json.loads((path / "adapter_config.json").read_text(encoding="utf-8")).get("base_model_name_or_path")
        except (OSError, ValueError, AttributeError):
            pass
        merged = path.with_name(f"{path.name}-merged")
        return (
            f"--model-name {model_name} is a LoRA adapter, not a model: pass its base, -m {base or 'BASE'}, with "
            f"--peft lora --adapter {model_name}"
            + (f", or the merged model -m {merged}" if (merged / "config.json").is_file() else
               " (or export the run with --export-merged on and pass its final-merged/)")
        )  # fmt: skip
    return (
        f"--model-name {model_name}: folder has no config.json; pass the folder that holds config.json and the "
        "weights (model_download.py fetches one; --init makes a new one)"
    )
