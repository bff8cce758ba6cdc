"""--fp8: the decoder layers' Linear layers trained in float8 (torchao's Float8Linear), as torchtitan does.

Each matmul of such a layer (forward, and both of its backward) takes float8 operands: inputs and weights in e4m3,
gradients in e5m2, with dynamic scales (from the current absolute maxima); the master weights, gradients and
optimizer state stay fp32 and everything outside these Linear layers runs in the compute dtype. The scales
(float8_recipe): rowwise when packed documents are kept apart (a token is scaled by its own row), else tensorwise
(one per tensor), where FSDP all-gathers the weights in float8 (half the bytes of bf16) with their scales computed
for all of them at once after each optimizer step (precompute_float8_dynamic_scale_for_fsdp: one all-reduce).

Which Linear layers: those inside the decoder layers whose two dimensions are multiples of 16 (what the float8
matmul needs); the embeddings, the output head and small projections (an MoE router) stay in the compute dtype.
`--fp8 on` needs a GPU with float8 matmuls (compute capability 8.9: Ada, Hopper and later); `--fp8 emulate` runs the
same casts with matmuls in high precision on any device, for tests: the numbers of float8 training, none of its speed.
The device check is checks.py's (before any process group).
"""

from __future__ import annotations

import torch
import torch.nn as nn


def float8_eligible(module: nn.Module, name: str) -> bool:
    """A plain Linear layer whose both dimensions are multiples of 16."""
    return type(module) is nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0


def float8_recipe(documents_apart: bool) -> str:
    """rowwise when packed documents must stay apart (a token's scale is its own row's: no document changes how
    another is rounded), else tensorwise (one scale per tensor, the fastest, weights all-gathered in float8)."""
    return "rowwise" if documents_apart else "tensorwise"


def convert_to_float8(layers: list[nn.Module], mode: str, recipe: str) -> tuple[int, int]:
    """Swap the eligible Linear layers of each decoder layer for torchao's Float8Linear (on the meta skeleton,
    before checkpoint wrapping, compile and sharding). Returns (converted, Linear layers left in high precision)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    else:
        config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=mode == "emulate")
    converted = skipped = 0
    for layer in layers:
        linears = [m for m in layer.modules() if isinstance(m, nn.Linear)]
        eligible = sum(float8_eligible(m, "") for m in linears)
        convert_to_float8_training(layer, config=config, module_filter_fn=float8_eligible)
        converted, skipped = converted + eligible, skipped + len(linears) - eligible
    return converted, skipped


def precompute_float8_scales(model: nn.Module) -> None:
    """After an optimizer step: the float8 scales of every sharded weight for the next all-gathers, at once."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def high_precision(t: torch.Tensor) -> torch.Tensor:
    """`t` without torchao's float8 weight wrapper (tensorwise scales with float8 all-gather wrap each weight, also
    inside its DTensor): what an export writes. Any other tensor comes back as it is."""
    import sys

    from torch.distributed.tensor import DTensor

    if "torchao.float8" not in sys.modules:  # never converted: no wrapper exists (and torchao stays unimported)
        return t
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    local = t.to_local() if isinstance(t, DTensor) else t
    if not isinstance(local, WeightWithDynamicFloat8CastTensor):
        return t
    if isinstance(t, DTensor):
        return DTensor.from_local(local._tensor, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
    return local._tensor
