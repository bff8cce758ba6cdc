"""The memory-efficient loss: chunked cross-entropy equals the full-logits loss and its gradients, for every
kind of output head the trainer meets, and a 2-process run with a 128k vocabulary stays within a memory bound
that the full-logits path exceeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fsdp_lib.data.batch import Batch
from fsdp_lib.data.cache import PackedBlocks
from fsdp_lib.data.plan import DataPlan, Prefetcher
from fsdp_lib.model.loss import CausalLMLoss, ChunkedCrossEntropy, chunked_loss_problem, chunked_loss_sum
from tests.fsdp_helpers import make_dataset, make_model, output_of, read_metrics, run_trainer, tiny_config, trainer_args


def _full_reference(hidden, weight, bias, labels, softcap=None):
    logits = F.linear(hidden, weight, bias).float()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("bias,softcap", [(False, None), (True, None), (False, 30.0)])
def test_chunked_loss_and_gradients_equal_the_full_logits_path(masked, bias, softcap):
    torch.manual_seed(0)
    tokens, dim, vocab, chunk = 37, 16, 101, 8  # neither tokens nor vocab divisible by the chunk
    hidden = torch.randn(tokens, dim, dtype=torch.float64).float().requires_grad_()
    head = torch.nn.Linear(dim, vocab, bias=bias)
    labels = torch.randint(0, vocab, (tokens,))
    if masked:
        labels[torch.rand(tokens) < 0.4] = -100
    expected = _full_reference(hidden, head.weight, head.bias, labels, softcap)
    expected_grads = torch.autograd.grad(expected * 0.37, [hidden, *head.parameters()])
    got = chunked_loss_sum(hidden, head, labels, chunk, softcap)
    got_grads = torch.autograd.grad(got * 0.37, [hidden, *head.parameters()])
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
    with torch.no_grad():  # evaluation takes the no-gradient path
        torch.testing.assert_close(chunked_loss_sum(hidden, head, labels, chunk, softcap), expected, rtol=1e-6, atol=0)


def test_all_labels_ignored_gives_zero_loss_and_zero_gradients():
    hidden = torch.randn(5, 4, requires_grad=True)
    head = torch.nn.Linear(4, 7, bias=False)
    loss = chunked_loss_sum(hidden, head, torch.full((5,), -100), 2, None)
    loss.backward()
    assert loss.item() == 0 and hidden.grad.abs().sum() == 0 and head.weight.grad.abs().sum() == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox", "opt", "gpt2", "gemma2", "mixtral"])
def test_training_forward_equals_the_models_own_logits(arch):
    """CausalLMLoss (decoder + chunked head) against the model's forward and a plain cross-entropy; Gemma2 has
    logit soft-capping, Mixtral a router loss the chunked path computes itself."""
    import transformers as tf

    torch.manual_seed(0)
    config = tiny_config(arch, 97, 0)
    config.use_cache = False
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()  # no dropout
    assert chunked_loss_problem(model) is None
    ids = torch.randint(0, 97, (2, 17))
    labels = torch.randint(0, 97, (2, 17))
    labels[0, :5] = -100
    batch = Batch(ids, labels, None)
    results = {}
    for chunk in (0, 5):
        loss, aux = CausalLMLoss(model, chunk)(batch)
        objective = loss if aux is None else loss + aux
        results[chunk] = (loss, aux, torch.autograd.grad(objective, list(model.parameters()), allow_unused=True))
    (full, full_aux, full_grads), (chunked, chunked_aux, chunked_grads) = results[0], results[5]
    torch.testing.assert_close(chunked, full, rtol=1e-6, atol=1e-6)
    assert (full_aux is None) == (chunked_aux is None) == (arch != "mixtral")
    if full_aux is not None:
        torch.testing.assert_close(chunked_aux, full_aux, rtol=1e-6, atol=1e-7)
    for c, f in zip(chunked_grads, full_grads):
        if f is not None:
            torch.testing.assert_close(c, f, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "name,config",
    [
        ("CohereConfig", {"logit_scale": 0.5}),  # logits * logit_scale after the head
        ("RecurrentGemmaConfig", {"logits_soft_cap": 30.0, "lru_width": 32, "attention_window_size": 16}),
        ("LlamaConfig", {}),
        ("Gemma2Config", {"final_logit_softcapping": 30.0, "head_dim": 8}),  # a soft cap the chunked path applies
    ],
)
def test_the_start_up_head_check_compares_the_chunked_head_with_the_models_own_logits(name, config):
    """No list of config keys: the chunked head (Linear, then the soft cap where final_logit_softcapping says so)
    is compared with the model's own logits on a probe. Cohere's logit_scale and RecurrentGemma's logits_soft_cap
    are transforms it does not apply: caught (the trainer then uses the model's own logits); the others agree."""
    import transformers as tf

    from fsdp_lib.model.probes import HEAD_TOLERANCE, head_difference

    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    model_config = getattr(tf, name)(**common, num_key_value_heads=1, eos_token_id=0, bos_token_id=0, **config)
    model_config.use_cache = False
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(model_config)
    assert chunked_loss_problem(model) is None  # nothing in the config tells a static check
    difference = head_difference(CausalLMLoss(model, 8), 97, torch.device("cpu"))
    transforms = name in ("CohereConfig", "RecurrentGemmaConfig")
    assert (difference > HEAD_TOLERANCE["fp32"]) == transforms, difference


def test_bf16_gradients_are_scaled_in_fp32_and_the_head_gradient_stays_in_its_dtype():
    """The loss scale (world / trained tokens) multiplies both gradients in fp32 and is rounded once; before, the
    hidden-state gradient got the scale rounded to bf16 (x1.0017 here). The head's gradient accumulates in the
    head's dtype: no fp32 [vocab x hidden] copy."""
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(101, 16, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 101, (37,))
    labels[::5] = -100
    scale = torch.tensor(2 / 1199)  # bf16 rounds it to 2 / 1199 * 1.0017
    ChunkedCrossEntropy.apply(hidden, weight, None, labels, 8, None).backward()
    unscaled = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    (ChunkedCrossEntropy.apply(hidden, weight, None, labels, 8, None) * scale).backward()
    assert weight.grad.dtype == torch.bfloat16
    for grad, reference in zip((hidden.grad, weight.grad), unscaled):
        assert torch.equal(grad, (reference.float() * scale).to(torch.bfloat16))
    assert not torch.equal(hidden.grad, unscaled[0] * scale.to(torch.bfloat16))  # what the old code did
    # and the chunk-by-chunk bf16 gradients stay as close to an fp32 reference as bf16 allows
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    F.cross_entropy(h32 @ w32.t(), labels, ignore_index=-100, reduction="sum").backward()
    for grad, reference in zip(unscaled, (h32.grad, w32.grad)):
        assert (grad.float() - reference).norm() / reference.norm() < 1e-2


def test_fp16_small_gradients_survive_until_the_loss_scale_lifts_them():
    """fp16 with a loss scale (1024 here): the gradients from unlikely tokens (softmax ~1e-7, where fp16 keeps a
    digit or none) must come out as the scaled fp32 value rounded once. Before, the chunk's softmax gradient was
    rounded to fp16 in forward, before the scale could lift it."""
    torch.manual_seed(0)
    hidden = (torch.randn(64, 16) * 2).half().requires_grad_()
    weight = (torch.randn(512, 16) * 2).half().requires_grad_()
    labels = torch.randint(0, 512, (64,))
    scale = torch.tensor(1024.0)
    (ChunkedCrossEntropy.apply(hidden, weight, None, labels, 16, None) * scale).backward()
    # The reference: exact (float64) gradients of the loss of the same fp16 logits the forward computes.
    logits = F.linear(hidden.detach(), weight.detach()).double()
    softmax_grad = (torch.softmax(logits, -1) - F.one_hot(labels, 512)) * 1024.0
    references = softmax_grad @ weight.detach().double(), softmax_grad.t() @ hidden.detach().double()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float16
    for grad, reference in zip((hidden.grad, weight.grad), references):
        assert torch.isfinite(grad).all()
        representable = reference.abs() > 1e-3  # well inside fp16's range once scaled
        error = (grad.double() - reference).abs()[representable] / reference.abs()[representable]
        assert error.max() < 2e-3, error.max()  # one fp16 rounding of the exact value


def _peak_rss_gb(vocab_model: Path, dataset: Path, save: Path, exp: str, chunk: str) -> float:
    args = trainer_args(exp, dataset, vocab_model, save) + ["-b", "4", "--seq-length", "256", "--max-steps", "2"]
    args += ["--loss-chunk-tokens", chunk, "--activation-checkpointing", "off", "--eval-freq", "1"]
    result = run_trainer(args, nproc=1)
    assert result.returncode == 0, output_of(result)
    # the dataset has no validation split: --eval-freq would evaluate nothing, and the log says so
    assert "WARNING: --eval-freq 1: --dataset-name" in result.stdout + result.stderr, output_of(result)
    assert "has no validation data (no validation split, or one" in result.stdout + result.stderr
    return max(r["mem_peak_alloc_gb"] for r in read_metrics(save / exp))


def test_128k_vocabulary_run_stays_within_a_bound_the_full_logits_path_exceeds(tmp_path):
    """1024 tokens per micro-batch x 131072 vocabulary: the full path holds 512 MiB of fp32 logits plus their
    gradient; the chunked path 128 tokens of them at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = make_model(tmp_path / "vocab128k")
    config = tiny_config("llama", 131072, AutoTokenizer.from_pretrained(model).eos_token_id)
    config.max_position_embeddings = 256
    config.save_pretrained(model)
    assert AutoModelForCausalLM.from_config(config).get_output_embeddings().out_features == 131072
    dataset = make_dataset(tmp_path / "corpus", validation=False, n_docs=400)
    chunked = _peak_rss_gb(model, dataset, tmp_path, "chunked", "128")
    full = _peak_rss_gb(model, dataset, tmp_path, "full", "0")
    bound = 1.25  # GiB per process: the interpreter, torch and transformers take ~0.6 of it
    print(f"peak RSS per process: chunked {chunked:.2f} GiB, full logits {full:.2f} GiB")
    assert chunked < bound < full, (chunked, full)


# --- no stalls in the step: prefetching, gradient sync, compile -----------------------------------


def test_prefetcher_gives_exactly_the_plans_batches_across_epochs_and_jumps():
    import numpy as np

    tokens = np.arange(8 * 23 + 1)
    blocks = PackedBlocks(tokens, 8, doc_ends=np.array([50, 51, 120, 185]))
    plan = DataPlan(blocks, seed=1, global_batch=4, micro_batch=1, world_size=2, rank=1)
    prefetch = Prefetcher(plan, pin=False)
    walk = [(0, s) for s in range(plan.steps_per_epoch)] + [(1, 0), (1, 1), (0, 3), (2, 4), (3, 0), (2, 2)]
    for epoch, step in walk:
        batches, trained = prefetch.get(epoch, step)
        order = plan.epoch_order(epoch)
        expected = plan.micro_batches(order, step)
        assert trained == plan.trained_tokens(order, step)
        assert len(batches) == len(expected) == 2
        for got, want in zip(batches, expected):
            for a, b in zip(
                (got.input_ids, got.labels, got.position_ids), (want.input_ids, want.labels, want.position_ids)
            ):
                assert torch.equal(a, b)


@pytest.fixture(scope="module")
def small_inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("loss_inputs")
    return make_dataset(root / "corpus"), make_model(root / "model", with_weights=True)


def _losses(
    inputs, save: Path, exp: str, *extra: str, env: dict[str, str] | None = None, nproc: int = 2
) -> dict[int, float]:
    from tests.fsdp_helpers import losses_by_step

    args = trainer_args(exp, *inputs, save) + ["-b", "2", "--max-steps", "4", *extra]
    result = run_trainer(args, nproc=nproc, env=env)
    assert result.returncode == 0, output_of(result)
    if env and "TORCH_LOGS" in env:  # what torch.compile logged: the caller's to read
        (save / exp / "compile.log").write_text(output_of(result))
    return losses_by_step(save / exp)


def test_gradient_sync_on_the_last_micro_batch_only_gives_the_same_run(small_inputs, tmp_path):
    each = _losses(small_inputs, tmp_path, "each", "--grad-accum-steps", "2")
    last = _losses(small_inputs, tmp_path, "last", "--grad-accum-steps", "2", "--accum-grad-sync", "last")
    assert each.keys() == last.keys() == {1, 2, 3, 4}
    for step in each:
        assert last[step] == pytest.approx(each[step], rel=1e-6)


def test_memory_figures_are_the_maximum_over_ranks(small_inputs, tmp_path):
    _losses(small_inputs, tmp_path, "mem")
    for row in read_metrics(tmp_path / "mem"):
        assert row["mem_peak_alloc_gb"] >= row["mem_peak_alloc_gb_rank0"] > 0


def test_compiled_decoder_layers_train_like_eager(small_inputs, tmp_path):
    """Same losses as eager; and the layers compile for the training step's shape only: the start-up probes
    ([1 x 32] and [2 x 32] rows), evaluation and samples run eagerly, so no recompilation for another size
    (which would also turn the training graph dynamic)."""
    eager = _losses(small_inputs, tmp_path, "eager")
    sampled = ["--sample-prompts", str(_prompts(tmp_path)), "--sample-max-new-tokens", "3", "--eval-freq", "2"]
    compiled = _losses(
        small_inputs, tmp_path, "compiled", "--compile", "on", *sampled, env={"TORCH_LOGS": "recompiles"}
    )
    for step in eager:
        assert compiled[step] == pytest.approx(eager[step], rel=1e-4)
    assert compiled[4] < compiled[1]
    log = (tmp_path / "compiled" / "compile.log").read_text()
    assert "size mismatch" not in log, log


def _prompts(folder: Path) -> Path:
    path = folder / "prompts.txt"
    path.write_text("1 + 2 =\n3 + 4 =\n")
    return path


def test_eager_attention_trains_like_sdpa(small_inputs, tmp_path):
    """The kernels --attn-implementation offers that train on CPU (flex_attention has no CPU backward in torch
    2.13; flash_attention_2 needs CUDA), with document masking on: same losses."""
    sdpa = _losses(small_inputs, tmp_path, "sdpa", "--attn-implementation", "sdpa", nproc=1)  # the kernel, not FSDP
    eager = _losses(small_inputs, tmp_path, "eager_attn", "--attn-implementation", "eager", nproc=1)
    for step in sdpa:
        assert eager[step] == pytest.approx(sdpa[step], rel=1e-5)


@pytest.mark.parametrize("vocab,expected", [(32000, 2048), (131072, 512), (151936, 384), (262144, 256), (10**7, 64)])
def test_auto_loss_chunk_keeps_one_chunks_fp32_logits_within_the_budget(vocab, expected):
    from fsdp_lib.model.loss import LOSS_CHUNK_BUDGET_BYTES, loss_chunk_tokens

    chunk = loss_chunk_tokens("auto", vocab)
    assert chunk == expected and chunk % 64 == 0
    assert chunk * vocab * 4 <= LOSS_CHUNK_BUDGET_BYTES or chunk == 64  # 64 rows at least, whatever the vocabulary
    assert loss_chunk_tokens("0", vocab) == 0 and loss_chunk_tokens("128", vocab) == 128


def test_loss_chunk_tokens_takes_auto_or_a_whole_number():
    from fsdp_lib.checks import validate_config
    from fsdp_lib.config import TrainConfig

    def problems(value: str) -> list[str]:
        return [p for p in validate_config(TrainConfig(loss_chunk_tokens=value), 1) if "--loss-chunk-tokens" in p]

    assert problems("auto") == problems("0") == problems("512") == []
    assert problems("1k") == ["--loss-chunk-tokens '1k': expected auto or a whole number of tokens (0 = full logits)"]
    assert problems("-5")
