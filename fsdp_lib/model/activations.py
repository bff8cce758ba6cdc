"""Activation memory beyond checkpointing (issue 33): --activation-offload moves the tensors autograd saves for
backward to host memory during the forward and brings each back when backward needs it; --tiled-mlp N computes each
decoder layer's MLP over N tiles of the tokens, so its [tokens x intermediate] activations exist for one tile at a
time, in the forward and in the backward. Both are exact: the same values go through the same operations.

Offload: torch's saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks) around the training forward. With
activation checkpointing on, what autograd saves is mostly each checkpointed layer's input (torch's non-reentrant
checkpoint saves it through the hooks), as Arctic Long Sequence Training offloads it; parameters (FSDP's gathered
ones included), tensor subclasses (DTensor, NF4) and small tensors stay where they are. On a GPU the copies go to
pinned host memory without blocking the host (the copy back is queued on the same stream before its use, so the
order of the stream keeps it right); they are not overlapped with compute on a side stream (torchtune's offloader
does that), so a step pays the copies' time. On CPU the tensors are already in host memory: the hooks copy them,
which exercises the path and saves nothing.

Tiled MLP: an autograd function (ArcticTraining's TiledMLP idea, written here) that runs the MLP on each tile
without keeping its graph, saves only its input (and each tile's random-number state, so a dropout draws the same
mask again), and in backward recomputes one tile at a time and back-propagates it into the parameters' gradients
(under FSDP the layer's gathered parameters, reduced by its post-backward hook as usual) and the input's gradient.
An MLP whose input needs no gradient (LoRA on the MLP alone, the layers below frozen) runs whole: autograd would
not call the function's backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn

MIN_OFFLOAD_BYTES = 1 << 16  # smaller saved tensors stay: a copy costs more than they hold


@dataclass
class ActivationOffload:
    """Saved-tensor hooks that keep large activations in host memory between the forward and the backward."""

    min_bytes: int = MIN_OFFLOAD_BYTES
    offloaded_bytes: int = 0  # over the forwards so far (the step's figure: reset by the caller)
    offloaded_tensors: int = 0
    _pinned: bool = field(default=False, init=False)

    def wanted(self, tensor: torch.Tensor) -> bool:
        return (
            type(tensor) is torch.Tensor  # not a Parameter (FSDP's gathered weights), a DTensor or an NF4 tensor
            and not isinstance(tensor._base, nn.Parameter)  # nor a view of one (a Linear saves weight.t())
            and tensor.numel() * tensor.element_size() >= self.min_bytes
        )

    def pack(self, tensor: torch.Tensor) -> torch.Tensor | tuple[torch.device, torch.Tensor]:
        if not self.wanted(tensor):
            return tensor
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        self.offloaded_tensors += 1
        if tensor.device.type == "cpu":  # nothing to offload to: a copy, so the path runs as on a GPU
            return tensor.device, tensor.detach().clone()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, layout=tensor.layout, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return tensor.device, host

    @staticmethod
    def unpack(packed: torch.Tensor | tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host if device.type == "cpu" else host.to(device, non_blocking=True)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield


class TiledMLPFunction(torch.autograd.Function):
    """y = mlp(x) computed over `tiles` slices of x's tokens; saves x only, recomputes each tile in backward."""

    @staticmethod
    def forward(ctx, mlp: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tiles: int) -> torch.Tensor:  # noqa: ANN001
        ctx.mlp, ctx.tiles, ctx.rng = mlp, tiles, []
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        outs = []
        with torch.no_grad():
            for part in flat.tensor_split(tiles):
                ctx.rng.append(rng_state(x.device))  # a dropout in the MLP draws the same mask again in backward
                outs.append(mlp(part))
        out = torch.cat(outs)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[None, torch.Tensor, None]:  # noqa: ANN001
        (x,) = ctx.saved_tensors
        flat = x.reshape(-1, x.shape[-1])
        grads = grad_out.reshape(-1, grad_out.shape[-1])
        parts = []
        devices = [x.device] if x.device.type == "cuda" else []
        for part, grad, state in zip(flat.tensor_split(ctx.tiles), grads.tensor_split(ctx.tiles), ctx.rng, strict=True):
            part = part.detach().requires_grad_(x.requires_grad)
            with torch.enable_grad(), torch.random.fork_rng(devices=devices):
                set_rng_state(state, x.device)
                out = ctx.mlp(part)
            # the parameters' gradients accumulate here, tile after tile; the input's is collected
            torch.autograd.backward(out, grad)
            parts.append(part.grad if part.grad is not None else torch.zeros_like(part))
        return None, torch.cat(parts).reshape(x.shape), None


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def tiled_forward(
    forward: Callable[[torch.Tensor], torch.Tensor], tiles: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """An MLP's forward computed in `tiles` tiles of its tokens (TiledMLPFunction) when gradients are wanted."""

    def tiled(x: torch.Tensor) -> torch.Tensor:
        # x without a gradient (e.g. LoRA on the MLP alone): autograd would never call the function's backward, so
        # the MLP's own parameters would get no gradient; computed whole instead
        if not torch.is_grad_enabled() or not x.requires_grad or x.shape[:-1].numel() < tiles:
            return forward(x)
        return TiledMLPFunction.apply(forward, x, tiles)

    return tiled


def tile_mlps(layers: list[nn.Module], tiles: int) -> str | None:
    """Each decoder layer's `mlp` computed in `tiles` tiles: its forward is replaced on the instance, so the
    parameters keep their names (checkpoints, weight loading, export). None, or why the model's layers cannot be
    tiled (checked on every layer before any is changed)."""
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            return f"its decoder layers ({type(layer).__name__}) have no `mlp` module"
        if hasattr(mlp, "experts") or (hasattr(mlp, "gate") and not hasattr(mlp, "gate_proj")):
            return f"its MLP ({type(mlp).__name__}) is a mixture of experts, whose router sees the tokens together"
    for layer in layers:
        layer.mlp.forward = tiled_forward(layer.mlp.forward, tiles)
    return None
