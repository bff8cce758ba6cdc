"""Start-up checks, on real numbers, that the model computes what the trainer assumes: the chunked loss's head
reproduces the model's own logits, and packed documents never attend to each other. Each runs a few no-grad
forwards of a [2 x 32] probe through the FSDP root (every rank, in step) before the first step: cheap next to
loading the weights, and they replace lists of architectures or config keys that a new model would slip past."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_lib.data.batch import Batch
from fsdp_lib.errors import TrainError
from fsdp_lib.model import varlen
from fsdp_lib.model.loss import CausalLMLoss
from fsdp_lib.runtime import Dist, all_ranks_agree, eagerly, log, reshard_all

ROWS, LENGTH, FIRST_DOCUMENT = 2, 32, 12  # probe rows of two documents: tokens [0, 12) and [12, 32)


def probe_shape(train_forward: CausalLMLoss) -> tuple[int, int]:
    """(row length, first document's length): LENGTH and FIRST_DOCUMENT, or under --context-parallel N lengths
    that split into N equal parts (16N and 4N), the first document crossing no part boundary on purpose."""
    n = train_forward.context.size if train_forward.context is not None else 1
    return (LENGTH, FIRST_DOCUMENT) if n == 1 else (16 * n, 4 * n)


# Largest difference, relative to the largest logit, still taken as "the same": fp32 paths agree to ~1e-6; bf16
# computations of the same numbers agree exactly, and different shapes to about 1e-2.
HEAD_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}
LEAK_TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3, "fp16": 1e-3}
ALONE_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 5e-2}
MASKING_MODES = ("position_ids", "one_row", "block_mask")  # after "varlen", for a model built with it


def probe_ids(vocab_size: int, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Token ids from a private generator: the same on every rank, and the global RNG (dropout, data order on
    resume) is not touched."""
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def probe_logits(
    train_forward: CausalLMLoss, ids: torch.Tensor, positions: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the model's own logits [rows x T x vocab], the chunked path's or None), in eval mode (no dropout)."""
    was_training = train_forward.training
    train_forward.eval()
    try:
        own, ours = train_forward(Batch(ids, ids, positions).to(device), probe=True)
    finally:
        train_forward.train(was_training)
        reshard_all(train_forward)
    rows, length = ids.shape
    return own.reshape(rows, length, -1), None if ours is None else ours.reshape(rows, length, -1)


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |a|; a host sync, at start-up only."""
    return float((a - b).abs().max() / a.abs().max().clamp_min(1e-6))


def head_difference(train_forward: CausalLMLoss, vocab_size: int, device: torch.device) -> float:
    """How far the chunked path's logits (the head over the decoder's output, soft-capped as configured) are from
    the model's own, relative to their largest value (inf when their shapes differ)."""
    own, ours = probe_logits(train_forward, probe_ids(vocab_size, (1, probe_shape(train_forward)[0]), 1), None, device)
    return relative_difference(own, ours) if own.shape == ours.shape else float("inf")


def document_leaks(train_forward: CausalLMLoss, vocab_size: int, device: torch.device) -> tuple[float, float]:
    """With the current document masking: how far the second document's logits move when the first document
    changes, and how far they are from the same document alone at the start of a row (both relative)."""
    length, cut = probe_shape(train_forward)
    first = probe_ids(vocab_size, (ROWS, cut), seed=2)
    other_first = probe_ids(vocab_size, (ROWS, cut), seed=3)
    second = probe_ids(vocab_size, (ROWS, length - cut), seed=4)
    restart = torch.cat([torch.arange(cut), torch.arange(length - cut)]).repeat(ROWS, 1)
    packed, _ = probe_logits(train_forward, torch.cat([first, second], 1), restart, device)
    changed, _ = probe_logits(train_forward, torch.cat([other_first, second], 1), restart, device)
    alone, _ = probe_logits(train_forward, second, torch.arange(length - cut).repeat(ROWS, 1), device)
    leak = relative_difference(packed[:, cut:], changed[:, cut:])
    return leak, relative_difference(alone, packed[:, cut:])


def check_chunked_head(train_forward: CausalLMLoss, vocab_size: int, precision: str, d: Dist) -> str | None:
    """Why the chunked path cannot stand in for the model's own logits (a transform after the head it does not
    know: a logit scale, a soft cap under another name, vocabulary slicing), or None when it can."""
    difference = head_difference(train_forward, vocab_size, d.device)
    if all_ranks_agree(difference > HEAD_TOLERANCE[precision], d):
        return f"its own logits differ from its output head's by {difference:.2g} of their largest value"
    return None


def sliding_window(config: Any) -> int | None:
    """The model's sliding-window length where some attention layer uses one, else None (a window in the config
    that use_sliding_window turns off, or that no layer type uses, does not count)."""
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    if not window or getattr(text, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def varlen_drops(config: Any, window: int | None) -> str | None:
    """What of the model's attention varlen would leave out, read after a probe forward through it: a sliding
    window the model declares but applies through its mask alone (no attention call was given it), or Llama 4's
    chunked attention; None when nothing."""
    if window and not varlen.SAW_WINDOW[0]:
        return f"the model applies its sliding window ({window}) through its mask alone, which varlen does not read"
    if chunk := getattr(config.get_text_config(), "attention_chunk_size", None):
        return f"the model's chunked attention (attention_chunk_size {chunk}) is applied through its mask alone"
    return None


def choose_document_masking(train_forward: CausalLMLoss, vocab_size: int, precision: str, d: Dist) -> str:
    """The first way of telling the model where packed documents start under which a document's logits are those
    it has alone: not moved by a change in the document before it, and equal to the same document at the start
    of a row. Raises TrainError (naming --document-masking) when there is none."""
    problems = []
    built = train_forward.model.config._attn_implementation
    if train_forward.context is not None:  # the Ulysses attention is varlen's: nothing else splits a sequence
        first, others = ("varlen",), ()
    else:
        first, others = ("varlen",) * (built == varlen.NAME), MASKING_MODES
    if first and train_forward.router_kwargs and not train_forward.chunk:
        problems.append("varlen: the model's own MoE router loss (full logits, no loss chunks) cannot read its mask")
        first = ()
    window = sliding_window(train_forward.model.config)
    for mode in first + others:
        if mode == "block_mask" and window:  # the probe's documents are shorter than any window: it cannot see this
            problems.append(f"block_mask: one [T x T] mask for every layer would drop the sliding window ({window})")
            continue
        train_forward.document_masking = mode
        varlen.SAW_WINDOW[0] = False
        try:
            leak, apart = document_leaks(train_forward, vocab_size, d.device)
        except Exception as exc:  # noqa: BLE001 - e.g. a model that takes no 4-D mask: the same on every rank
            problems.append(f"{mode}: the model refuses it ({type(exc).__name__}: {str(exc)[:100]})")
            continue
        if mode == varlen.NAME and (dropped := varlen_drops(train_forward.model.config, window)):
            problems.append(f"varlen: {dropped}")  # the probe compares varlen with itself: it cannot see this
            continue
        if not all_ranks_agree(leak > LEAK_TOLERANCE[precision] or apart > ALONE_TOLERANCE[precision], d):
            if problems:
                log(f"--document-masking on: {mode}, as {'; '.join(problems)}")
            return mode
        problems.append(
            f"{mode}: the second document's logits move by {leak:.2g} with the first, {apart:.2g} from alone"
        )
    arch = type(train_forward.model).__name__
    raise TrainError(
        f"--document-masking on: {arch} lets packed documents see each other however they are marked "
        f"({'; '.join(problems)}). Recurrent or state-space layers carry state along the whole sequence; "
        f"some models build their mask or position bias (ALiBi) from a 2-D mask only, or without the position ids (gpt-oss). Use --document-masking off (a document then "
        f"sees the ones before it in its block), or another --attn-implementation."
    )


def run_start_up_checks(train_forward: CausalLMLoss, vocab_size: int, precision: str, packed: bool, d: Dist) -> None:
    """Falls back to the model's own logits when the chunked head differs; picks the document masking. Runs
    compiled layers eagerly (their probe shapes are not the training step's)."""
    try:
        with eagerly():
            _start_up_checks(train_forward, vocab_size, precision, packed, d)
    except RuntimeError as exc:  # the same forward on every rank: all raise it
        if "mixed torch.Tensor and DTensor" not in str(exc):
            raise
        raise TrainError(
            f"the start-up probe's forward of {type(train_forward.model).__name__} failed: {str(exc)[:160]} (a "
            "weight used while its layer's shards were not gathered: a model that computes with a layer's weights "
            "outside that layer's forward cannot be sharded per layer)"
        ) from exc


def _start_up_checks(train_forward: CausalLMLoss, vocab_size: int, precision: str, packed: bool, d: Dist) -> None:
    if train_forward.chunk and (problem := check_chunked_head(train_forward, vocab_size, precision, d)):
        log(
            f"--loss-chunk-tokens: full logits instead of the chunked loss for {type(train_forward.model).__name__}: {problem}"
        )
        train_forward.chunk = 0
    if packed:
        train_forward.document_masking = choose_document_masking(train_forward, vocab_size, precision, d)
