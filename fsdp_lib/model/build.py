"""The model: built on the meta device with the attention kernel chosen, decoder layers found from the model's own
_no_split_modules, activation checkpointing (recompute in backward) per layer, FSDP2 fully_shard per layer plus
the root, then its shards filled from the HF weight files or initialised. Also the --dry-run report."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
import types
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import yaml

from fsdp_lib.config import TrainConfig
from fsdp_lib.context_degree import context_heads_problem
from fsdp_lib.errors import TrainError
from fsdp_lib.experiment_dir import resume_outlook
from fsdp_lib.model import varlen
from fsdp_lib.model.activations import ActivationOffload, tile_mlps
from fsdp_lib.model.adapters import (
    PeftSetup,
    adapter_flag_conflicts,
    adapter_problems,
    init_adapters,
    inject_adapters,
    load_adapter,
    lora_config,
    prepare_peft,
    resolve_targets,
    target_names,
    unsupported_adapter_features,
)
from fsdp_lib.model.anatomy import (
    clean_fqn,
    count_params,
    find_decoder_layers,
    largest_unit_params,
    own_units,
    peft_sizes,
    root_unit_params,
)
from fsdp_lib.model.float8 import convert_to_float8, float8_recipe
from fsdp_lib.model.hf_files import weights_identity
from fsdp_lib.model.hf_weights import export_dtype, is_adapter_name, load_pretrained_sharded, weight_keys
from fsdp_lib.model.lora_kernel import fuse_lora
from fsdp_lib.model.loss import (
    CausalLMLoss,
    chunked_loss_problem,
    head_forward,
    loss_chunk_tokens,
    router_forward_kwargs,
)
from fsdp_lib.model.memory_plan import (
    COMPUTE_BYTES,
    activation_bytes_per_token,
    format_bytes,
    format_long_context_plan,
    format_memory_plan,
    format_peft_memory_plan,
    offloaded_bytes_per_token,
    peft_memory_plan,
    training_memory_plan,
)
from fsdp_lib.model.probes import run_start_up_checks
from fsdp_lib.model.quantize import is_nf4, resident_bytes
from fsdp_lib.offline import resolve_model_dir
from fsdp_lib.runtime import Dist, log


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build a model with parameters on the meta device but real buffers.

    Parameters cost nothing (their init runs on meta), while buffers such as rotary `inv_freq`
    are computed for real, so we can put them back after `to_empty` wipes them.
    """
    original = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":  # meta already: a re-registration (weight tying)
            kwargs = {"requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def auto_attention_order(packed_documents: bool) -> tuple[str, ...]:
    """--attn-implementation auto. With document masking, varlen first (varlen.py: each document attends to itself,
    from bounds computed on the host; no [T x T] mask, no host sync), which the start-up probe still has to find
    exact for the model; then sdpa, then eager."""
    return (varlen.NAME, "sdpa", "eager") if packed_documents else ("sdpa", "eager")


def build_model_skeleton(
    model_dir: Path, attn_implementation: str = "auto", packed_documents: bool = False
) -> nn.Module:
    """The model with parameters on meta. auto tries the kernels of auto_attention_order in turn.

    Each attempt starts from a freshly read config: from_config records the requested implementation in
    the config object it is given, so retrying with the same object would ask for sdpa again (Gemma2).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    attempts = auto_attention_order(packed_documents) if attn_implementation == "auto" else (attn_implementation,)
    if varlen.NAME in attempts:
        varlen.register()
    for attn in attempts:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        config.use_cache = False
        try:
            with parameters_on_meta():
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn)
            if attn == varlen.NAME and not model._supports_sdpa:  # varlen is sdpa per document, and sdpa elsewhere
                raise ValueError(f"{type(model).__name__} does not support sdpa, which varlen attention builds on")
            return model
        # no such kernel for this architecture, or not installed; KeyError: a model that looks the name up in a
        # table of its own (GPT-Neo's attention classes)
        except (ValueError, ImportError, KeyError) as exc:
            problem = exc
    raise TrainError(
        f"--attn-implementation {attn_implementation}: cannot build {config.architectures or config.model_type} "
        f"from {model_dir} ({problem}); try --attn-implementation auto or eager"
    )


def apply_activation_checkpointing(model: nn.Module, layers: list[nn.Module], every_n: int) -> int:
    """Wrap every Nth decoder layer with torch's checkpoint wrapper (non-reentrant).

    We do not use HF's gradient_checkpointing flag: under FSDP it re-runs the layer outside the
    FSDP hooks' view and costs an extra all-gather per layer.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as wrap,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    selected = {id(layer) for i, layer in enumerate(layers) if i % every_n == 0}
    wrap(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: id(m) in selected)
    return len(selected)


def shard_model(root: nn.Module, layers: list[nn.Module], cfg: TrainConfig, precision: str, d: Dist) -> None:
    """fully_shard each decoder layer, an untied input embedding and output head (own_units), then the root: the
    training forward (CausalLMLoss) around the model, whose group holds the final norm and whatever else is left
    (a tied embedding and head: one parameter, so one unit)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    # Pinned host memory speeds up the GPU copies; without a GPU there is nothing to pin for (and it fails).
    offload = CPUOffloadPolicy(pin_memory=d.device.type == "cuda") if cfg.cpu_offload == "on" else OffloadPolicy()
    reshard = cfg.sharding != "grad-op"
    # A shard group of one process (one GPU, --sharding none): torch's FSDP2 then skips the all-gather and keeps only
    # the first of a parameter's all-gather inputs, which breaks NF4 (three: scales, factors, codes). Sharding over
    # one process does nothing, so FSDP leaves the frozen NF4 weights alone.
    ignored = {p for p in root.parameters() if is_nf4(p)} if d.mesh.size(-1) == 1 else set()
    shard = functools.partial(
        fully_shard, mesh=d.mesh, mp_policy=mp, offload_policy=offload, ignored_params=ignored or None
    )
    wrappers = {id(m._checkpoint_wrapped_module): m for m in root.modules() if hasattr(m, "_checkpoint_wrapped_module")}
    for i, layer in enumerate(layers):
        unit = wrappers.get(id(layer), layer)  # shard the checkpoint wrapper, so recompute sees FSDP's hooks
        if cfg.compile == "on":
            unit.compile()
        # The last layer's backward comes right after the loss: resharding it after forward would only regather it.
        shard(unit, reshard_after_forward=reshard and i < len(layers) - 1)
    for module in own_units(root.model):
        head = module is root.model.get_output_embeddings()
        # the head's backward follows its forward at once (kept gathered, like the last layer); the embedding's
        # weight is not read by its backward, but FSDP regathers it there, overlapped with the first layer's
        shard(module, reshard_after_forward=reshard and not head)
        if head:  # the chunked loss reads the weight through the head's own call (loss.through_head)
            module.forward = types.MethodType(head_forward, module)
    shard(root, reshard_after_forward=reshard)


def materialize(model: nn.Module, d: Dist, cfg: TrainConfig) -> None:
    """Allocate the local shards, then restore the buffers that `to_empty` left as garbage."""
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    model.to_empty(device="cpu" if cfg.cpu_offload == "on" else d.device)
    for name, value in buffers.items():
        module_name, _, buffer_name = name.rpartition(".")
        owner = model.get_submodule(module_name) if module_name else model
        owner._buffers[buffer_name] = value.to(d.device)  # buffers stay on the compute device, even with offload


def init_weights_on_shards(model: nn.Module, config: Any, seed: int, d: Dist, whole: bool = True) -> None:
    """Initialise from scratch, shard by shard, identically at any number of processes.

    Each parameter is drawn in full from a generator seeded by (seed, name) and sliced to this rank's shard,
    so only one full parameter exists at a time. Rule: matrices ~ N(0, initializer_range), 1-D weights
    (norms) = 1, biases = 0. whole=False: each rank draws its own shard alone from a generator of (seed, rank),
    at 1/processes the cost and building no full parameter; the weights then depend on the process count: for
    the start-up probes of a model whose checkpoint replaces every weight next.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    std = getattr(config, "initializer_range", 0.02)
    gen_device = d.device if d.device.type == "cuda" else torch.device("cpu")
    own = torch.Generator(device=gen_device).manual_seed(seed * 1_000_003 + d.rank)
    with torch.no_grad():
        for name, param in model.named_parameters():
            name = clean_fqn(name)
            if is_adapter_name(name):  # adapters.init_adapters
                continue
            local = param.to_local() if isinstance(param, DTensor) else param
            shape, generator = (param.shape, None) if whole else (local.shape, own)
            full = torch.empty(shape, dtype=torch.float32, device=gen_device)
            if param.ndim >= 2:
                seeded = seed * 1_000_003 + zlib.crc32(name.encode())
                full.normal_(0.0, std, generator=generator or torch.Generator(device=gen_device).manual_seed(seeded))
            else:
                full.fill_(0.0 if name.endswith("bias") else 1.0)
            if whole and isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            local.copy_(full)


def check_still_tied(model: nn.Module) -> None:
    """Tied input/output embeddings must remain one Parameter through sharding, or training unties them."""
    head = model.get_output_embeddings()
    if getattr(model.config, "tie_word_embeddings", False) and head is not None:
        if head.weight is not model.get_input_embeddings().weight:
            raise TrainError("tied input/output embeddings became two tensors during sharding; please report this")


@dataclass
class ModelBundle:
    model: nn.Module  # the Hugging Face model: its state dict is what checkpoints and the export hold
    train_forward: CausalLMLoss  # the FSDP root around it: batch -> summed loss
    config: Any
    model_dir: Path
    num_params: int
    activation_checkpointed_layers: int  # decoder layers recomputed in backward
    flops_per_token: Callable[[float], float]  # of the positions a token attends over (see flops_per_token)
    export_dtype: torch.dtype  # --export-dtype; auto = the dtype the model was shipped in
    peft: PeftSetup | None = None  # --peft lora/qlora


def flops_per_token(model: nn.Module, config: Any, adapter_params: int | None = None) -> Callable[[float], float]:
    """Model FLOPs per token as a function of T, the positions a token attends over: 6N + 12*L*H*Q*T (PaLM
    appendix B). N counts matmul parameters, i.e. all but the input embedding, plus the output head even when it
    is tied to the input embedding (the head matmul still runs). T is the sequence length for whole rows, less for
    packed documents kept apart (metrics.attended_span: the mean over tokens of their document's length).
    With adapters (`adapter_params`, not counted in N): the frozen base costs 4N (forward 2N, and 2N for the
    gradients of the activations flowing back through it; no weight gradients), the adapters 6 x their count.
    The parameters are counted now (before sharding renames or splits them)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    n = sum(p.numel() for name, p in model.named_parameters() if not is_adapter_name(name)) - embed.numel()
    if head is not None and head.weight is embed:
        n += embed.numel()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:  # no attention heads (Mamba, RWKV): no attention term; a head size per layer (Gemma 4): not counted
        layers, heads = text.num_hidden_layers, getattr(text, "num_attention_heads", 0) or 0
        head_dim = (getattr(text, "head_dim", None) or text.hidden_size // heads) if heads else 0
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError is its own class
        layers, heads, head_dim = 0, 0, 0
    dense = 6 * n if adapter_params is None else 4 * n + 6 * adapter_params
    per_position = 12 * layers * heads * head_dim
    return lambda span: dense + per_position * span


def check_context_parallel(model: nn.Module, n: int, world: int, seq_length: int) -> None:
    """--context-parallel N: the model runs varlen attention, its query heads split into N groups (Ulysses; the
    key/value heads split too, or are replicated where there are fewer than N), and it has no router loss
    (computed per part, it would not equal the unsplit run's). TrainError naming the flag and the largest degree
    that works otherwise."""
    config = model.config.get_text_config()
    impl = model.config._attn_implementation
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if impl != varlen.NAME:
        raise TrainError(
            f"--context-parallel {n}: {type(model).__name__} cannot run the varlen attention kernel it needs "
            f"(it was built with {impl}); use --context-parallel 1"
        )
    if router_forward_kwargs(model.config):
        raise TrainError(
            f"--context-parallel {n}: {type(model).__name__} has a router load-balancing loss, which is not exact "
            "when each process sees part of a sequence; use --context-parallel 1"
        )
    if problem := context_heads_problem(n, heads, kv_heads, type(model).__name__, world, seq_length):
        raise TrainError(problem)


def build_model(
    cfg: TrainConfig, precision: str, d: Dist, from_checkpoint: bool = False, probes: bool = True
) -> ModelBundle:
    """The model sharded for training, with its pretrained (or initial) weights and adapters. from_checkpoint: a
    checkpoint is loaded next and, without adapters, replaces every weight, so the model folder's are not read
    (a resumed 8B run reads 16 GB less before its first step); the shards are initialised for the start-up probes
    instead. probes=False: no start-up probe runs (an --export-only, which trains nothing; bench_loading.py)."""
    model_dir = resolve_model_dir(cfg.model_name)
    packed = cfg.document_masking == "on" or cfg.context_parallel > 1  # auto: varlen first
    model = build_model_skeleton(model_dir, cfg.attn_implementation, packed)
    if cfg.context_parallel > 1:
        check_context_parallel(model, cfg.context_parallel, d.world_size, cfg.seq_length)
    num_params = sum(p.numel() for p in model.parameters())
    layers = find_decoder_layers(model)
    arch, layer_class = type(model).__name__, type(layers[0]).__name__  # before fully_shard renames the classes
    compute_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    peft = prepare_peft(cfg, model, layers, model_dir, compute_dtype, d.world_size) if cfg.peft != "none" else None
    recipe = float8_recipe(cfg.document_masking == "on")
    float8 = convert_to_float8(layers, cfg.fp8, recipe) if cfg.fp8 != "off" else None
    if peft is not None and cfg.lora_kernel == "fused":  # after float8: a Float8Linear base keeps peft's forward
        fused, adapted = fuse_lora(model)
        where = (
            " in eager passes (evaluation, samples); --compile on traces peft's forward, which inductor fuses"
            if cfg.compile == "on"
            else ""
        )
        log(f"--peft {cfg.peft}: {fused} of {adapted} adapted Linear modules run the fused LoRA kernel{where}")
    fpt = flops_per_token(model, model.config, peft.trainable if peft else None)
    recomputed = (
        apply_activation_checkpointing(model, layers, cfg.ac_every_n_layers)
        if cfg.activation_checkpointing == "on"
        else 0
    )
    if cfg.tiled_mlp and (problem := tile_mlps(layers, cfg.tiled_mlp)):
        raise TrainError(f"--tiled-mlp {cfg.tiled_mlp}: cannot tile {arch}'s MLP: {problem}; leave --tiled-mlp out")
    vocab_size = model.get_input_embeddings().num_embeddings
    train_forward = CausalLMLoss(model, loss_chunk_tokens(cfg.loss_chunk_tokens, vocab_size))
    if cfg.activation_offload == "on":
        train_forward.offload = ActivationOffload()
    if train_forward.chunk and (problem := chunked_loss_problem(model)):
        log(f"--loss-chunk-tokens: full logits instead of the chunked loss for {arch}: {problem}")
        train_forward.chunk = 0
    if d.context_size > 1:
        train_forward.context = varlen.Context(d.context_size, d.context_rank, d.context_group)
    shard_model(train_forward, layers, cfg, precision, d)
    materialize(model, d, cfg)
    files, fmt = weight_keys(model_dir)
    if from_checkpoint and peft is None:
        initialised = ""
        if probes:  # finite numbers for them, which the checkpoint replaces
            start = time.perf_counter()
            init_weights_on_shards(model, model.config, cfg.seed, d, whole=False)
            initialised = f" (the shards initialised for the start-up checks, {time.perf_counter() - start:.1f}s)"
        log(
            f"{'--export-only' if cfg.export_only else 'resuming'}: every weight comes from the checkpoint; "
            f"{model_dir}'s weights are not read for it (a live frozen reference, where one is kept, is){initialised}"
        )
    elif files:
        start = time.perf_counter()
        load_pretrained_sharded(model, model_dir, files, fmt, d.file_threads)
        log(f"loaded pretrained weights from {model_dir} (sharded, {time.perf_counter() - start:.1f}s)")
    elif cfg.peft == "qlora":
        raise TrainError(f"--peft qlora: {model_dir} has no weight files to quantise; QLoRA adapts a pretrained base")
    else:
        init_weights_on_shards(model, model.config, cfg.seed, d)
        log(f"no weight files in {model_dir}: initialised {num_params:,} parameters from scratch on the shards")
    if peft is not None:
        load_adapter(model, Path(cfg.adapter)) if cfg.adapter else init_adapters(model, cfg.seed)
        log_peft(peft, model, cfg)
    check_still_tied(model)
    model.train()
    train_forward.mask_dtype = compute_dtype
    masked_training = cfg.document_masking == "on" and probes
    if probes:
        run_start_up_checks(train_forward, vocab_size, precision, masked_training, d)
    log(
        f"model {arch}: {num_params:,} parameters, {len(layers)} decoder layers "
        f"({layer_class}){' + embedding + head' if own_units(model) else ''} sharded with --sharding {cfg.sharding} "
        f"over mesh {tuple(d.mesh.shape)}, "
        f"{recomputed} layers checkpointed, compute {precision}, cpu offload {cfg.cpu_offload}, "
        f"attention {model.config._attn_implementation}, loss chunks of {train_forward.chunk or 'all'} tokens"
        + (" (auto)" if cfg.loss_chunk_tokens == "auto" and train_forward.chunk else "")
        + (f", packed documents kept apart by {train_forward.document_masking}" if masked_training else "")
        + (
            f", each sequence split over {d.context_size} processes (Ulysses; {d.world_size // d.context_size} "
            f"context group(s) training different micro-batches)"
            if d.context_size > 1
            else ""
        )
        + (f", MLP in {cfg.tiled_mlp} tiles" if cfg.tiled_mlp else "")
        + (", saved activations offloaded to host memory" if cfg.activation_offload == "on" else "")
        + (
            f", {float8[0]} Linear layers in float8 ({recipe} scales"
            + (": packed documents never share one" if recipe == "rowwise" else ", all-gathered in float8")
            + f"; {'emulated' if cfg.fp8 == 'emulate' else 'float8 matmuls'}; {float8[1]} left in {precision}: a "
            "dimension not a multiple of 16)"
            if float8
            else ""
        )
    )
    return ModelBundle(
        model, train_forward, model.config, model_dir, num_params, recomputed, fpt, export_dtype(cfg, model_dir), peft
    )


def log_peft(peft: PeftSetup, model: nn.Module, cfg: TrainConfig) -> None:
    """What trains and what the frozen base costs on this rank."""
    from fsdp_lib.model.memory_plan import format_bytes

    frozen = [p for p in model.parameters() if not p.requires_grad]
    dtypes = sorted({"nf4" if is_nf4(p) else str(p.dtype).removeprefix("torch.") for p in frozen})
    base_bytes = sum(resident_bytes(p) for p in frozen)
    source = f"from {cfg.adapter}" if cfg.adapter else f"initialised (seed {cfg.seed})"
    log(
        f"--peft {cfg.peft}: {peft.trainable:,} trainable of {peft.total:,} parameters "
        f"({100 * peft.trainable / peft.total:.2f}%), rank {peft.config.r}, alpha {peft.config.lora_alpha}, targets "
        f"{target_names(peft.config)}, adapters {source}; frozen base stored as {'+'.join(dtypes)}, "
        f"{format_bytes(base_bytes)} on this rank"
        + (f"; NF4 per layer: {', '.join(peft.quantized)}" if peft.quantized else "")
        + (f"; kept in the compute dtype (not whole NF4 blocks): {', '.join(peft.kept)}" if peft.kept else "")
    )


def peft_problems(cfg: TrainConfig) -> list[str]:
    """--lora-target-modules and --adapter checked against the model, built on meta (before any process group)."""
    if cfg.peft == "none":
        return []
    model_dir = resolve_model_dir(cfg.model_name)
    model = build_model_skeleton(model_dir, "eager")
    layers = find_decoder_layers(model)
    targets, problem = resolve_targets(cfg.lora_target_modules, model, layers)
    if problem:
        return [problem]
    if cfg.peft == "qlora" and not any(type(m) is nn.Linear for layer in layers for m in layer.modules()):
        kinds = sorted({type(m).__name__ for m in layers[0].modules() if m is not layers[0] and not list(m.children())})
        return [
            f"--peft qlora stores the decoder's nn.Linear weights in NF4, and {type(model).__name__}'s decoder layers "
            f"have none ({', '.join(kinds)}): it would train as --peft lora with nothing quantised; use --peft lora"
        ]
    if not cfg.adapter:
        return []
    try:
        config = lora_config(cfg, targets, cfg.model_name)
        if overridden := adapter_flag_conflicts(cfg, config, targets):
            return overridden
        if unsupported := unsupported_adapter_features(config, model):
            return [
                f"--adapter {cfg.adapter} uses {'; '.join(unsupported)}, which this trainer does not train or "
                "export; continue from a plain LoRA adapter on Linear layers, or from the model with this one merged "
                "in (PeftModel.from_pretrained(...).merge_and_unload(), saved as a model folder)"
            ]
        inject_adapters(model, config)
    except Exception as exc:  # noqa: BLE001 - peft raises many types for a config it cannot use
        return [f"--adapter {cfg.adapter}: not a LoRA adapter this model can take ({type(exc).__name__}: {exc})"]
    return adapter_problems(cfg, model, weights_identity(model_dir))


def long_context_plan(model: nn.Module, cfg: TrainConfig, state_bytes: float, compute: str) -> str:
    """--dry-run's activation estimate for this run's --seq-length, -b and --context-parallel, and the longest
    sequence per GPU size (memory_plan.activation_bytes_per_token's rule), in the `compute` dtype's bytes."""
    config = model.config.get_text_config()
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    kv_copies = max(1, cfg.context_parallel // kv_heads)  # varlen.py's copies of each key/value head
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    checkpointing, offload = cfg.activation_checkpointing == "on", cfg.activation_offload == "on"
    shapes = (hidden, intermediate, layers, kv_heads * head_dim)
    values = COMPUTE_BYTES[compute]
    every = cfg.ac_every_n_layers
    per_token = activation_bytes_per_token(
        *shapes, checkpointing, cfg.context_parallel, values, offload, cfg.tiled_mlp, kv_copies, every
    )
    host = offloaded_bytes_per_token(*shapes, checkpointing, values, cfg.tiled_mlp, kv_copies, every) if offload else 0
    vocab = model.get_input_embeddings().num_embeddings
    chunk = loss_chunk_tokens(cfg.loss_chunk_tokens, vocab) or cfg.seq_length * cfg.batch_size
    fixed = min(chunk, cfg.seq_length * cfg.batch_size) * vocab * 4
    return format_long_context_plan(
        per_token, state_bytes, fixed, cfg.seq_length, cfg.batch_size, cfg.context_parallel, host, cfg.tiled_mlp,
        kv_copies, getattr(config, "max_position_embeddings", None), every if checkpointing else 1,
    )  # fmt: skip


def sharding_group_size(cfg: TrainConfig, world_size: int) -> int:
    """The processes one FSDP shard group spans, over which the model state is divided (runtime.py's mesh): one
    with --sharding none, --hybrid-shard-size (else the processes per node: LOCAL_WORLD_SIZE where torchrun set it,
    else planned as HYBRID_NODE_GUESS, which the plan says) with hybrid, every process otherwise."""
    if cfg.sharding == "none":
        return 1
    if cfg.sharding == "hybrid":
        return min(world_size, cfg.hybrid_shard_size or _processes_per_node() or HYBRID_NODE_GUESS)
    return world_size


def _processes_per_node() -> int:
    """LOCAL_WORLD_SIZE, which torchrun sets; 0 outside it (a --dry-run), where HYBRID_NODE_GUESS is planned."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or 0)


HYBRID_NODE_GUESS = 8  # GPUs per node a --dry-run outside torchrun plans --sharding hybrid with


def dry_run(cfg: TrainConfig, world_size: int) -> int:
    model_dir = resolve_model_dir(cfg.model_name)
    model = build_model_skeleton(model_dir, cfg.attn_implementation, cfg.document_masking == "on")
    layers = find_decoder_layers(model)
    num_params = count_params(model)
    per_layer = count_params(layers[0])
    log("resolved config:\n" + yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False).rstrip())
    log(f"model {type(model).__name__} from {model_dir}: {num_params:,} parameters")
    apart = own_units(model)
    units = (
        f", the embedding and head ({', '.join(f'{n:,}' for n in map(count_params, apart))} params)" if apart else ""
    )
    rest = root_unit_params(model, layers)
    largest = largest_unit_params(model, layers)
    log(
        f"sharding plan: {len(layers)} x {type(layers[0]).__name__} ({per_layer:,} params each) each its own FSDP "
        f"unit{units}, plus the root unit ({rest:,} params: {'final norm' if apart else 'embeddings, final norm, head'}); "
        f"--sharding {cfg.sharding} over {world_size} processes, cpu offload {cfg.cpu_offload}, activation "
        f"checkpointing {cfg.activation_checkpointing} (every {cfg.ac_every_n_layers} layer(s))"
    )
    if "WORLD_SIZE" not in os.environ and world_size > 1:
        log(
            f"planned for {world_size} processes, one context group of --context-parallel {world_size} (no torchrun "
            f"here); WORLD_SIZE=32 python fsdp_train.py ... --dry-run plans a launch of 32"
        )
    shard_size = sharding_group_size(cfg, world_size)
    sizes = sorted({1, 2, 4, 8, world_size, shard_size})
    # --precision auto is bf16 on the GPU a run trains on: planned as such, also on a login node without one
    compute = "bf16" if cfg.precision == "auto" else cfg.precision
    values = COMPUTE_BYTES[compute]
    rows = training_memory_plan(num_params, world_sizes=sizes, largest_unit_params=largest, compute_bytes=values)
    log(
        f"per-rank memory estimate (this run: {world_size} processes, --precision {cfg.precision}"
        f"{' planned as bf16, its choice on a GPU' if cfg.precision == 'auto' else ''}):\n"
        + format_memory_plan(rows, compute)
    )
    linear, adapters = peft_sizes(model, layers, cfg.lora_rank)
    peft_rows = peft_memory_plan(num_params, linear, adapters, sizes, largest, values)
    log(f"this run: --peft {cfg.peft}\n" + format_peft_memory_plan(rows, peft_rows, cfg.lora_rank, compute))
    if cfg.peft == "none":
        state = next(r for r in rows if r["world_size"] == shard_size and r["cpu_offload"] == (cfg.cpu_offload == "on"))
    else:
        state = next(r for r in peft_rows if r["world_size"] == shard_size and r["mode"] == cfg.peft)
    state_bytes = float(state["gpu_total_bytes"]) + (num_params * values if cfg.sharding == "grad-op" else 0)
    log(
        f"this run's model state per GPU: {format_bytes(state_bytes)} (the table's row for {shard_size} GPU(s): "
        + (
            f"--sharding {cfg.sharding} shards over {shard_size} of the {world_size} processes"
            if shard_size != world_size
            else f"sharded over the {world_size} processes"
        )
        + (f"; + every layer's {compute} weights, kept unsharded from forward to backward by --sharding grad-op"
           if cfg.sharding == "grad-op" else "")
        + (f"; {HYBRID_NODE_GUESS} processes per node assumed: LOCAL_WORLD_SIZE or --hybrid-shard-size says otherwise"
           if cfg.sharding == "hybrid" and not (cfg.hybrid_shard_size or _processes_per_node()) else "")
        + ")"
    )  # fmt: skip
    log(long_context_plan(model, cfg, state_bytes, compute))
    log(resume_outlook(cfg.experiment_dir))
    log("dry run: nothing was trained")
    return 0
