"""The fused LoRA kernel (fsdp_lib/model/lora_kernel.py, `--lora-kernel fused`) against peft's modules
(`--lora-kernel peft`): forward + backward of one decoder layer's seven adapted projections, on one process.

    python bench/bench_lora_kernel.py            # CPU: 2048 tokens, hidden 1024, MLP 2816, rank 16; ~1 minute
    python bench/bench_lora_kernel.py --quick    # seconds

A Llama decoder layer (frozen base and rank-16 adapters on q, k, v, o, gate, up and down, in --dtype: fp32, or
bf16 as on a GPU, which CPUs without bf16 matrix units run many times slower) is built once with peft's adapters, deep-copied and fused; both copies run the same input's forward and
backward, interleaved, after warm-up, and the medians are compared. Also counted: the bytes autograd saves for
backward (saved-tensor hooks), and the outputs and input gradients are compared. No goal of its own: the GPU's
LoRA-versus-full-fine-tuning claim (issue 32) is gpu_check.py's peft section; this shows what the kernel removes
(the scale and add passes over each output, the input-gradient sum) where it can be measured every day.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FULL = {"tokens": 2048, "hidden": 1024, "intermediate": 2816, "heads": 16, "kv_heads": 4, "rank": 16, "reps": 15}
QUICK = {"tokens": 128, "hidden": 128, "intermediate": 352, "heads": 4, "kv_heads": 2, "rank": 8, "reps": 3}


def build(p: dict, dtype):  # noqa: ANN001, ANN201
    import torch
    import transformers
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=p["hidden"], intermediate_size=p["intermediate"], num_hidden_layers=1,
        num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"], vocab_size=256,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, 0)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    inject_adapter_in_model(LoraConfig(r=p["rank"], lora_alpha=2 * p["rank"], target_modules=targets), layer)
    for name, param in layer.named_parameters():
        param.requires_grad_("lora_" in name)
        param.data = param.data.to(dtype)
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return layer, rotary


def step(layer, rotary, x):  # noqa: ANN001, ANN201
    import torch

    positions = torch.arange(x.shape[1])[None]
    embeddings = rotary(x, positions)
    out = layer(x, position_embeddings=embeddings, position_ids=positions)
    out = out[0] if isinstance(out, tuple) else out
    out.float().square().mean().backward()
    return out


def saved_bytes(layer, rotary, x) -> int:  # noqa: ANN001
    import torch

    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(layer, rotary, x)
    return total


def main(argv: list[str] | None = None) -> int:
    import torch
    from common import bench_arg_parser, machine_info, median, print_table, write_results

    from fsdp_lib.model.lora_kernel import fuse_lora

    parser = bench_arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32", help="compute dtype (bf16 is slow on CPUs)"
    )
    args = parser.parse_args(argv)
    p = QUICK if args.quick else FULL
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    peft_layer, rotary = build(p, dtype)
    fused_layer = copy.deepcopy(peft_layer)
    fused, adapted = fuse_lora(fused_layer)
    x = torch.randn(1, p["tokens"], p["hidden"], dtype=dtype)
    sides = {"peft": peft_layer, "fused": fused_layer}
    inputs = {name: x.clone().requires_grad_(True) for name in sides}
    outputs = {name: step(layer, rotary, inputs[name]).detach() for name, layer in sides.items()}
    difference = (outputs["fused"].float() - outputs["peft"].float()).abs().max().item()
    grad_difference = (inputs["fused"].grad.float() - inputs["peft"].grad.float()).abs().max().item()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for rep in range(p["reps"] + 2):  # two warm-up rounds
        for name, layer in sides.items():
            layer.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step(layer, rotary, x.clone().requires_grad_(True))
            if rep >= 2:
                times[name].append(time.perf_counter() - start)
    saved = {name: saved_bytes(layer, rotary, x.clone().requires_grad_(True)) for name, layer in sides.items()}
    ms = {name: median(t) * 1000 for name, t in times.items()}
    speedup = ms["peft"] / ms["fused"]
    print(
        f"one Llama decoder layer, {p['tokens']} tokens, hidden {p['hidden']}, MLP {p['intermediate']}, rank "
        f"{p['rank']}, {fused} of {adapted} projections fused, adapters {args.dtype}, {p['reps']} timed reps"
    )
    print_table(
        ["LoRA", "forward + backward, median (ms)", "saved for backward (MB)"],
        [[name, round(ms[name], 2), round(saved[name] / 1e6, 2)] for name in sides],
    )
    print(
        f"fused / peft: {speedup:.3f}x faster, saves {saved['fused'] / saved['peft']:.3f}x the bytes; outputs differ "
        f"by at most {difference:.2e}, input gradients by {grad_difference:.2e}"
    )
    write_results(
        args.results_dir, "lora_kernel",
        {"machine": machine_info(), "params": p, "dtype": args.dtype, "fused": fused, "adapted": adapted,
         "times_s": times, "median_ms": ms, "speedup": speedup, "saved_bytes": saved,
         "max_output_difference": difference, "max_input_grad_difference": grad_difference},
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
