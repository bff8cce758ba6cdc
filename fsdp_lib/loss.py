"""The training forward and its loss: CausalLMLoss (the FSDP root) runs the decoder, then the output head and the
cross-entropy together in chunks of --loss-chunk-tokens, so full [tokens x vocab] logits never exist; plus the
MoE router load-balancing loss."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lib.data import Batch


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the targets that carry loss (label -100 = none), in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T (+ bias)` over the targets that carry loss, computed in chunks of
    tokens so the [tokens x vocab] logits exist one chunk at a time (fp32 within the chunk, as the full path).

    The forward also computes the gradients chunk by chunk (the loss is a scalar, so backward only scales them):
    no logits are kept and none are recomputed. Optional tanh soft-capping (Gemma 2/3) is applied per chunk.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, softcap):  # type: ignore[override]
        needs_grad = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if needs_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and needs_grad[2] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start : start + chunk], labels[start : start + chunk]
            logits = F.linear(h, weight, bias).float()
            if softcap:
                capped = torch.tanh(logits / softcap)
                logits = capped * softcap
            keep = y != -100
            safe = torch.where(keep, y, 0)
            target_logit = logits.gather(1, safe[:, None]).squeeze(1)
            # Log-sum-exp, then softmax, in place in the chunk's (fresh) logits: one [chunk x vocab] buffer at a time.
            row_max = logits.amax(dim=-1, keepdim=True)
            sum_exp = logits.sub_(row_max).exp_().sum(dim=-1, keepdim=True)
            total += ((row_max.squeeze(1) + sum_exp.log().squeeze(1) - target_logit) * keep).sum()
            if not any(needs_grad):
                continue
            grad = logits.div_(sum_exp)  # d loss / d logits = softmax - onehot, on kept rows
            grad[torch.arange(len(y), device=y.device), safe] -= 1.0
            grad *= keep[:, None]
            if softcap:
                grad *= 1.0 - capped * capped
            grad = grad.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + chunk] = grad @ weight
            if grad_weight is not None:
                grad_weight += (grad.t() @ h).float()
            if grad_bias is not None:
                grad_bias += grad.float().sum(0)
            del logits, grad  # free this chunk's buffers before the next chunk allocates its own
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in (grad_hidden, grad_weight, grad_bias)))
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        needs = ctx.needs_input_grad
        return (
            grad_hidden * grad_output.to(grad_hidden.dtype) if needs[0] else None,
            (grad_weight * grad_output).to(ctx.dtypes[0]) if needs[1] else None,
            (grad_bias * grad_output).to(ctx.dtypes[1]) if needs[2] and ctx.dtypes[1] is not None else None,
            None,
            None,
            None,
        )


def chunked_loss_sum(
    hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, chunk: int, softcap: float | None
) -> torch.Tensor:
    """Summed cross-entropy of the output head over `hidden` [tokens x dim], chunk tokens at a time."""
    if torch.is_grad_enabled():
        return ChunkedCrossEntropy.apply(hidden, head.weight, head.bias, labels, chunk, softcap)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        logits = head(hidden[start : start + chunk]).float()
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        total += F.cross_entropy(logits, labels[start : start + chunk], ignore_index=-100, reduction="sum")
    return total


def _load_balancing_fn(model: nn.Module) -> Any:
    """The load_balancing_loss_func of the model's own modeling module (Mixtral, Qwen2/3-MoE, OLMoE, ...)."""
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def moe_aux_loss(model: nn.Module, outputs: Any) -> torch.Tensor | None:
    """The router loss transformers' CausalLM forward adds, computed from the base model's router logits."""
    aux = _load_balancing_fn(model)(outputs.router_logits, model.num_experts, model.num_experts_per_tok, None)
    return router_aux_loss(SimpleNamespace(aux_loss=aux), model.config)


# Config attributes that rescale a model's logits after its output head: the chunked loss cannot know how.
LOGIT_POSTPROCESSING = ("logit_scale", "logits_scaling", "output_multiplier_scale", "lm_head_multiplier")


def chunked_loss_problem(model: nn.Module) -> str | None:
    """Why the chunked loss cannot reproduce this model's logits, or None when it can."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        return f"its output head is a {type(head).__name__}, not a Linear layer"
    if model.base_model is model:
        return "it has no separate base model to take hidden states from"
    if router_forward_kwargs(model.config) and not (
        _load_balancing_fn(model) and hasattr(model, "num_experts") and hasattr(model, "num_experts_per_tok")
    ):
        return "its router loss is computed in a way only its own forward knows"
    found = [a for a in LOGIT_POSTPROCESSING if getattr(model.config, a, None) not in (None, 1, 1.0)]
    return f"its config rescales logits ({', '.join(found)})" if found else None


class CausalLMLoss(nn.Module):
    """The training forward: the decoder, then output head and loss together, in chunks of --loss-chunk-tokens
    tokens, so the [tokens x vocab] logits and their gradient never exist in full. This module is the FSDP
    root, so the head's weight stays gathered from the decoder's output to the end of the loss.
    With chunk 0 (or a model whose head the chunked path cannot reproduce) the model's own logits are used."""

    def __init__(self, model: nn.Module, chunk_tokens: int):
        super().__init__()
        self.model = model
        self.chunk = chunk_tokens
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.router_kwargs = router_forward_kwargs(model.config)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(summed token loss, the MoE router loss weighted by router_aux_loss_coef or None)."""
        inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, **self.router_kwargs}
        if not self.chunk:
            outputs = self.model(**inputs)
            return token_loss_sum(outputs.logits, batch.labels), router_aux_loss(outputs, self.model.config)
        outputs = self.model.base_model(**inputs)
        head = self.model.get_output_embeddings()
        hidden = outputs.last_hidden_state.flatten(0, 1)
        loss = chunked_loss_sum(hidden, head, batch.labels.flatten(), self.chunk, self.softcap)
        return loss, (moe_aux_loss(self.model, outputs) if self.router_kwargs else None)


def router_forward_kwargs(model_config: Any) -> dict[str, bool]:
    """MoE models compute their router load-balancing loss only when asked for the router logits."""
    has_aux = getattr(model_config, "router_aux_loss_coef", 0) and hasattr(model_config, "output_router_logits")
    return {"output_router_logits": True} if has_aux else {}


def router_aux_loss(outputs: Any, model_config: Any) -> torch.Tensor | None:
    """The config's router_aux_loss_coef times the model's load-balancing loss; None for models without one."""
    aux = getattr(outputs, "aux_loss", None)
    coef = getattr(model_config, "router_aux_loss_coef", 0)
    return None if aux is None or not coef else coef * aux
