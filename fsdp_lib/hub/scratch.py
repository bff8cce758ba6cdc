"""A new model from scratch (`model_download.py --init SIZE`): a Llama-architecture folder of a preset's shape with
its tokenizer, config, generation config and, with --with-weights, random-initialised safetensors (seeded), built in
a hidden staging folder, verified, and only then put in place; memory and disk are checked before the slow parts.
No torch at import."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_lib.errors import file_above, name_sample
from fsdp_lib.hub.console import ToolError, log
from fsdp_lib.hub.download import free_disk_bytes, refuse_inside_another_tools_folder
from fsdp_lib.hub.plan import TOKENIZER_FILES
from fsdp_lib.hub.presets import (
    SIZE_PRESETS,
    SizePreset,
    apply_size_overrides,
    describe_init,
    preset_config_kwargs,
    preset_parameter_count,
)
from fsdp_lib.hub.tokenizer import build_tokenizer, save_tokenizer
from fsdp_lib.hub.verify import VerifiedModel, verify_model, write_verification_record
from fsdp_lib.integrity import umask_mode
from fsdp_lib.lock import FolderLock
from fsdp_lib.markers import INCOMPLETE_DOWNLOAD, VERIFICATION_RECORD, folder_kind
from fsdp_lib.model.memory_plan import format_bytes, format_count

MAX_SHARD_SIZE = "5GB"  # --with-weights shard size; also bounds the extra memory needed while saving


@dataclass(frozen=True)
class InitRequest:
    """What --init asked for: a preset and the size flags on top of it, where the tokenizer comes from (exactly one
    of tokenizer_from, a dataset to train on, and tokenizer, one to reuse), and the weights."""

    preset_name: str
    overrides: dict[str, int]  # {size flag: value}
    tokenizer_from: str | None
    tokenizer: str | None
    vocab_size: int | None
    with_weights: bool
    dtype: str
    seed: int

    @property
    def shape(self) -> SizePreset:
        return apply_size_overrides(SIZE_PRESETS[self.preset_name], self.overrides)

    def description(self) -> str:
        return describe_init(self.preset_name, self.overrides)

    def record_source(self) -> dict[str, Any]:
        """The `source` of the verification record: how to make the folder again."""
        return {
            "init": self.preset_name,
            "seed": self.seed,
            "tokenizer_from": self.tokenizer_from,
            "tokenizer": self.tokenizer,
            "size_overrides": self.overrides,
        }


def check_init_target(path: Path, overwrite: bool) -> None:
    """Refuse to clobber a non-empty folder; --overwrite replaces only something that is a model folder."""
    if blocker := file_above(path):
        raise ToolError(f"--local-dir {path} is under {blocker}, which is a file; choose a folder path")
    refuse_inside_another_tools_folder(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise ToolError(f"--local-dir {path} exists and is a file; choose a folder path for --local-dir")
    if not any(path.iterdir()):
        return
    if not overwrite:
        raise ToolError(
            f"--local-dir {path} is not empty; pass --overwrite to replace the model in it, or pick a new folder"
        )
    kind = folder_kind(path)
    if kind is not None and kind.kind != "model":
        raise ToolError(
            f"--local-dir {kind.describe(path)}; --overwrite replaces only a model folder: pick a new folder"
        )
    if kind is None:
        raise ToolError(
            f"--local-dir {path} does not look like a model folder (no config.json with a model type beside weights"
            " or a tokenizer); --overwrite refuses it: delete it yourself or pick a new folder"
        )
    if foreign := not_model_files(path):
        raise ToolError(
            f"--local-dir {path} is a model folder that also holds {name_sample(foreign, 10)}, which --overwrite would"
            " delete with it: move them out"
            " or pick a new folder"
        )


# What a model folder holds (hub downloads, save_pretrained, --init): anything else in it is the user's. JSON files
# by name (a *config.json, a weight index, a tokenizer's files, our verification record), not by suffix: a user's
# results.json beside the weights is theirs.
_MODEL_FILE_SUFFIXES = (".safetensors", ".model", ".jinja", ".tiktoken", ".index.json")
_MODEL_FILE_NAMES = (
    *TOKENIZER_FILES,
    INCOMPLETE_DOWNLOAD,  # an interrupted download's (--overwrite replaces such a folder too)
    "config.json",
    "generation_config.json",
    "adapter_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "quantize_config.json",  # GPTQ
    VERIFICATION_RECORD,
    "params.json",  # Meta's original checkpoints
    "README.md",
    "LICENSE",
    ".gitattributes",
)
_MODEL_SUBFOLDERS = (".cache", "original")
_ORIGINAL_FILES = (".pth", ".pt", ".safetensors", ".model", ".tiktoken", "params.json", ".chk")


def not_model_files(folder: Path) -> list[str]:
    """Entries of a model folder that no model download or save writes (a nested dataset, the user's notes)."""
    foreign = []
    for entry in sorted(folder.iterdir()):
        if entry.is_dir() and not entry.is_symlink():
            if entry.name not in _MODEL_SUBFOLDERS:
                foreign.append(f"{entry.name}/")
            elif entry.name == "original":  # Meta's checkpoints: weights, params.json, the tokenizer; nothing else
                foreign += [
                    f"original/{path.relative_to(entry).as_posix()}"
                    for path in sorted(entry.rglob("*"))
                    if path.is_file() and not path.name.endswith(_ORIGINAL_FILES)
                ]
        elif not _is_model_file(entry.name):
            foreign.append(entry.name)
    return foreign


def _is_model_file(name: str) -> bool:
    if name.endswith(".bin"):  # PyTorch weights and the Trainer's arguments; a user's results.bin is theirs
        return name.startswith(("pytorch_model", "adapter_model", "training_args"))
    return name.endswith(_MODEL_FILE_SUFFIXES) or name in _MODEL_FILE_NAMES


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
    umask_mode(*folder.glob("*.safetensors"))


def create_model_folder(request: InitRequest, target: Path, overwrite: bool) -> VerifiedModel:
    """The new model folder at `target`, verified and recorded; a failure leaves whatever was there untouched.
    One --init per --local-dir at a time: a second one would build in the same staging folder and replace the
    first one's model."""
    check_init_target(target, overwrite)  # refused before the lock is taken (a file in the path, say); again under it
    what, instead = f"--local-dir {target}", "choose another --local-dir"
    with FolderLock(target.parent, f".{target.name}.init.lock", what, instead, ToolError).held():
        return _create_model_folder(request, target, overwrite)


def _create_model_folder(request: InitRequest, target: Path, overwrite: bool) -> VerifiedModel:
    preset = request.shape
    check_init_target(target, overwrite)
    dtype_bytes = 4 if request.dtype == "float32" else 2
    if request.with_weights:  # fail before the slow tokenizer training; the vocab can only shrink from here
        # a reused tokenizer's vocabulary is not known yet: 0 counts the model without its embeddings
        vocab_bound = (request.vocab_size or preset.default_vocab_size) if request.tokenizer_from else 0
        estimate = preset_parameter_count(preset, vocab_bound)
        check_weights_fit(
            estimate, dtype_bytes, available_memory_bytes(), free_disk_bytes(target.parent), target.parent
        )
    staging = target.with_name(f".{target.name}.init-incomplete")
    shutil.rmtree(staging, ignore_errors=True)  # left by a crashed run
    staging.mkdir(parents=True)
    try:
        verified = build_model_folder(request, preset, staging, dtype_bytes, target.parent)
        if target.exists():
            shutil.rmtree(target)  # checked above: empty, or a model folder the user asked to --overwrite
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # only still there when something failed
    verified.folder = target
    return verified


def build_model_folder(
    request: InitRequest, preset: SizePreset, staging: Path, dtype_bytes: int, disk: Path
) -> VerifiedModel:
    """Tokenizer, config, optional weights, verification and its record, all written into `staging`."""
    tokenizer = build_tokenizer(request.tokenizer, request.tokenizer_from, request.vocab_size, preset)
    save_tokenizer(tokenizer, staging, trained_here=request.tokenizer is None)
    config = build_config(preset, tokenizer)
    num_params = preset_parameter_count(preset, config.vocab_size)
    if request.with_weights:
        check_weights_fit(num_params, dtype_bytes, available_memory_bytes(), free_disk_bytes(disk), disk)
    log(
        f"{request.description()}: {preset.num_hidden_layers} layers, hidden"
        f" {preset.hidden_size}, heads {preset.num_attention_heads} (kv {preset.num_key_value_heads}), intermediate"
        f" {preset.intermediate_size}, vocab {config.vocab_size}, {num_params:,} parameters"
    )
    save_model_files(config, staging, request.with_weights, request.dtype, request.seed)
    verified = verify_model(staging, str(staging), None, require_weights=request.with_weights)
    write_verification_record(verified, request.record_source())
    return verified
