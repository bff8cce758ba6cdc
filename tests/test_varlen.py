"""--attn-implementation varlen (fsdp_lib/model/varlen.py): packed documents attend to themselves alone, with no
[T x T] mask, and give the loss and gradients of the model's own masked attention, family by family."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from fsdp_lib.data.batch import Batch, Documents, attended_positions
from fsdp_lib.model import varlen
from fsdp_lib.model.build import flops_per_token
from fsdp_lib.model.loss import CausalLMLoss
from fsdp_lib.testing import LLAMA_LIKE, tiny_config

# Two rows of 48: documents of 20, 1, 4 and 23 tokens (longer than the tiny configs' 16-token sliding window), and
# one document filling the second row.
POSITIONS = torch.tensor([[*range(20), 0, *range(4), *range(23)], list(range(48))])
FAMILIES = [*LLAMA_LIKE, "opt", "gpt2", "gpt_neox"]


def test_documents_are_read_from_the_positions_and_every_row_starts_one():
    documents = Documents.of(np.array([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]]))
    assert documents.bounds == (0, 3, 5, 7, 10) and documents.longest == 3 and documents.row_length == 5
    assert documents.cu_seqlens.tolist() == [0, 3, 5, 7, 10] and documents.cu_seqlens.dtype == torch.int32
    moved = Batch(torch.zeros(2, 5), torch.zeros(2, 5), torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]]))
    assert moved.to(torch.device("cpu")).documents.bounds == documents.bounds
    found = moved.with_documents()  # as the prefetch thread finds them: once, then carried
    assert found.documents.bounds == documents.bounds and found.with_documents() is found
    assert found.to(torch.device("cpu")).documents.bounds == documents.bounds


def test_the_mfu_counts_attention_over_each_document_not_the_row():
    positions = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]])  # documents of 3, 2, 2 and 3 tokens
    packed = Batch(torch.zeros(2, 5), torch.zeros(2, 5), positions)
    assert attended_positions([packed]) == (9 + 4 + 4 + 9, 10)
    assert attended_positions([packed.to(torch.device("cpu"))]) == (26, 10)  # from the documents it carries
    whole = Batch(torch.zeros(3, 5), torch.zeros(3, 5), None)  # no position ids: each row one document
    assert attended_positions([packed, whole]) == (26 + 3 * 25, 25)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    model = transformers.LlamaForCausalLM(config)
    per_token = flops_per_token(model, config)
    matmul = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    assert per_token(0) == 6 * matmul and per_token(2.6) - per_token(0) == pytest.approx(12 * 2 * 4 * 8 * 2.6)


def test_groups_pad_each_document_at_its_end_and_the_inverse_finds_every_token():
    documents = Documents.of(POSITIONS.numpy())
    buckets, inverse = varlen.buckets_of(documents, torch.device("cpu"))
    assert [b.length for b in buckets] == [1, 4, 23, 48]  # 20 and 23 in one group, the 20 padded to 23
    laid = torch.cat([b.rows for b in buckets])
    assert torch.equal(laid[inverse], torch.arange(96))  # each token's output comes from its own row


def _train_forward(arch: str, attn: str, mode: str) -> CausalLMLoss:
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, 64, 0)
    config.use_cache = False
    torch.manual_seed(0)
    model = CausalLMLoss(AutoModelForCausalLM.from_config(config, attn_implementation=attn), 16).eval()
    model.document_masking = mode
    return model


def _loss_and_grads(model: CausalLMLoss) -> tuple[float, torch.Tensor]:
    ids = torch.randint(0, 64, POSITIONS.shape, generator=torch.Generator().manual_seed(1))
    loss, _ = model(Batch(ids, ids, POSITIONS).to(torch.device("cpu")))
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("arch", FAMILIES)
def test_varlen_gives_the_masked_models_loss_and_gradients(arch):
    """Against eager attention with the family's own way of masking documents (transformers' mask from the
    position ids, with the sliding window where the family has one; OPT, which ignores them, an explicit mask).
    Gemma2 soft-caps its attention logits, which varlen refuses: the start-up probe then moves on."""
    varlen.register()
    model = _train_forward(arch, varlen.NAME, "varlen")
    if arch == "gemma2":
        with pytest.raises(NotImplementedError, match="softcap"):
            _loss_and_grads(model)
        return
    loss, grads = _loss_and_grads(model)
    want_loss, want_grads = _loss_and_grads(
        _train_forward(arch, "eager", "block_mask" if arch == "opt" else "position_ids")
    )
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    assert (grads - want_grads).abs().max() <= 1e-5 * want_grads.abs().max()


def test_varlen_takes_a_value_head_size_other_than_the_querys():
    """Multi-head latent attention (DeepSeek-V2/V3's real shapes: values of 8 where queries and keys have 24)
    crashed varlen ('shape [64, 4, 24] is invalid'), and the probe's fallback to position ids gave up varlen's speed
    and --context-parallel: the value's own head size is the output's."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    varlen.register()
    config = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=8, head_dim=8, first_k_dense_replace=1, n_routed_experts=4, n_group=1,
        topk_group=1, num_experts_per_tok=2, use_cache=False,
    )  # fmt: skip

    def built(attn: str, mode: str) -> CausalLMLoss:
        torch.manual_seed(0)
        model = CausalLMLoss(AutoModelForCausalLM.from_config(config, attn_implementation=attn), 16).eval()
        model.document_masking = mode
        return model

    loss, grads = _loss_and_grads(built(varlen.NAME, "varlen"))
    want_loss, want_grads = _loss_and_grads(built("eager", "position_ids"))
    assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
    assert (grads - want_grads).abs().max() <= 1e-5 * want_grads.abs().max()
