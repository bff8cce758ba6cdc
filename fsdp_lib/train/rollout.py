"""--objective grpo's generation: completions sampled on the sharded model, batched over prompts with a KV cache,
every rank in lockstep. `generate` is the one entry point, so an inference engine can replace it later.

Sampling draws no state: completion g of prompt p in epoch e, at its t-th token, uses the uniform number
`sampling_uniforms(seed, e, p, g)[t]`, a counter-based hash (splitmix64) of those integers. The draw is inverse-CDF
over the (temperature-scaled, top-p-filtered) distribution, so a completion depends only on the model's logits and
these keys: a resumed run, or a rank that gets the prompt in another batch, draws the same numbers. No random number
generator is saved or restored."""

from __future__ import annotations

import inspect
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lib.model.anatomy import clean_fqn
from fsdp_lib.model.loss import head_logits
from fsdp_lib.runtime import reshard_all

_MASK64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(_MASK64)
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(_MASK64)
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & np.uint64(_MASK64)
        return x ^ (x >> np.uint64(31))


def sampling_uniforms(seed: int, epoch: int, prompts: np.ndarray, generations: np.ndarray, steps: int) -> torch.Tensor:
    """[rows x steps] uniform numbers in [0, 1), row i keyed by (seed, epoch, prompts[i], generations[i]) and the
    token index: the same numbers whatever the batch, rank or process count."""
    key = _splitmix64(np.full(len(prompts), seed & _MASK64, dtype=np.uint64))
    for part in (np.full(len(prompts), epoch & _MASK64, dtype=np.uint64), prompts, generations):
        key = _splitmix64(key ^ np.asarray(part).astype(np.uint64))
    counters = _splitmix64(
        key[:, None] ^ np.arange(1, steps + 1, dtype=np.uint64)[None, :] * np.uint64(0xD1B54A32D192ED03)
    )
    return torch.from_numpy((counters >> np.uint64(11)).astype(np.float64) * 2.0**-53)


def sample_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampled token per row, entropy of each row's temperature-scaled distribution) by inverse CDF: the token
    whose cumulative probability first exceeds u. top_p < 1 keeps the most probable tokens whose mass reaches
    top_p (at least one). Temperature 0: the most probable token (greedy; entropy 0, the uniforms unused)."""
    if temperature == 0:
        return logits.argmax(-1), torch.zeros(logits.shape[0], device=logits.device)
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    probs = logp.exp()
    entropy = -(probs * logp).sum(-1)
    order = None
    if top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs  # the mass of the more probable tokens
        probs = probs * (before < top_p)
    cdf = probs.cumsum(-1)
    u = uniforms.to(cdf.device, cdf.dtype)[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)
    # a token of probability 0 is never picked: searchsorted(right) lands on the first token with cdf > u
    if order is not None:
        picked = order.gather(-1, picked)
    return picked.squeeze(-1), entropy


def keep_layers_gathered(setting: str, num_params: int, precision: str, device: torch.device) -> bool:
    """Whether a generation keeps the decoder layers gathered from its first token to its last (--rollout-unshard
    `setting`): on, off, or auto = on where the whole model's parameters take under a quarter of the
    accelerator's memory (always on a CPU)."""
    if setting != "auto":
        return setting == "on"
    if device.type != "cuda":
        return True
    itemsize = {"bf16": 2, "fp16": 2}.get(precision, 4)
    return num_params * itemsize < 0.25 * torch.cuda.get_device_properties(device).total_memory


def cache_argument(model: nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` in newer transformers (`past_key_values` there is a
    deprecated alias that warns), `past_key_values` in older ones."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(outputs: Any) -> Any:
    """The KV cache a forward returned, under either name."""
    return outputs["cache"] if "cache" in outputs else outputs["past_key_values"]


@dataclass
class Completions:
    tokens: list[list[int]]  # per row: the sampled tokens up to and with the first stop token
    stopped: list[bool]  # whether the row ended on a stop token (else it reached --max-new-tokens)
    entropy_sum: float  # of the sampling distributions at the completions' tokens
    forwards: int  # decoding forwards run (the same on every rank)
    seconds: float


def _keep_gathered(root: nn.Module, keep: bool) -> list[tuple[nn.Module, bool]]:
    """With `keep`: every FSDP unit gathered now and set to stay gathered after its forward; returns the settings
    they had, to restore."""
    from torch.distributed.fsdp import FSDPModule

    saved = []
    if not keep:
        return saved
    for module in root.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            saved.append((module, group is not None and group.post_forward_mesh_info is not None))
            module.set_reshard_after_forward(False, recurse=False)
            module.unshard()
    return saved


_VIEWS: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


def gathered_view(train_forward: nn.Module) -> nn.Module | None:
    """The Hugging Face model as a plain module over its gathered parameters: a copy of its structure (built once,
    on the meta device) whose parameters and buffers are the very tensors FSDP gathered (no copy, no memory), so
    decoding skips FSDP's per-module hooks and input casts (~11 of 25 ms per token of a 1B model on one H200).
    Every FSDP unit must be gathered first. None where such a copy cannot stand in: adapters (peft), a parameter
    still sharded, a structure the config does not rebuild; the caller then decodes through FSDP."""
    from torch.distributed.tensor import DTensor

    model = train_forward.model
    if hasattr(model, "peft_config"):
        return None
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    if any(isinstance(t, DTensor) or t.device.type == "meta" for t in tensors.values()):
        return None
    view = _VIEWS.get(model)
    if view is None:
        try:
            with torch.device("meta"):
                view = type(model)(model.config)
        except Exception:  # noqa: BLE001 - a model its config cannot rebuild: decode through FSDP instead
            return None
        view.eval().requires_grad_(False)
        _VIEWS[model] = view
    own = {**dict(view.named_parameters(remove_duplicate=False)), **dict(view.named_buffers(remove_duplicate=False))}
    for name, tensor in tensors.items():
        name = clean_fqn(name)
        if name not in own:
            return None
        owner, _, attr = name.rpartition(".")
        module = view.get_submodule(owner)
        slot = module._parameters if attr in module._parameters else module._buffers
        slot[attr] = tensor
    if getattr(view.config, "tie_word_embeddings", False) and view.get_output_embeddings() is not None:
        view.get_output_embeddings().weight = view.get_input_embeddings().weight
    left = [n for n, t in {**dict(view.named_parameters(remove_duplicate=False)), **dict(view.named_buffers())}.items()
            if t.device.type == "meta"]  # fmt: skip
    return None if left else view


@torch.no_grad()
def generate(
    train_forward: nn.Module,
    prompts: list[list[int]],
    uniforms: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    stops: set[int],
    pad_id: int,
    device: torch.device,
    keep_gathered: bool,
    check_every: int = 8,
    stand_in: bool = False,
) -> Completions:
    """Sampled completions of `prompts` (token ids; left-padded into one batch) on the FSDP-sharded model.

    Every rank must call it together (FSDP's all-gathers line up): each runs the same number of decoding forwards,
    stopping when every row of every rank has ended (agreed by an all-reduce every `check_every` tokens).
    keep_gathered: the decoder layers stay gathered from the first token to the last (one all-gather per layer per
    call; the whole model's parameters in memory meanwhile) instead of being gathered again for every token.
    stand_in: the rows only keep this rank's forwards in line with the others' (a rank with nothing to sample):
    they count as ended from the start, so they never hold the others back."""
    start = time.perf_counter()
    model = train_forward.model
    head = model.get_output_embeddings()
    rows = len(prompts)
    width = max(len(p) for p in prompts)
    ids = torch.full((rows, width), pad_id, dtype=torch.int64)
    mask = torch.zeros((rows, width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_(min=0)
    stop_ids = torch.tensor(sorted(stops), dtype=torch.int64, device=device)
    uniforms = uniforms.to(device)
    tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.int64, device=device)
    ended = torch.full((rows,), stand_in, dtype=torch.bool, device=device)
    entropy = torch.zeros((), dtype=torch.float64, device=device)
    was_training = train_forward.training
    train_forward.eval()
    saved = _keep_gathered(train_forward, keep_gathered)
    train_forward.unshard()
    if keep_gathered:  # every unit gathered: decoded without FSDP's hooks where the model allows
        view = gathered_view(train_forward)
        if view is not None:
            model, head = view, view.get_output_embeddings()
    decoder = model.base_model if train_forward.chunk else model  # the chunked loss's head, or the model's own
    cache_name = cache_argument(decoder)
    past, step_ids, forwards = None, ids, 0
    try:
        for t in range(max_new_tokens):
            inputs = {"input_ids": step_ids, "attention_mask": mask, "position_ids": positions, cache_name: past}
            out = decoder(**inputs, use_cache=True)
            if train_forward.chunk:
                logits = head_logits(out.last_hidden_state[:, -1], head, train_forward.softcap)
            else:
                logits = out.logits[:, -1]
            forwards += 1
            past = returned_cache(out)
            picked, row_entropy = sample_tokens(logits, uniforms[:, t], temperature, top_p)
            live = ~ended
            entropy += (row_entropy.double() * live).sum()
            picked = torch.where(live, picked, pad_id)
            tokens[:, t] = picked
            ended |= live & torch.isin(picked, stop_ids)
            step_ids = picked[:, None]
            positions = positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=device)], dim=1)
            if (t + 1) % check_every == 0 and t + 1 < max_new_tokens:
                left = (~ended).any().to(torch.int32)
                dist.all_reduce(left, op=dist.ReduceOp.MAX)
                if not left.item():
                    break
    finally:
        for module, setting in saved:
            module.set_reshard_after_forward(setting, recurse=False)
        reshard_all(train_forward)
        train_forward.train(was_training)
    host = tokens[:, :forwards].cpu().tolist()
    stop_set = set(stops)
    out_tokens, stopped = [], []
    for row in host:
        cut = next((i for i, tok in enumerate(row) if tok in stop_set), None)
        out_tokens.append(row[: cut + 1] if cut is not None else row)
        stopped.append(cut is not None)
    return Completions(out_tokens, stopped, float(entropy.item()), forwards, time.perf_counter() - start)
