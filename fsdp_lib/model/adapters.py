"""LoRA adapters (--peft lora/qlora) with the peft library: which Linear layers to adapt, peft's LoRA modules
injected into the model while it is still on the meta device, the frozen base stored in the compute dtype,
adapter initialisation that is the same at any process count, a PEFT adapter folder in (--adapter) and out
(outputs/EXP/final), and the merged weights for --export-merged. The 4-bit base of QLoRA is quantize.py."""

from __future__ import annotations

import json
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lib.config import TrainConfig
from fsdp_lib.errors import TrainError
from fsdp_lib.integrity import umask_mode
from fsdp_lib.model.anatomy import adaptable_modules, clean_fqn, default_targets
from fsdp_lib.model.hf_files import weights_identity
from fsdp_lib.model.hf_weights import copy_into_shard, is_adapter_name, replace_folder
from fsdp_lib.model.quantize import dequantized_local, is_nf4, quantize_linears_on_meta
from fsdp_lib.objective_flags import changed_flags
from fsdp_lib.runtime import Dist, log

ADAPTER = "default"  # peft's adapter name inside the modules; the files written never carry it
BASE_FILE = "training_base.json"  # beside an exported adapter: the identity of the base it was trained on


def resolve_targets(value: str, model: nn.Module, layers: list[nn.Module]) -> tuple[list[str] | str, str | None]:
    """--lora-target-modules -> peft's target_modules (leaf names where they select exactly the wanted layers,
    else full names), or a problem naming the flag and listing the model's Linear names."""
    linear = adaptable_modules(model)
    leaf_names = sorted({n.rpartition(".")[2] for n in linear})
    if value == "all-linear":
        return "all-linear", None
    if value == "auto":
        wanted = default_targets(model, layers, model.config)
        if not wanted:
            return (
                [],
                f"--lora-target-modules auto: no Linear layer inside the decoder layers of {type(model).__name__}",
            )
    else:
        asked = [v.strip() for v in value.split(",") if v.strip()]
        unknown = [a for a in asked if not any(n == a or n.endswith("." + a) for n in linear)]
        if unknown or not asked:
            return [], (
                f"--lora-target-modules {value!r}: no Linear layer named {', '.join(unknown) or '(none given)'} in "
                f"{type(model).__name__}; its Linear layers are: {', '.join(leaf_names)} (or use auto / all-linear)"
            )
        wanted = [n for n in linear if any(n == a or n.endswith("." + a) for a in asked)]
        if (head := tied_head_name(model)) in wanted:
            return [], (
                f"--lora-target-modules {value!r}: {head} of {type(model).__name__} is tied to the input embedding "
                "(tie_word_embeddings), and adapters on embeddings are not offered (a merged export would drop it "
                f"in silence: the head is re-tied to the unchanged embedding); leave {head} out"
            )
    leaves = sorted({n.rpartition(".")[2] for n in wanted})
    selected_by_leaves = {n for n in linear if n.rpartition(".")[2] in leaves}
    # a stacked experts' parameter of the same name (Qwen2-MoE's experts.down_proj beside the shared expert's
    # down_proj Linear): peft would adapt it too from a leaf name, so the names are given whole
    stacked = any(n.rpartition(".")[2] in leaves for n, _ in model.named_parameters(remove_duplicate=False))
    return (leaves if selected_by_leaves == set(wanted) and not stacked else sorted(wanted)), None


def tied_head_name(model: nn.Module) -> str | None:
    """The output head's module name when its weight is the input embedding's (a tied model), else None."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embedding is None or head.weight is not embedding.weight:
        return None
    return next((name for name, module in model.named_modules() if module is head), None)


def lora_config(cfg: TrainConfig, targets: list[str] | str, base_name: str) -> Any:
    """peft's LoraConfig from the flags, or that of --adapter (its rank, alpha and targets win)."""
    from peft import LoraConfig

    if cfg.adapter:
        config = LoraConfig.from_pretrained(cfg.adapter)
        config.inference_mode = False
    else:
        config = LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=targets,
            bias="none",
            task_type="CAUSAL_LM",
        )
    config.base_model_name_or_path = base_name
    return config


def adapter_flag_conflicts(cfg: TrainConfig, config: Any, targets: list[str] | str) -> list[str]:
    """--lora-rank/--lora-alpha/--lora-dropout/--lora-target-modules given with --adapter and different from what
    the adapter's config says: its config wins, so the run trained other adapters than the flags said, in silence."""
    given = changed_flags(cfg, ("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules"))
    pairs = {
        "--lora-rank": (cfg.lora_rank, config.r),
        "--lora-alpha": (cfg.lora_alpha, config.lora_alpha),
        "--lora-dropout": (cfg.lora_dropout, config.lora_dropout),
        "--lora-target-modules": (targets if isinstance(targets, str) else sorted(targets), target_names(config)),
    }
    return [
        f"{flag} {pairs[flag][0]} differs from --adapter {cfg.adapter}'s {pairs[flag][1]}: the adapter's own "
        f"adapter_config.json sets its rank, alpha, dropout and targets; drop {flag}"
        for flag in given
        if pairs[flag][0] != pairs[flag][1]
    ]


def unsupported_adapter_features(config: Any, model: nn.Module) -> list[str]:
    """What an --adapter's config asks for beyond LoRA on Linear layers, which the trainer builds, trains and exports:
    each was refused as "trained on another base" or died with a traceback."""
    from peft.tuners.tuners_utils import check_target_module_exists

    found = []
    if getattr(config, "use_dora", False):
        found.append("DoRA (use_dora)")
    if getattr(config, "modules_to_save", None):
        found.append(f"modules_to_save {sorted(config.modules_to_save)} (whole trained copies of those modules)")
    if getattr(config, "bias", "none") != "none":
        found.append(f"trained biases (bias {config.bias!r})")
    embeddings = [
        name for name, module in model.named_modules()
        if isinstance(module, nn.Embedding) and check_target_module_exists(config, name)
    ]  # fmt: skip
    if embeddings:
        found.append(f"adapters on embeddings ({embeddings[0]})")
    return found


def inject_adapters(model: nn.Module, config: Any) -> tuple[int, int]:
    """peft's LoRA modules into the (meta) model, in place; everything else frozen.
    Returns (trainable, total) parameter counts."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_name(name))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if not trainable:
        raise TrainError("--peft: peft added no adapter to the model; check --lora-target-modules")
    return trainable, sum(p.numel() for p in model.parameters())


def store_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """The frozen base in the compute dtype (no fp32 master copy: it never updates). In place, so tied
    parameters stay one tensor."""
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and not is_nf4(param):
            param.data = param.data.to(dtype)


@dataclass
class PeftSetup:
    config: Any  # peft's LoraConfig
    trainable: int  # adapter parameters
    total: int  # all parameters, adapters included
    base_identity: str  # hf_files.weights_identity of the base folder (resume fingerprint, training_base.json)
    quantized: list[str]  # QLoRA: the NF4 weights of each decoder layer
    kept: list[str]  # QLoRA: decoder Linear weights left in the compute dtype (not whole NF4 blocks)
    start: str  # "init", or a hash of the --adapter weights training started from


def target_names(config: Any) -> list[str] | str:
    """peft's target_modules as written and compared: a sorted list (peft keeps a set), or its string form."""
    targets = config.target_modules
    return targets if isinstance(targets, str) else sorted(targets)


def adapter_identity(folder: Path) -> str:
    """A hash of an adapter folder's weight file (small: read whole)."""
    import hashlib

    files = [folder / n for n in ("adapter_model.safetensors", "adapter_model.bin") if (folder / n).is_file()]
    return hashlib.sha256(files[0].read_bytes()).hexdigest()[:16] if files else "none"


def base_model_name(cfg: TrainConfig, model_dir: Path) -> str:
    """What adapter_config.json records as the base: the hub id as given, else the folder's absolute path."""
    return cfg.model_name if not Path(cfg.model_name).expanduser().is_dir() else str(model_dir.resolve())


def prepare_peft(
    cfg: TrainConfig, model: nn.Module, layers: list[nn.Module], model_dir: Path, dtype: torch.dtype, world_size: int
) -> PeftSetup:
    """On the meta model, before sharding: the adapters injected, QLoRA's NF4 weights, the frozen rest in `dtype`."""
    targets, problem = resolve_targets(cfg.lora_target_modules, model, layers)
    if problem:
        raise TrainError(problem)
    config = lora_config(cfg, targets, base_model_name(cfg, model_dir))
    trainable, total = inject_adapters(model, config)
    quantized, kept = quantize_linears_on_meta(layers, dtype, world_size) if cfg.peft == "qlora" else ([], [])
    store_frozen_in(model, dtype)
    start = adapter_identity(Path(cfg.adapter)) if cfg.adapter else "init"
    return PeftSetup(config, trainable, total, weights_identity(model_dir), quantized, kept, start)


def adapter_key(name: str) -> str:
    """A parameter name as peft's files write it, without the `base_model.model.` prefix:
    model.layers.0.self_attn.q_proj.lora_A.weight (FSDP/checkpoint wrappers and the adapter name removed)."""
    name = clean_fqn(name).removeprefix("base_model.model.")
    return name.replace(f".{ADAPTER}.", ".").removesuffix(f".{ADAPTER}")


def init_adapters(model: nn.Module, seed: int) -> None:
    """LoRA's initialisation, drawn in full per adapter from a generator seeded by (seed, name) and sliced to this
    rank's shard, so it is the same at any process count (and for a model peft built unsharded): A ~
    U(-1/sqrt(in), 1/sqrt(in)) (peft's kaiming_uniform(a=sqrt(5))), B = 0, so training starts at the base."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            key = adapter_key(name)
            full = torch.zeros(param.shape, dtype=torch.float32)
            if ".lora_A." in f".{key}" and param.ndim == 2:
                g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
                bound = 1.0 / param.shape[1] ** 0.5
                full.uniform_(-bound, bound, generator=g)
            elif ".lora_B." not in f".{key}":
                raise TrainError(f"--peft: no initialisation rule for adapter parameter {key}; please report this")
            copy_into_shard(param, full.to(param.dtype))


def read_adapter_file(folder: Path) -> dict[str, torch.Tensor]:
    """An adapter folder's tensors by adapter_key (prefix and adapter name removed)."""
    path = folder / "adapter_model.safetensors"
    if path.is_file():
        from safetensors.torch import load_file

        stored = load_file(str(path))
    elif (folder / "adapter_model.bin").is_file():
        stored = torch.load(folder / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise TrainError(f"--adapter {folder}: no adapter_model.safetensors or adapter_model.bin")
    return {adapter_key(k): v for k, v in stored.items()}


def adapter_problems(cfg: TrainConfig, model: nn.Module, base_identity: str) -> list[str]:
    """--adapter against the model on meta (after inject_adapters): every tensor must land on an adapter of
    the same shape, and an adapter this tool exported must have been trained on this base."""
    folder = Path(cfg.adapter)
    side = folder / BASE_FILE
    if side.is_file():
        recorded = json.loads(side.read_text()).get("base_identity")
        if recorded and recorded != base_identity:
            return [
                f"--adapter {folder} was trained on another base model (weights identity {recorded}, this "
                f"--model-name {cfg.model_name} is {base_identity}); pass the base it was trained on"
            ]
    try:
        stored = read_adapter_file(folder)
    except (TrainError, OSError, RuntimeError) as exc:
        return [f"--adapter {folder}: cannot read its weights ({exc})"]
    params = {adapter_key(n): p for n, p in model.named_parameters() if p.requires_grad}
    wrong = [k for k, v in stored.items() if k not in params or tuple(params[k].shape) != tuple(v.shape)]
    missing = sorted(set(params) - set(stored))
    if wrong or missing:
        example = wrong[0] if wrong else missing[0]
        shape = tuple(stored[example].shape) if example in stored else "missing"
        ours = tuple(params[example].shape) if example in params else "no such module"
        return [
            f"--adapter {folder} does not fit --model-name {cfg.model_name}: {len(wrong)} tensors of other names or "
            f"shapes and {len(missing)} missing, e.g. {example} (adapter: {shape}, model: {ours}); it was trained "
            f"on another base"
        ]
    return []


def load_adapter(model: nn.Module, folder: Path) -> None:
    """--adapter: copy the folder's tensors into this rank's adapter shards (checked by adapter_problems)."""
    stored = read_adapter_file(folder)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                copy_into_shard(param, stored[adapter_key(name)].to(param.dtype))


def full_adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter tensor in full, on every rank (collectives in the same order everywhere; adapters are small)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            value = param.detach()
            out[adapter_key(name)] = (value.full_tensor() if isinstance(value, DTensor) else value).cpu()
    return out


def _json_value(value: Any) -> Any:
    """What peft's own save writes for a config value JSON lacks: a set as a sorted list (peft 0.22 leaves
    target_parameters = set(); written as the string "set()" the folder did not load), anything else as text."""
    return sorted(value) if isinstance(value, set | frozenset) else str(value)


def export_adapter(
    model: nn.Module, config: Any, tokenizer: Any, out_dir: Path, d: Dist, base_identity: str, step: int
) -> None:
    """outputs/EXP/final as a PEFT adapter folder: adapter_config.json (with the base's name or path),
    adapter_model.safetensors in fp32 (the adapters' training dtype; they are small), the tokenizer with its chat
    template, and training_base.json (the base's weights identity, checked by --adapter)."""
    from safetensors.torch import save_file

    tensors = full_adapter_tensors(model)
    if d.is_main:
        tmp = out_dir.with_name(f".{out_dir.name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        named = {f"base_model.model.{k}": v.float().contiguous() for k, v in tensors.items()}
        save_file(named, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        umask_mode(tmp / "adapter_model.safetensors")
        saved = config.to_dict()
        saved["inference_mode"] = True
        saved["target_modules"] = target_names(config)
        (tmp / "adapter_config.json").write_text(json.dumps(saved, indent=2, sort_keys=True, default=_json_value))
        (tmp / BASE_FILE).write_text(
            json.dumps({"base_model_name_or_path": config.base_model_name_or_path, "base_identity": base_identity})
        )
        tokenizer.save_pretrained(tmp)
        replace_folder(tmp, out_dir, step)
        trainable = sum(v.numel() for v in tensors.values())
        log(f"exported PEFT adapter ({trainable:,} parameters, fp32) to {out_dir}")
    dist.barrier()


@torch.no_grad()
def merged_state_dict(model: nn.Module, dtype: torch.dtype) -> dict[str, Any]:
    """The model's state in the base's own names with every adapter merged in: W + alpha/r x B A (transposed for
    Conv1D), dequantised first where the base is NF4, computed in fp32 and rounded to `dtype` (the export's) one
    tensor at a time, so fp32 copies of the merged model never exist together (8B on one GPU: +42 GB before).
    Sharded as the weights are: per adapted layer the small A and B are gathered and the update is sliced to
    this rank's rows, never the whole model on one rank."""
    from peft.tuners.lora import LoraLayer
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor, distribute_tensor

    lora_layers = {clean_fqn(n): m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    merged: dict[str, Any] = {}
    for key, value in get_model_state_dict(model).items():
        key = clean_fqn(key)
        if is_adapter_name(key):
            continue
        owner, _, leaf = key.rpartition(".base_layer.")
        if owner in lora_layers and leaf == "weight":
            layer = lora_layers[owner]
            a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
            full_a = a.full_tensor() if isinstance(a, DTensor) else a
            full_b = b.full_tensor() if isinstance(b, DTensor) else b
            delta = (full_b.float() @ full_a.float()) * layer.scaling[ADAPTER]
            if getattr(layer, "fan_in_fan_out", False):
                delta = delta.T
            base = dequantized_local(value) if is_nf4(value) else value
            base = (base.to_local() if isinstance(base, DTensor) else base).float()
            if isinstance(value, DTensor):
                part = distribute_tensor(delta.contiguous(), value.device_mesh, value.placements, src_data_rank=None)
                merged_local = (base + part.to_local().to(base.device)).to(dtype)
                value = DTensor.from_local(
                    merged_local, value.device_mesh, value.placements, shape=value.shape, stride=delta.stride()
                )
            else:
                value = (base + delta.to(base.device)).to(dtype)
            del delta, base
        merged[key.replace(".base_layer.", ".")] = value
    return merged
