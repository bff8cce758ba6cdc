"""--tiled-mlp and --activation-offload are exact: a tiny model's loss and every gradient equal the plain forward's
(float64), the parameters keep their names, the offload hooks move the large saved tensors (and leave parameters),
a mixture-of-experts MLP is refused with the reason, and a tile count of 1 is refused naming the flag. The trainer
runs them split over two processes in tests/test_context_parallel.py (the same losses as the unsplit run)."""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_lib.checks import validate_config
from fsdp_lib.config import load_config
from fsdp_lib.model.activations import ActivationOffload, tile_mlps


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return LlamaForCausalLM(config).double()


@pytest.mark.parametrize("tiles", [2, 5])
def test_tiled_mlp_and_offload_give_the_same_loss_and_gradients(tiles):
    plain = tiny_llama()
    ours = copy.deepcopy(plain)
    names = [name for name, _ in ours.named_parameters()]
    assert tile_mlps(list(ours.model.layers), tiles) is None
    assert [name for name, _ in ours.named_parameters()] == names, "checkpoints and exports keep their keys"
    ids = torch.randint(0, 100, (2, 23))
    want = plain(input_ids=ids, labels=ids).loss
    want.backward()
    offload = ActivationOffload(min_bytes=1024)
    with offload():
        got = ours(input_ids=ids, labels=ids).loss
    got.backward()
    assert offload.offloaded_tensors > 0 and offload.offloaded_bytes >= 1024 * offload.offloaded_tensors
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for (name, a), b in zip(ours.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12, msg=name)


def test_offload_leaves_parameters_and_small_tensors():
    offload = ActivationOffload(min_bytes=1024)
    weight = torch.nn.Parameter(torch.randn(64, 64))
    assert offload.pack(weight) is weight and offload.pack(torch.randn(4)).numel() == 4
    assert offload.pack(weight.t()) is not None and offload.offloaded_tensors == 0  # a Linear saves weight.t()
    big = torch.randn(64, 64)
    packed = offload.pack(big)
    assert isinstance(packed, tuple) and torch.equal(offload.unpack(packed), big)
    assert offload.offloaded_tensors == 1


def test_a_mixture_of_experts_mlp_and_one_tile_are_refused(tmp_path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=2,
                            num_experts_per_tok=1, shared_expert_intermediate_size=8)  # fmt: skip
    model = Qwen2MoeForCausalLM(config)
    problem = tile_mlps(list(model.model.layers), 2)
    assert problem is not None and "mixture of experts" in problem
    cfg = load_config(["-e", "x", "-d", str(tmp_path), "-m", str(tmp_path), "--tiled-mlp", "1"])
    assert any("--tiled-mlp 1: give the number of tiles, 2 or more" in p for p in validate_config(cfg, 1))


class DropoutMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.drop = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.drop(torch.relu(self.up(x))))


def test_a_dropout_in_the_mlp_draws_the_same_mask_in_backward_and_a_frozen_input_still_trains_the_mlp():
    """Each tile's recompute in backward restores the random state its forward drew with: the gradients equal
    autograd's through the very masks of the forward. An input without a gradient (LoRA on the MLP alone) runs the
    MLP whole, so its parameters still get theirs."""
    torch.manual_seed(0)
    layer = torch.nn.Module()
    layer.mlp = DropoutMLP()
    plain = copy.deepcopy(layer.mlp)
    assert tile_mlps([layer], 3) is None
    x, upstream = torch.randn(2, 9, 8, requires_grad=True), torch.randn(2, 9, 8)
    torch.manual_seed(1)
    (layer.mlp(x) * upstream).sum().backward()
    torch.manual_seed(1)  # the same draws, tile by tile, with autograd all the way
    reference = x.detach().clone().requires_grad_(True)
    parts = [plain(t) for t in reference.reshape(-1, 8).tensor_split(3)]
    (torch.cat(parts).reshape(2, 9, 8) * upstream).sum().backward()
    torch.testing.assert_close(x.grad, reference.grad)
    for a, b in zip(layer.mlp.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    layer.mlp.zero_grad()
    frozen = torch.randn(2, 9, 8)
    layer.mlp(frozen).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.mlp.parameters())
