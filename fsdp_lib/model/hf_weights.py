"""HF weight files in and out, side by side because they are inverses: sharded loading of a Hugging Face model
folder into the FSDP shards (routed through transformers' own key conversions, equal bit for bit to
from_pretrained), and the export of the sharded model back to a standard folder in save_pretrained's layout.
Training checkpoints are checkpoint.py; which files make up a folder's weights is hf_files.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from fsdp_lib.config import TrainConfig
from fsdp_lib.data.chat import add_end_of_turn_stop
from fsdp_lib.errors import TrainError
from fsdp_lib.faults import fault_point
from fsdp_lib.integrity import umask_mode
from fsdp_lib.model.anatomy import clean_fqn
from fsdp_lib.model.float8 import high_precision
from fsdp_lib.model.hf_files import hf_weight_files, read_safetensors_header
from fsdp_lib.model.quantize import fill_nf4_rows, fill_nf4_shard, is_nf4, shard_rows
from fsdp_lib.runtime import Dist, log

ADAPTER_PARTS = ("lora_A", "lora_B", "lora_magnitude_vector", "lora_embedding_A", "lora_embedding_B")


def is_adapter_name(name: str) -> bool:
    """A peft adapter tensor (--peft lora/qlora): not part of the base model's weight files."""
    return any(part in ADAPTER_PARTS for part in name.split("."))


def base_fqn(name: str) -> str:
    """The name in the base model of a (possibly peft-wrapped) parameter: `q_proj.base_layer.weight` -> `q_proj.weight`."""
    return clean_fqn(name).replace(".base_layer.", ".")


def weight_keys(model_dir: Path) -> tuple[dict[str, Path], str]:
    """Each tensor name in the folder's weight files (hf_weight_files) -> its file, and the format: "safetensors",
    "bin", or "none" for a folder without weights."""
    from safetensors import safe_open

    names, problems = hf_weight_files(model_dir)
    if problems:
        raise TrainError(f"--model-name {model_dir}: {'; '.join(problems)}; re-download with model_download.py")
    files: dict[str, Path] = {}
    for name in names:
        path = model_dir / name
        if name.endswith(".safetensors"):
            with safe_open(str(path), framework="pt") as fh:
                files.update(dict.fromkeys(fh.keys(), path))
        else:
            files.update(dict.fromkeys(torch.load(path, map_location="meta", weights_only=True, mmap=True), path))
    fmt = "none" if not files else "safetensors" if names[0].endswith(".safetensors") else "bin"
    return files, fmt


@dataclass
class WeightLoadPlan:
    """Where each model tensor comes from, routed by transformers' own conversion mapping for this version."""

    files: dict[str, Path]  # tensor name in the weight files -> the file holding it
    renamed: dict[str, str]  # model FQN -> tensor name in the files: read slice by slice
    converted: dict[str, Any]  # first target FQN -> transformers WeightConverter holding its source keys
    conversions: list[Any]  # the transforms that matched; the export reverts exactly these (as save_pretrained)


@dataclass
class WeightRouting:
    """Where from_pretrained puts each tensor of the weight files, under this transformers version's conversions."""

    renamed: dict[str, str]  # model name -> tensor name in the files (renamings and the base-model prefix only)
    converted: dict[str, Any]  # first target name -> a WeightConverter holding its source tensors
    sources: dict[str, list[str]]  # first target name -> the tensor names it is built from, in stacking order
    unused: dict[str, str]  # tensor name in the files -> its name after renaming, which the model does not have
    conversions: list[Any]  # the architecture's whole conversion mapping


TESTED_TRANSFORMERS = ">=5.17,<6 (tested: 5.17 on GPU, 5.24-5.25 on CPU)"


def core_model_loading() -> tuple[Any, Any]:
    """transformers' own weight-conversion internals (transformers.core_model_loading, transformers.conversion_mapping,
    transformers 5), through which weights load and export as from_pretrained and save_pretrained would; TrainError
    naming the installed version and the tested ones when they are missing (transformers 4, or a release that
    moved them)."""
    names = ("WeightConverter", "WeightRenaming", "dot_natural_key", "rename_source_key", "revert_weight_conversion")
    try:
        import transformers.conversion_mapping as mapping
        import transformers.core_model_loading as core

        for name in names:
            getattr(core, name)
        mapping.get_model_conversion_mapping  # noqa: B018 - present, or AttributeError
    except (ImportError, AttributeError) as exc:
        import transformers

        raise TrainError(
            f"transformers {transformers.__version__} lacks what fsdp_train.py loads and exports weights through "
            f"({type(exc).__name__}: {exc}); install transformers{TESTED_TRANSFORMERS}"
        ) from exc
    return core, mapping


def route_weight_keys(
    model: nn.Module, keys: Iterable[str], expected: Iterable[str], source: Callable[[str], Any] = str
) -> WeightRouting:
    """Route every tensor name of the weight files as from_pretrained does (transformers.core_model_loading): all
    WeightRenamings, then at most one WeightConverter, then add or strip the base-model prefix; a name the model
    already has (maybe prefixed) wins over a conversion. `expected`: the model's tensor names. `source(key)`: what a
    converter collects for a key (the name, to read it later; a meta tensor, to learn the converted shapes).
    One routing for the sharded load (plan_weight_load) and model_download.py's verification."""
    import copy

    core, mapping = core_model_loading()
    dot_natural_key, rename_source_key = core.dot_natural_key, core.rename_source_key
    conversions = mapping.get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, core.WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, core.WeightConverter)]
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", "model")
    names = dict.fromkeys(expected, True)
    routing = WeightRouting({}, {}, {}, {}, conversions)
    for key in sorted(keys, key=dot_natural_key):  # experts.2 before experts.10: the stacking order
        target, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if target not in names:  # as from_pretrained: a name the model already has (maybe prefixed) wins
            target, pattern = rename_source_key(key, [], [], prefix, names)
        if target not in names:
            routing.unused[key] = target
        elif pattern is None:
            routing.renamed[target] = key
        else:
            converter = routing.converted.setdefault(target, copy.deepcopy(by_pattern[pattern]))
            converter.add_tensor(target, key, pattern, source(key))
            routing.sources.setdefault(target, []).append(key)
    return routing


def plan_weight_load(model: nn.Module, files: dict[str, Path]) -> WeightLoadPlan:
    """Route every tensor name of the weight files as from_pretrained does (route_weight_keys).

    A renamed key is read slice by slice; a converted one (e.g. per-expert `experts.N.gate_proj` stacked into
    `experts.gate_up_proj`) needs its whole source tensors. Keys the architecture does not use are ignored, as
    from_pretrained ignores them; tied copies (lm_head tied to the embedding) are never loaded separately; a
    persistent buffer the weight files lack keeps its computed value.
    """
    tied = _tied_parameter_names(model)
    params = {base_fqn(n) for n, _ in model.named_parameters(remove_duplicate=False) if not is_adapter_name(n)}
    # Persistent buffers load too where stored, as in from_pretrained (e.g. GLM-4.5's router e_score_correction_bias)
    buffers = {base_fqn(n) for n in model.state_dict() if not is_adapter_name(n)}
    routing = route_weight_keys(model, files, params | buffers)
    renamed = {target: key for target, key in routing.renamed.items() if target not in tied}
    converted = {target: c for target, c in routing.converted.items() if target not in tied}
    produced = set(renamed)
    for first, converter in converted.items():
        produced.update(first.replace(converter.target_patterns[0], t) for t in converter.target_patterns)
    missing = sorted(params - produced - tied)
    if missing:
        raise TrainError(
            f"the model folder's weights lack {len(missing)} tensors the architecture needs (after transformers' "
            f"key conversions), e.g. {missing[:5]}; re-download with model_download.py (it verifies every tensor)"
        )
    return WeightLoadPlan(files, renamed, converted, [c for c in routing.conversions if c.was_used()])


def _tied_parameter_names(model: nn.Module) -> set[str]:
    """Names under which an already-seen Parameter appears again (e.g. lm_head.weight tied to embed_tokens)."""
    seen: set[int] = set()
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(base_fqn(name))
        seen.add(id(param))
    return tied


def load_pretrained_sharded(
    model: nn.Module, model_dir: Path, files: dict[str, Path], fmt: str, threads: int = 1
) -> None:
    """Load the folder's weights into the shards, equal bit for bit to from_pretrained. `files` and `fmt`: what
    weight_keys found in model_dir. Peft adapters are not in the files (adapters.py fills them); QLoRA's NF4
    weights are quantised one at a time: from this rank's rows of a safetensors file (quantize.fill_nf4_rows),
    else read whole (quantize.fill_nf4_shard keeps this rank's rows).

    Renamed tensors: each rank reads only its own slices (DCP's Hugging Face reader, memory-mapped), from
    `threads` files at once where the installed torch's reader takes a thread count.
    Converted tensors: each rank reads the whole source tensors of one converter at a time (e.g. every
    expert's gate and up projection of one layer), lets transformers' ops build the full target, and
    keeps its slice, so the extra memory is about twice one layer's fused tensor.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    plan = plan_weight_load(model, files)
    params = {base_fqn(n): p for n, p in model.named_parameters()}
    state = {}
    for key, value in get_model_state_dict(model).items():
        if not is_adapter_name(key):
            key = base_fqn(key)
            # NF4: the parameter itself; fill_nf4_shard sets attributes on it, which an alias would not carry over
            state[key] = params[key] if is_nf4(value) else value
    whole = {k for k, v in state.items() if is_nf4(v) and k in plan.renamed}
    by_file_key = {plan.renamed[k]: v for k, v in state.items() if k in plan.renamed and k not in whole}
    if fmt == "safetensors":
        _check_shapes(by_file_key, plan.files, model_dir)
        dcp.load(by_file_key, storage_reader=hf_reader(model_dir, threads))
    else:
        _load_bin_slices(by_file_key, model_dir)
    with torch.no_grad(), contextlib.ExitStack() as open_files:
        handles: dict = {}
        for name in sorted(whole):  # one tensor at a time, in the same order on every rank (fill_nf4_rows gathers)
            target, key = state[name], plan.renamed[name]
            if isinstance(target, DTensor) and plan.files[key].suffix == ".safetensors":  # this rank's rows only
                start, stop = shard_rows(target)
                fill_nf4_rows(target, _open(plan.files, open_files, handles, key).get_slice(key)[start:stop])
            else:
                copy_into_shard(target, _read_whole_tensor(plan.files, open_files, handles, key))
    _load_converted(model, plan, state)
    model._weight_conversions = plan.conversions  # what from_pretrained records; save/export revert these


def _check_shapes(targets: dict[str, Any], files: dict[str, Path], model_dir: Path) -> None:
    """Every tensor read slice by slice has the shape the model built from config.json gives it: a config edited
    by hand, or another model's, is refused by name (DCP's reader would fail with a bare size mismatch)."""
    headers: dict[Path, dict[str, Any]] = {}
    wrong = []
    for key, target in targets.items():
        path = files[key]
        if path not in headers:
            headers[path] = read_safetensors_header(path)
        info = headers[path].get(key)
        if info is not None and tuple(info.shape) != tuple(target.shape):
            wrong.append(f"{key} is {list(info.shape)} in {path.name}, {list(target.shape)} by the config")
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise TrainError(
            f"--model-name {model_dir}: config.json does not match the weights: {'; '.join(wrong[:3])}{more}. "
            "It was edited, or belongs to another model: restore it, or fetch the model again"
        )


def hf_reader(model_dir: Path, threads: int) -> Any:
    """DCP's Hugging Face reader over model_dir, reading `threads` files at once (its thread_count; a torch whose
    reader has none reads one file at a time)."""
    import inspect

    if "thread_count" in inspect.signature(dcp.HuggingFaceStorageReader).parameters:
        return dcp.HuggingFaceStorageReader(str(model_dir), thread_count=threads)
    return dcp.HuggingFaceStorageReader(str(model_dir))


def _load_converted(model: nn.Module, plan: WeightLoadPlan, state: dict[str, Any]) -> None:
    import functools

    with torch.no_grad(), contextlib.ExitStack() as open_files:
        read = functools.partial(_read_whole_tensor, plan.files, open_files, {})
        for first, converter in plan.converted.items():
            for pattern, keys in converter.collected_tensors.items():  # load lazily, one converter at a time
                converter.collected_tensors[pattern] = [functools.partial(read, key) for key in keys]
            for name, full in converter.convert(first, model=model, config=model.config).items():
                copy_into_shard(state[name], full[0] if isinstance(full, list) else full)


def _read_whole_tensor(files: dict[str, Path], open_files: contextlib.ExitStack, handles: dict, key: str) -> Any:
    handle = _open(files, open_files, handles, key)
    return handle.get_tensor(key) if files[key].suffix == ".safetensors" else handle[key]


def _open(files: dict[str, Path], open_files: contextlib.ExitStack, handles: dict, key: str) -> Any:
    """The open file that holds `key` (safetensors: memory-mapped, read per tensor or slice; .bin: its state dict,
    memory-mapped), opened once per load."""
    from safetensors import safe_open

    path = files[key]
    if path not in handles:
        if path.suffix == ".safetensors":
            handles[path] = open_files.enter_context(safe_open(str(path), framework="pt"))
        else:
            handles[path] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return handles[path]


def copy_into_shard(target: Any, full: torch.Tensor) -> None:
    """Copy this rank's slice of a full tensor into a parameter (its DTensor shard, or all of it)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if is_nf4(target):  # QLoRA: quantised whole, so every rank's rows share the tensor's scale mean
        fill_nf4_shard(target, full)
    elif isinstance(target, DTensor):  # src_data_rank=None: every rank holds `full`, so slice locally, no messages
        full = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(full.to_local())
    else:
        target.copy_(full)


def _load_bin_slices(targets: dict[str, Any], model_dir: Path) -> None:
    """Fallback for repos without safetensors: mmap each .bin and copy this rank's slice of each tensor."""
    with torch.no_grad():
        for f in sorted(model_dir.glob("pytorch_model*.bin")):
            stored = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            for key, tensor in stored.items():
                if key in targets:
                    copy_into_shard(targets[key], tensor)


def export_dtype(cfg: TrainConfig, model_dir: Path) -> torch.dtype:
    if cfg.export_dtype != "auto":
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.export_dtype]
    return original_dtype(model_dir)


def original_dtype(model_dir: Path) -> torch.dtype:
    """The model's own dtype: config.json's dtype/torch_dtype, else that of its weight files, else fp32."""
    config = json.loads((model_dir / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        with safe_open(str(files[0]), framework="pt") as fh:
            keys = list(fh.keys())
            if keys:
                stored = fh.get_slice(keys[0]).get_dtype()
                return {"BF16": torch.bfloat16, "F16": torch.float16}.get(stored, torch.float32)
    return torch.float32


def export_hf_model(
    model: nn.Module,
    tokenizer: Any,
    out_dir: Path,
    d: Dist,
    dtype: torch.dtype,
    source_dir: Path,
    step: int,
    state: dict[str, Any] | None = None,
) -> None:
    """Write a standard HF folder (config, safetensors shards + index, tokenizer) from the sharded model,
    in the layout save_pretrained writes (transformers' conversions reverted, e.g. one tensor per expert).

    Tensors that only rename on save: DCP's HF writer has every rank write its own slices, then rank 0
    consolidates them file by file, so no process gathers them. Tensors a converter reverts (stacked MoE
    experts): gathered one decoder layer at a time, reverted by transformers and written by rank 0.
    Saved in `dtype` (--export-dtype; auto: the model's own); tied weights stay tied. The generation config of
    source_dir (the model folder trained from) is copied. `state`: the sharded tensors by the model's names
    (default: the model's state dict; adapters.merged_state_dict for a merged LoRA export).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    tied = _tied_parameter_names(model)
    state = get_model_state_dict(model) if state is None else state
    state = {k: high_precision(v).to(dtype) for k, v in state.items() if k not in tied}  # --fp8: not the wrapper
    _refuse_overflow(state, dtype, d)
    state, converted_by_layer = split_export_layout(model, state)
    index, size, max_bytes = {}, 0, 4 * 2**30  # shards of at most ~4 GiB, like save_pretrained's default
    file_no = 1
    for key, value in state.items():
        nbytes = value.numel() * value.element_size()
        if size and size + nbytes > max_bytes:
            file_no, size = file_no + 1, 0
        index[key], size = file_no, size + nbytes
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier(group=d.cpu_group)
    writer = _ExportWriter(d, str(tmp), fqn_to_index_mapping=index, save_distributed=True, enable_consolidation=True)
    dcp.save(state, storage_writer=writer, process_group=d.cpu_group)
    _write_converted(model, converted_by_layer, tmp, max_bytes, d)
    if d.is_main:
        shutil.rmtree(tmp / "sharded", ignore_errors=True)
        config = model.config
        config.use_cache, config.dtype = True, dtype
        config.save_pretrained(tmp)
        if (source_dir / "generation_config.json").is_file():
            shutil.copy2(source_dir / "generation_config.json", tmp / "generation_config.json")
        add_end_of_turn_stop(tmp, tokenizer, config)
        tokenizer.save_pretrained(tmp)
        replace_folder(tmp, out_dir, step)
        log(f"exported Hugging Face model ({dtype}) to {out_dir}")
    dist.barrier(group=d.cpu_group)


def _refuse_overflow(cast: dict[str, Any], dtype: torch.dtype, d: Dist) -> None:
    """Stop an export whose --export-dtype cannot hold a trained value (fp16 tops out at 65,504): the folder would
    carry inf weights, silently. The values not finite once cast (a merged LoRA export arrives cast already) are
    counted over every rank's shards, before anything is written; a dtype with fp32's range is not checked."""
    if dtype.is_floating_point and torch.finfo(dtype).max >= torch.finfo(torch.float32).max:
        return
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731 - a DTensor's shard, or a tensor
    counts = torch.tensor([int((~torch.isfinite(local(v))).sum()) for v in cast.values()], dtype=torch.int64)
    dist.all_reduce(counts, group=d.cpu_group)
    if counts.sum():
        names = [f"{name} ({int(n):,})" for name, n in zip(cast, counts.tolist()) if n]
        raise TrainError(
            f"--export-dtype {str(dtype).removeprefix('torch.')}: {int(counts.sum()):,} trained value(s) exceed its "
            f"range ({torch.finfo(dtype).max:,.0f}) and would be exported as inf, in {', '.join(names[:3])}"
            f"{' and more' if len(names) > 3 else ''}; export with --export-only --export-dtype bf16 (or fp32): the "
            "checkpoint is intact"
        )


class _ExportWriter(dcp.HuggingFaceStorageWriter):
    """DCP's Hugging Face writer with the fault-injection point inside its write phase ("export_write")."""

    def __init__(self, d: Dist, path: str, **kwargs: Any):
        super().__init__(path, **kwargs)
        self._dist = d

    def write_data(self, plan: Any, planner: Any) -> Any:
        fault_point("export_write", self._dist)
        return super().write_data(plan, planner)


# What an export writes (export_hf_model, export_adapter): weights and their index, configs, a tokenizer's files, an
# adapter's base record. Each export lists its files in EXPORT_RECORD; an earlier export's listed files go with it
# (the new export writes its own: a shard count, a tokenizer file or adapter against full weights may differ) and
# anything else in the folder, a model card, notes or a quantised copy the user put there, is kept. An export from
# before the record is judged by these names.
EXPORT_RECORD = ".export.json"
_EXPORT_FILES = re.compile(
    r".+\.(safetensors|bin|pt)(\.index\.json)?|.*config\.json|.*tokens?(_map)?\.json|tokenizer\.\w+|vocab\.\w+"
    r"|merges\.txt|spiece\.model|chat_template\.\w+|training_base\.json|.+\.tiktoken"
)


# The names transformers and peft load a model folder by (weights, a variant's, their index, an adapter and its
# config): one the export did not write is moved into NOT_EXPORTED/, where no loader looks, instead of being kept
# beside the export (a model.safetensors beside the export's index is what transformers loads).
_LOADABLE = re.compile(
    r"(model|pytorch_model)(\.\w+)?\.(safetensors|bin)(\.index\.json)?|adapter_model\.(safetensors|bin)|adapter_config\.json"
)
NOT_EXPORTED = "not_exported"


def export_step(folder: Path) -> int | None:
    """The training step an export folder holds (its EXPORT_RECORD), or None for one without a record."""
    try:
        step = json.loads((folder / EXPORT_RECORD).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def warn_stale_export(folder: Path, step: int) -> None:
    """An export folder this export did not replace (final-merged without --export-merged on) is named when it holds
    another step than the one just written beside it."""
    then = export_step(folder)
    if then != step:
        what = f"step {then}" if then is not None else "an earlier export"
        log(
            f"WARNING: {folder} holds {what}, not step {step} as final/ beside it now does: refresh it with "
            "--export-only --export-merged on, or delete it"
        )


def replace_folder(tmp: Path, out_dir: Path, step: int) -> None:
    """Put the finished folder `tmp` at out_dir, replacing an earlier export only once the new one is complete;
    what the earlier folder holds that no export wrote (a model card, notes) is moved into the new one. A swap a
    kill cut short is finished first, so the user's files it was carrying are not lost."""
    old = out_dir.with_name(f".{out_dir.name}.old")
    if old.is_dir():  # an earlier swap was cut short
        if not out_dir.exists():  # before its new folder was in place: the earlier export is whole in `old`
            os.rename(old, out_dir)
        else:
            _carry_over(old, out_dir)
            shutil.rmtree(old, ignore_errors=True)
    files = sorted(path.relative_to(tmp).as_posix() for path in tmp.rglob("*") if path.is_file())
    (tmp / EXPORT_RECORD).write_text(json.dumps({"written_by": "fsdp_train.py", "step": step, "files": files}) + "\n")
    if out_dir.is_dir() and not out_dir.is_symlink():
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old.is_dir():
        _carry_over(old, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _carry_over(old: Path, new: Path) -> None:
    """Move into `new` what the earlier export folder `old` holds that its export did not write, and say what of
    its export's files the new one does not write again (they go with it)."""
    try:
        written = set(json.loads((old / EXPORT_RECORD).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        written = None
    kept, dropped = [], []
    for entry in sorted(old.iterdir()):
        if entry.name == EXPORT_RECORD or (new / entry.name).exists():
            continue
        ours = entry.name in written if written is not None else bool(_EXPORT_FILES.fullmatch(entry.name))
        (dropped if ours else kept).append(entry)
    loadable = [entry for entry in kept if _LOADABLE.fullmatch(entry.name)]
    kept = [entry for entry in kept if entry not in loadable]
    for entry in kept:  # an earlier not_exported/ among them: carried first, the new arrivals join it
        os.rename(entry, new / entry.name)
    if loadable:  # beside the export, transformers or peft would load them instead of (or into) it
        aside = new / NOT_EXPORTED
        aside.mkdir(exist_ok=True)
        for entry in loadable:
            target, number = aside / entry.name, 1
            while target.exists() or target.is_symlink():  # never over one moved aside by an earlier export
                target, number = aside / f"{entry.name}.{number}", number + 1
            os.rename(entry, target)
        log(
            f"WARNING: {new} held weight files that no export wrote ({', '.join(e.name for e in loadable)}), which "
            f"transformers or peft would load instead of this export (e.g. a model.safetensors beside the index): "
            f"moved into {aside}/"
        )
    if kept:
        log(f"kept in {new} what no export wrote: {', '.join(e.name for e in kept)}")
    if dropped:
        log(f"removed with the earlier export in {new}: {', '.join(e.name for e in dropped)} (this export has none)")


def split_export_layout(model: nn.Module, state: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Ask transformers how save_pretrained would write each tensor (revert_weight_conversion on a meta copy):
    -> {saved name: sharded tensor} for plain renames, and per decoder layer the tensors a converter reverts."""
    revert_weight_conversion = core_model_loading()[0].revert_weight_conversion

    renamed: dict[str, Any] = {}
    converted: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        probe = torch.empty(value.shape, dtype=value.dtype, device="meta")
        try:
            saved = revert_weight_conversion(model, {key: probe})
        except Exception:  # noqa: BLE001 - a many-to-one revert needs its partners: handled with its layer below
            saved = {}
        if len(saved) == 1 and next(iter(saved.values())) is probe:
            renamed[next(iter(saved))] = value
        else:
            layer = re.match(r"(.*?\.\d+)\.", key)
            converted.setdefault(layer.group(1) if layer else "", {})[key] = value
    return renamed, list(converted.values())


def _write_converted(model: nn.Module, groups: list[dict[str, Any]], folder: Path, max_bytes: int, d: Dist) -> None:
    """Gather each layer's converted tensors (every rank takes part), revert them, and let rank 0 append them
    to the export as extra safetensors files listed in the index."""
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor

    revert_weight_conversion = core_model_loading()[0].revert_weight_conversion

    if not groups:
        return
    pending: dict[str, torch.Tensor] = {}
    written: dict[str, str] = {}
    written_bytes = 0

    def flush() -> None:
        nonlocal written_bytes
        written_bytes += sum(v.numel() * v.element_size() for v in pending.values())
        name = f"model-converted-{len(set(written.values())) + 1:05d}.safetensors"
        save_file({k: v.contiguous() for k, v in pending.items()}, str(folder / name), metadata={"format": "pt"})
        umask_mode(folder / name)
        written.update(dict.fromkeys(pending, name))
        pending.clear()

    for group in groups:
        full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).cpu() for k, v in group.items()}
        if d.is_main:
            # clone: reverted tensors are views of one stacked tensor, and safetensors refuses shared storage
            pending.update({k: v.clone() for k, v in revert_weight_conversion(model, full).items()})
            if sum(v.numel() * v.element_size() for v in pending.values()) >= max_bytes:
                flush()
    if d.is_main:
        if pending:
            flush()
        index_path = folder / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        index["weight_map"].update(written)
        index["metadata"]["total_size"] += written_bytes
        index_path.write_text(json.dumps(index, indent=2))
