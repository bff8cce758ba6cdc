"""The files of a Hugging Face model folder: its weight files, listed by one function for the trainer and
model_download.py, their safetensors headers read against the file size, and the checks that find a damaged folder
before a run starts. No torch here (transformers is imported inside the vocabulary check): model_download.py imports
it for its checks."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_lib.errors import name_sample
from fsdp_lib.markers import INCOMPLETE_DOWNLOAD, VERIFICATION_RECORD, unfinished_download

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
SAFETENSORS_SINGLE, BIN_SINGLE = "model.safetensors", "pytorch_model.bin"  # what transformers loads before an index
# bytes per element of each safetensors dtype tag (https://github.com/huggingface/safetensors format spec)
SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip


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
            single = SAFETENSORS_SINGLE if index_name == SAFETENSORS_INDEX else BIN_SINGLE
            if single not in shards and (folder / single).is_file():
                problems.append(
                    f"{folder} holds both {single} and {index_name} ({len(shards)} other files): two sets of weights, "
                    f"of which transformers loads {single} and this toolkit the index's; remove the set that is not "
                    "this model's (or download it again into a new folder)"
                )
            return [name for name in shards if name not in missing], problems
    names = sorted(path.name for path in folder.glob("*.safetensors") if path.is_file())
    names = [name for name in names if not name.startswith(("consolidated", "adapter_model"))]
    if not names:
        names = sorted(path.name for path in folder.glob("pytorch_model*.bin") if path.is_file())
    return names, []


# Files a tokenizer loads from (fast, SentencePiece, BPE and WordPiece vocabularies); a model folder has one of them.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "tokenizer_config.json",
    "vocab.txt",
    "spiece.model",
)


def model_folder_problems(folder: Path, flag: str = "--model-name") -> list[str]:
    """What in a model folder would stop a run part-way, found before any process group or tokenising: weight files
    missing, cut short or with a broken header (safetensors headers read against the file size), JSON files that do
    not parse, and a tokenizer with more ids than the model's embedding has rows. Each problem names the file."""
    if rerun := unfinished_download(folder):  # files missing, cut short or of two commits: nothing else is certain
        return [f"{flag} {folder}: its download did not finish ({INCOMPLETE_DOWNLOAD}); finish it with: {rerun}"]
    names, problems = hf_weight_files(folder)
    redownload = "fetch the model again (model_download.py verifies what it downloads)"
    problems = [f"{flag} {folder}: {problem}; {redownload}" for problem in problems]
    if not names and (recorded := _recorded_weight_files(folder)):  # else: trained from random weights, silently
        problems.append(
            f"{flag} {folder}: no weight files, but {VERIFICATION_RECORD} lists {name_sample(recorded, 3)}: they "
            f"were moved or deleted; {redownload}"
        )
    for name in names:
        if name.endswith(".safetensors"):
            try:
                read_safetensors_header(folder / name)
            except (OSError, ValueError) as exc:
                problems.append(f"{flag}: {exc}; {redownload}")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            problems.append(f"{flag}: {path} is not valid JSON ({exc}); restore it or {redownload}")
    return problems or _vocabulary_problems(folder, flag)


def _recorded_weight_files(folder: Path) -> list[str]:
    """The weight files model_download.py verified in `folder` ([] without its record)."""
    try:
        record = json.loads((folder / VERIFICATION_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    files = record.get("weight_files") if isinstance(record, dict) else None
    return sorted(files) if isinstance(files, dict) else []


def _vocabulary_problems(folder: Path, flag: str) -> list[str]:
    """A tokenizer whose vocabulary, or whose special tokens the trainer inserts (BOS, EOS, padding), reach past the
    embedding: every such id would fail at its first forward. Added tokens beyond it (a tokenizer class that adds an
    unknown token on load, say) are left alone: the data may never hold them."""
    from transformers import AutoConfig, AutoTokenizer

    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        return [
            f"{flag} {folder}: no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); copy them from the model "
            "this one was made from, or fetch the model again"
        ]
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for files it cannot use
        said = " ".join(str(exc).split())  # transformers' messages run over several lines
        return [
            f"{flag}: cannot load the config or the tokenizer of {folder} ({type(exc).__name__}: {said}); restore "
            "the files, or fetch the model again"
        ]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    sizes = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    bad = {name: value for name in sizes if isinstance(value := getattr(text, name, None), int) and value < 1}
    if bad:
        return [
            f"{flag} {folder}: config.json has {', '.join(f'{k} {v}' for k, v in bad.items())}; sizes are 1 or "
            "more: restore config.json, or fetch the model again"
        ]
    rows = getattr(text, "vocab_size", None)
    inserted = [i for i in (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None]
    highest = max([tokenizer.vocab_size - 1, *inserted])
    if rows and highest >= rows:
        return [
            f"{flag} {folder}: the tokenizer has ids up to {highest:,} (vocabulary {tokenizer.vocab_size:,}, BOS/EOS/"
            f"padding {inserted}) but the model's embedding has {rows:,} rows (config.json vocab_size): ids {rows:,} "
            "and up would fail at their first step. Use the model's own tokenizer, or resize the embedding and save "
            "the model before training"
        ]
    return []


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


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str  # safetensors tag, e.g. "BF16"
    file: str


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor shapes and dtypes from a safetensors file's header, checking that the data is all there.

    Format: 8-byte little-endian header length N, N bytes of JSON, then the data; each tensor's data_offsets
    are relative to byte 8 + N. A file shorter than the largest end offset was cut off mid-download.
    """
    file_size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: {file_size} bytes, too short to be a safetensors file (truncated)")
        header_size = int.from_bytes(prefix, "little")
        if header_size > file_size - 8:
            raise ValueError(f"{path}: header claims {header_size} bytes but the file has {file_size} (truncated)")
        try:
            header = json.loads(handle.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: unreadable safetensors header ({exc}); the file is corrupt") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object; the file is corrupt")
    tensors: dict[str, TensorInfo] = {}
    data_end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(offset) for offset in entry["data_offsets"])
            shape, dtype = tuple(int(dim) for dim in entry["shape"]), str(entry["dtype"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: malformed header entry for tensor {name!r}; the file is corrupt") from exc
        expected_bytes = _numel(shape) * SAFETENSORS_DTYPE_BYTES.get(dtype, 0)
        if dtype in SAFETENSORS_DTYPE_BYTES and end - begin != expected_bytes:
            raise ValueError(f"{path}: tensor {name!r} spans {end - begin} bytes, its shape needs {expected_bytes}")
        tensors[name] = TensorInfo(shape, dtype, path.name)
        data_end = max(data_end, end)
    expected_size = 8 + header_size + data_end
    if file_size != expected_size:
        verdict = "is truncated" if file_size < expected_size else "has trailing bytes"
        raise ValueError(f"{path}: {file_size} bytes on disk, the header says {expected_size}: the file {verdict}")
    return tensors


def _numel(shape: Iterable[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
