"""The fused LoRA kernel (fsdp_lib/model/lora_kernel.py) computes what peft's modules compute: the same outputs
and gradients, on the modules it takes, and leaves the others (dropout, adapters off) to peft."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from fsdp_lib.model.lora_kernel import LoRALinear, fuse_lora
from fsdp_lib.testing import DECODER, tiny_config


def lora_model(dropout: float = 0.0, arch: str = "llama", **lora_options) -> torch.nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    if arch == "llama":  # a frozen bias on q, k, v and o too
        config = transformers.LlamaConfig(
            **{**DECODER, "vocab_size": 64, "intermediate_size": 48, "attention_bias": True}
        )
    else:
        config = tiny_config(arch, 64, 0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()  # eval: OPT's and GPT-2's dropout off
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear", bias="none", **lora_options)
    inject_adapter_in_model(lora, model)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
        if "lora_B" in name:  # peft starts B at zero: the adapter's product would be zero
            torch.nn.init.normal_(param, std=0.5)
    return model


def grads_after_a_step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logits = model(input_ids=ids).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_lora_equals_peft_outputs_and_every_adapter_gradient(dtype):
    peft_model = lora_model().to(dtype)
    fused_model = copy.deepcopy(peft_model)
    assert fuse_lora(fused_model) == (14, 14)  # seven projections per layer
    ids = torch.randint(0, 64, (2, 12))
    want_logits, want = grads_after_a_step(peft_model, ids)
    got_logits, got = grads_after_a_step(fused_model, ids)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got_logits, want_logits, **tol)
    assert got.keys() == want.keys() and len(got) == 28
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=name)


# (family, adapted Linear modules fused of all adapted): phi3 fuses q/k/v and gate/up into single Linears, OPT and
# GPT-NeoX have biases, GPT-2's Conv1D is not an nn.Linear (peft's fan_in_fan_out path: left to peft)
FAMILIES = [("qwen2", 14, 14), ("phi3", 8, 8), ("gemma2", 14, 14), ("opt", 12, 12), ("gpt_neox", 8, 8), ("gpt2", 0, 8)]


@pytest.mark.parametrize("arch,fused,adapted", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_fused_lora_equals_peft_family_by_family(arch, fused, adapted):
    peft_model = lora_model(arch=arch)
    fused_model = copy.deepcopy(peft_model)
    assert fuse_lora(fused_model) == (fused, adapted)
    ids = torch.randint(0, 64, (2, 10))
    want_logits, want = grads_after_a_step(peft_model, ids)
    got_logits, got = grads_after_a_step(fused_model, ids)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-5, msg=name)


def test_adapters_in_another_dtype_than_the_base_keep_peft():
    model = lora_model()
    for name, param in model.named_parameters():
        if "lora_" not in name:
            param.data = param.data.to(torch.bfloat16)  # a bf16 base under fp32 adapters
    fused = copy.deepcopy(model)
    fuse_lora(fused)
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, model(input_ids=ids).logits, atol=0, rtol=0)


def test_dora_and_adapter_bias_keep_peft():
    assert fuse_lora(lora_model(use_dora=True)) == (0, 14)
    assert fuse_lora(lora_model(lora_bias=True)) == (0, 14)


def test_the_input_gradient_is_the_base_and_the_adapter_paths_together():
    torch.manual_seed(1)
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    w, b = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    a = torch.randn(2, 8, dtype=torch.float64, requires_grad=True)
    up = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x, a, up: LoRALinear.apply(x, w, b, a, up, 1.5), (x, a, up))
    torch.autograd.gradcheck(lambda x, a, up: LoRALinear.apply(x, w, None, a, up, 0.5), (x, a, up))


def test_dropout_keeps_peft_and_disabled_adapters_give_the_base():
    from peft.tuners.lora.layer import LoraLayer

    assert fuse_lora(lora_model(dropout=0.1)) == (0, 14)  # dropout's mask is peft's: not fused
    model = lora_model()
    base = copy.deepcopy(model)
    fuse_lora(model)
    ids = torch.randint(0, 64, (1, 7))
    for module in [*model.modules(), *base.modules()]:
        if isinstance(module, LoraLayer):
            module.enable_adapters(False)  # as DPO's reference pass runs the base
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits, atol=0, rtol=0)


def test_the_kernel_compiles_without_a_graph_break():
    torch.manual_seed(2)
    x = torch.randn(4, 16, requires_grad=True)
    w, a, up = torch.randn(24, 16), torch.randn(4, 16, requires_grad=True), torch.randn(24, 4, requires_grad=True)
    eager = LoRALinear.apply(x, w, None, a, up, 2.0)
    eager.sum().backward()
    want = [t.grad.clone() for t in (x, a, up)]
    for t in (x, a, up):
        t.grad = None
    compiled = torch.compile(
        lambda x, a, up: LoRALinear.apply(x, w, None, a, up, 2.0), backend="aot_eager", fullgraph=True
    )
    out = compiled(x, a, up)
    out.sum().backward()
    torch.testing.assert_close(out, eager)
    for got, expected in zip((x.grad, a.grad, up.grad), want):
        torch.testing.assert_close(got, expected)


def test_a_compiled_layer_runs_peft_s_forward_for_inductor_to_fuse():
    """Under torch.compile the fused Linear traces peft's ops (inductor fuses the scale and add into its kernels;
    the function's in-place accumulation cost copies on an H200), with the same output."""
    model = lora_model()
    base = copy.deepcopy(model)
    fuse_lora(model)
    q_proj = model.model.layers[0].self_attn.q_proj
    x = torch.randn(1, 7, model.config.hidden_size)
    targets = [str(n.target) for n in torch._dynamo.explain(q_proj)(x).graphs[0].graph.nodes]
    assert "autograd_function_apply" not in targets and "<built-in function add>" in targets, targets
    compiled = torch.compile(q_proj, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), base.model.layers[0].self_attn.q_proj(x))
