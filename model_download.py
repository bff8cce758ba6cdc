"""Fetch a Hugging Face causal LM for offline training, or create a new one from a size preset.

Training machines have no internet. Run this once where there is a connection; it fills the Hugging Face
cache (HF_HOME) or a plain folder with exactly what training needs, then verifies offline that the model
loads and that every weight is present. After that everything works with HF_HUB_OFFLINE=1.

    # download into the cache ($HF_HOME/hub), then copy HF_HOME to the training machine
    export HF_HOME=$PWD/.cache/huggingface
    python model_download.py --model-name meta-llama/Llama-3.2-3B-Instruct      # token: HF_TOKEN or --token

    # download into a plain folder instead, at a pinned revision
    python model_download.py --model-name Qwen/Qwen2.5-0.5B --revision main --local-dir models/qwen0.5b

    # re-check an existing download without any network
    HF_HUB_OFFLINE=1 python model_download.py --model-name meta-llama/Llama-3.2-3B-Instruct --verify-only

    # a hub dataset into the cache, verified to load with HF_DATASETS_OFFLINE=1 (then fsdp_train.py -d ORG/NAME)
    python model_download.py --dataset ORG/NAME

    # a new model from scratch: Llama architecture + a BPE tokenizer trained on a data_hf.py dataset
    python model_download.py --init tiny --tokenizer-from hf_datasets/my_corpus --local-dir models/tiny --with-weights

Exit status: 0 on success, 1 when the download or the verification fails, 2 for invalid flags.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fsdp_lib.model.hf_files import BIN_INDEX, SAFETENSORS_INDEX, hf_weight_files, shards_from_index
from fsdp_lib.model.memory_plan import (
    format_bytes,
    format_count,
    format_memory_plan,
    format_peft_memory_plan,
    peft_memory_plan,
    training_memory_plan,
)

VERIFICATION_RECORD = "model_download_verified.json"
"""Written into the model folder only after verification passes; removed before any re-download."""

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",  # sentencepiece (Llama 2, Mistral, Gemma)
    "vocab.json",
    "merges.txt",  # GPT-2 style BPE
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)
MAX_SHARD_SIZE = "5GB"  # --with-weights shard size; also bounds the extra memory needed while saving

# bytes per element of each safetensors dtype tag (https://github.com/huggingface/safetensors format spec)
SAFETENSORS_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


class ToolError(Exception):
    """A failure the user can fix; the message names the flag, file or action."""


def log(message: str) -> None:
    print(message, flush=True)


# ---------------------------------------------------------------------------------------------------------
# Size presets (--init)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SizePreset:
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    default_vocab_size: int


# Llama-style shapes: 20M is a small GQA model for CPU runs (head_dim 64, 8/3 * hidden rounded to a multiple of
# 128); 125M is SmolLM-135M's shape (30 narrow layers, GQA 9/3; 135M there with its 49152 vocab);
# 350M is GPT-3-Medium-like; 1B/3B follow Llama-3.2-1B/3B (GQA, tied embeddings);
# 7B/13B follow Llama-2; 30B is LLaMA-1 33B; 70B is Llama-2-70B (GQA with 8 kv heads).
# intermediate_size as in those models; 350M uses Llama's 8/3 * hidden rounded up to a multiple of 256.
# Exact counts per vocabulary: preset_parameter_count (20M: 21,730,176 and 125M: 124,635,456 with 32000 tokens).
SIZE_PRESETS: dict[str, SizePreset] = {
    "tiny": SizePreset(2, 64, 4, 2, 176, 512, True, 1024),
    "20M": SizePreset(6, 384, 6, 2, 1024, 2048, True, 32000),
    "125M": SizePreset(30, 576, 9, 3, 1536, 2048, True, 32000),
    "350M": SizePreset(24, 1024, 16, 16, 2816, 4096, True, 32000),
    "1B": SizePreset(16, 2048, 32, 8, 8192, 4096, True, 32000),
    "3B": SizePreset(28, 3072, 24, 8, 8192, 4096, True, 32000),
    "7B": SizePreset(32, 4096, 32, 32, 11008, 4096, False, 32000),
    "13B": SizePreset(40, 5120, 40, 40, 13824, 4096, False, 32000),
    "30B": SizePreset(60, 6656, 52, 52, 17920, 4096, False, 32000),
    "70B": SizePreset(80, 8192, 64, 8, 28672, 4096, False, 32000),
}


def preset_config_kwargs(preset: SizePreset, vocab_size: int) -> dict[str, Any]:
    """LlamaConfig keyword arguments for a preset (special-token ids are added by the caller)."""
    return {
        "vocab_size": vocab_size,
        "hidden_size": preset.hidden_size,
        "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers,
        "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads,
        "max_position_embeddings": preset.max_position_embeddings,
        "tie_word_embeddings": preset.tie_word_embeddings,
    }


# --init size flags: (flag, SizePreset field) for custom shapes on top of a preset
SIZE_FLAGS: dict[str, str] = {
    "--num-layers": "num_hidden_layers",
    "--hidden-size": "hidden_size",
    "--num-heads": "num_attention_heads",
    "--num-kv-heads": "num_key_value_heads",
    "--intermediate-size": "intermediate_size",
}


def size_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The size flags the user passed, as {flag: value}."""
    given = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in SIZE_FLAGS}
    return {flag: value for flag, value in given.items() if value is not None}


def apply_size_overrides(preset: SizePreset, overrides: dict[str, int]) -> SizePreset:
    return replace(preset, **{SIZE_FLAGS[flag]: value for flag, value in overrides.items()})


def size_problems(preset_name: str, overrides: dict[str, int]) -> list[str]:
    """What makes a custom shape unbuildable, each naming the flag and the fix (the preset's own values count too)."""
    problems = [f"{flag} {value} must be a positive integer" for flag, value in overrides.items() if value < 1]
    if problems:
        return problems
    shape = apply_size_overrides(SIZE_PRESETS[preset_name], overrides)
    hidden, heads, kv_heads = shape.hidden_size, shape.num_attention_heads, shape.num_key_value_heads

    def source(flag: str, value: int) -> str:
        return f"{flag} {value}" if flag in overrides else f"{flag} {value} (preset {preset_name})"

    if hidden % heads:
        problems.append(
            f"{source('--hidden-size', hidden)} is not divisible by {source('--num-heads', heads)}: each head gets"
            f" hidden/heads dimensions; pick --num-heads dividing {hidden} (e.g. {hidden // 64 or 1} for head size 64)"
            " or a --hidden-size that is a multiple of it"
        )
    elif (hidden // heads) % 2:
        problems.append(
            f"{source('--hidden-size', hidden)} / {source('--num-heads', heads)} = head size {hidden // heads}, which"
            " is odd; rotary position embeddings need an even head size: change --num-heads or --hidden-size"
        )
    if heads % kv_heads:
        problems.append(
            f"{source('--num-heads', heads)} is not divisible by {source('--num-kv-heads', kv_heads)}: grouped-query"
            f" attention shares each kv head among heads/kv-heads query heads; pick --num-kv-heads dividing {heads}"
        )
    return problems


def describe_init(preset_name: str, overrides: dict[str, int]) -> str:
    """`--init 125M --num-layers 12`: how the user asked for this shape, for logs and the verification record."""
    return " ".join([f"--init {preset_name}", *(f"{flag} {value}" for flag, value in overrides.items())])


def preset_parameter_count(preset: SizePreset, vocab_size: int) -> int:
    """Exact parameter count of a preset Llama model (no biases; tied embeddings counted once)."""
    hidden, head_dim = preset.hidden_size, preset.hidden_size // preset.num_attention_heads
    attention = 2 * hidden * preset.num_attention_heads * head_dim + 2 * hidden * preset.num_key_value_heads * head_dim
    mlp = 3 * hidden * preset.intermediate_size  # gate, up, down (SwiGLU)
    per_layer = attention + mlp + 2 * hidden  # + input and post-attention RMSNorm weights
    embeddings = vocab_size * hidden * (1 if preset.tie_word_embeddings else 2)
    return preset.num_hidden_layers * per_layer + embeddings + hidden  # + final norm


# ---------------------------------------------------------------------------------------------------------
# Which files to fetch (pure)
# ---------------------------------------------------------------------------------------------------------


@dataclass
class DownloadPlan:
    metadata_files: list[str]
    """config, generation config, tokenizer files and the weight index, fetched first."""
    weight_format: str  # "safetensors" or "bin"
    index_file: str | None
    """When set, the weight files are the shards named in its weight_map."""
    weight_files: list[str] = field(default_factory=list)
    """The weight files when there is no index."""


def plan_download(repo_files: Iterable[str]) -> DownloadPlan:
    """Choose what training needs from a repository listing: safetensors preferred, .bin only as a fallback.

    Only top-level files: subfolders hold other formats (e.g. Meta's original/ checkpoints) training never reads.
    """
    top_level = sorted(name for name in set(repo_files) if "/" not in name)
    if "config.json" not in top_level:
        raise ToolError("the repository has no config.json; it is not a transformers model")
    metadata = [name for name in top_level if name in CONFIG_FILES or name in TOKENIZER_FILES]
    safetensors_files = [
        name
        for name in top_level
        if name.endswith(".safetensors") and not name.startswith(("consolidated", "adapter_model"))
    ]
    bin_files = [name for name in top_level if name.startswith("pytorch_model") and name.endswith(".bin")]
    if SAFETENSORS_INDEX in top_level:
        return DownloadPlan(metadata + [SAFETENSORS_INDEX], "safetensors", SAFETENSORS_INDEX)
    if safetensors_files:
        return DownloadPlan(metadata, "safetensors", None, safetensors_files)
    if BIN_INDEX in top_level:
        return DownloadPlan(metadata + [BIN_INDEX], "bin", BIN_INDEX)
    if bin_files:
        return DownloadPlan(metadata, "bin", None, bin_files)
    raise ToolError(
        "the repository has no weights in safetensors or PyTorch .bin format "
        f"(top-level files: {', '.join(top_level) or 'none'})"
    )


def glob_escape(name: str) -> str:
    """allow_patterns are fnmatch patterns: escape [, ] , * and ? so a filename matches only itself."""
    return "".join(f"[{char}]" if char in "[]*?" else char for char in name)


# ---------------------------------------------------------------------------------------------------------
# Checkpoint inspection: safetensors headers, .bin metadata, comparison with the architecture
# ---------------------------------------------------------------------------------------------------------


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
            raise ToolError(f"{path}: {file_size} bytes, too short to be a safetensors file (truncated)")
        header_size = int.from_bytes(prefix, "little")
        if header_size > file_size - 8:
            raise ToolError(f"{path}: header claims {header_size} bytes but the file has {file_size} (truncated)")
        try:
            header = json.loads(handle.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ToolError(f"{path}: unreadable safetensors header ({exc}); the file is corrupt") from exc
    if not isinstance(header, dict):
        raise ToolError(f"{path}: safetensors header is not a JSON object; the file is corrupt")
    tensors: dict[str, TensorInfo] = {}
    data_end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(offset) for offset in entry["data_offsets"])
            shape, dtype = tuple(int(dim) for dim in entry["shape"]), str(entry["dtype"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ToolError(f"{path}: malformed header entry for tensor {name!r}; the file is corrupt") from exc
        expected_bytes = _numel(shape) * SAFETENSORS_DTYPE_BYTES.get(dtype, 0)
        if dtype in SAFETENSORS_DTYPE_BYTES and end - begin != expected_bytes:
            raise ToolError(f"{path}: tensor {name!r} spans {end - begin} bytes, its shape needs {expected_bytes}")
        tensors[name] = TensorInfo(shape, dtype, path.name)
        data_end = max(data_end, end)
    expected_size = 8 + header_size + data_end
    if file_size != expected_size:
        verdict = "truncated" if file_size < expected_size else "has trailing bytes"
        raise ToolError(f"{path}: {file_size} bytes on disk, the header says {expected_size}: the file {verdict}")
    return tensors


def read_bin_checkpoint(path: Path) -> dict[str, TensorInfo]:
    """Tensor shapes and dtypes of a PyTorch .bin file; mmap keeps the tensor data on disk."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # torch raises RuntimeError/pickle errors/EOFError for damaged archives
        raise ToolError(f"{path}: cannot read PyTorch checkpoint ({exc}); the file is truncated or corrupt") from exc
    tags = {"torch.float16": "F16", "torch.bfloat16": "BF16", "torch.float32": "F32", "torch.float64": "F64"}
    return {
        name: TensorInfo(tuple(tensor.shape), tags.get(str(tensor.dtype), str(tensor.dtype)), path.name)
        for name, tensor in state.items()
    }


def _numel(shape: Iterable[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def read_checkpoint(folder: Path, files: list[str]) -> tuple[dict[str, TensorInfo], list[str]]:
    """All tensors in the given weight files, plus one problem line per unreadable or truncated file."""
    tensors: dict[str, TensorInfo] = {}
    problems: list[str] = []
    for name in files:
        try:
            reader = read_safetensors_header if name.endswith(".safetensors") else read_bin_checkpoint
            tensors.update(reader(folder / name))
        except ToolError as exc:
            problems.append(str(exc))
    return tensors, problems


@dataclass(frozen=True)
class ExpectedTensor:
    shape: tuple[int, ...]
    is_parameter: bool


def compare_checkpoint(
    expected: dict[str, ExpectedTensor],
    tied_groups: list[list[str]],
    found: dict[str, TensorInfo],
    base_model_prefix: str = "",
) -> tuple[list[str], list[str]]:
    """(problems, notes) from comparing the tensors an architecture expects with those in the checkpoint.

    A tied group (e.g. lm_head.weight and model.embed_tokens.weight) needs only one member stored. Missing
    parameters and wrong shapes or non-float dtypes are problems; missing persistent buffers and extra tensors
    are notes, because transformers recomputes or ignores those.
    """
    found = _align_prefix(found, set(expected), base_model_prefix)
    tied_alias = {name: group for group in tied_groups for name in group}
    problems: list[str] = []
    notes: list[str] = []
    missing_params, missing_buffers = [], []
    for name, want in expected.items():
        stored = next((alias for alias in tied_alias.get(name, [name]) if alias in found), None)
        if stored is None:
            (missing_params if want.is_parameter else missing_buffers).append(name)
            continue
        have = found[stored]
        if have.shape != want.shape:
            problems.append(
                f"{stored} in {have.file}: shape {list(have.shape)}, the architecture needs {list(want.shape)}"
            )
        if want.is_parameter and have.dtype not in FLOAT_DTYPES:
            problems.append(f"{stored} in {have.file}: dtype {have.dtype} is not a float type (quantized checkpoint?)")
    if missing_params:
        problems.append(f"{len(missing_params)} parameter(s) missing from the checkpoint: {_sample(missing_params)}")
    if missing_buffers:
        notes.append(
            f"{len(missing_buffers)} buffer(s) not stored, transformers will recompute: {_sample(missing_buffers)}"
        )
    extra = sorted(set(found) - {alias for name in expected for alias in tied_alias.get(name, [name])})
    if extra:
        notes.append(f"{len(extra)} tensor(s) in the checkpoint the architecture does not use: {_sample(extra)}")
    return problems, notes


def _align_prefix(found: dict[str, TensorInfo], expected: set[str], prefix: str) -> dict[str, TensorInfo]:
    """Base-model checkpoints (e.g. GPT-2's) omit the 'transformer.' prefix that the LM-head model adds."""
    if not prefix or any(name in expected for name in found):
        return found
    return {f"{prefix}.{name}" if f"{prefix}.{name}" in expected else name: info for name, info in found.items()}


def _sample(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def checkpoint_dtype_summary(found: dict[str, TensorInfo]) -> str:
    counts: dict[str, int] = {}
    for info in found.values():
        counts[info.dtype] = counts.get(info.dtype, 0) + 1
    parts = [
        f"{FLOAT_DTYPES.get(tag, tag)} ({count} tensors)"
        for tag, count in sorted(counts.items(), key=lambda kv: -kv[1])
    ]
    return ", ".join(parts) or "no tensors"


# ---------------------------------------------------------------------------------------------------------
# Offline verification
# ---------------------------------------------------------------------------------------------------------


@dataclass
class VerifiedModel:
    folder: Path
    architecture: str
    num_params: int
    largest_unit_params: int
    linear_params: int  # the decoder layers' Linear weights (NF4 under --peft qlora)
    lora_params: int  # rank-16 adapters on every decoder-layer Linear (--peft lora/qlora defaults)
    dtype_summary: str
    weight_files: dict[str, int]
    size_on_disk: int
    tokenizer_summary: str
    notes: list[str]


def verify_model(folder: Path, load_name: str, revision: str | None, require_weights: bool) -> VerifiedModel:
    """Load config and tokenizer offline, build the model on the meta device, check every weight is on disk.

    `load_name` is what training will pass to from_pretrained (a hub id resolved in the cache, or the folder).
    Raises ToolError listing every problem found.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    problems: list[str] = []
    kwargs = {"revision": revision, "local_files_only": True} if revision else {"local_files_only": True}
    try:
        config = AutoConfig.from_pretrained(load_name, **kwargs)
    except Exception as exc:
        raise ToolError(f"config of {load_name} does not load offline from {folder}: {exc}") from exc
    tokenizer_summary, tokenizer_problems = _check_tokenizer(load_name, kwargs, config)
    problems += tokenizer_problems
    try:
        with torch.device("meta"):  # shapes only: no memory for weights, however large the model
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:
        raise ToolError(f"cannot build {config.model_type} as a causal LM from {folder}/config.json: {exc}") from exc
    files, weight_problems = hf_weight_files(folder)
    problems += weight_problems
    notes: list[str] = []
    found: dict[str, TensorInfo] = {}
    if not files and not weight_problems and require_weights:
        problems.append(f"no weight files (*.safetensors or pytorch_model*.bin) in {folder}")
    if files:
        found, read_problems = read_checkpoint(folder, files)
        problems += read_problems
        if not read_problems:
            compare_problems, notes = _compare_with_model(model, found)
            problems += compare_problems
    if problems:
        raise ToolError("verification failed:\n  - " + "\n  - ".join(problems))
    return VerifiedModel(
        folder=folder,
        architecture=f"{type(model).__name__} ({config.model_type})",
        num_params=sum(param.numel() for param in model.parameters()),
        largest_unit_params=largest_fsdp_unit_params(model),
        **dict(zip(("linear_params", "lora_params"), decoder_linear_params(model, LORA_RANK))),
        dtype_summary=checkpoint_dtype_summary(found) if files else "no weights (the trainer initialises them)",
        weight_files={name: (folder / name).stat().st_size for name in files},
        size_on_disk=_folder_size(folder),
        tokenizer_summary=tokenizer_summary,
        notes=notes,
    )


def _folder_size(folder: Path) -> int:
    """Bytes of the model's files (cache snapshots are symlinks: stat follows them to the blobs)."""
    files = [path for path in folder.rglob("*") if ".cache" not in path.relative_to(folder).parts]
    return sum(path.stat().st_size for path in files if path.is_file())


def _check_tokenizer(load_name: str, kwargs: dict[str, Any], config: Any) -> tuple[str, list[str]]:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(load_name, **kwargs)
    except Exception as exc:
        return "", [f"tokenizer does not load offline: {exc}"]
    summary = (
        f"{type(tokenizer).__name__}, {len(tokenizer)} tokens, bos={tokenizer.bos_token!r} eos={tokenizer.eos_token!r}"
        f" pad={tokenizer.pad_token!r}"
    )
    vocab_size = getattr(config, "vocab_size", None) or getattr(config.get_text_config(), "vocab_size", None)
    if vocab_size is not None and len(tokenizer) > vocab_size:  # real for added tokens the data never contains
        summary += f"; note: {len(tokenizer)} tokens > config.vocab_size {vocab_size}, the extra ids would overflow"
    return summary, []


def _compare_with_model(model: Any, found: dict[str, TensorInfo]) -> tuple[list[str], list[str]]:
    """Name-by-name and shape-by-shape check of what from_pretrained would make of the checkpoint."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    groups: dict[int, list[str]] = {}
    for name, param in parameters.items():
        groups.setdefault(id(param), []).append(name)
    tied_groups = [names for names in groups.values() if len(names) > 1]
    state = model.state_dict()  # excludes non-persistent buffers such as rotary inv_freq
    expected = {name: ExpectedTensor(tuple(tensor.shape), name in parameters) for name, tensor in state.items()}
    converted, problems = converted_checkpoint_layout(model, found)
    compare_problems, notes = compare_checkpoint(
        expected, tied_groups, converted, getattr(model, "base_model_prefix", "")
    )
    return problems + compare_problems, notes


def converted_checkpoint_layout(model: Any, found: dict[str, TensorInfo]) -> tuple[dict[str, TensorInfo], list[str]]:
    """The checkpoint's tensors as from_pretrained sees them: names and shapes after the installed transformers'
    own key and layout conversions (e.g. Mixtral's per-expert w1/w3 stacked into mlp.experts.gate_up_proj).

    The conversions run on meta tensors, so nothing is read from disk. Keys are routed as
    transformers.core_model_loading does: all renamings, then at most one converter, then the base-model prefix.
    """
    import copy

    import torch

    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:  # transformers 4.x loads checkpoint keys as they are
        return found, []
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", "")
    model_keys = dict.fromkeys(model.state_dict(), True)
    layout: dict[str, TensorInfo] = {}
    pending: dict[str, tuple[Any, TensorInfo]] = {}
    for key in sorted(found, key=dot_natural_key):  # experts.2 before experts.10: the stacking order
        target, pattern = rename_source_key(key, renamings, converters, prefix, model_keys)
        if target not in model_keys:
            target, pattern = rename_source_key(key, [], [], prefix, model_keys)
        if pattern is None or target not in model_keys:
            layout[target if pattern is None else key] = found[key]
            continue
        converter, first_info = pending.setdefault(target, (copy.deepcopy(by_pattern[pattern]), found[key]))
        converter.add_tensor(target, key, pattern, torch.empty(found[key].shape, device="meta"))
    problems = []
    for target, (converter, info) in pending.items():
        try:
            produced = converter.convert(target, model=model, config=model.config)
        except Exception as exc:  # noqa: BLE001 - e.g. experts of different shapes cannot be stacked
            problems.append(f"{target}: transformers cannot build it from the checkpoint's tensors ({exc})")
            continue
        for name, tensor in produced.items():
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            layout[name] = TensorInfo(tuple(tensor.shape), info.dtype, info.file)
    return layout, problems


LORA_RANK = 16  # fsdp_train.py's --lora-rank default, for the memory table


def decoder_linear_params(model: Any, rank: int) -> tuple[int, int]:
    """(weights of the Linear layers inside the decoder layers, parameters of rank-`rank` adapters on them): the
    sizes of fsdp_train.py's --peft qlora base and --peft lora adapters, counted by the trainer's own rules;
    (0, 0) when the trainer would not find the decoder layers (the --peft table is then left out)."""
    from fsdp_lib.errors import TrainError
    from fsdp_lib.model.anatomy import find_decoder_layers, peft_sizes

    try:
        return peft_sizes(model, find_decoder_layers(model), rank)
    except TrainError:
        return 0, 0


def largest_fsdp_unit_params(model: Any) -> int:
    """Parameters of the largest unit FSDP all-gathers at once: one decoder layer, or the root's remainder
    (embeddings, final norm, untied LM head), which is larger for big vocabularies."""
    import torch

    layers = next((module for module in model.modules() if isinstance(module, torch.nn.ModuleList)), None)
    total = sum(param.numel() for param in model.parameters())
    if layers is None or len(layers) == 0:
        return total
    per_layer = [sum(param.numel() for param in layer.parameters()) for layer in layers]
    return max(max(per_layer), total - sum(per_layer))


def report_verified(model: VerifiedModel, source: str) -> None:
    weights = sum(model.weight_files.values())
    log(f"verified {source}")
    log(f"  folder:       {model.folder}")
    log(f"  architecture: {model.architecture}")
    log(f"  parameters:   {model.num_params:,} ({format_count(model.num_params)})")
    log(f"  dtype:        {model.dtype_summary}")
    log(
        f"  size on disk: {format_bytes(model.size_on_disk)}"
        f" ({len(model.weight_files)} weight file(s), {format_bytes(weights)})"
    )
    log(f"  tokenizer:    {model.tokenizer_summary}")
    for note in model.notes:
        log(f"  note: {note}")
    full_rows = training_memory_plan(model.num_params, largest_unit_params=model.largest_unit_params)
    log(format_memory_plan(full_rows))
    if not model.linear_params:
        return
    peft_rows = peft_memory_plan(
        model.num_params, model.linear_params, model.lora_params, largest_unit_params=model.largest_unit_params
    )
    log(format_peft_memory_plan(full_rows, peft_rows, LORA_RANK))


def write_verification_record(model: VerifiedModel, source: dict[str, Any]) -> Path:
    """Mark the folder verified; written atomically so a crash never leaves a half record."""
    record = {
        "verified_by": "model_download.py",
        "verified_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": source,
        "num_params": model.num_params,
        "dtype": model.dtype_summary,
        "weight_files": model.weight_files,
    }
    path = model.folder / VERIFICATION_RECORD
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def read_verification_record(folder: str | Path) -> dict[str, Any] | None:
    """The record of a passed verification, or None when absent or when a weight file changed size since."""
    path = Path(folder) / VERIFICATION_RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    for name, size in record.get("weight_files", {}).items():
        weight = Path(folder) / name
        if not weight.is_file() or weight.stat().st_size != size:
            return None
    return record


def remove_verification_record(folder: Path) -> None:
    (folder / VERIFICATION_RECORD).unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------------------
# Download
# ---------------------------------------------------------------------------------------------------------

OFFLINE_HINT = "on an offline machine copy HF_HOME from one that has internet"


def offline_mode_message(repo_id: str) -> str:
    return (
        f"HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set, so {repo_id} cannot be downloaded; unset it for the download"
    )


def explain_hub_error(exc: BaseException, repo_id: str, revision: str, flag: str = "--model-name") -> str | None:
    """A message naming the cause and the fix for an exception raised while talking to the hub, or None.

    Looks through the whole __cause__/__context__ chain: huggingface_hub often wraps the real error (a refused
    connection inside LocalEntryNotFoundError, an ENOSPC inside its own OSError).
    """
    from huggingface_hub import errors as hub_errors

    chain = _exception_chain(exc)
    names = {cls.__name__ for error in chain for cls in type(error).__mro__}

    def first(cls: type[BaseException]) -> Any:
        return next((error for error in chain if isinstance(error, cls)), None)

    http_error = first(hub_errors.HfHubHTTPError)
    status = getattr(getattr(http_error, "response", None), "status_code", None)
    if any(isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT) for error in chain):
        return (
            f"disk full while downloading {repo_id} ({_first_line(exc)}); free space or point HF_HOME / --local-dir"
            " at a larger disk, then rerun: files already complete are kept"
        )
    if "OfflineModeIsEnabled" in names:
        return offline_mode_message(repo_id)
    if first(hub_errors.GatedRepoError):
        return (
            f"{repo_id} is gated: accept its licence at https://huggingface.co/{repo_id} while logged in, then pass"
            " a token with read access (HF_TOKEN=... or --token)"
        )
    if first(hub_errors.RevisionNotFoundError):
        return f"revision {revision!r} not found in {repo_id}; check --revision (a branch, tag or commit hash)"
    if first(hub_errors.RepositoryNotFoundError):
        return (
            f"repository {repo_id} not found, or it is private or gated and you are not authorised: check"
            f" {flag}, and pass a token (HF_TOKEN=... or --token) if it is private or gated"
        )
    if status in (401, 403):
        return (
            f"not authorised to download {repo_id} (HTTP {status}): pass a valid token (HF_TOKEN=... or --token);"
            " a fine-grained token needs read access to this repo, or to public gated repos"
        )
    if status is not None and status >= 500:
        return f"the hub answered HTTP {status} for {repo_id} ({_first_line(http_error)}); retry later"
    if names & {"ConnectError", "ConnectionError", "TimeoutException", "Timeout", "NetworkError", "ProxyError"}:
        return (
            f"cannot reach the hub ({_first_line(exc)}); {OFFLINE_HINT}. With internet, check HF_ENDPOINT and proxies"
        )
    if "RemoteProtocolError" in names or "Consistency check failed" in str(exc):
        return f"the connection dropped while downloading {repo_id} ({_first_line(exc)}); rerun to resume"
    if first(hub_errors.LocalEntryNotFoundError):
        return f"cannot reach the hub ({_first_line(exc)}); {OFFLINE_HINT}"
    if http_error is not None:
        return f"the hub answered HTTP {status} for {repo_id} ({_first_line(http_error)})"
    return None


def _exception_chain(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def check_free_space(needed_bytes: int, free_bytes: int, where: Path) -> None:
    """Refuse up front rather than fail at 90% of a 140 GB download; keeps 1% + 100 MB of slack."""
    margin = needed_bytes // 100 + 100_000_000
    if needed_bytes + margin > free_bytes:
        raise ToolError(
            f"not enough disk space in {where}: the download needs {format_bytes(needed_bytes)},"
            f" {format_bytes(free_bytes)} free; free space or point HF_HOME / --local-dir at a larger disk"
        )


def free_disk_bytes(path: Path) -> int:
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    return shutil.disk_usage(existing).free


@dataclass
class HubSnapshot:
    """One download: where it goes and what the hub said about the repository."""

    repo_id: str
    revision: str
    local_dir: Path | None
    token: str | None
    force: bool
    commit: str
    sizes: dict[str, int]
    repo_type: str = "model"

    def fetch(self, files: list[str]) -> Path:
        """Download these files (skipping complete ones) and return the folder holding them."""
        from huggingface_hub import snapshot_download

        folder = snapshot_download(
            self.repo_id,
            repo_type=self.repo_type,
            revision=self.revision,
            local_dir=self.local_dir,
            token=self.token,
            allow_patterns=[glob_escape(name) for name in files],
            force_download=self.force,
        )
        return Path(folder)

    def is_present(self, name: str) -> bool:
        if self.local_dir is not None:
            path = self.local_dir / name
            return path.is_file() and path.stat().st_size == self.sizes[name]
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(self.repo_id, name, revision=self.commit, repo_type=self.repo_type)
        return isinstance(cached, str)


def download_model(repo_id: str, revision: str, local_dir: Path | None, token: str | None, force: bool) -> Path:
    """Fetch config, tokenizer and weights; return the folder holding them (cache snapshot or local_dir).

    Files already complete are skipped, so rerunning after an interruption fetches only what is missing;
    a connection dropped mid-file is resumed with an HTTP Range request by huggingface_hub.
    """
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        raise ToolError(offline_mode_message(repo_id))
    info = HfApi(token=token).model_info(repo_id, revision=revision, files_metadata=True)
    sizes = {sibling.rfilename: sibling.size or 0 for sibling in info.siblings or []}
    snapshot = HubSnapshot(repo_id, revision, local_dir, token, force, info.sha or revision, sizes)
    plan = plan_download(sizes)
    # Before the index is read, every weight file of the chosen format bounds what the shards need.
    weight_bound = plan.weight_files or [name for name in sizes if _is_weight_file(name, plan.weight_format)]
    needed = sum(sizes[name] for name in plan.metadata_files + weight_bound if force or not snapshot.is_present(name))
    target = local_dir or Path(constants.HF_HUB_CACHE)
    check_free_space(needed, free_disk_bytes(target), target)

    log(f"{repo_id} @ {revision} (commit {info.sha}): fetching {len(plan.metadata_files)} config/tokenizer files")
    folder = snapshot.fetch(plan.metadata_files)
    remove_verification_record(folder)  # from here until verification passes, the folder is not complete
    weights = plan.weight_files
    if plan.index_file:
        try:
            weights = shards_from_index(json.loads((folder / plan.index_file).read_text()), plan.index_file)
        except ValueError as exc:  # json's decode error is a ValueError too
            raise ToolError(f"{plan.index_file} of {repo_id} is not a valid index ({exc})") from exc
        absent = [name for name in weights if name not in sizes]
        if absent:
            raise ToolError(f"{plan.index_file} of {repo_id} lists shards the repository lacks: {_sample(absent)}")
    weight_bytes = format_bytes(sum(sizes[name] for name in weights))
    log(f"fetching {len(weights)} weight file(s), {weight_bytes} ({plan.weight_format})")
    if snapshot.fetch(weights) != folder:
        raise ToolError(f"{repo_id} @ {revision} moved to a new commit during the download; rerun")
    _note_partial_files(folder)
    return folder


def _is_weight_file(name: str, weight_format: str) -> bool:
    if "/" in name:
        return False
    if weight_format == "safetensors":
        return name.endswith(".safetensors") and not name.startswith(("consolidated", "adapter_model"))
    return name.startswith("pytorch_model") and name.endswith(".bin")


def _note_partial_files(folder: Path) -> None:
    """huggingface_hub 2.x names partial files uniquely per attempt: one a killed run left is never reused."""
    in_cache = folder.parent.name == "snapshots"
    where = folder.parent.parent / "blobs" if in_cache else folder / ".cache" / "huggingface"
    stale = [path for path in where.rglob("*.incomplete") if path.is_file()] if where.is_dir() else []
    if stale:
        total = format_bytes(sum(path.stat().st_size for path in stale))
        log(f"note: {len(stale)} partial file(s), {total}, left by interrupted runs in {where}")
        log("      safe to delete when no other download is running")


def run_download(args: argparse.Namespace) -> int:
    local_dir = Path(args.local_dir).resolve() if args.local_dir else None
    try:
        folder = download_model(args.model_name, args.revision, local_dir, args.token, args.force_download)
    except ToolError:
        raise
    except Exception as exc:
        message = explain_hub_error(exc, args.model_name, args.revision)
        if message is None:
            raise
        raise ToolError(message) from exc
    source = {"model_name": args.model_name, "revision": args.revision, "commit": None if local_dir else folder.name}
    if local_dir is None:  # verify exactly as training will load it: by hub id, from the cache, offline
        return run_verification(folder, args.model_name, args.revision, source, require_weights=True)
    return run_verification(folder, str(folder), None, source, require_weights=True)


def download_dataset(repo_id: str, revision: str, token: str | None, force: bool) -> Path:
    """Fetch every file of a hub dataset repository into the HF_HOME cache; return its snapshot folder.

    The same machinery as download_model: a free-space check up front, complete files skipped on a rerun,
    interrupted files resumed by huggingface_hub."""
    from huggingface_hub import HfApi, constants

    if constants.HF_HUB_OFFLINE:
        raise ToolError(offline_mode_message(repo_id))
    info = HfApi(token=token).dataset_info(repo_id, revision=revision, files_metadata=True)
    sizes = {sibling.rfilename: sibling.size or 0 for sibling in info.siblings or []}
    if not sizes:
        raise ToolError(f"dataset repository {repo_id} @ {revision} has no files; check --dataset and --revision")
    snapshot = HubSnapshot(repo_id, revision, None, token, force, info.sha or revision, sizes, repo_type="dataset")
    needed = sum(size for name, size in sizes.items() if force or not snapshot.is_present(name))
    target = Path(constants.HF_HUB_CACHE)
    check_free_space(needed, free_disk_bytes(target), target)
    log(f"dataset {repo_id} @ {revision} (commit {info.sha}): fetching {len(sizes)} file(s), {format_bytes(needed)}")
    folder = snapshot.fetch(sorted(sizes))
    _note_partial_files(folder)
    return folder


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


def verify_dataset(repo_id: str, revision: str) -> dict[str, dict[str, Any]]:
    """Load the cached dataset as fsdp_train.py -d will, in a fresh interpreter with HF_DATASETS_OFFLINE=1 and
    HF_HUB_OFFLINE=1 (both are read at import); {split: {"rows", "columns"}}."""
    import subprocess

    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    here = str(Path(__file__).resolve().parent)
    result = subprocess.run(
        [sys.executable, "-c", DATASET_CHECK, here, repo_id, revision], env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        detail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise ToolError(
            f"--dataset {repo_id}: downloaded, but it does not load offline (HF_DATASETS_OFFLINE=1): {detail}\n"
            "  fix: rerun with --force-download if a file is corrupt; the files must be parquet, json/jsonl, csv or"
            " text that the datasets library reads"
        )
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_dataset_download(args: argparse.Namespace) -> int:
    try:
        download_dataset(args.dataset, args.revision, args.token, args.force_download)
    except ToolError:
        raise
    except Exception as exc:
        message = explain_hub_error(exc, args.dataset, args.revision, flag="--dataset")
        if message is None:
            raise
        raise ToolError(message) from exc
    splits = verify_dataset(args.dataset, args.revision)
    log(f"verified offline: dataset {args.dataset} @ {args.revision} loads with HF_DATASETS_OFFLINE=1")
    for name, split in splits.items():
        log(f"  {name}: {split['rows']:,} rows, columns {', '.join(split['columns'])}")
    columns = set(splits.get("train", {}).get("columns", []))
    if "train" not in splits:
        log("  note: no 'train' split; fsdp_train.py -d needs one")
    elif not columns & {"text", "messages"}:
        log("  note: no 'text' or 'messages' column; train with fsdp_train.py -d ... --text-column NAME")
    hf_home = os.environ.get("HF_HOME", "~/.cache/huggingface")
    log(f"offline use: export HF_HOME={hf_home}, then fsdp_train.py -d {args.dataset}")
    if args.revision != "main":
        log(
            f"  note: fsdp_train.py -d {args.dataset} reads the cached 'main' revision only; fetch it too (no"
            " --revision) to train on this dataset"
        )
    return 0


def run_verify_only(args: argparse.Namespace) -> int:
    if args.local_dir:
        folder = Path(args.local_dir).resolve()
        if not (folder / "config.json").is_file():
            raise ToolError(f"--local-dir {folder} has no config.json; download or --init the model first")
        previous = read_verification_record(folder) or {}
        source = previous.get("source") or {"local_dir": str(folder)}
        # Only an --init folder made without --with-weights may lack weights; anything else without them is broken.
        weightless_init = "init" in source and not previous.get("weight_files")
        return run_verification(folder, str(folder), None, source, require_weights=not weightless_init)
    from huggingface_hub import constants, try_to_load_from_cache

    cached = try_to_load_from_cache(args.model_name, "config.json", revision=args.revision)
    if not isinstance(cached, str):
        raise ToolError(
            f"{args.model_name} @ {args.revision} is not in the cache {constants.HF_HUB_CACHE}: run"
            f" `python model_download.py --model-name {args.model_name}` where there is internet; {OFFLINE_HINT}"
        )
    folder = Path(cached).parent
    source = {"model_name": args.model_name, "revision": args.revision, "commit": folder.name}
    return run_verification(folder, args.model_name, args.revision, source, require_weights=True)


def run_verification(
    folder: Path, load_name: str, revision: str | None, source: dict[str, Any], require_weights: bool
) -> int:
    remove_verification_record(folder)  # a rerun re-verifies; a failure must not leave an old record behind
    try:
        verified = verify_model(folder, load_name, revision, require_weights)
    except ToolError as exc:
        raise ToolError(f"{exc}\n  fix: rerun the download (add --force-download if a file is corrupt)") from exc
    report_verified(verified, load_name + (f" @ {revision}" if revision else ""))
    log(f"wrote {write_verification_record(verified, source)}")
    if revision:
        hf_home = os.environ.get("HF_HOME", "~/.cache/huggingface")
        log(f"offline use: export HF_HOME={hf_home} HF_HUB_OFFLINE=1, then load {load_name} by name")
    return 0


# ---------------------------------------------------------------------------------------------------------
# From scratch (--init)
# ---------------------------------------------------------------------------------------------------------

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
TEXT_BATCH_SIZE = 1000


def check_init_target(path: Path, overwrite: bool) -> None:
    """Refuse to clobber a non-empty folder; --overwrite replaces only something that is a model folder."""
    if not path.exists():
        return
    if not path.is_dir():
        raise ToolError(f"--local-dir {path} exists and is not a folder")
    if not any(path.iterdir()):
        return
    if not overwrite:
        raise ToolError(
            f"--local-dir {path} is not empty; pass --overwrite to replace the model in it, or pick a new folder"
        )
    if not (path / "config.json").is_file():
        raise ToolError(
            f"--local-dir {path} does not look like a model folder (no config.json); --overwrite refuses it:"
            " delete it yourself"
        )


def available_memory_bytes() -> int:
    """Memory the process can allocate without swapping (MemAvailable), or free pages where /proc is absent."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def weights_memory_needed(num_params: int, dtype_bytes: int) -> int:
    """The model in memory, plus one shard's serialised copy while save_pretrained writes it, plus 0.5 GB."""
    model_bytes = num_params * dtype_bytes
    return model_bytes + min(model_bytes, 5_000_000_000) + 500_000_000


def check_weights_fit(num_params: int, dtype_bytes: int, available: int, disk_free: int, folder: Path) -> None:
    needed = weights_memory_needed(num_params, dtype_bytes)
    if needed > available:
        raise ToolError(
            f"--with-weights needs about {format_bytes(needed)} of memory for {format_count(num_params)} parameters,"
            f" {format_bytes(available)} is available; drop --with-weights (the trainer then initialises the weights"
            " itself, sharded) or run on a machine with more memory"
        )
    if num_params * dtype_bytes > disk_free:
        raise ToolError(
            f"--with-weights needs {format_bytes(num_params * dtype_bytes)} on disk in {folder},"
            f" {format_bytes(disk_free)} free"
        )


def load_tokenizer_corpus(path: Path) -> Any:
    """The train split of a dataset written by data_hf.py; reading that format is data_hf.py's job."""
    from data_hf import load_text_dataset

    try:
        dataset, _ = load_text_dataset(path)
    except ValueError as exc:
        raise ToolError(f"--tokenizer-from: {exc}") from exc
    if len(dataset) == 0:
        raise ToolError(f"--tokenizer-from {path} has no rows")
    return dataset


def iter_text_batches(dataset: Any, batch_size: int = TEXT_BATCH_SIZE) -> Iterator[list[str]]:
    """Batches of the text column read from the memory-mapped Arrow files; the column is never materialised."""
    for batch in dataset.select_columns(["text"]).iter(batch_size=batch_size):
        yield [text for text in batch["text"] if text]


def train_bpe_tokenizer(
    batches: Iterable[list[str]], vocab_size: int, model_max_length: int, num_texts: int | None = None
) -> Any:
    """A byte-level BPE tokenizer (lossless on any UTF-8 text) that prepends BOS, like Llama 3's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknown tokens, ever
        show_progress=False,
    )
    tokenizer.train_from_iterator(batches, trainer=trainer, length=num_texts)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,  # keeps decode(encode(s)) == s
    )


def build_tokenizer(args: argparse.Namespace, preset: SizePreset) -> Any:
    if args.tokenizer:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        except Exception as exc:
            raise ToolError(
                f"--tokenizer {args.tokenizer} does not load offline (pass a folder, or a hub id already in the"
                f" cache): {exc}"
            ) from exc
        if tokenizer.pad_token is None and tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of the loss, any id will do
            log(f"note: --tokenizer has no pad token; using eos {tokenizer.eos_token!r}")
        return tokenizer
    dataset = load_tokenizer_corpus(Path(args.tokenizer_from))
    vocab_size = args.vocab_size or preset.default_vocab_size
    log(f"training a byte-level BPE tokenizer, vocab {vocab_size}, on {len(dataset):,} texts of {args.tokenizer_from}")
    tokenizer = train_bpe_tokenizer(
        iter_text_batches(dataset), vocab_size, preset.max_position_embeddings, len(dataset)
    )
    if len(tokenizer) < vocab_size:
        log(
            f"note: the corpus supports only {len(tokenizer)} tokens (asked for {vocab_size});"
            " config.vocab_size follows the tokenizer"
        )
    return tokenizer


def save_tokenizer(tokenizer: Any, folder: Path, trained_here: bool) -> None:
    tokenizer.save_pretrained(folder)
    if trained_here:
        # transformers 5 writes its internal class name; the public one loads in 4.x and 5.x alike
        config_path = folder / "tokenizer_config.json"
        tokenizer_config = json.loads(config_path.read_text())
        tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def build_config(preset: SizePreset, tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    config = LlamaConfig(
        **preset_config_kwargs(preset, len(tokenizer)),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


def save_model_files(config: Any, folder: Path, with_weights: bool, dtype_name: str, seed: int) -> None:
    """Random-initialised safetensors (seeded) with config and generation config, or the two configs alone."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if not with_weights:
        config.save_pretrained(folder)
        GenerationConfig.from_model_config(config).save_pretrained(folder)
        return
    torch.manual_seed(seed)  # transformers' _init_weights draws from torch's global generator
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype_name))
    model.save_pretrained(folder, max_shard_size=MAX_SHARD_SIZE)


def run_init(args: argparse.Namespace) -> int:
    preset = apply_size_overrides(SIZE_PRESETS[args.init], size_overrides(args))
    target = Path(args.local_dir).resolve()
    check_init_target(target, args.overwrite)
    dtype_bytes = 4 if args.dtype == "float32" else 2
    if args.with_weights:  # fail before the slow tokenizer training; the vocab can only shrink from here
        vocab_bound = (args.vocab_size or preset.default_vocab_size) if args.tokenizer_from else 0  # 0: not known yet
        estimate = preset_parameter_count(preset, vocab_bound)
        check_weights_fit(
            estimate, dtype_bytes, available_memory_bytes(), free_disk_bytes(target.parent), target.parent
        )
    staging = target.with_name(f".{target.name}.init-incomplete")
    shutil.rmtree(staging, ignore_errors=True)  # left by a crashed run
    staging.mkdir(parents=True)
    try:
        verified = build_model_folder(args, preset, staging, dtype_bytes, target.parent)
        if target.exists():
            shutil.rmtree(target)  # checked above: empty, or a model folder the user asked to --overwrite
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # only still there when something failed
    verified.folder = target
    report_verified(verified, describe_init(args.init, size_overrides(args)))
    return 0


def build_model_folder(
    args: argparse.Namespace, preset: SizePreset, staging: Path, dtype_bytes: int, disk: Path
) -> VerifiedModel:
    """Tokenizer, config, optional weights, verification and its record, all written into `staging`."""
    tokenizer = build_tokenizer(args, preset)
    save_tokenizer(tokenizer, staging, trained_here=args.tokenizer is None)
    config = build_config(preset, tokenizer)
    num_params = preset_parameter_count(preset, config.vocab_size)
    if args.with_weights:
        check_weights_fit(num_params, dtype_bytes, available_memory_bytes(), free_disk_bytes(disk), disk)
    log(
        f"{describe_init(args.init, size_overrides(args))}: {preset.num_hidden_layers} layers, hidden"
        f" {preset.hidden_size}, heads {preset.num_attention_heads} (kv {preset.num_key_value_heads}), intermediate"
        f" {preset.intermediate_size}, vocab {config.vocab_size}, {num_params:,} parameters"
    )
    save_model_files(config, staging, args.with_weights, args.dtype, args.seed)
    verified = verify_model(staging, str(staging), None, require_weights=args.with_weights)
    source = {"init": args.init, "seed": args.seed, "tokenizer_from": args.tokenizer_from, "tokenizer": args.tokenizer}
    source["size_overrides"] = size_overrides(args)
    write_verification_record(verified, source)
    return verified


# ---------------------------------------------------------------------------------------------------------
# main()
# ---------------------------------------------------------------------------------------------------------


def init_size_help() -> str:
    counts = {name: preset_parameter_count(p, p.default_vocab_size) for name, p in SIZE_PRESETS.items()}
    return ", ".join(f"{name} {count:,}" for name, count in counts.items())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="model_download.py",
        description="Fetch a Hugging Face causal LM for offline training (HF_HOME cache or --local-dir), verify it"
        " offline, or create a new Llama-architecture model from a size preset with --init.",
    )
    source = parser.add_argument_group("download / verify")
    source.add_argument("--model-name", help="hub repository id, e.g. meta-llama/Llama-3.2-3B-Instruct")
    source.add_argument(
        "--dataset",
        metavar="ORG/NAME",
        help="download a hub dataset repository into the HF_HOME cache instead, and verify it loads offline",
    )
    source.add_argument("--revision", default="main", help="branch, tag or commit hash to fetch (default: main)")
    source.add_argument(
        "--local-dir", help="write a plain folder instead of the HF_HOME cache (the --init output folder)"
    )
    source.add_argument(
        "--token", default=None, help="hub access token for gated/private repos (default: HF_TOKEN or a saved login)"
    )
    source.add_argument(
        "--verify-only", action="store_true", help="only re-run the offline verification of an existing download"
    )
    source.add_argument(
        "--force-download",
        action="store_true",
        help="re-fetch every file even if already present (repairs a corrupt file)",
    )
    scratch = parser.add_argument_group("new model from scratch")
    scratch.add_argument(
        "--init",
        choices=list(SIZE_PRESETS),
        help="create a new Llama model folder of this size in --local-dir; exact parameter counts with a 32000 vocab"
        f" (1024 for tiny): {init_size_help()}",
    )
    for flag, config_field in SIZE_FLAGS.items():
        scratch.add_argument(
            flag, type=int, default=None, metavar="N", help=f"with --init: {config_field} instead of the preset's"
        )
    scratch.add_argument(
        "--tokenizer-from",
        metavar="DATASET",
        help="train a byte-level BPE tokenizer on the text column of this data_hf.py dataset",
    )
    scratch.add_argument(
        "--tokenizer", metavar="NAME_OR_DIR", help="reuse this tokenizer (a folder, or a hub id already cached) instead"
    )
    scratch.add_argument(
        "--vocab-size", type=int, default=None, help="BPE vocabulary size (default: 1024 for tiny, 32000 otherwise)"
    )
    scratch.add_argument(
        "--with-weights",
        action="store_true",
        help="also write random-initialised safetensors (else the trainer initialises them)",
    )
    scratch.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        default="bfloat16",
        help="dtype of --with-weights (default: bfloat16)",
    )
    scratch.add_argument("--seed", type=int, default=0, help="seed for the weight initialisation (default: 0)")
    scratch.add_argument("--overwrite", action="store_true", help="replace an existing model folder in --local-dir")
    return parser


def validate_args(args: argparse.Namespace) -> list[str]:
    """Every flag problem at once, each naming the flag and the fix."""
    problems = []
    scratch_flags = {
        "--tokenizer-from": args.tokenizer_from,
        "--tokenizer": args.tokenizer,
        "--vocab-size": args.vocab_size,
        "--with-weights": args.with_weights,
        "--overwrite": args.overwrite,
        **size_overrides(args),
    }
    if args.dataset:
        if args.model_name or args.init or args.verify_only or args.local_dir:
            problems.append(
                "--dataset downloads a dataset into the HF_HOME cache: drop --model-name/--init/--verify-only/--local-dir"
            )
        if args.dataset.count("/") != 1:
            problems.append(f"--dataset {args.dataset}: expected a hub id ORG/NAME")
    if args.init:
        if args.model_name or args.verify_only:
            problems.append("--init creates a new model: drop --model-name/--verify-only")
        if not args.local_dir:
            problems.append("--init needs --local-dir DIR for the new model folder")
        if bool(args.tokenizer_from) == bool(args.tokenizer):
            problems.append(
                "--init needs exactly one of --tokenizer-from DATASET (train a tokenizer) or --tokenizer NAME_OR_DIR"
            )
        if args.vocab_size is not None and args.tokenizer:
            problems.append("--vocab-size applies to --tokenizer-from only; a reused --tokenizer keeps its vocabulary")
        if args.vocab_size is not None and args.vocab_size < 259:
            problems.append(f"--vocab-size {args.vocab_size} is below 259 (256 byte tokens + bos, eos, pad)")
        problems += size_problems(args.init, size_overrides(args))
    else:
        used = [flag for flag, value in scratch_flags.items() if value not in (None, False)]
        if used:
            problems.append(f"{', '.join(used)} only apply with --init SIZE")
        if not args.model_name and not args.dataset and not (args.verify_only and args.local_dir):
            problems.append(
                "pass --model-name NAME (download), --dataset ORG/NAME, --verify-only with --model-name or"
                " --local-dir, or --init SIZE"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problems = validate_args(args)
    if problems:
        for problem in problems:
            print(f"model_download.py: error: {problem}", file=sys.stderr)
        return 2
    try:
        if args.dataset:
            return run_dataset_download(args)
        if args.init:
            return run_init(args)
        if args.verify_only:
            return run_verify_only(args)
        return run_download(args)
    except ToolError as exc:
        print(f"model_download.py: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
