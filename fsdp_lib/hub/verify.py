"""Offline verification of a model folder: config and tokenizer load with no network, the architecture builds on
the meta device, every weight it needs is on disk with the right shape; then the size report (parameters, dtype,
memory per GPU for full fine-tuning and --peft) and the verification record written into the folder once it
passes. No torch at import."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_lib.hub.checksums import check_against_hub
from fsdp_lib.hub.console import ToolError, log
from fsdp_lib.hub.weights import TensorInfo, compare_with_model, read_weights, weights_dtype_summary
from fsdp_lib.markers import VERIFICATION_RECORD, folder_kind
from fsdp_lib.model.hf_files import hf_weight_files
from fsdp_lib.model.memory_plan import (
    format_bytes,
    format_count,
    format_memory_plan,
    format_peft_memory_plan,
    peft_memory_plan,
    training_memory_plan,
)

LORA_RANK = 16  # fsdp_train.py's --lora-rank default, for the memory table
# In a --local-dir download, beside huggingface_hub's own notes: the repository and revision it fetches.
DOWNLOAD_SOURCE = Path(".cache") / "huggingface" / "model_download_source.json"


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


def verify_model(
    folder: Path, load_name: str, revision: str | None, require_weights: bool, checksums: bool = False
) -> VerifiedModel:
    """Load config and tokenizer offline, build the model on the meta device, check every weight is on disk (and
    with `checksums` every file's bytes against the hub's checksums).

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
        found, read_problems = read_weights(folder, files)
        problems += read_problems
        if not read_problems:
            compare_problems, notes = compare_with_model(model, found)
            problems += compare_problems
    if checksums:
        report = check_against_hub(folder)
        problems += report.problems
        notes.append(report.summary())
    if problems:  # a tied weight is checked under both names: say each problem once
        raise ToolError("verification failed:\n  - " + "\n  - ".join(dict.fromkeys(problems)))
    return VerifiedModel(
        folder=folder,
        architecture=f"{type(model).__name__} ({config.model_type})",
        num_params=sum(param.numel() for param in model.parameters()),
        largest_unit_params=largest_fsdp_unit_params(model),
        **dict(zip(("linear_params", "lora_params"), decoder_linear_params(model, LORA_RANK))),
        dtype_summary=weights_dtype_summary(found) if files else "no weights (the trainer initialises them)",
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
    """Parameters of the largest unit FSDP all-gathers at once, by the trainer's own rule (anatomy.largest_unit_params):
    one decoder layer, an untied embedding or head, or the root's remainder (with a tied head: the embedding);
    the whole model when the trainer would not find its decoder layers."""
    from fsdp_lib.errors import TrainError
    from fsdp_lib.model.anatomy import find_decoder_layers, largest_unit_params

    try:
        return largest_unit_params(model, find_decoder_layers(model))
    except TrainError:
        return sum(param.numel() for param in model.parameters())


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


def write_download_source(folder: Path, source: dict[str, Any]) -> None:
    """Note, before a --local-dir download fetches its first file, which repository the folder holds, so that a rerun
    knows it even when verification never finished (interrupted, or its record removed)."""
    path = folder / DOWNLOAD_SOURCE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(source) + "\n")
    os.replace(tmp, path)


def folder_source(folder: Path) -> dict[str, Any]:
    """Where a model folder came from ({"model_name": ...} or {"init": ...}): its verification record's source (even
    when a weight file changed since), else the note a --local-dir download wrote before fetching; {} when neither
    says."""
    for path in (folder / VERIFICATION_RECORD, folder / DOWNLOAD_SOURCE):
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        source = value.get("source", value) if isinstance(value, dict) else None
        if isinstance(source, dict) and ("model_name" in source or "init" in source):
            return source
    return {}


def verify_and_record(
    folder: Path,
    load_name: str,
    revision: str | None,
    source: dict[str, Any],
    require_weights: bool,
    checksums: bool = False,
) -> None:
    """Verify the folder as training will load it (`load_name`: the hub id, or the folder), report it and write
    the record; a failure leaves no record behind, an old one included."""
    remove_verification_record(folder)  # a rerun re-verifies; a failure must not leave an old record behind
    try:
        verified = verify_model(folder, load_name, revision, require_weights, checksums)
    except ToolError as exc:
        raise ToolError(f"{exc}\n  fix: rerun the download (add --force-download if a file is corrupt)") from exc
    report_verified(verified, load_name + (f" @ {revision}" if revision else ""))
    log(f"wrote {write_verification_record(verified, source)}")
    if revision:
        hf_home = os.environ.get("HF_HOME", "~/.cache/huggingface")
        log(f"offline use: export HF_HOME={hf_home} HF_HUB_OFFLINE=1, then load {load_name} by name")


def reverify_folder(folder: Path, model_name: str | None = None, checksums: bool = False) -> None:
    """--verify-only --local-dir: verify a downloaded or --init folder again, keeping the source its record (or its
    download's note) names; with --model-name, the folder must hold that model."""
    if not folder.exists():
        raise ToolError(f"--local-dir {folder} does not exist; pass the folder of a downloaded or --init model")
    if not folder.is_dir():
        raise ToolError(f"--local-dir {folder} is a file; pass the folder of a downloaded or --init model")
    kind = folder_kind(folder)
    if kind is not None and kind.kind != "model":
        raise ToolError(f"--local-dir {kind.describe(folder)}, not a model; pass the folder of a model")
    if not (folder / "config.json").is_file():
        raise ToolError(f"--local-dir {folder} has no config.json; download or --init the model first")
    previous = read_verification_record(folder) or {}
    source = folder_source(folder) or {"local_dir": str(folder)}
    if model_name is not None and "local_dir" not in source and source.get("model_name") != model_name:
        held = source.get("model_name") or f"a model made with --init {source.get('init')}"
        raise ToolError(f"--local-dir {folder} holds {held}, not --model-name {model_name}: check both flags")
    if checksums and "init" in source:
        raise ToolError(f"--checksums: {folder} was made by --init, not downloaded; it has no hub checksums to compare")
    # Only an --init folder made without --with-weights may lack weights; anything else without them is broken.
    weightless_init = "init" in source and not previous.get("weight_files")
    verify_and_record(folder, str(folder), None, source, not weightless_init, checksums)
