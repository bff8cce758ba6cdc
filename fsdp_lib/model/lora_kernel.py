"""LoRA's forward and backward as one autograd function per adapted Linear (issue 32: LoRA ran slower than full
fine-tuning on a GPU).

peft computes y = base(x) + B(A(dropout(x))) * scale as separate modules: besides the three matmuls, a scale and an
add pass over the [tokens x out] output in the forward (again under activation checkpointing) and their gradients
plus a third pass summing the two input gradients in the backward. Here the adapter's product accumulates into
the base output inside the matmul (addmm_ with alpha = scale), and the backward accumulates the adapter's input
gradient into the base's the same way: five matmuls and no pass over a [tokens x features] tensor of its own.
What autograd keeps is what peft's modules keep (x, the [tokens x r] product A x, the weights).

Exact: the same products in the same dtype as peft's path (the tests compare outputs and every gradient, family
by family). Only where it is the same computation: a peft Linear over an nn.Linear (GPT-2's Conv1D is not one)
with one vanilla adapter (no DoRA, no adapter bias), no dropout, a frozen dense base weight (not NF4, not float8)
and a frozen or absent bias; every other module keeps peft's forward."""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn as nn

from fsdp_lib.model.quantize import is_nf4


class LoRALinear(torch.autograd.Function):
    """y = x W^T + b + scale (x A^T) B^T over the last dimension of x; gradients for x, A and B (W and b frozen)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        low = flat @ lora_a.t()  # [tokens x r]
        out = torch.addmm(bias, flat, weight.t()) if bias is not None else flat @ weight.t()
        out.addmm_(low, lora_b.t(), alpha=scale)
        ctx.save_for_backward(flat, low, weight, lora_a, lora_b)
        ctx.scale, ctx.shape = scale, x.shape
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        flat, low, weight, lora_a, lora_b = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1])
        grad_low = (grad @ lora_b).mul_(ctx.scale)  # [tokens x r]
        grad_b = (grad.t() @ low).mul_(ctx.scale) if ctx.needs_input_grad[4] else None
        grad_a = grad_low.t() @ flat if ctx.needs_input_grad[3] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ weight).addmm_(grad_low, lora_a).reshape(ctx.shape)
        return grad_x, None, None, grad_a, grad_b, None


def fused_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A peft lora.Linear's forward through LoRALinear while its one adapter is active and unmerged; peft's own
    forward otherwise (adapters disabled, e.g. DPO's reference pass, merged, called with peft's extra arguments,
    or adapters in another dtype than the base, which FSDP's mixed precision never leaves), and inside a compiled
    layer: there inductor fuses peft's elementwise passes into its own kernels, while this function's in-place
    accumulation into the output costs copies (H200, 1B, --compile on: 56,481 tokens/s fused, 58,548 peft's)."""
    base, name = self.base_layer, self.fused_name
    if (
        torch.compiler.is_compiling()  # --compile on: inductor fuses peft's scale and add itself (H200: 1.04x faster)
        or self.disable_adapters
        or self.merged
        or args
        or kwargs
        or list(self.active_adapters) != [name]
        or base.weight.dtype != self.lora_A[name].weight.dtype  # peft adds a product of another dtype, casts back
    ):
        return type(self).forward(self, x, *args, **kwargs)
    x = self._cast_input_dtype(x, self.lora_A[name].weight.dtype)
    scale = self.scaling[name]
    return LoRALinear.apply(x, base.weight, base.bias, self.lora_A[name].weight, self.lora_B[name].weight, scale)


def fusable(module: nn.Module) -> str | None:
    """The adapter name if `module` is a peft lora.Linear whose forward LoRALinear reproduces, else None."""
    from peft.tuners.lora.layer import Linear as PeftLoraLinear

    if type(module) is not PeftLoraLinear or type(module.base_layer) is not nn.Linear:
        return None
    if len(module.lora_A) != 1 or module.lora_variant or getattr(module, "lora_magnitude_vector", None):
        return None
    (name,) = module.lora_A.keys()
    base = module.base_layer
    if not isinstance(module.lora_dropout[name], nn.Identity) or name not in module.scaling:
        return None
    if module.lora_A[name].bias is not None or module.lora_B[name].bias is not None:  # peft's lora_bias
        return None
    if base.weight.requires_grad or is_nf4(base.weight) or (base.bias is not None and base.bias.requires_grad):
        return None
    return name


def fuse_lora(model: nn.Module) -> tuple[int, int]:
    """Every fusable peft Linear of `model` runs LoRALinear (its forward replaced on the instance; its modules,
    parameters and state dict untouched). Returns (fused, adapted Linear modules)."""
    from peft.tuners.lora.layer import LoraLayer

    fused = adapted = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        adapted += 1
        if (name := fusable(module)) is not None:
            module.fused_name = name
            module.forward = types.MethodType(fused_forward, module)
            fused += 1
    return fused, adapted
