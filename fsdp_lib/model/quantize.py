"""The 4-bit base of QLoRA (--peft qlora): torchao's NF4 tensor (4-bit NormalFloat in blocks of 64 weights, the
blocks' scales quantised again to 8 bits in blocks of 256: double quantisation). It is FSDP2-aware: fully_shard
splits it by rows and all-gathers its 4-bit data, and F.linear on it dequantises to the compute dtype.

The weights are made NF4 on the meta device before sharding, and filled while loading one tensor at a time. A
rank that can read its own rows (safetensors) quantises those only: each 64-weight block's scale is its own rows',
and the one tensor-wide mean of the scales that double quantisation centres them on is taken over every rank's
scales, all-gathered (fill_nf4_rows). Otherwise each rank quantises the whole tensor and keeps its rows
(fill_nf4_shard). Both give every rank exactly the rows that quantising the whole tensor gives, so the all-gathered
weight is the same on every rank and at any process count."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from fsdp_lib.errors import TrainError

# torchao warns at import about its optional CUDA kernels (mxfp8, cutlass) that fail to load on this torch build;
# NF4 is plain torch and never uses them. (peft imports torchao too, whenever it is installed.)
logging.getLogger("torchao").setLevel(logging.ERROR)

BLOCK = 64  # weights per NF4 block (one absmax scale each), QLoRA's choice
SCALER_BLOCK = 256  # scales per double-quantisation block


def is_nf4(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return type(local).__name__ == "NF4Tensor"


def quantizable(weight: torch.Tensor, world_size: int) -> str | None:
    """Why a Linear weight cannot be NF4 when sharded over world_size processes, or None when it can: its rows must
    split evenly and each rank's part must hold whole double-quantisation blocks."""
    rows, cols = weight.shape
    if rows % world_size:
        return f"{rows} rows do not split evenly over {world_size} processes"
    if (rows // world_size) * cols % (BLOCK * SCALER_BLOCK):
        return f"{rows // world_size} x {cols} weights per process are not a multiple of {BLOCK * SCALER_BLOCK}"
    return None


def quantize_linears_on_meta(
    layers: list[nn.Module], dtype: torch.dtype, world_size: int
) -> tuple[list[str], list[str]]:
    """Make the weight of every nn.Linear inside the decoder layers an NF4 meta tensor (frozen) that dequantises to
    `dtype`. A weight that is not whole NF4 blocks even unsharded stays in `dtype` at any process count (logged);
    one that is but does not split into whole blocks over this run's processes is refused by name, never silently
    kept, so the set of NF4 weights is the same at every process count a run can resume on.
    Returns (NF4 weights, weights kept) as FQNs within each layer, e.g. `self_attn.q_proj.base_layer.weight`."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    done, kept = [], []
    for index, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if type(module) is not nn.Linear or any(part.startswith("lora_") for part in name.split(".")):
                continue  # peft's adapters are Linear modules too: they train, in fp32
            if quantizable(module.weight, 1):
                if index == 0:
                    kept.append(f"{name}.weight {tuple(module.weight.shape)}")
                continue
            problem = quantizable(module.weight, world_size)
            if problem:
                raise TrainError(
                    f"--peft qlora: decoder layer {index}'s {name}.weight {tuple(module.weight.shape)} cannot be "
                    f"sharded as NF4 over {world_size} processes: {problem}. Use fewer processes per model "
                    f"replica (one that divides it), or --peft lora"
                )
            meta = torch.empty(module.weight.shape, dtype=dtype, device="meta")
            module.weight = nn.Parameter(to_nf4(meta, BLOCK, SCALER_BLOCK), requires_grad=False)
            if index == 0:
                done.append(f"{name}.weight")
    return done, kept


def fill_nf4_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    """Quantise the whole tensor `full` and copy this rank's rows into the NF4 shard `target` (a DTensor sharded
    on dim 0, or a plain NF4 tensor without sharding)."""
    from torch.distributed.tensor import DTensor
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    local = target._local_tensor if isinstance(target, DTensor) else target  # the object FSDP all-gathers from
    quantized = to_nf4(full.to(device=local.quantized_data.device, dtype=local.dtype).contiguous(), BLOCK, SCALER_BLOCK)
    if isinstance(target, DTensor):
        mesh = target.device_mesh
        quantized = torch.chunk(quantized, mesh.size(), dim=0)[mesh.get_local_rank()]
    with torch.no_grad():
        local.copy_(quantized)
    # copy_ fills the sharded data; the tensor-wide scale mean and the NF4 code table were left on meta by to_empty
    local.scaler_mean = quantized.scaler_mean.clone()
    local.nf4 = quantized.nf4.clone()


def shard_rows(target: torch.Tensor) -> tuple[int, int]:
    """[start, stop) of the rows this rank holds of an NF4 weight sharded on dim 0 over a 1-D mesh (quantizable():
    the rows split evenly)."""
    mesh = target.device_mesh
    per_rank = target.shape[0] // mesh.size()
    return mesh.get_local_rank() * per_rank, (mesh.get_local_rank() + 1) * per_rank


def fill_nf4_rows(target: torch.Tensor, rows: torch.Tensor) -> None:
    """Quantise this rank's rows of an NF4 weight (`rows`: the shard_rows(target) rows of the full weight) into its
    DTensor shard `target`, exactly as quantising the whole weight and keeping these rows would (fill_nf4_shard):
    the 4-bit codes and each block's scale depend on the block alone; the double quantisation of the scales
    depends also on their mean over the whole tensor, computed here from every rank's scales, all-gathered in rank
    order (1/64 of the weight's values), with the same reduction as for the whole tensor."""
    import torch.distributed as dist
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    local = target._local_tensor
    own = rows.to(device=local.quantized_data.device, dtype=local.dtype).contiguous()
    quantized = to_nf4(own, BLOCK, SCALER_BLOCK)  # the codes as the whole tensor's; the scales centred on own mean
    scales = own.flatten().view(-1, BLOCK).abs().amax(dim=1)  # each block's absmax, the first quantisation
    group = target.device_mesh.get_group()
    # gathered on the accelerator where there is one (the mesh's backend; the shard may sit in host memory with
    # --cpu-offload), the mean taken where the shard is, as for the whole tensor
    comm = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else own.device
    every = [torch.empty_like(scales, device=comm) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, scales.to(comm), group=group)
    mean = torch.cat(every).to(own.device).mean()
    centred = (scales - mean).view(-1, SCALER_BLOCK)
    factor = 256 / (2 * centred.abs().amax(dim=1))  # per block of 256 scales: to int8
    codes = (centred * factor[:, None]).round().clamp(-128, 127).flatten().to(torch.int8)
    with torch.no_grad():  # inner tensor by inner tensor: a shard keeps the whole tensor's block count, which an
        local.quantized_data.copy_(quantized.quantized_data)  # NF4 copy_ would check against these rows' own
        local.quantized_scalers.copy_(codes)
        local.quantization_factor.copy_(factor)
    local.scaler_mean = mean.clone()
    local.nf4 = quantized.nf4.clone()


def dequantized_local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's rows of an NF4 weight in its dequantised dtype."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.get_original_weight()


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds for a parameter: its shard's storage, NF4's data, scales and factors included."""
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if type(local).__name__ == "NF4Tensor":
        inner = (local.quantized_data, local.quantized_scalers, local.quantization_factor, local.scaler_mean)
        return sum(t.numel() * t.element_size() for t in inner)
    return local.numel() * local.element_size()
