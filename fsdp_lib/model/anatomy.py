"""Model anatomy, read off a model (one built on the meta device too): its decoder layers, the Linear modules LoRA can
adapt and the parameters adapters and NF4 weights would count. torch only: no process group, no weights, no FSDP;
model_download.py uses it for its size report."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from fsdp_lib.errors import TrainError


def clean_fqn(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def find_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """Decoder layers, found from the model's own `_no_split_modules` so any architecture works."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        candidates = sorted(
            {type(m).__name__ for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst}
        )
        raise TrainError(
            f"cannot find decoder layers of {type(model).__name__}: _no_split_modules={sorted(names)} matches no "
            f"submodule. Candidates (children of ModuleLists): {candidates}"
        )
    inner = {id(m) for layer in layers for m in layer.modules() if m is not layer}
    layers = [layer for layer in layers if id(layer) not in inner]  # a listed class inside another: the outer one
    seen: dict[int, nn.Module] = {}
    for layer in layers:
        for p in layer.parameters():
            if seen.setdefault(id(p), layer) is not layer:
                raise TrainError(
                    f"{type(model).__name__} shares weights between its decoder layers ({type(seen[id(p)]).__name__} "
                    f"and {type(layer).__name__}, e.g. a shared attention block as in Zamba2): FSDP shards each layer "
                    "as a unit of its own, which shared weights cannot be; this architecture is not supported"
                )
    return layers


def own_units(model: nn.Module) -> list[nn.Module]:
    """The input embedding and output head as FSDP units of their own when they are two parameters (an untied
    head): in the root's unit they would be all-gathered together before the first layer, nothing to overlap with
    (2 GB at every micro-batch for an 8B model's 128k vocabulary); apart, the head's gather overlaps the layers'
    forward. A tied pair stays in the root (one parameter, one unit), and so does a head that is no plain Linear."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None or type(head) is not nn.Linear or head.weight is embed.weight:
        return []
    return [embed, head]


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def root_unit_params(model: nn.Module, layers: list[nn.Module]) -> int:
    """Parameters left to the root's unit: all but the decoder layers' and own_units' (the final norm; a tied
    embedding and head too)."""
    return count_params(model) - sum(map(count_params, [*layers, *own_units(model)]))


def largest_unit_params(model: nn.Module, layers: list[nn.Module]) -> int:
    """Parameters of the largest unit FSDP all-gathers at once: a decoder layer, an untied embedding or head
    (own_units), or the root's remainder (root_unit_params)."""
    units = [*layers, *own_units(model)]
    return max([*map(count_params, units), root_unit_params(model, layers)])


def peft_sizes(model: nn.Module, layers: list[nn.Module], rank: int) -> tuple[int, int]:
    """(weights of the decoder layers' Linear modules: what QLoRA stores as NF4, parameters of rank-`rank`
    adapters on --lora-target-modules auto), counted on the meta model."""
    linear = sum(m.weight.numel() for layer in layers for m in layer.modules() if type(m) is nn.Linear)
    modules = adaptable_modules(model)
    adapters = sum(rank * sum(modules[n].weight.shape) for n in default_targets(model, layers, model.config))
    return linear, adapters


def adaptable_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every Linear-like module peft can adapt (nn.Linear, transformers' Conv1D of GPT-2), by clean FQN."""
    from transformers.pytorch_utils import Conv1D

    return {clean_fqn(n): m for n, m in model.named_modules() if type(m) in (nn.Linear, Conv1D)}


def default_targets(model: nn.Module, layers: list[nn.Module], config: Any) -> list[str]:
    """--lora-target-modules auto: the names of the Linear layers inside the decoder layers (attention and MLP),
    except routers and gates with one output per expert or a single output (MoE); stacked experts are not
    Linear modules, so they stay frozen."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    experts = {getattr(text, k, None) for k in ("num_local_experts", "num_experts", "n_routed_experts")} - {None}
    inside = {id(m) for layer in layers for m in layer.modules()}
    names = []
    for name, module in adaptable_modules(model).items():
        out_features = module.weight.shape[0 if isinstance(module, nn.Linear) else 1]
        if id(module) in inside and out_features not in experts | {1}:
            names.append(name)
    return names
