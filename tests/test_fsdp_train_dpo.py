"""--objective dpo: the pair losses are the papers' formulas, the chunked per-token log-probabilities and their
gradients equal the full logits', pairs render with only their responses trained, are cut from the left to fit
and packed whole; the trainer's loss and gradients equal the formula on the unsharded model at 1 x accum 2 and
2 x accum 1, step 1 is ln 2, a precomputed reference is computed once and a kill -9 resumes bit-identically (and
on another process count), a live reference gives the same losses, DPO teaches held-out facts with full weights
and LoRA, and bad flags exit with the flag named."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_lib.data.chat import ChatEncoder
from fsdp_lib.data.preference import PairBlocks, PairEncoder, pack_pairs, read_reference, write_reference
from fsdp_lib.model.loss import ChunkedTokenLogProbs, token_log_probs
from fsdp_lib.testing import llama_sizes
from fsdp_lib.train.dpo import disable_dropout, pair_losses, reference_free_losses, sequence_sums
from tests.fsdp_helpers import (
    REPO_ROOT,
    assert_loss_and_grads_match,
    fact_pairs,
    killed_at_step,
    losses_by_step,
    make_chat_model,
    make_dataset,
    make_preference_dataset,
    output_of,
    run_trainer,
    save_pairs,
    trainer_args,
)

WORKERS = REPO_ROOT / "tests" / "workers"
LN2 = math.log(2.0)


# -- the formulas -----------------------------------------------------------------------------------------------


def test_pair_losses_are_the_papers_formulas():
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(64, generator=g, dtype=torch.float64) * 5 for _ in range(4))
    beta, eps = 0.3, 0.1
    h = (pc - rc) - (pr - rr)
    sig = lambda x: 1 / (1 + torch.exp(-x))  # noqa: E731
    expected = -(1 - eps) * torch.log(sig(beta * h)) - eps * torch.log(sig(-beta * h))
    losses, reward_c, reward_r = pair_losses(pc, pr, rc, rr, beta, "sigmoid", eps)
    torch.testing.assert_close(losses, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reward_c, beta * (pc - rc))
    torch.testing.assert_close(reward_r, beta * (pr - rr))
    ipo, _, _ = pair_losses(pc, pr, rc, rr, beta, "ipo")
    torch.testing.assert_close(ipo, (h - 1 / (2 * beta)) ** 2)
    # policy == reference: sigmoid is ln 2 (any smoothing), ipo is 1 / (4 beta^2) (documented in docs/preference.md)
    same = pair_losses(pc, pr, pc, pr, beta, "sigmoid", eps)[0]
    assert torch.allclose(same, torch.full_like(same, LN2), atol=1e-12)
    assert torch.allclose(pair_losses(pc, pr, pc, pr, beta, "ipo")[0], torch.full_like(same, 1 / (4 * beta**2)))


def test_reference_free_losses_are_the_papers_formulas():
    """SimPO (Meng et al. 2024) and ORPO (Hong et al. 2024), written here from the papers with plain probabilities."""
    g = torch.Generator().manual_seed(1)
    mc, mr = (-(torch.rand(64, generator=g, dtype=torch.float64) * 4 + 0.01) for _ in range(2))  # mean log-probs < 0
    beta, gamma = 2.0, 0.7
    sig = lambda x: 1 / (1 + torch.exp(-x))  # noqa: E731
    simpo, reward_c, reward_r = reference_free_losses(mc, mr, beta, "simpo", gamma)
    torch.testing.assert_close(simpo, -torch.log(sig(beta * (mc - mr) - gamma)), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reward_c, beta * mc)
    torch.testing.assert_close(reward_r, beta * mr)
    pc, pr = torch.exp(mc), torch.exp(mr)
    odds_ratio = torch.log((pc / (1 - pc)) / (pr / (1 - pr)))
    orpo, _, _ = reference_free_losses(mc, mr, 0.1, "orpo")
    torch.testing.assert_close(orpo, -mc - 0.1 * torch.log(sig(odds_ratio)), rtol=1e-10, atol=1e-10)
    # near probability 1 (mean log-prob -1e-9) the odds stay finite, and so do the gradients
    near = torch.tensor([-1e-9, -5.0], dtype=torch.float64, requires_grad=True)
    loss = reference_free_losses(near[:1], near[1:], 0.1, "orpo")[0].sum()
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(near.grad).all()


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("dtype,temperature", [(torch.float64, 1.0), (torch.float32, 0.7)])
def test_chunked_token_log_probs_and_gradients_equal_the_full_logits(softcap, dtype, temperature):
    """fp64 (the chunks' logits are fp32 copies) and fp32 (the head's own output, changed in place) with GRPO's
    sampling temperature: values and gradients equal the full logits' path."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(37, 16, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=dtype, requires_grad=True)
    bias = torch.randn(50, generator=g, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[::4] = -100
    upstream = torch.randn(37, generator=g, dtype=dtype)
    tolerance = 1e-6 if dtype == torch.float64 else 1e-5

    logits = F.linear(hidden, weight, bias)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    full = token_log_probs(logits[None] / temperature, labels[None])
    full_grads = torch.autograd.grad((full * upstream).sum(), (hidden, weight, bias))
    ours = ChunkedTokenLogProbs.apply(hidden, weight, bias, labels, 8, softcap, temperature)
    our_grads = torch.autograd.grad((ours * upstream).sum(), (hidden, weight, bias))
    torch.testing.assert_close(ours.double(), full.float().double(), rtol=tolerance, atol=tolerance)
    assert (ours[labels == -100] == 0).all()
    for a, b in zip(our_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


class _VocabWide(TorchDispatchMode):
    """Counts the [rows x vocab] buffers the ops under it allocate (outputs of that shape that are neither views
    nor in-place results of an input)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.made = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in [*args, *(kwargs or {}).values()] if torch.is_tensor(a)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if torch.is_tensor(t) and t.dim() == 2 and t.shape[1] == self.vocab:
                self.made += t.untyped_storage().data_ptr() not in inputs
        return out


@pytest.mark.parametrize("softcap,per_chunk", [(None, (1, 1)), (5.0, (1, 2))])
def test_chunked_token_log_probs_make_one_logits_buffer_per_chunk(softcap, per_chunk):
    """The head's chunks of DPO, KTO and GRPO: the forward's log-softmax and the backward's softmax gradient are
    computed in place in the chunk's logits, so each chunk makes one [chunk x vocab] buffer in each direction (with
    a soft cap, the backward keeps the tanh values for its gradient too), and the temperature divides in place."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(37, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    chunks = 5  # 37 tokens in chunks of 8
    with _VocabWide(50) as forward:
        out = ChunkedTokenLogProbs.apply(hidden, weight, None, labels, 8, softcap, 0.7)
    with _VocabWide(50) as backward:
        out.sum().backward()
    assert (forward.made, backward.made) == (chunks * per_chunk[0], chunks * per_chunk[1])


def test_dropout_is_switched_off_for_the_policy():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, attention_dropout=0.1)  # fmt: skip
    model = LlamaForCausalLM(config)
    model.model.extra = torch.nn.Dropout(0.2)  # e.g. LoRA's lora_dropout
    assert disable_dropout(model) == 3  # two attention modules and the Dropout
    assert model.model.extra.p == 0 and all(layer.self_attn.attention_dropout == 0 for layer in model.model.layers)
    assert disable_dropout(model) == 0


def test_sequence_sums_ignore_tokens_of_no_sequence():
    values = torch.arange(6, dtype=torch.float32)
    ids = torch.tensor([[0, 0, -1], [1, -1, 1]])
    assert sequence_sums(values, ids, 3).tolist() == [1.0, 8.0, 0.0]


# -- pairs to tokens ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_chat_model(tmp_path_factory.mktemp("dpo_tok") / "model"))


def _rows(pairs: list[dict]) -> dict[str, list]:
    return {k: [p[k] for p in pairs] for k in ("prompt", "chosen", "rejected")}


def test_the_preference_token_cache_keys_are_pinned(chat_tokenizer):
    """The DPO/KTO token cache keys as existing caches hold them: a change of one re-tokenises every preference
    dataset on resume and, as the precomputed reference's file sits beside the cache, redoes its whole pass (a
    ChatEncoder.VERSION bump for a change that did not reach pairs did so, before it was undone). Pinned on purpose."""
    from fsdp_lib.data.unpaired import ExampleEncoder

    pairs = PairEncoder(ChatEncoder(chat_tokenizer, "assistant"), 1000)
    assert pairs.version == "pairs-v4|chat-v5|fit-1000"
    assert ExampleEncoder(pairs).version == "kto-v3|pairs-v4|chat-v5|fit-1000"


def test_pairs_of_strings_are_one_user_turn_and_one_assistant_turn(chat_tokenizer):
    """TRL's standard shape (prompt, chosen, rejected as strings), as KTO already read it: list() split each string
    into characters and the chat template raised AttributeError, a traceback."""
    encoder = PairEncoder(ChatEncoder(chat_tokenizer, "assistant"), 1000)
    as_turns = {"prompt": [{"role": "user", "content": "What is 1 plus 2?"}]}
    as_turns |= {
        "chosen": [{"role": "assistant", "content": " 3."}],
        "rejected": [{"role": "assistant", "content": " 4."}],
    }
    as_strings = {"prompt": "What is 1 plus 2?", "chosen": " 3.", "rejected": " 4."}
    skipped: dict[str, int] = {}
    [strings] = encoder.encode(_rows([as_strings]), skipped, {}, 0)
    [turns] = encoder.encode(_rows([as_turns]), skipped, {}, 0)
    assert not skipped and all(np.array_equal(a, b) for a, b in zip(strings, turns))


def test_responses_that_repeat_the_prompt_are_trained_without_it(chat_tokenizer):
    """UltraFeedback's shape given straight to the trainer (a hub dataset): chosen and rejected are whole
    conversations that start with the prompt. data_hf.py strips the repeat; the trainer rendered the prompt twice
    (and cut the first copy from the left to fit), exit 0."""
    encoder = PairEncoder(ChatEncoder(chat_tokenizer, "assistant"), 1000)
    user = {"role": "user", "content": "What is 6 plus 6?"}
    system = {"role": "system", "content": "Be brief."}
    standard = {"prompt": [user], "chosen": [{"role": "assistant", "content": " 12."}]}
    standard["rejected"] = [{"role": "assistant", "content": " 13."}]
    repeated = {"prompt": [user], "chosen": [user, *standard["chosen"]], "rejected": [user, *standard["rejected"]]}
    with_system = {key: [system, *value] if key == "prompt" else value for key, value in standard.items()}
    repeated_no_system = {**with_system, "chosen": repeated["chosen"], "rejected": repeated["rejected"]}
    skipped: dict[str, int] = {}
    [want] = encoder.encode(_rows([standard]), skipped, {}, 0)
    [got] = encoder.encode(_rows([repeated]), skipped, {}, 0)
    assert not skipped and all(np.array_equal(a, b) for a, b in zip(want, got))
    [want] = encoder.encode(_rows([with_system]), skipped, {}, 0)
    [got] = encoder.encode(_rows([repeated_no_system]), skipped, {}, 0)
    assert not skipped and all(np.array_equal(a, b) for a, b in zip(want, got))
    assert chat_tokenizer.decode(got[0]).count("What is 6 plus 6?") == 1
    # an HH dialogue as the prompt string (Dahoas/rm-static on the hub): its turns, as data_hf.py reads them, not
    # one user turn wrapping the literal "Human:" and "Assistant:" markers
    hh = {"prompt": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: What is 6 plus 6?\n\nAssistant:",
          "chosen": " 12.", "rejected": " 13."}  # fmt: skip
    turns = {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, user]}
    turns |= {"chosen": standard["chosen"], "rejected": standard["rejected"]}
    [want] = encoder.encode(_rows([turns]), skipped, {}, 0)
    [got] = encoder.encode(_rows([hh]), skipped, {}, 0)
    assert not skipped and all(np.array_equal(a, b) for a, b in zip(want, got))
    assert "Human:" not in chat_tokenizer.decode(got[0])


def test_pair_encoder_trains_the_responses_only_and_cuts_prompts_from_the_left(chat_tokenizer):
    pair = {
        "prompt": [
            {"role": "system", "content": "You add numbers."},
            {"role": "user", "content": "What is 1 plus 2?"},
            {"role": "assistant", "content": "1 plus 2 is 3."},
            {"role": "user", "content": "What is 2 plus 2?"},
        ],
        "chosen": [{"role": "assistant", "content": "2 plus 2 is 4."}],
        "rejected": [{"role": "assistant", "content": "2 plus 2 is 5."}],
    }
    encoder = PairEncoder(ChatEncoder(chat_tokenizer, "assistant"), 1000)
    skipped: dict[str, int] = {}
    [(c_ids, c_mask, r_ids, r_mask)] = encoder.encode(_rows([pair]), skipped, {}, 0)
    assert not skipped
    decode = lambda ids, mask: chat_tokenizer.decode(ids[mask == 1])  # noqa: E731
    assert decode(c_ids, c_mask) == "2 plus 2 is 4.<|eot_id|>"  # not the prompt's earlier assistant turn
    assert decode(r_ids, r_mask) == "2 plus 2 is 5.<|eot_id|>"
    full_c, full_r = len(c_ids), len(r_ids)

    # a block too small for both: the same number of prompt tokens is cut from the left of each, responses stay
    fitted = PairEncoder(ChatEncoder(chat_tokenizer, "assistant"), full_c + full_r - 20)
    cut = [0, 0]
    [(c2, m2, r2, n2)] = fitted.encode(_rows([pair]), skipped, {}, 0, cut)
    assert len(c2) + len(r2) <= full_c + full_r - 20 and len(c_ids) - len(c2) == len(r_ids) - len(r2) == 10
    assert cut == [1, 10], "counted for the run's log: a pair cut, 10 tokens of each sequence"
    assert (
        (c2 == c_ids[10:]).all()
        and decode(c2, m2) == "2 plus 2 is 4.<|eot_id|>"
        and decode(r2, n2).endswith("5.<|eot_id|>")
    )

    # a block that leaves the pair nothing of its prompt but the template's answer header: a counted skip (DPO
    # trained such pairs, prompt-less, in silence); one token more of the prompt and it trains
    header = encoder.header_tokens
    assert chat_tokenizer.decode(c_ids[int(np.argmax(c_mask)) - header : int(np.argmax(c_mask))]).startswith(
        "<|eot_id|><|start_header_id|>assistant"  # the user turn's end counts as markup, not prompt
    )
    prompt_tokens = int(np.argmax(c_mask)) - header
    bare = PairEncoder(ChatEncoder(chat_tokenizer, "assistant"), full_c + full_r - 2 * prompt_tokens)
    skipped, first = {}, {}
    assert bare.encode(_rows([pair]), skipped, first, 3) == []
    assert first == {
        f"the prompt would be cut away whole to fit one block of {bare.max_tokens} tokens (--seq-length)": 3
    }
    one_left = PairEncoder(ChatEncoder(chat_tokenizer, "assistant"), full_c + full_r - 2 * (prompt_tokens - 1))
    assert len(one_left.encode(_rows([pair]), skipped, {}, 0)) == 1

    # responses alone too long, and identical responses: counted skips, the other rows kept
    tiny = PairEncoder(ChatEncoder(chat_tokenizer, "assistant"), 20)
    same = {**pair, "rejected": pair["chosen"]}
    skipped, first = {}, {}
    assert tiny.encode(_rows([pair]), skipped, first, 5) == []
    assert first == {"the responses alone do not fit one block of 20 tokens (--seq-length)": 5}
    skipped = {}
    assert len(encoder.encode(_rows([same, pair]), skipped, {}, 0)) == 1
    assert skipped == {"chosen and rejected are the same tokens": 1}
    skipped = {}
    no_answer = {**pair, "chosen": [{"role": "user", "content": "hm"}]}
    assert encoder.encode(_rows([no_answer]), skipped, {}, 0) == [] and skipped == {
        "a response has no assistant turn": 1
    }
    # a hub dataset reaches the trainer without data_hf.py's checks: an empty reply or prompt trained (an empty
    # chosen taught the end-of-turn marker alone; a pair without a prompt prefers a reply to nothing)
    skipped = {}
    empty_reply = {**pair, "chosen": [{"role": "assistant", "content": " "}]}
    no_prompt = {**pair, "prompt": [{"role": "user", "content": ""}]}
    assert encoder.encode(_rows([empty_reply, no_prompt, {**pair, "prompt": []}]), skipped, {}, 0) == []
    assert skipped == {
        "a response's assistant turns are empty": 1,
        "an empty prompt: nothing before the response to answer": 2,
    }


def test_pack_pairs_puts_every_pair_in_one_block_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 120, size=500)
    blocks = pack_pairs(lengths, 128)
    flat = sorted(p for b in blocks for p in b)
    assert flat == list(range(500))
    assert all(sum(lengths[b]) <= 128 for b in blocks)
    assert blocks == pack_pairs(lengths, 128)  # deterministic
    assert len(blocks) <= math.ceil(lengths.sum() / 128) * 1.1  # best fit decreasing wastes little


def test_pair_blocks_keep_sequences_apart(chat_tokenizer):
    pairs = fact_pairs(False)[:6]
    encoder = PairEncoder(ChatEncoder(chat_tokenizer, "assistant"), 256)
    encoded = encoder.encode(_rows(pairs), {}, {}, 0)
    seqs = [(ids, mask) for c, cm, r, rm in encoded for ids, mask in ((c, cm), (r, rm))]
    tokens = np.concatenate([s for s, _ in seqs])
    mask = np.concatenate([m for _, m in seqs])
    ends = np.cumsum([len(s) for s, _ in seqs])
    blocks = PairBlocks(tokens, mask, ends, 256, pad_id=0)
    batch = blocks.gather(list(range(len(blocks))))
    assert sum(blocks.pairs_in) == 6 and len(batch.sequences) == 12
    for row in range(len(blocks)):
        owner, labels, ids, pos = (
            t[row] for t in (batch.sequence_ids, batch.labels, batch.input_ids, batch.position_ids)
        )
        assert ((labels != -100) == (owner >= 0)).all()  # exactly the response tokens' predictions carry a sequence
        starts = (pos == 0).nonzero().flatten().tolist()
        for k in owner[owner >= 0].unique().tolist():
            where = (owner == k).nonzero().flatten()
            s = batch.sequences[k].item()
            seq_ids, seq_mask = seqs[s]
            # the labels are the sequence's own next tokens where its mask trains them, inside one document
            assert labels[where].tolist() == seq_ids[1:][seq_mask[1:] == 1].tolist()
            assert max(x for x in starts if x <= where[0]) == max(x for x in starts if x <= where[-1])


def test_stored_reference_is_checked(tmp_path):
    path = tmp_path / "train.reference-x.f64"
    values = np.linspace(-50, -1, 10)
    write_reference(path, values)
    assert (read_reference(path, 10) == values).all()
    assert read_reference(path, 12) is None  # another data set's count
    raw = bytearray(path.read_bytes())
    raw[3] ^= 0x10
    path.write_bytes(bytes(raw))
    assert read_reference(path, 10) is None  # a flipped bit: recomputed, never used


# -- the trainer ------------------------------------------------------------------------------------------------

DPO_FLAGS = ["--seq-length", "128", "--precision", "fp32", "--log-freq", "1", "--lr-schedule", "constant"]


@pytest.fixture(scope="module")
def dpo_inputs(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("dpo")
    # untied: the embedding and head are FSDP units of their own, so the gradient tests below cover them
    model = make_chat_model(root / "model", with_weights=True, tied=False)
    return model, make_preference_dataset(root / "pairs", n=48, n_validation=8), root


def dpo_args(name: str, inputs: tuple[Path, Path, Path], *extra: str) -> list[str]:
    model, data, root = inputs
    return [*trainer_args(name, data, model, root / "out"), *DPO_FLAGS, "--lr", "1e-3", *extra]


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,flags",
    [
        ((1, 2), ["--dpo-label-smoothing", "0.1", "--sft-weight", "0.5"]),
        ((2, 1), ["--dpo-label-smoothing", "0.1", "--sft-weight", "0.5"]),
        ((2, 1), ["--dpo-loss", "ipo"]),
        ((2, 1), ["--dpo-loss", "simpo", "--simpo-gamma", "0.3"]),
        ((1, 2), ["--dpo-loss", "orpo"]),
    ],
    ids=["sigmoid-1x2", "sigmoid-2x1", "ipo-2x1", "simpo-2x1", "orpo-1x2"],
)
def test_loss_and_gradients_equal_the_formula_on_the_unsharded_model(dpo_inputs, layout, flags, tmp_path):
    """The worker runs the trainer's first step (its data plan, packing, reference file and DPOObjective) with the
    stored reference shifted by known offsets (so policy != reference) and writes the loss and full gradients; here
    the same pairs go one by one, unpacked, through from_pretrained and the formula, in float64. SimPO and ORPO
    (reference-free) the same, with nothing computed for a reference."""
    from transformers import AutoModelForCausalLM

    nproc, accum = layout
    out = tmp_path / "grads.pt"
    args = dpo_args(f"grads-{nproc}x{accum}-{flags[1]}", dpo_inputs, "-b", "2", "--grad-accum-steps", str(accum))
    proc = run_trainer([*args, *flags, "--dpo-beta", "0.5"], nproc=nproc, script=WORKERS / "dpo_grads.py",
                       env={"DPO_GRADS_OUT": str(out)})  # fmt: skip
    assert proc.returncode == 0, output_of(proc)
    got = torch.load(out)
    model = AutoModelForCausalLM.from_pretrained(dpo_inputs[0], dtype=torch.float64, use_cache=False)
    logps = []
    for ids, mask in got["sequences"]:
        ids, mask = torch.tensor(ids), torch.tensor(mask)
        logits = model(input_ids=ids[None]).logits[0, :-1]
        token = torch.log_softmax(logits, -1).gather(1, ids[1:, None]).squeeze(1)
        logps.append((token * mask[1:]).sum())
    logps = torch.stack(logps)
    lengths = torch.tensor([sum(m[1:]) for _, m in got["sequences"]], dtype=torch.float64)
    if "simpo" in flags or "orpo" in flags:  # reference-free: nothing was computed, read or stored for a reference
        assert got["reference"] is None and "reference log-probabilities" not in output_of(proc)
        assert "reference: none (reference-free: nothing is computed or built for a reference)" in output_of(proc)
    losses = expected_losses(flags, logps, lengths, got["reference"], beta=0.5)
    assert_loss_and_grads_match(got, losses.mean(), model)


def expected_losses(flags: list[str], logps: torch.Tensor, lengths: torch.Tensor, reference, beta: float):
    """Each pair's loss by the papers' formulas from its summed response log-probs (chosen, rejected alternating)."""
    if "simpo" in flags or "orpo" in flags:
        mc, mr = logps[0::2] / lengths[0::2], logps[1::2] / lengths[1::2]  # mean log-prob per response token
        if "simpo" in flags:
            return -F.logsigmoid(beta * (mc - mr) - 0.3)
        odds = lambda m: torch.log(torch.exp(m) / (1 - torch.exp(m)))  # noqa: E731
        return -mc - beta * F.logsigmoid(odds(mc) - odds(mr))
    ref = torch.tensor(reference, dtype=torch.float64)
    h = (logps[0::2] - ref[0::2]) - (logps[1::2] - ref[1::2])
    if "ipo" in flags:
        return (h - 1 / (2 * beta)) ** 2
    losses = -0.9 * F.logsigmoid(beta * h) - 0.1 * F.logsigmoid(-beta * h)
    return losses + 0.5 * (-logps[0::2] / lengths[0::2])


RUN_FLAGS = ["-b", "2", "--max-steps", "8", "--ckpt-freq", "4", "--eval-freq", "4"]


@pytest.fixture(scope="module")
def dpo_run(dpo_inputs) -> tuple[Path, str]:
    """An uninterrupted 2-process DPO run (full weights, precomputed reference) of 8 steps: the baseline. Its own
    save folder (token cache), so it computes the reference whichever test ran first."""
    args = dpo_args("base", dpo_inputs, *RUN_FLAGS)
    save_dir = dpo_inputs[2] / "baseline"
    args[args.index("--save-dir") + 1] = str(save_dir)
    proc = run_trainer(args)
    assert proc.returncode == 0, output_of(proc)
    return save_dir / "base", output_of(proc)


@pytest.mark.slow
def test_step_one_is_ln2_and_accuracy_one_half(dpo_run):
    exp, log = dpo_run
    assert "--objective dpo (auto: the dataset has chosen and rejected columns)" in log
    assert "reference log-probabilities of the train pairs: computed by the starting model" in log
    rows = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in rows if r["step"] == 0)
    assert abs(start["val_loss"] - LN2) < 1e-6 and start["val_rewards/accuracies"] == 0.5
    assert start["val_rewards/margins"] == 0.0
    first = next(r for r in rows if r["step"] == 1 and "loss" in r)
    assert abs(first["loss"] - LN2) < 1e-6 and first["rewards/accuracies"] == 0.5
    assert first["pairs_per_s"] > 0 and first["trained_tokens"] > 0
    last = losses_by_step(exp)
    assert len(last) == 8 and last[8] != last[1]
    assert (exp / "final" / "model.safetensors.index.json").is_file()


@pytest.mark.slow
def test_export_only_computes_no_reference(dpo_inputs, dpo_run):
    """`-e EXP --export-only` alone: the run's settings (data, model, objective) come from its config.yaml."""
    proc = run_trainer(["-e", "base", "--save-dir", str(dpo_run[0].parent), "--export-only"], nproc=1)
    log = output_of(proc)
    assert proc.returncode == 0, log
    assert "reference log-probabilities" not in log and "exported" in log


@pytest.mark.slow
def test_an_objectives_log_window_is_exact_across_a_save_and_a_resume(dpo_inputs, dpo_run):
    """--log-freq 3 with saves at steps 2 and 4, killed after the first, resumed: each line's trained tokens (DPO's
    response tokens, summed in the objective's window figures over the ranks) equal the per-step run's over the same
    steps. The save read the window's figures over the ranks in place, so a later line counted them twice (an
    uninterrupted 2-process GRPO run logged 480 trained tokens for 288); the resume lost the steps before it."""
    from tests.fsdp_helpers import read_metrics

    args = dpo_args("window", dpo_inputs, "-b", "2", "--max-steps", "6", "--ckpt-freq", "2", "--log-freq", "3")
    args[args.index("--save-dir") + 1] = str(dpo_run[0].parent)  # the stored reference: no second reference pass
    killed = run_trainer(args, env={"FSDP_TRAIN_FAULT": "kill_after_rename@0:2"})
    assert killed.returncode != 0
    rerun = run_trainer(args)
    assert rerun.returncode == 0 and "at step 2" in output_of(rerun), output_of(rerun)
    per_step = {r["step"]: r["trained_tokens"] for r in read_metrics(dpo_run[0])}
    got = {r["step"]: r["trained_tokens"] for r in read_metrics(dpo_run[0].parent / "window")}
    assert got == {3: sum(per_step[s] for s in (1, 2, 3)), 6: sum(per_step[s] for s in (4, 5, 6))}


@pytest.mark.slow
def test_a_stop_during_the_preference_validation_cuts_it_short(dpo_inputs, tmp_path):
    """Ctrl-C while the held-out pairs are evaluated (step 0 here): the pass stops at its next micro-batch (DPO's,
    KTO's and GRPO's passes ran to their end), and before the first step the run ends without training or saving.
    SimPO: no reference pass to wait for; one process, so the signal reaches the trainer itself."""
    import signal

    args = dpo_args("stop", dpo_inputs, "--dpo-loss", "simpo", "-b", "2", "--max-steps", "4", "--eval-freq", "4")
    args[args.index("--save-dir") + 1] = str(tmp_path)
    proc = run_trainer(args, nproc=1, env={"FSDP_TRAIN_EVAL_DELAY_S": "2"}, background=True)
    said = ""
    for line in proc.stdout:  # the step-0 evaluation starts once the loop announces its steps
        said += line
        if "training steps 1.." in line:
            break
    proc.send_signal(signal.SIGINT)
    said += proc.communicate(timeout=120)[0]
    assert proc.returncode == 0 and "Traceback" not in said, said
    assert "evaluation cut short by the stop request" in said and "stopped on request before the first step" in said
    assert not (tmp_path / "stop" / "checkpoint").exists() or not any((tmp_path / "stop" / "checkpoint").iterdir())


@pytest.mark.slow
def test_kill9_rerun_is_bit_identical_and_reads_the_stored_reference(dpo_inputs, dpo_run, tmp_path):
    args = dpo_args("run", dpo_inputs, *RUN_FLAGS)
    args[args.index("--save-dir") + 1] = str(tmp_path)  # its own token cache: this run computes the reference
    first_log = killed_at_step(args, tmp_path / "run", 5)
    assert "computed by the starting model" in first_log
    rerun = run_trainer(args)
    log = output_of(rerun)
    assert rerun.returncode == 0, log
    assert "at step 4" in log and "computed by the starting model" not in log
    assert "loaded pretrained weights" in log  # a precomputed reference may need the starting model on a resume
    assert "reference log-probabilities of the train pairs: read from" in log and "(checksum verified)" in log
    expected, resumed = losses_by_step(dpo_run[0]), losses_by_step(tmp_path / "run")
    assert all(resumed[s] == expected[s] for s in range(1, 9)), (resumed, expected)


@pytest.mark.slow
def test_a_resume_with_another_precomputed_reference_is_refused_before_the_reference_pass(dpo_inputs, dpo_run):
    """The baseline's experiment rerun with --attn-implementation eager: the stored reference's key differs, so the
    resume would be refused; it is, before the starting model computes the whole dataset's reference again (the
    check came after that pass, which on a large dataset takes long), and the checkpoints stay."""
    args = [*dpo_args("base", dpo_inputs, *RUN_FLAGS), "--attn-implementation", "eager"]
    args[args.index("--save-dir") + 1] = str(dpo_run[0].parent)
    before = sorted(p.name for p in (dpo_run[0] / "checkpoint").iterdir())
    proc = run_trainer(args)
    log = output_of(proc)
    assert proc.returncode != 0 and not re.search(r'File ".*(fsdp_train|fsdp_lib)', log), log  # no trainer traceback
    assert "cannot resume from" in log and "--reference: checkpoint 'precomputed, key " in log
    assert "computed by the starting model" not in log and "--force-resume" in log, log
    assert sorted(p.name for p in (dpo_run[0] / "checkpoint").iterdir()) == before


@pytest.mark.slow
def test_context_parallel_run_resumes_on_one_process(dpo_inputs, dpo_run, tmp_path):
    """The first 4 steps with each pair's sequences split over 2 processes (--context-parallel 2, accumulation 2:
    the baseline's global batch), its reference computed split too; then one process resumes: every step's loss is
    the 2-process baseline's."""
    first = dpo_args("run", dpo_inputs, *RUN_FLAGS, "--context-parallel", "2", "--grad-accum-steps", "2")
    first[first.index("--save-dir") + 1] = str(tmp_path)
    first[first.index("--max-steps") + 1] = "4"
    split = run_trainer(first)
    assert split.returncode == 0, output_of(split)
    assert "each sequence split over 2 processes" in output_of(split)
    assert "computed by the starting model" in output_of(split)
    second = [*dpo_args("run", dpo_inputs, *RUN_FLAGS), "--grad-accum-steps", "2"]
    second[second.index("--save-dir") + 1] = str(tmp_path)
    resumed = run_trainer(second, nproc=1)
    log = output_of(resumed)
    assert resumed.returncode == 0, log
    assert "world size changed (2 -> 1)" in log and "computed by the starting model" not in log
    expected, got = losses_by_step(dpo_run[0]), losses_by_step(tmp_path / "run")
    for step in range(1, 9):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    held_out = {  # evaluated split at steps 0 and 4: each pair counted once
        exp: {
            r["step"]: r for r in map(json.loads, (exp / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r
        }
        for exp in (dpo_run[0], tmp_path / "run")
    }
    for step in (0, 4):
        want, have = held_out[dpo_run[0]][step], held_out[tmp_path / "run"][step]
        assert have["val_pairs"] == want["val_pairs"] and have["val_response_tokens"] == want["val_response_tokens"]
        assert have["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5), step


@pytest.mark.slow
def test_live_reference_copy_gives_the_precomputed_losses(dpo_inputs, dpo_run):
    """Split over 2 processes too (--context-parallel 2, accumulation 2: the baseline's global batch): the frozen
    copy's log-probabilities of each sequence are summed over its parts."""
    args = dpo_args("live", dpo_inputs, *RUN_FLAGS, "--reference", "live", "--context-parallel", "2")
    args[args.index("--max-steps") + 1] = "4"
    proc = run_trainer([*args, "--grad-accum-steps", "2"])
    log = output_of(proc)
    assert proc.returncode == 0, log
    assert "reference: a frozen FSDP-sharded copy" in log and "computed by the starting model" not in log
    expected, got = losses_by_step(dpo_run[0]), losses_by_step(dpo_inputs[2] / "out" / "live")
    for step in range(1, 5):
        assert got[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-7), step


LORA = ["--peft", "lora", "--lora-rank", "8", "--lora-alpha", "16"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [[], LORA, ["--dpo-loss", "simpo", "--dpo-beta", "2.0"], ["--dpo-loss", "orpo", *LORA]],
    ids=["full", "lora", "simpo-full", "orpo-lora"],
)
def test_dpo_learns_a_fact_on_held_out_pairs(dpo_inputs, flags, tmp_path):
    """Chosen = the fact the pairs teach, rejected = a wrong city; the held-out pairs ask in another phrasing and
    reject cities no training pair rejected. The reference-free losses learn it too (their step 0 is the starting
    model's own preference, not a tie)."""
    data = save_pairs(tmp_path / "facts_data", fact_pairs(False, repeats=3), fact_pairs(True, repeats=2))
    args = [*trainer_args("facts", data, dpo_inputs[0], tmp_path), *DPO_FLAGS, "--lr", "3e-3", "-b", "1"]
    proc = run_trainer([*args, "--max-steps", "20", "--eval-freq", "10", *flags])
    log = output_of(proc)
    assert proc.returncode == 0, log
    reference_free = "--dpo-loss" in flags
    if "--peft" in flags:
        assert reference_free or "reference: the same model with its adapters off" in log
        assert (tmp_path / "facts" / "final" / "adapter_config.json").is_file()
    rows = [json.loads(line) for line in (tmp_path / "facts" / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in rows if "val_rewards/accuracies" in r]
    first, last = evaluations[0], evaluations[-1]
    assert first["step"] == 0 and (reference_free or first["val_rewards/accuracies"] == 0.5)
    assert last["step"] == 20 and last["val_rewards/accuracies"] >= 0.9, evaluations
    assert last["val_rewards/margins"] > max(0.0, first["val_rewards/margins"])
    assert last["val_loss"] < (first["val_loss"] if reference_free else LN2)


@pytest.mark.slow
def test_qlora_dpo_resumes_bit_identically(tmp_path):
    """QLoRA (NF4 base, reference = adapters off): step 1 is ln 2, and the run resumed from its step-2 checkpoint
    trains steps 3-4 to the losses of the uninterrupted run, bit for bit."""
    model = make_chat_model(tmp_path / "model", with_weights=True, sizes=llama_sizes(256, 2))
    data = make_preference_dataset(tmp_path / "pairs", n=16, n_validation=4)

    def run(save: Path, steps: int) -> str:
        args = [*trainer_args("q", data, model, save), *DPO_FLAGS, "--lr", "1e-3", "-b", "1", "--peft", "qlora"]
        proc = run_trainer([*args, "--lora-rank", "4", "--max-steps", str(steps), "--ckpt-freq", "2"])
        assert proc.returncode == 0, output_of(proc)
        return output_of(proc)

    log = run(tmp_path / "whole", 4)
    assert "reference: the same model with its adapters off" in log and "nf4" in log
    # as if stopped after its step-2 checkpoint: the run's folder without the step-4 checkpoint and the export
    shutil.copytree(tmp_path / "whole" / "q", tmp_path / "part" / "q")
    for later in ("checkpoint/step_00000004", "final"):
        shutil.rmtree(tmp_path / "part" / "q" / later)
    assert "resumed from" in run(tmp_path / "part", 4)
    whole, part = losses_by_step(tmp_path / "whole" / "q"), losses_by_step(tmp_path / "part" / "q")
    assert abs(whole[1] - LN2) < 1e-6, whole
    assert part[3] == whole[3] and part[4] == whole[4], (part, whole)
    assert (tmp_path / "part" / "q" / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_bad_dpo_flags_and_data_are_refused(dpo_inputs, tmp_path, capsys):
    import fsdp_train

    model, pairs, _ = dpo_inputs
    text = make_dataset(tmp_path / "text")
    base = trainer_args("bad", pairs, model, tmp_path)
    for extra, message in [
        (["--dpo-beta", "0"], "--dpo-beta must be a positive number"),
        (["--dpo-loss", "ipo", "--dpo-label-smoothing", "0.1"], "applies to --dpo-loss sigmoid"),
        (["--objective", "lm", "--dpo-beta", "0.2"], "--dpo-beta needs --objective dpo or kto"),
        (["--objective", "dpo", "--document-masking", "off"], "needs --document-masking on"),
    ]:
        assert fsdp_train.main([*base, *extra]) == 2  # before any process group
        assert message in capsys.readouterr().out, extra
        assert not (tmp_path / "bad").exists()
    on_text = [*trainer_args("bad2", text, model, tmp_path), "--objective", "dpo"]
    proc = run_trainer(on_text, nproc=1)
    assert proc.returncode != 0 and "not prompt, chosen and rejected" in output_of(proc)
    on_pairs = [*base, "--objective", "lm"]
    proc = run_trainer(on_pairs, nproc=1)
    assert proc.returncode != 0 and "holds preference pairs" in output_of(proc)


def test_prompts_cut_to_fit_are_said_at_every_start(capsys):
    """The pairs whose prompt lost tokens to fit a block were trained without a word (a 64-token block cut every
    prompt of a run); the split's report says how many and how much, loudly above 1% (read from the cache too)."""
    from fsdp_lib.data.cache import report_skipped

    skips = {"conversations": 10, "expanded": 0, "skipped": {}, "first_row": {}, "unit": "pairs"}
    report_skipped({**skips, "cut": {"units": 3, "tokens": 30, "block": 64}}, "the train split", 0.5, "pairs")
    said = capsys.readouterr().out
    assert (
        "WARNING: 3 pairs (30.0%) of the train split lost prompt tokens from the left to fit one block of 64 tokens "
        in said
    )
    assert "(--seq-length), 10 per sequence on average" in said
    report_skipped(skips, "the train split", 0.5, "pairs")  # a cache written before the count: nothing to say
    assert "prompt tokens" not in capsys.readouterr().out


def test_packing_stream_is_refused_for_pairs(dpo_inputs):
    """Pairs (and KTO's examples, GRPO's prompts) are always packed whole: --packing stream would change nothing,
    so it is refused by name before anything is tokenised."""
    from transformers import AutoTokenizer

    from fsdp_lib.config import TrainConfig
    from fsdp_lib.data.plan import load_source
    from fsdp_lib.errors import TrainError

    model, data, root = dpo_inputs
    cfg = TrainConfig(experiment_name="x", dataset_name=[str(data)], model_name=str(model), packing="stream")
    with pytest.raises(
        TrainError, match="--packing stream: .* trains --objective dpo, whose pairs .* are always whole"
    ):
        load_source(cfg, str(data), AutoTokenizer.from_pretrained(model), "t", None)
