"""The training forward and its loss: CausalLMLoss (the FSDP root) runs the decoder, then the output head and the
cross-entropy together in chunks of --loss-chunk-tokens, so full [tokens x vocab] logits never exist; plus the
MoE router load-balancing loss."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lib.data.batch import Batch, Documents
from fsdp_lib.model import varlen
from fsdp_lib.model.activations import ActivationOffload

HeadFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], Any]  # (hidden, weight, bias) -> result

# --loss-chunk-tokens auto: one chunk's fp32 logits (softmax and gradient are computed in place in them) stay within
# this. At a 128k vocabulary that is 512 tokens: at 2,048 tokens per micro-batch the loss path's extra memory is
# about a quarter of the full fp32 logits (bench/bench_loss.py), and each head matmul still has >= 256 rows.
LOSS_CHUNK_BUDGET_BYTES = 256 * 2**20


def loss_chunk_tokens(setting: str | int, vocab_size: int) -> int:
    """--loss-chunk-tokens as a number of tokens: a number as given (0 = full logits); auto = the most tokens,
    a multiple of 64 and at least 64, whose fp32 logits fit LOSS_CHUNK_BUDGET_BYTES."""
    if str(setting) != "auto":
        return int(setting)
    return max(64, LOSS_CHUNK_BUDGET_BYTES // (4 * vocab_size) // 64 * 64)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the targets that carry loss (label -100 = none), in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of `hidden @ weight.T (+ bias)` over the targets that carry loss, computed in chunks of
    tokens so the [tokens x vocab] logits exist one chunk at a time (fp32 within the chunk, as the full path).

    The forward also computes the gradients chunk by chunk (the loss is a scalar, so backward only scales them):
    no logits are kept and none are recomputed. Optional tanh soft-capping (Gemma 2/3) is applied per chunk.

    The head's gradient accumulates in the weight's own dtype: it is the one [vocab x hidden] buffer autograd
    must return anyway (bf16 under mixed precision), so no fp32 copy of the head exists (2.1 GB for a 128k x 4096
    head); the chunks' partial sums are rounded to that dtype as they add up, like the gradient of any Linear
    layer under mixed precision. Backward scales both gradients by the incoming scale (world / trained tokens)
    in fp32, in place, never rounding the scale itself to bf16.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, softcap):  # type: ignore[override]
        needs_grad = ctx.needs_input_grad[:3]
        # fp16: the gradients stay fp32 until backward has applied the loss scale (its grad_output). Rounded to
        # fp16 here, a softmax gradient below fp16's 6e-8 would flush to zero before the scale could lift it, and a
        # head gradient summed over many tokens could overflow. bf16 has fp32's range: rounded here, as above.
        fp16 = torch.float16 in (hidden.dtype, weight.dtype)
        work = torch.float32 if fp16 else None
        head = weight.float() if fp16 and needs_grad[0] else weight  # for the hidden states' gradient only
        grad_hidden = torch.zeros_like(hidden, dtype=work) if needs_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=work) if needs_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and needs_grad[2] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start : start + chunk], labels[start : start + chunk]
            logits, capped = _chunk_logits(h, weight, bias, softcap)
            keep, safe, target_logit = _targets(logits, y)
            # Log-sum-exp, then softmax, in place in the chunk's (fresh) logits: one [chunk x vocab] buffer at a time.
            row_max, sum_exp = _exp_shifted_(logits)
            total += ((row_max + sum_exp.log() - target_logit) * keep).sum()
            if not any(needs_grad):
                continue
            grad = logits.div_(sum_exp[:, None])  # d loss / d logits = softmax - onehot, on kept rows
            grad[torch.arange(len(y), device=y.device), safe] -= 1.0
            grad *= keep[:, None]
            if softcap:
                grad.mul_(capped.square_().neg_().add_(1.0))  # tanh' = 1 - tanh^2, in the tanh values' buffer
            grad = grad.to(work or hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + chunk] = grad @ head
            if grad_weight is not None:  # in place: no [vocab x hidden] temporary per chunk
                grad_weight.addmm_(grad.t().to(grad_weight.dtype), h.to(grad_weight.dtype))
            if grad_bias is not None:
                grad_bias += grad.float().sum(0)
            del logits, grad  # free this chunk's buffers before the next chunk allocates its own
        ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in (grad_hidden, grad_weight, grad_bias)))
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        grad_hidden, grad_weight, grad_bias = ctx.saved_tensors
        needs = ctx.needs_input_grad
        return (
            _scale_in_fp32_(grad_hidden, grad_output).to(ctx.dtypes[0]) if needs[0] else None,
            _scale_in_fp32_(grad_weight, grad_output).to(ctx.dtypes[1]) if needs[1] else None,
            (grad_bias * grad_output).to(ctx.dtypes[2]) if needs[2] and ctx.dtypes[2] is not None else None,
            None,
            None,
            None,
        )


class ChunkedTokenLogProbs(torch.autograd.Function):
    """Per-token log-probabilities of the targets, log softmax(hidden @ weight.T (+ bias) / temperature)[label], 0
    where the label is -100, computed in chunks of tokens so the [tokens x vocab] logits exist one chunk at a time
    (fp32). The temperature (GRPO's sampling temperature; 1 elsewhere) divides the soft-capped logits.

    Unlike ChunkedCrossEntropy the loss built on them (DPO) weighs each token by a factor known only after the whole
    sequence is summed, so the gradients cannot be formed in forward: backward recomputes each chunk's logits (one
    more head matmul per chunk) and applies the incoming per-token gradient, d logp / d logits = onehot - softmax.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk, softcap, temperature=1.0):  # type: ignore[override]
        out = chunked_token_log_probs(hidden, weight, bias, labels, chunk, softcap, temperature)
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), labels)
        ctx.chunk, ctx.softcap, ctx.has_bias, ctx.temperature = chunk, softcap, bias is not None, temperature
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        hidden, weight, bias, labels = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        needs = ctx.needs_input_grad
        grad_hidden = torch.zeros_like(hidden) if needs[0] else None
        grad_weight = torch.zeros_like(weight) if needs[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and needs[2] else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            h, y = hidden[start : start + ctx.chunk], labels[start : start + ctx.chunk]
            logits, capped = _chunk_logits(h, weight, bias, ctx.softcap)
            keep, safe = _kept_labels(y)
            g = grad_out[start : start + ctx.chunk].float() * keep
            if ctx.temperature != 1.0:  # d/d logits of logp(logits / T): (onehot - softmax(logits / T)) / T
                logits.div_(ctx.temperature)
                g = g / ctx.temperature
            grad = _softmax_(logits).mul_(-g[:, None])  # d/d logits of sum g * logp, in the logits' buffer
            grad[torch.arange(len(y), device=y.device), safe] += g
            if capped is not None:
                grad.mul_(capped.square_().neg_().add_(1.0))  # tanh' = 1 - tanh^2, in the tanh values' buffer
            g_hidden = grad.to(hidden.dtype)  # one rounded copy for both products (none in fp32)
            if grad_hidden is not None:
                grad_hidden[start : start + ctx.chunk] = g_hidden @ weight
            if grad_weight is not None:
                g_weight = g_hidden if weight.dtype == hidden.dtype else grad.to(weight.dtype)
                grad_weight.addmm_(g_weight.t(), h.to(weight.dtype))
            if grad_bias is not None:
                grad_bias += grad.sum(0)
            del logits, capped, grad, g_hidden
        return (
            grad_hidden,
            grad_weight,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
            None,
            None,
        )


def chunked_token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    chunk: int,
    softcap: float | None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """ChunkedTokenLogProbs' values, without autograd (also its forward)."""
    out = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        logits = _chunk_logits(hidden[start : start + chunk], weight, bias, softcap, keep_tanh=False)[0]
        if temperature != 1.0:
            logits.div_(temperature)
        out[start : start + chunk] = _target_log_probs_(logits, labels[start : start + chunk])
        del logits
    return out


def _chunk_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None, keep_tanh: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(fp32 logits of one chunk, soft-capped where configured; the tanh values for the cap's gradient, or None
    without a cap or without keep_tanh). The cap is applied in place: one [chunk x vocab] buffer, two with the
    tanh values kept."""
    logits = F.linear(h, weight, bias).float()
    if not softcap:
        return logits, None
    capped = logits.div_(softcap).tanh_()
    return (capped * softcap, capped) if keep_tanh else (capped.mul_(softcap), None)


def _kept_labels(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows with a target, the labels with -100 replaced by 0: safe to index with)."""
    keep = labels != -100
    return keep, torch.where(keep, labels, 0)


def _targets(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_kept_labels and each row's target logit, of [tokens x vocab] logits."""
    keep, safe = _kept_labels(labels)
    return keep, safe, logits.gather(1, safe[:, None]).squeeze(1)


def _exp_shifted_(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp(logits - row max) in place in `logits`; returns (row max, row sum of the exponentials), one per row. The
    log-sum-exp is their max + log(sum); the softmax is `logits` divided by the sum."""
    row_max = logits.amax(dim=-1)
    return row_max, logits.sub_(row_max[:, None]).exp_().sum(dim=-1)


def _softmax_(logits: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension, in place in `logits` (which it returns)."""
    return logits.div_(_exp_shifted_(logits)[1][:, None])


def _target_log_probs_(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """_target_log_probs without a second [tokens x vocab] buffer: the log-sum-exp exponentiates `logits` in place
    (their values are gone afterwards)."""
    keep, _, target = _targets(logits, labels)
    row_max, sum_exp = _exp_shifted_(logits)
    return (target - row_max - sum_exp.log_()) * keep


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] per token in fp32, 0 where the label is -100 (the model's own logits)."""
    return _target_log_probs(logits.flatten(0, 1).float(), labels.flatten())


def _target_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] of [tokens x vocab] fp32 logits, 0 where the label is -100."""
    keep, _, target = _targets(logits, labels)
    return (target - torch.logsumexp(logits, dim=-1)) * keep


def _scale_in_fp32_(tensor: torch.Tensor, scale: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """tensor *= scale, computed in fp32 and rounded once to the tensor's dtype, in place, a block of rows at a
    time (bounded fp32 temporaries). `bf16_tensor * fp32_scalar_tensor` would round the scale to bf16 first."""
    if tensor.dtype == torch.float32:
        return tensor.mul_(scale)
    for block in tensor.split(rows):
        block.copy_(block.float().mul_(scale))
    return tensor


def chunked_loss_sum(
    hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, chunk: int, softcap: float | None
) -> torch.Tensor:
    """Summed cross-entropy of the output head over `hidden` [tokens x dim], chunk tokens at a time."""

    def loss_sum(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.is_grad_enabled():
            return ChunkedCrossEntropy.apply(h, weight, bias, labels, chunk, softcap)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk):
            logits = _chunk_logits(h[start : start + chunk], weight, bias, softcap, keep_tanh=False)[0]
            total += F.cross_entropy(logits, labels[start : start + chunk], ignore_index=-100, reduction="sum")
        return total

    return through_head(head, loss_sum, hidden)


def head_forward(self: nn.Linear, hidden: torch.Tensor, via: HeadFn | None = None) -> Any:
    """The output head's forward once it is an FSDP unit of its own (an untied head, build.shard_model): the Linear
    as before, or via(hidden, weight, bias), which is how the chunked loss reads the weight: inside the head's own
    call, so FSDP gathers the weight before it and reduce-scatters its gradient once the backward has passed it."""
    if via is None:
        return F.linear(hidden, self.weight, self.bias)
    return via(hidden, self.weight, self.bias)


def through_head(head: nn.Module, fn: HeadFn, hidden: torch.Tensor) -> Any:
    """fn(hidden, head.weight, head.bias): through the head's call where the head is its own FSDP unit (head_forward),
    directly where its weight is already whole (inside the root's unit, or a gathered view's plain Linear)."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(head, FSDPModule):
        return head(hidden, via=fn)
    return fn(hidden, head.weight, head.bias)


def head_logits(hidden: torch.Tensor, head: nn.Module, softcap: float | None) -> torch.Tensor:
    """What the chunked path computes from the decoder's output: the head, in fp32, soft-capped where configured."""
    return through_head(head, lambda h, weight, bias: _chunk_logits(h, weight, bias, softcap)[0], hidden)


def _load_balancing_fn(model: nn.Module) -> Any:
    """The load_balancing_loss_func of the model's own modeling module (Mixtral, Qwen2/3-MoE, OLMoE, ...)."""
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def micro_batch_note(model_config: Any, changed: list[str]) -> str:
    """What another -b (among a resume's `changed` flags, `--batch-size NOW (was THEN)`) changes beyond the memory,
    for its log: an MoE model's router loss, computed per micro-batch (a product of two means over its tokens, as
    transformers computes it per forward), differs."""
    if not router_forward_kwargs(model_config) or not any(flag.startswith("--batch-size ") for flag in changed):
        return ""
    return " (-b: this MoE model's router loss is computed per micro-batch, so the updates differ slightly from here)"


def moe_aux_loss(model: nn.Module, outputs: Any) -> torch.Tensor | None:
    """The router loss transformers' CausalLM forward adds, computed from the base model's router logits."""
    aux = _load_balancing_fn(model)(outputs.router_logits, model.num_experts, model.num_experts_per_tok, None)
    return router_aux_loss(SimpleNamespace(aux_loss=aux), model.config)


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
    return None  # what the head computes after the Linear is checked on real numbers at start-up (probes.py)


class CausalLMLoss(nn.Module):
    """The training forward: the decoder, then output head and loss together, in chunks of --loss-chunk-tokens
    tokens, so the [tokens x vocab] logits and their gradient never exist in full. This module is the FSDP
    root; the head's weight is read inside the head's own call (through_head), so it stays gathered from the
    decoder's output to the end of the loss whether the head sits in the root's unit or in one of its own.
    With chunk 0 (or a model whose head the chunked path cannot reproduce) the model's own logits are used.

    Packed documents (a batch with position ids) are kept apart the way the model needs, chosen at start-up by
    probes.choose_document_masking: "varlen" (with --attn-implementation varlen: each document attends to
    itself through varlen.py's kernels, from bounds the batch carries; no mask), "position_ids" (transformers derives a block-diagonal mask from positions
    that restart per document), "one_row" (the micro-batch as one row: varlen kernels such as flash-attention
    detect packed documents only in a batch of one row) or "block_mask" (an explicit [batch x 1 x T x T] mask, for
    models that build their causal mask without the position ids)."""

    def __init__(self, model: nn.Module, chunk_tokens: int):
        super().__init__()
        self.model = model
        self.chunk = chunk_tokens
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.router_kwargs = router_forward_kwargs(model.config)
        self.document_masking = "position_ids"
        self.mask_dtype = torch.float32  # of an additive block mask (eager attention): the compute dtype
        self.context: varlen.Context | None = None  # --context-parallel: this rank's part of each sequence
        self.offload: ActivationOffload | None = None  # --activation-offload on

    def forward(
        self, batch: Batch, probe: bool = False, per_token: bool = False, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(summed token loss, the MoE router loss weighted by router_aux_loss_coef or None). probe (start-up
        checks, no grad): (the model's own logits, the chunked path's logits or None) instead. per_token (DPO, GRPO):
        (each target's log-probability [batch x T flattened], 0 where the label is -100, of the logits divided by
        `temperature`; the router loss or None). With --activation-offload, what autograd saves goes to host memory."""
        with self.offload() if self.offload is not None else contextlib.nullcontext():
            return self.compute(batch, probe, per_token, temperature)

    def compute(
        self, batch: Batch, probe: bool, per_token: bool, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.context is not None:
            batch = local_part(batch, self.context)
        inputs = self.model_inputs(batch)
        if per_token:
            return self.token_log_probs(inputs, batch, temperature)
        if probe:  # the logits only: transformers' router loss cannot read a 4-D mask
            own = self.model(**{k: v for k, v in inputs.items() if k not in self.router_kwargs}).logits.float()
            if self.context is not None:  # the whole rows' logits, from every part
                own = all_parts(own, self.context)
            ours = (
                head_logits(
                    self.model.base_model(**inputs).last_hidden_state, self.model.get_output_embeddings(), self.softcap
                )
                if self.chunk
                else None
            )
            return own, (all_parts(ours, self.context) if self.context is not None and ours is not None else ours)
        if not self.chunk:
            outputs = self.model(**inputs)
            return token_loss_sum(outputs.logits, batch.labels), router_aux_loss(outputs, self.model.config)
        outputs = self.model.base_model(**inputs)
        head = self.model.get_output_embeddings()
        hidden = outputs.last_hidden_state.flatten(0, 1)
        loss = chunked_loss_sum(hidden, head, batch.labels.flatten(), self.chunk, self.softcap)
        return loss, (moe_aux_loss(self.model, outputs) if self.router_kwargs else None)

    def token_log_probs(
        self, inputs: dict[str, Any], batch: Batch, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.chunk:
            outputs = self.model(**inputs)
            logits = outputs.logits.reshape(*batch.labels.shape, -1)
            logits = logits / temperature if temperature != 1.0 else logits
            return token_log_probs(logits, batch.labels), router_aux_loss(outputs, self.model.config)
        outputs = self.model.base_model(**inputs)
        head = self.model.get_output_embeddings()
        hidden = outputs.last_hidden_state.flatten(0, 1)
        labels = batch.labels.flatten()
        # only the positions that have a target go through the head (a prompt's and padding's do not); found on
        # the host where the batch came from there (Batch.to), else here, which waits for the device
        rows = batch.targets if batch.targets is not None else (labels != -100).nonzero().squeeze(1)
        args = (labels[rows], self.chunk, self.softcap, temperature)

        def log_probs(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if torch.is_grad_enabled():
                return ChunkedTokenLogProbs.apply(h, weight, bias, *args)
            return chunked_token_log_probs(h, weight, bias, *args)

        picked = through_head(head, log_probs, hidden.index_select(0, rows))
        logps = torch.zeros(len(labels), dtype=picked.dtype, device=picked.device).index_copy(0, rows, picked)
        return logps, (moe_aux_loss(self.model, outputs) if self.router_kwargs else None)

    def model_inputs(self, batch: Batch) -> dict[str, Any]:
        inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, **self.router_kwargs}
        varlen_rows = self.document_masking == "varlen" and batch.documents is not None
        if varlen_rows or self.context is not None:  # each document attends to itself, no [T x T] mask (varlen.py)
            varlen.use_documents(batch.documents, self.context)
            mark = varlen.documents_mark(batch.input_ids.shape[0], batch.input_ids.device)
            return {**inputs, "attention_mask": mark}
        if batch.position_ids is None or self.document_masking == "position_ids":
            return inputs
        if self.document_masking == "one_row":  # every block starts at position 0, so blocks stay apart too
            return {
                **inputs,
                "input_ids": batch.input_ids.reshape(1, -1),
                "position_ids": batch.position_ids.reshape(1, -1),
            }
        eager = self.model.config._attn_implementation == "eager"
        return {**inputs, "attention_mask": block_diagonal_mask(batch.position_ids, self.mask_dtype if eager else None)}


def context_columns(t: torch.Tensor, context: varlen.Context | None) -> torch.Tensor:
    """This rank's contiguous part of every row of a [rows x T] tensor under --context-parallel (the positions its
    per-token outputs cover); all of it without."""
    if context is None:
        return t
    part = t.shape[1] // context.size
    return t[:, context.rank * part : (context.rank + 1) * part]


def local_part(batch: Batch, context: varlen.Context) -> Batch:
    """--context-parallel: this rank's contiguous part of every row (inputs, their targets, their positions),
    with the documents of the whole rows, which the attention's all-to-all brings back together. Rows without
    position ids (--document-masking off) count positions from each row's start, one document per row."""
    rows, length = batch.input_ids.shape
    positions, documents = batch.position_ids, batch.documents
    if positions is None:
        positions = torch.arange(length, device=batch.input_ids.device).expand(rows, length)
        documents = Documents.whole_rows(rows, length, batch.input_ids.device)
    return dataclasses.replace(
        batch,
        input_ids=context_columns(batch.input_ids, context),
        labels=context_columns(batch.labels, context),
        position_ids=context_columns(positions, context),
        documents=documents,
        targets=None,  # positions in the whole rows
    )


@torch.no_grad()
def all_parts(t: torch.Tensor, context: varlen.Context) -> torch.Tensor:
    """[rows x T/N x ...] of each rank of a context group -> [rows x T x ...], the parts in order (no gradient:
    the start-up probes only)."""
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(context.size)]
    dist.all_gather(parts, t.contiguous(), group=context.group)
    return torch.cat(parts, dim=1)


def block_diagonal_mask(position_ids: torch.Tensor, additive_dtype: torch.dtype | None) -> torch.Tensor:
    """[batch x 1 x T x T]: token i may attend to token j <= i of its own document (documents start where the
    position ids restart at 0). Boolean (True = attend), or additive (0 / the dtype's lowest) for eager attention."""
    document = (position_ids == 0).cumsum(dim=1)
    same = document[:, :, None] == document[:, None, :]
    causal = torch.ones(position_ids.shape[1], position_ids.shape[1], dtype=torch.bool, device=position_ids.device)
    allowed = (same & causal.tril())[:, None]
    if additive_dtype is None:
        return allowed
    zeros = torch.zeros((), dtype=additive_dtype, device=position_ids.device)
    return torch.where(allowed, zeros, torch.finfo(additive_dtype).min)


def router_forward_kwargs(model_config: Any) -> dict[str, bool]:
    """MoE models compute their router load-balancing loss only when asked for the router logits."""
    has_aux = getattr(model_config, "router_aux_loss_coef", 0) and hasattr(model_config, "output_router_logits")
    return {"output_router_logits": True} if has_aux else {}


def router_aux_loss(outputs: Any, model_config: Any) -> torch.Tensor | None:
    """The config's router_aux_loss_coef times the model's load-balancing loss; None for models without one."""
    aux = getattr(outputs, "aux_loss", None)
    coef = getattr(model_config, "router_aux_loss_coef", 0)
    return None if aux is None or not coef else coef * aux
