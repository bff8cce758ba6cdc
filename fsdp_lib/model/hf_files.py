"""The weight files of a Hugging Face model folder, listed by one function for the trainer and model_download.py.
No torch here: model_download.py imports it for its checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


def shards_from_index(index: dict[str, Any], index_name: str) -> list[str]:
    """The weight files a sharded-checkpoint index refers to; ValueError when it has no weight map."""
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_name} has no weight_map; the index is corrupt")
    return sorted(set(weight_map.values()))


def hf_weight_files(folder: Path) -> tuple[list[str], list[str]]:
    """(names of the weight files the folder's model consists of, problems such as shards missing from disk).

    With an index (model.safetensors.index.json, else pytorch_model.bin.index.json), the shards it lists.
    Without one, every *.safetensors file except other formats' copies that some repositories ship beside the
    model (consolidated*.safetensors of Mistral's own format, adapter_model*.safetensors of PEFT), else every
    pytorch_model*.bin. No files and no problems: a folder without weights (config and tokenizer only)."""
    for index_name in (SAFETENSORS_INDEX, BIN_INDEX):
        index_path = folder / index_name
        if index_path.exists():
            try:
                shards = shards_from_index(json.loads(index_path.read_text()), index_name)
            except json.JSONDecodeError as exc:
                return [], [f"{index_path}: not valid JSON ({exc}); the index is corrupt"]
            except ValueError as exc:
                return [], [f"{folder}/{exc}"]
            missing = [name for name in shards if not (folder / name).is_file()]
            problems = [f"shard {name} listed in {index_name} is missing from {folder}" for name in missing]
            return [name for name in shards if name not in missing], problems
    names = sorted(path.name for path in folder.glob("*.safetensors") if path.is_file())
    names = [name for name in names if not name.startswith(("consolidated", "adapter_model"))]
    if not names:
        names = sorted(path.name for path in folder.glob("pytorch_model*.bin") if path.is_file())
    return names, []


def weights_identity(folder: Path, samples: int = 16, sample_bytes: int = 65536) -> str:
    """A short fingerprint of the folder's weights that tells two bases apart without reading them all (an 8B model
    and its instruct variant share config and shapes): each weight file's name and size, and a hash of `samples`
    evenly spaced `sample_bytes` reads of it. "none" for a folder without weights. Cheap at any model size."""
    import hashlib

    names, _ = hf_weight_files(folder)
    if not names:
        return "none"
    digest = hashlib.sha256()
    for name in names:
        path = folder / name
        size = path.stat().st_size
        digest.update(f"{name}:{size}".encode())
        with path.open("rb") as fh:
            for i in range(samples):
                fh.seek(max(0, size - sample_bytes) * i // max(1, samples - 1))
                digest.update(fh.read(sample_bytes))
    return digest.hexdigest()[:16]
