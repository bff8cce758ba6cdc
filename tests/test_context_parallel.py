"""--context-parallel N (Ulysses over the varlen kernel): each sequence split over N processes trains exactly as
one process with the whole sequence, on packed multi-document blocks and chat masks, resumes at another degree,
each rank keeps the right part of every row (packed or not), and a degree that cannot work is refused before any
process group, naming the flag."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fsdp_lib.checks import validate_config
from fsdp_lib.config import load_config
from fsdp_lib.testing import DECODER
from tests.fsdp_helpers import (
    killed_at_step,
    make_chat_dataset,
    make_chat_model,
    make_dataset,
    make_model,
    output_of,
    read_metrics,
    run_trainer,
    trainer_args,
)

# One global batch of 2 blocks per step on every degree: 1 process (no split), or 2 processes of one context group.
SAME_STEPS = ["-b", "2", "--global-batch-size", "2", "--seq-length", "64", "--warmup-steps", "1"]


def _figures(exp_dir: Path) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in read_metrics(exp_dir)}


def _validation(exp_dir: Path) -> dict[int, tuple[float, int]]:
    lines = [json.loads(line) for line in (exp_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["val_loss"], r["val_tokens"]) for r in lines if "val_loss" in r}


def _assert_same(got: dict[int, tuple[float, float]], want: dict[int, tuple[float, float]], steps: list[int]) -> None:
    for step in steps:
        for a, b in zip(got[step], want[step]):
            assert abs(a - b) <= 1e-5 * abs(b), (step, got[step], want[step])


def test_context_parallel_2_trains_like_one_process_and_resumes_at_1(tmp_path):
    """Llama (GQA: 4 query, 2 key/value heads), packed documents: losses and gradient norms of every step equal
    the unsplit run's to 1e-5 (fp32), and so does the held-out loss; killed after its step-2 checkpoint, the split
    run resumes on one process without the split and ends where the uninterrupted run does."""
    dataset, model = make_dataset(tmp_path / "data"), make_model(tmp_path / "model", with_weights=True)
    base = [*SAME_STEPS, "--max-steps", "4", "--ckpt-freq", "2"]
    whole = run_trainer(trainer_args("whole", dataset, model, tmp_path) + base, nproc=1)
    assert whole.returncode == 0, output_of(whole)
    want = _figures(tmp_path / "whole")
    split = trainer_args("split", dataset, model, tmp_path) + base
    out = killed_at_step([*split, "--context-parallel", "2"], tmp_path / "split", 3)
    assert (
        "each sequence split over 2 processes (Ulysses; 1 context group(s)" in out and "kept apart by varlen" in out
    ), out
    _assert_same(_figures(tmp_path / "split"), want, [1, 2, 3])
    resumed = run_trainer(split, nproc=1)
    assert resumed.returncode == 0, output_of(resumed)
    assert "resumed from" in output_of(resumed) and "step 2" in output_of(resumed)
    _assert_same(_figures(tmp_path / "split"), want, [3, 4])
    # the held-out loss, evaluated split at step 0 and whole at step 4, and its token count
    for step in (0, 4):
        (got, got_tokens), (loss, tokens) = _validation(tmp_path / "split")[step], _validation(tmp_path / "whole")[step]
        assert abs(got - loss) <= 1e-5 * loss and got_tokens == tokens


def test_context_parallel_chat_with_another_family(tmp_path):
    """Qwen2 with one key/value head for 4 query heads (fewer than the 2 processes: each gets a copy of it), chat
    SFT with the loss on assistant turns, packed, on 4 processes: 2 context groups of 2 training different
    micro-batches (this crashed at start-up: the timeout was set on every context group, also those a rank is not
    in); the split run's losses and gradient norms equal the unsplit run's; the split run also offloads its saved
    activations and tiles its MLPs (both exact)."""
    dataset = make_chat_dataset(tmp_path / "chat")
    model = make_chat_model(
        tmp_path / "model", with_weights=True, arch="qwen2", sizes={**DECODER, "num_key_value_heads": 1}
    )
    args = [*SAME_STEPS, "--max-steps", "2"]
    whole = run_trainer(trainer_args("whole", dataset, model, tmp_path) + args, nproc=1)
    extra = ["--context-parallel", "2", "--activation-offload", "on", "--tiled-mlp", "3"]
    split = run_trainer(trainer_args("split", dataset, model, tmp_path) + [*args, *extra, "-b", "1"], nproc=4)
    assert whole.returncode == 0 and split.returncode == 0, output_of(whole) + output_of(split)
    said = output_of(split)
    assert "each sequence split over 2 processes (Ulysses; 2 context group(s) training different" in said, said
    assert "MLP in 3 tiles, saved activations offloaded to host memory" in output_of(split)
    _assert_same(_figures(tmp_path / "split"), _figures(tmp_path / "whole"), [1, 2])


@pytest.mark.parametrize(
    "heads,kv_heads,degree,largest",
    [(4, 2, 2, None), (4, 1, 2, None), (8, 2, 4, None), (6, 3, 2, 1), (4, 4, 8, 4)],
)
def test_a_degree_must_divide_the_query_heads_and_divide_or_be_a_multiple_of_the_key_value_heads(
    tmp_path, heads, kv_heads, degree, largest
):
    """(largest: the degree the refusal proposes; None: the degree works.) Refused from config.json before any
    process group (validate_config), and again by the built model."""
    from fsdp_lib.checks import validate_config
    from fsdp_lib.config import TrainConfig
    from fsdp_lib.context_degree import context_degree_fits
    from fsdp_lib.errors import TrainError
    from fsdp_lib.model.build import build_model_skeleton, check_context_parallel

    assert context_degree_fits(heads, kv_heads, degree) == (largest is None)
    if largest is None:
        return
    sizes = {**DECODER, "hidden_size": 8 * heads, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    folder = make_model(tmp_path / "m", sizes=sizes)
    proposal = f"largest that works (and divides the processes and --seq-length) is {largest}: use --context-parallel"
    cfg = TrainConfig(experiment_name="e", dataset_name=["d"], model_name=str(folder), seq_length=64)
    problems = validate_config(dataclasses.replace(cfg, context_parallel=degree), 8)
    assert any(f"has {heads} attention and {kv_heads} key/value heads" in p for p in problems)
    assert any(proposal in p for p in problems), problems
    model = build_model_skeleton(folder, "varlen", True)
    with pytest.raises(TrainError, match=f"largest that works .* is {largest}: use --context-parallel {largest}"):
        check_context_parallel(model, degree, world=8, seq_length=64)


def test_each_rank_keeps_its_part_of_every_row_and_the_documents_of_the_whole_rows():
    """loss.local_part: inputs, targets and positions cut at the same place; packed rows keep their
    documents; rows without position ids (--document-masking off) count positions from the row's start and are
    one document each."""
    import torch

    from fsdp_lib.data.batch import Batch
    from fsdp_lib.model.loss import local_part
    from fsdp_lib.model.varlen import Context

    ids = torch.arange(16).reshape(2, 8)
    second = Context(size=2, rank=1, group=None)
    packed = Batch(ids, ids + 100, torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]]))
    part = local_part(packed.to(torch.device("cpu")), second)
    assert part.input_ids.tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]] and torch.equal(
        part.labels, part.input_ids + 100
    )
    assert part.position_ids.tolist() == [[1, 2, 3, 4], [4, 5, 6, 7]]
    assert part.documents.bounds == (0, 3, 8, 16)  # the whole rows' documents
    unpacked = local_part(Batch(ids, ids, None), second)
    assert unpacked.position_ids.tolist() == [[4, 5, 6, 7], [4, 5, 6, 7]]
    assert unpacked.documents.bounds == (0, 8, 16) and unpacked.documents.longest == 8


def _all_to_alls(rank: int, store: str, rows: int) -> None:
    """One of 2 processes: its part of a [rows x 4 heads x 8 x 3] tensor through both all-to-alls and back."""
    import torch
    import torch.distributed as dist

    from fsdp_lib.model.varlen import Context, _heads_to_sequence, _sequence_to_heads

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        context = Context(size=2, rank=rank, group=dist.group.WORLD)
        whole = torch.randn(rows, 4, 8, 3, generator=torch.Generator().manual_seed(0))
        part = whole[:, :, 4 * rank : 4 * rank + 4].clone().requires_grad_()
        heads = _heads_to_sequence(part, context)  # every token of heads 2r, 2r + 1
        assert torch.equal(heads, whole[:, 2 * rank : 2 * rank + 2])
        flat = heads.transpose(1, 2).reshape(rows * 8, 2, 3)  # what both attention paths do to it
        assert (flat.data_ptr() == heads.data_ptr()) and flat.is_contiguous(), "the flattening copied"
        back = _sequence_to_heads(heads.transpose(1, 2).contiguous(), context)
        assert torch.equal(back, part.detach().transpose(1, 2))  # [rows x 4 tokens x 4 heads x 3]
        upstream = torch.randn(back.shape, generator=torch.Generator().manual_seed(1 + rank))
        (back * upstream).sum().backward()  # the composition is the identity: so is its gradient
        assert torch.equal(part.grad, upstream.transpose(1, 2))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rows", [1, 2])
def test_the_ulysses_all_to_alls_move_heads_and_tokens_and_their_gradients(tmp_path, rows):
    """Two gloo processes: the all-to-all to whole sequences gives each process its heads for every token, in the
    layout the attention flattens without a copy, and the way back (and both backwards) returns each part."""
    import torch.multiprocessing as mp

    mp.spawn(_all_to_alls, args=(str(tmp_path / "store"), rows), nprocs=2)


@pytest.mark.parametrize(
    "flags,world,message",
    [
        (["--context-parallel", "3"], 2, "--context-parallel 3 does not divide the 2 processes"),
        (["--context-parallel", "2", "--seq-length", "33"], 2, "does not divide --seq-length 33"),
        (["--context-parallel", "2", "--attn-implementation", "sdpa"], 2, "use auto or varlen"),
        (["--context-parallel", "0"], 1, "--context-parallel must be 1 or more"),
    ],
)
def test_a_degree_that_cannot_work_is_refused_before_any_process_group(tmp_path, flags, world, message):
    cfg = load_config(["-e", "x", "-d", str(tmp_path), "-m", str(tmp_path), *flags])
    assert any(message in problem for problem in validate_config(cfg, world))


def test_a_dry_run_plans_the_degree_without_torchrun_and_one_process_is_told_how_to_launch(tmp_path, monkeypatch):
    """--dry-run, which needs no GPU or process group, refused every --context-parallel N outside torchrun ("does not
    divide the 1 processes; use a divisor of 1"): it now plans N processes (WORLD_SIZE another count), and a real
    launch on one process names torchrun."""
    from fsdp_lib.checks import launch_world

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = ["-e", "x", "-d", str(tmp_path), "-m", str(tmp_path), "--context-parallel", "8"]
    assert launch_world(load_config([*args, "--dry-run"])) == 8
    assert launch_world(load_config(args)) == 1
    (problem,) = [p for p in validate_config(load_config(args), 1) if "--context-parallel" in p]
    assert "this is one process: start it with torchrun --nproc_per_node 8 (or a multiple of 8)" in problem
    monkeypatch.setenv("WORLD_SIZE", "32")
    assert launch_world(load_config([*args, "--dry-run"])) == 32
