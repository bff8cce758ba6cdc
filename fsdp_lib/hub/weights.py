"""Inspection of an HF model folder's weight files without loading them: the tensors' names, shapes and dtypes
(safetensors headers, checked against the file size; .bin archives memory-mapped), and their comparison with what
an architecture expects, after the installed transformers' own key conversions. No torch at import."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_lib.errors import name_sample
from fsdp_lib.hub.console import ToolError
from fsdp_lib.model.hf_files import TensorInfo, read_safetensors_header

FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


def read_bin_weights(path: Path) -> dict[str, TensorInfo]:
    """Tensor shapes and dtypes of a PyTorch .bin weight file; mmap keeps the tensor data on disk."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # torch raises RuntimeError/pickle errors/EOFError for damaged archives
        raise ToolError(f"{path}: cannot read PyTorch weight file ({exc}); the file is truncated or corrupt") from exc
    tags = {"torch.float16": "F16", "torch.bfloat16": "BF16", "torch.float32": "F32", "torch.float64": "F64"}
    return {
        name: TensorInfo(tuple(tensor.shape), tags.get(str(tensor.dtype), str(tensor.dtype)), path.name)
        for name, tensor in state.items()
    }


def read_weights(folder: Path, files: list[str]) -> tuple[dict[str, TensorInfo], list[str]]:
    """All tensors in the given weight files, plus one problem line per unreadable or truncated file."""
    tensors: dict[str, TensorInfo] = {}
    problems: list[str] = []
    for name in files:
        try:
            reader = read_safetensors_header if name.endswith(".safetensors") else read_bin_weights
            tensors.update(reader(folder / name))
        except (ToolError, ValueError) as exc:  # a damaged .bin, or a safetensors file that is not whole
            problems.append(str(exc))
    return tensors, problems


@dataclass(frozen=True)
class ExpectedTensor:
    shape: tuple[int, ...]
    is_parameter: bool


def compare_weights(
    expected: dict[str, ExpectedTensor],
    tied_groups: list[list[str]],
    found: dict[str, TensorInfo],
    base_model_prefix: str = "",
) -> tuple[list[str], list[str]]:
    """(problems, notes) from comparing the tensors an architecture expects with those in the weight files.

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
            problems.append(f"{stored} in {have.file}: dtype {have.dtype} is not a float type (quantized weights?)")
    if missing_params:
        problems.append(
            f"{len(missing_params)} parameter(s) missing from the weight files: {name_sample(missing_params)}"
        )
    if missing_buffers:
        notes.append(
            f"{len(missing_buffers)} buffer(s) not stored, transformers will recompute: {name_sample(missing_buffers)}"
        )
    extra = sorted(set(found) - {alias for name in expected for alias in tied_alias.get(name, [name])})
    if extra:
        notes.append(f"{len(extra)} tensor(s) in the weight files the architecture does not use: {name_sample(extra)}")
    return problems, notes


def _align_prefix(found: dict[str, TensorInfo], expected: set[str], prefix: str) -> dict[str, TensorInfo]:
    """Base-model weight files (e.g. GPT-2's) omit the 'transformer.' prefix that the LM-head model adds."""
    if not prefix or any(name in expected for name in found):
        return found
    return {f"{prefix}.{name}" if f"{prefix}.{name}" in expected else name: info for name, info in found.items()}


def weights_dtype_summary(found: dict[str, TensorInfo]) -> str:
    counts: dict[str, int] = {}
    for info in found.values():
        counts[info.dtype] = counts.get(info.dtype, 0) + 1
    parts = [
        f"{FLOAT_DTYPES.get(tag, tag)} ({count} tensors)"
        for tag, count in sorted(counts.items(), key=lambda kv: -kv[1])
    ]
    return ", ".join(parts) or "no tensors"


def compare_with_model(model: Any, found: dict[str, TensorInfo]) -> tuple[list[str], list[str]]:
    """Name-by-name and shape-by-shape check of what from_pretrained would make of the weight files."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    groups: dict[int, list[str]] = {}
    for name, param in parameters.items():
        groups.setdefault(id(param), []).append(name)
    tied_groups = [names for names in groups.values() if len(names) > 1]
    state = model.state_dict()  # excludes non-persistent buffers such as rotary inv_freq
    expected = {name: ExpectedTensor(tuple(tensor.shape), name in parameters) for name, tensor in state.items()}
    converted, problems = converted_weights_layout(model, found)
    compare_problems, notes = compare_weights(expected, tied_groups, converted, getattr(model, "base_model_prefix", ""))
    return problems + compare_problems, notes


def converted_weights_layout(model: Any, found: dict[str, TensorInfo]) -> tuple[dict[str, TensorInfo], list[str]]:
    """The weight files' tensors as from_pretrained sees them: names and shapes after the installed transformers'
    own key and layout conversions (e.g. Mixtral's per-expert w1/w3 stacked into mlp.experts.gate_up_proj).

    Keys are routed as the trainer's sharded load routes them (hf_weights.route_weight_keys); the conversions run
    on meta tensors, so nothing is read from disk. Names the model does not have stay, for compare_weights' notes.
    """
    import torch

    from fsdp_lib.model.hf_weights import route_weight_keys

    def meta_tensor(key: str) -> Any:
        return torch.empty(found[key].shape, device="meta")

    try:
        routing = route_weight_keys(model, found, model.state_dict(), meta_tensor)
    except ImportError:  # transformers 4.x has no conversion mapping: it loads weight keys as they are
        return found, []
    layout = {name: found[key] for key, name in routing.unused.items()}
    layout.update({target: found[key] for target, key in routing.renamed.items()})
    problems = []
    for target, converter in routing.converted.items():
        info = found[routing.sources[target][0]]
        try:
            produced = converter.convert(target, model=model, config=model.config)
        except Exception as exc:  # noqa: BLE001 - e.g. experts of different shapes cannot be stacked
            problems.append(f"{target}: transformers cannot build it from the weight files' tensors ({exc})")
            continue
        for name, tensor in produced.items():
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            layout[name] = TensorInfo(tuple(tensor.shape), info.dtype, info.file)
    return layout, problems
