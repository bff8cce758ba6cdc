"""Dataset mixtures (-d several times, --data-weights): the plan's shares, its epoch, its independence of the process
count, the flags' checks, and a real mixed text + chat run that resumes after kill -9 on another process count."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fsdp_lib.checks import validate_config
from fsdp_lib.config import TrainConfig, load_config
from fsdp_lib.data.mixture import MixedBlocks, Mixture, short_names
from fsdp_lib.data.plan import DataPlan
from tests.fsdp_helpers import (
    killed_at_step,
    losses_by_step,
    make_chat_dataset,
    make_chat_model,
    make_dataset,
    output_of,
    run_trainer,
    trainer_args,
)


class CountedBlocks:
    """Stand-in blocks: len() only (the plan's order never reads them)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def mixture_plan(sizes: list[int], weights: list[float], world: int, rank: int, global_batch: int = 8) -> DataPlan:
    parts = [CountedBlocks(n) for n in sizes]
    blocks = MixedBlocks(parts, [f"d{i}" for i in range(len(sizes))])
    total = sum(weights)
    mixture = Mixture(blocks.names, sizes, [w / total for w in weights])
    return DataPlan(blocks, 3, global_batch, global_batch // world // 2, world, rank, mixture)


@pytest.mark.parametrize(("sizes", "weights"), [([900, 150], [0.7, 0.3]), ([60, 400, 90], [0.2, 0.5, 0.3])])
def test_shares_over_1000_samples_are_within_2_percent_of_the_weights(sizes, weights):
    plan = mixture_plan(sizes, weights, 1, 0)
    drawn: list[int] = []
    epoch = 0
    while len(drawn) < 1000:
        order = plan.epoch_order(epoch)
        drawn += [i for step in range(plan.steps_per_epoch) for i in plan.step_blocks(order, step)]
        epoch += 1
    shares = np.array(plan.mixture.sources(drawn[:1000])) / 1000
    assert np.all(np.abs(shares - np.array(weights) / sum(weights)) <= 0.02), shares
    # every global batch too, within one block: the interleave keeps every prefix in proportion
    order = plan.epoch_order(0)
    for step in range(plan.steps_per_epoch):
        counts = np.array(plan.mixture.sources(plan.step_blocks(order, step)))
        assert np.all(np.abs(counts - 8 * np.array(weights) / sum(weights)) < 1.5), (step, counts)


def test_the_plan_is_the_same_at_one_and_two_processes():
    """The union of the ranks' micro-batch slots is the global batch, whatever the process count."""
    sizes, weights = [300, 70], [0.6, 0.4]
    one = mixture_plan(sizes, weights, 1, 0)
    two = [mixture_plan(sizes, weights, 2, rank) for rank in (0, 1)]
    for epoch in (0, 1):
        assert (
            one.epoch_order(epoch).tolist() == two[0].epoch_order(epoch).tolist() == two[1].epoch_order(epoch).tolist()
        )
    assert one.steps_per_epoch == two[0].steps_per_epoch


def test_an_epoch_draws_the_heaviest_dataset_once_and_repeats_the_small_ones_evenly():
    plan = mixture_plan([400, 50, 1000], [0.5, 0.3, 0.2], 1, 0)
    mixture, offsets = plan.mixture, plan.mixture.offsets
    assert mixture.counts == [400, 240, 160] and plan.epoch_blocks == 800
    order = np.concatenate([plan.epoch_order(e).numpy() for e in range(5)])
    heaviest = order[(order >= offsets[0]) & (order < offsets[1])]
    for e in range(5):  # dataset 0: each epoch a permutation of its 400 blocks
        assert sorted(heaviest[e * 400 : (e + 1) * 400].tolist()) == list(range(400))
    small = np.bincount(order[(order >= offsets[1]) & (order < offsets[2])] - offsets[1], minlength=50)
    assert small.min() == small.max() == 5 * 240 // 50  # 24 passes over 50 blocks in five epochs
    large = np.bincount(order[order >= offsets[2]] - offsets[2], minlength=1000)
    assert set(large.tolist()) == {0, 1} and large.sum() == 800  # 160 per epoch: none twice before all once
    assert plan.epoch_order(2).tolist() == mixture_plan([400, 50, 1000], [0.5, 0.3, 0.2], 1, 0).epoch_order(2).tolist()


def test_default_weights_are_the_sizes_so_an_epoch_is_each_dataset_once():
    mixture = Mixture(["a", "b"], [300, 100], [0.75, 0.25])
    assert mixture.counts == [300, 100]
    assert short_names(["data/x", "other/x", "hub/org/y"]) == ["x_0", "x_1", "y"]


def test_a_weight_that_rounds_to_no_block_is_refused_and_a_tie_says_which_dataset_sets_the_epoch(tmp_path, capsys):
    """--data-weights 1,0.001 gave the second dataset '0 blocks per epoch (0.00 passes)': never trained, without a
    word, although every weight had to be positive. Refused (warned on a resume of a run that began so). Of equal
    weights the first listed sets the epoch (sizes 40 and 4000 at 1,1: an 80-block epoch, 1% of the large one;
    listed the other way round, 8000 blocks): said, with the fix."""
    from fsdp_lib.data.plan import check_mixture_counts
    from fsdp_lib.errors import TrainError

    cfg = TrainConfig(experiment_name="mix", save_dir=str(tmp_path), data_weights="1,0.001")
    with pytest.raises(TrainError, match=r"--data-weights 1,0.001: big get\(s\) none of an epoch's 306 blocks"):
        check_mixture_counts(cfg, Mixture(["small", "big"], [306, 832], [1 / 1.001, 0.001 / 1.001]))
    (tmp_path / "mix" / "checkpoint" / "step_00000004").mkdir(parents=True)  # a run that began so: warned
    check_mixture_counts(cfg, Mixture(["small", "big"], [306, 832], [1 / 1.001, 0.001 / 1.001]))
    assert "WARNING: --data-weights 1,0.001: big get(s) none" in capsys.readouterr().out
    cfg.data_weights = "1,1"
    check_mixture_counts(cfg, Mixture(["small", "big"], [40, 4000], [0.5, 0.5]))
    said = capsys.readouterr().out
    assert "of the datasets of the highest weight, small (listed first) sets the epoch" in said, said
    assert "big 0.01 times" in said
    check_mixture_counts(cfg, Mixture(["a", "b"], [40, 40], [0.5, 0.5]))  # the same size: no matter which
    assert "sets the epoch" not in capsys.readouterr().out


def test_mixture_flags_are_checked_before_training(tmp_path):
    one, two = make_dataset(tmp_path / "one", n_docs=20), make_dataset(tmp_path / "two", n_docs=20)
    base = ["-e", "x", "-m", str(tmp_path), "-d", str(one), "-d", str(two)]

    def problems(*flags: str) -> str:
        return "\n".join(p for p in validate_config(load_config([*base, *flags]), 1) if "model" not in p)

    assert problems() == "" and problems("--data-weights", "0.7,0.3") == ""
    assert "2 numbers" in problems("--data-weights", "0.7")
    assert "positive" in problems("--data-weights", "1,-1")
    assert "give -d once" in problems("--objective", "dpo")
    assert "give -d once" in problems("--data-slice", "0:5")
    single = validate_config(load_config(["-e", "x", "-m", str(tmp_path), "-d", str(one), "--data-weights", "1"]), 1)
    assert any("needs two or more datasets" in p for p in single)
    config = tmp_path / "mix.yaml"
    config.write_text(f"dataset-name: [{one}, {two}]\ndata-weights: '3,1'\n")
    assert load_config(["--config", str(config)]).dataset_name == [str(one), str(two)]
    assert TrainConfig(dataset_name=str(one)).dataset_name == [str(one)]


# --- a real mixture: text + conversations, kill -9, resume on another process count ------------------------------

MIX_STEPS = 10


@pytest.fixture(scope="module")
def mix_inputs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mix")
    return {
        "text": make_dataset(root / "text", n_docs=120),
        "chat": make_chat_dataset(root / "chat", n=60),
        "model": make_chat_model(root / "model", "llama3"),
    }


def mix_flags(inputs: dict[str, Path], save: Path, nproc: int = 2) -> list[str]:
    args = trainer_args("mix", inputs["text"], inputs["model"], save) + ["-d", str(inputs["chat"])]
    args += ["--data-weights", "0.6,0.4", "-b", "2", "--grad-accum-steps", str(2 // nproc), "--eval-freq", "5"]
    args += ["--max-steps", str(MIX_STEPS), "--ckpt-freq", "4", "--lr-schedule", "constant"]
    args[args.index("--warmup-steps") + 1] = "0"
    return args


def test_a_mixture_says_which_datasets_its_validation_loss_covers(mix_inputs, tmp_path):
    """A saved train/test DatasetDict's test split was ignored in a folder (a hub dataset's was used), and val_loss
    of a mixture whose other member has no validation split read as the whole mixture's, without a word."""
    import datasets

    text = [f"{a} plus {b} is {a + b}. " * 4 for a in range(10) for b in range(10)]
    parts = {
        "train": datasets.Dataset.from_dict({"text": text[:80]}),
        "test": datasets.Dataset.from_dict({"text": text[80:]}),
    }
    datasets.DatasetDict(parts).save_to_disk(str(tmp_path / "with_test"))
    datasets.Dataset.from_dict({"text": text}).save_to_disk(str(tmp_path / "no_val"))
    args = trainer_args("mixv", tmp_path / "with_test", mix_inputs["model"], tmp_path) + [
        "-d",
        str(tmp_path / "no_val"),
    ]
    result = run_trainer([*args, "--max-steps", "1"], nproc=1)
    said = output_of(result)
    assert result.returncode == 0, said
    assert "no_val: " in said and ", no validation" in said and "validation blocks" in said, said
    assert "note: the validation loss covers with_test only: no_val has no validation data" in said, said
    rows = [json.loads(line) for line in (tmp_path / "mixv" / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss/with_test" in r for r in rows) and not any("val_loss/no_val" in r for r in rows)


def test_mixture_run_reports_per_dataset_and_resumes_after_kill9_on_another_process_count(mix_inputs, tmp_path):
    reference = run_trainer(mix_flags(mix_inputs, tmp_path / "ref"))
    out = output_of(reference)
    assert reference.returncode == 0, out
    assert "mixture of 2 datasets" in out and "weight 0.600" in out and "SFT on conversations" in out
    rows = [json.loads(line) for line in (tmp_path / "ref" / "mix" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    assert sum(r["samples/text"] for r in train) + sum(r["samples/chat"] for r in train) == 4 * MIX_STEPS
    assert sum(r["samples/text"] for r in train) == pytest.approx(0.6 * 4 * MIX_STEPS, abs=2)
    val = [r for r in rows if "val_loss" in r]
    assert val and all({"val_loss/text", "val_loss/chat", "val_tokens/text"} <= r.keys() for r in val)
    expected = losses_by_step(tmp_path / "ref" / "mix")

    args = mix_flags(mix_inputs, tmp_path / "run")
    killed_at_step(args, tmp_path / "run" / "mix", 6, delay_s="0.25", timeout=180)
    resumed = run_trainer(mix_flags(mix_inputs, tmp_path / "run", nproc=1), nproc=1)
    assert resumed.returncode == 0, output_of(resumed)
    assert "at step 4" in output_of(resumed) and "world size changed (2 -> 1)" in output_of(resumed)
    got = losses_by_step(tmp_path / "run" / "mix")
    for step in range(5, MIX_STEPS + 1):  # the same blocks in the same order: equal up to the reduction order
        assert got[step] == pytest.approx(expected[step], abs=1e-5), step


def test_a_mixture_names_its_prompts_or_pairs_dataset_in_any_order(tmp_path):
    """Text first and GRPO's flags given: the text dataset was blamed ('--num-generations ... apply to --objective
    grpo, on prompts only; --dataset-name text has the columns [text]'); the prompts first: 'train alone'. Both
    orders now name the dataset that cannot be mixed."""
    import datasets

    from fsdp_lib.data.objective import check_mixture_kinds
    from fsdp_lib.errors import TrainError

    text = make_dataset(tmp_path / "text", n_docs=20)
    prompts = tmp_path / "prompts"
    rows = datasets.Dataset.from_dict({"prompt": ["1 + 1?", "2 + 2?"], "answer": ["2", "4"]})
    datasets.DatasetDict({"train": rows}).save_to_disk(str(prompts))
    for order in ([text, prompts], [prompts, text]):
        cfg = load_config(["-e", "x", "-m", str(tmp_path), *(f for d in order for f in ("-d", str(d)))])
        with pytest.raises(
            TrainError, match=f"--dataset-name {prompts} holds prompts, which train alone; give -d once"
        ):
            check_mixture_kinds(cfg)
    check_mixture_kinds(load_config(["-e", "x", "-m", str(tmp_path), "-d", str(text), "-d", str(prompts / "..")]))


def test_a_text_column_missing_from_a_dataset_that_has_text_says_how_to_mix_them():
    """-d A -d B --text-column body, A's text in 'text' and B's in 'body': 'A has no column body' led nowhere,
    the flag naming the column of every dataset. The message says so and how to give both one name."""
    from datasets import Dataset

    from fsdp_lib.records.dataset import use_as_text

    with pytest.raises(ValueError) as err:
        use_as_text(Dataset.from_dict({"text": ["a b c"]}), "body", "train", "text_set")
    said = str(err.value)
    assert said.startswith("--text-column body: text_set has no column 'body' in its train split (columns: ['text'])")
    assert "Dataset.rename_column('body', 'text')" in said and "leave --text-column out" in said
