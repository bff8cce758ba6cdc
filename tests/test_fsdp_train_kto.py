"""--objective kto: the loss is the paper's formula (TRL's form, written here in float64); examples come from
unpaired records (strings or messages, TRL's shape) and from pairs (unpaired), each with a KL sequence of its own
prompt and another example's completion; the trainer's loss and every gradient equal the formula on the unsharded
model, with z measured over the whole global batch; KTO teaches a fact on held-out examples, and a kill -9 rerun on
another process count continues the run; bad flags and data are refused naming the flag."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fsdp_lib.data.chat import ChatEncoder
from fsdp_lib.data.preference import DESIRABLE, UNDESIRABLE, PairEncoder
from fsdp_lib.data.unpaired import ExampleEncoder, as_label
from fsdp_lib.train.kto import kto_losses
from tests.fsdp_helpers import (
    FACT_PROMPTS,
    REPO_ROOT,
    WRONG_CAPITALS,
    assert_loss_and_grads_match,
    killed_at_step,
    losses_by_step,
    make_chat_model,
    make_preference_dataset,
    output_of,
    run_trainer,
    trainer_args,
)

WORKERS = REPO_ROOT / "tests" / "workers"
KTO_FLAGS = ["--objective", "kto", "--seq-length", "128", "--precision", "fp32", "--log-freq", "1",
             "--lr-schedule", "constant"]  # fmt: skip


def reference_kto(policy, reference, desirable, kl_policy, kl_reference, beta, w_d, w_u):
    """KTO as TRL's KTOTrainer.kto_loss computes it, in plain float64: z = max(0, mean KL log-ratio), then
    1 - sigmoid(beta (r - z)) for a desirable example, 1 - sigmoid(beta (z - r)) for an undesirable one."""
    z = max(0.0, float((kl_policy - kl_reference).mean()))
    sig = lambda x: 1.0 / (1.0 + torch.exp(-x))  # noqa: E731
    r = policy - reference
    losses = torch.where(desirable, w_d * (1 - sig(beta * (r - z))), w_u * (1 - sig(beta * (z - r))))
    return losses, z


def test_kto_losses_are_the_papers_formula():
    g = torch.Generator().manual_seed(0)
    pol, ref, kl_pol, kl_ref = (torch.randn(64, generator=g, dtype=torch.float64) * 5 for _ in range(4))
    desirable = torch.rand(64, generator=g) > 0.4
    expected, z = reference_kto(pol, ref, desirable, kl_pol, kl_ref, 0.3, 1.5, 0.7)
    losses, rewards = kto_losses(pol, ref, desirable, torch.tensor(z, dtype=torch.float64), 0.3, 1.5, 0.7)
    torch.testing.assert_close(losses, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rewards, 0.3 * (pol - ref))
    # policy == reference and z = 0: every loss is its weight / 2
    same, _ = kto_losses(pol, pol, desirable, torch.zeros((), dtype=torch.float64), 0.3, 1.5, 0.7)
    torch.testing.assert_close(same, torch.where(desirable, 0.75, 0.35).double())


def test_figures_of_a_kind_without_examples_are_left_out():
    """A window of desirable examples only has no rejected figures (a mean of none was logged as 0, a log-prob of
    0 that reads as certainty) and no margin."""
    from fsdp_lib.train.kto import KTO_STATS, kto_figures

    sums = dict.fromkeys(KTO_STATS, 0.0) | {"examples": 4, "desirable": 4, "rewards/chosen": 2.0, "logps/chosen": -8.0}
    figures = kto_figures(torch.tensor([sums[k] for k in KTO_STATS], dtype=torch.float64))
    assert figures["rewards/chosen"] == 0.5 and figures["logps/chosen"] == -2.0
    assert not {"rewards/rejected", "logps/rejected", "rewards/margins"} & set(figures)
    both = sums | {"desirable": 3, "rewards/rejected": -1.0, "logps/rejected": -3.0}
    figures = kto_figures(torch.tensor([both[k] for k in KTO_STATS], dtype=torch.float64))
    assert figures["rewards/margins"] == pytest.approx(2.0 / 3 + 1.0) and figures["logps/rejected"] == -3.0


def test_labels_are_booleans_only():
    assert [as_label(v) for v in (True, False, 1, 0, "true", " False ", "1")] == [True, False, True, False, True,
                                                                                   False, True]  # fmt: skip
    assert [as_label(v) for v in (None, 2, "yes", 0.5, [True])] == [None] * 5


@pytest.fixture(scope="module")
def kto_inputs(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("kto")
    model = make_chat_model(root / "model", with_weights=True)
    return model, make_preference_dataset(root / "pairs", n=48, n_validation=8), root


def test_examples_unpair_pairs_and_borrow_another_prompts_completion(kto_inputs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(kto_inputs[0])
    encoder = ExampleEncoder(PairEncoder(ChatEncoder(tokenizer, "assistant"), 128))
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    bot = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    pairs = {"prompt": [user("2+2?"), user("3+3?")], "chosen": [bot("4"), bot("6")], "rejected": [bot("5"), bot("7")]}
    skipped, first = {}, {}
    out = encoder.encode(pairs, skipped, first, 0)
    assert len(out) == 4 and not skipped  # chosen (desirable) and rejected (undesirable) of each pair
    values = [int(mask.max()) for ids, mask, _, _ in out]
    assert values == [DESIRABLE, UNDESIRABLE, DESIRABLE, UNDESIRABLE]
    decode = lambda ids, mask: tokenizer.decode(ids[mask != 0])  # noqa: E731
    for k, (ids, mask, kl_ids, kl_mask) in enumerate(out):
        start = int(np.argmax(mask != 0))
        assert np.array_equal(kl_ids[:start], ids[:start]) and len(kl_ids) <= len(ids)  # its own prompt
        own, borrowed = decode(ids, mask), decode(kl_ids, kl_mask)
        assert own.strip().startswith(("4", "5", "6", "7")) and borrowed != own
        # the completion of the next example with another prompt: 4 -> 6 (5 shares its prompt), 5 -> 6, 6 -> 4, 7 -> 4
        assert borrowed.strip()[0] == "6644"[k]
    # TRL's unpaired shape, strings or messages; a label that is not a boolean is a counted skip
    unpaired = {"prompt": ["2+2?", user("3+3?"), "4+4?"], "completion": ["4", bot("7"), "8"],
                "label": [True, "false", "maybe"]}  # fmt: skip
    skipped, first = {}, {}
    out = encoder.encode(unpaired, skipped, first, 10)
    assert [int(mask.max()) for _, mask, _, _ in out] == [DESIRABLE, UNDESIRABLE]
    assert skipped == {"the label is not true or false (nor 1/0)": 1} and list(first.values()) == [12]
    # a pair whose chosen is its rejected (DPO skips it) would train one text as desirable and undesirable; responses
    # that repeat the prompt first (UltraFeedback) are read without it, as DPO reads them
    same = {"prompt": ["2+2?", "3+3?"], "chosen": [bot("4"), user("3+3?") + bot("6")], "rejected": [" 4 ", bot("7")]}
    skipped, first = {}, {}
    out = encoder.encode(same, skipped, first, 0)
    assert list(skipped.values()) == [1] and "chosen and rejected are the same" in next(iter(skipped))
    assert [int(mask.max()) for _, mask, _, _ in out] == [DESIRABLE, UNDESIRABLE]
    assert tokenizer.decode(out[0][0]).count("3+3?") == 1


def test_skips_are_counted_in_examples_two_per_pair(kto_inputs, tmp_path):
    """A paired dataset unpairs into two examples per pair: the skip report counts examples of examples (it said
    240 of 120, 200%, when every example was too long for the block)."""
    import datasets
    from transformers import AutoTokenizer

    from fsdp_lib.data.cache import stream_paths
    from fsdp_lib.data.preference import tokenize_pairs_to_file

    tokenizer = AutoTokenizer.from_pretrained(kto_inputs[0])
    encoder = ExampleEncoder(PairEncoder(ChatEncoder(tokenizer, "assistant"), 24))
    pairs = datasets.load_from_disk(str(kto_inputs[1]))["train"].select(range(6))
    paths = stream_paths(tmp_path / "train.tokens")
    kept = tokenize_pairs_to_file(pairs, encoder, paths, np.dtype(np.uint16))
    skips = json.loads(paths["skips"].read_text())
    assert skips["conversations"] == 12 == kept + sum(skips["skipped"].values()), skips
    assert sum(skips["skipped"].values()) > 0 and skips["unit"] == "examples"


@pytest.mark.slow
def test_loss_and_gradients_equal_the_formula_on_the_unsharded_model(kto_inputs, tmp_path):
    """The worker runs the trainer's first step (2 processes, its data plan, packing, stored reference shifted by
    known offsets, KTOObjective with z over the global batch) and writes the loss and full gradients; here the same
    examples and KL sequences go one by one, unpacked, through from_pretrained and TRL's formula, in float64."""
    from transformers import AutoModelForCausalLM

    model_dir, data, root = kto_inputs
    out = tmp_path / "grads.pt"
    args = [*trainer_args("grads", data, model_dir, root / "out"), *KTO_FLAGS, "-b", "3", "--dpo-beta", "0.5",
            "--kto-desirable-weight", "1.5", "--kto-undesirable-weight", "0.8"]  # fmt: skip
    proc = run_trainer(args, script=WORKERS / "dpo_grads.py", env={"DPO_GRADS_OUT": str(out)})
    assert proc.returncode == 0, output_of(proc)
    got = torch.load(out)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, use_cache=False)
    logps = []
    for ids, mask in got["sequences"]:
        ids, mask = torch.tensor(ids), (torch.tensor(mask) != 0).double()
        logits = model(input_ids=ids[None]).logits[0, :-1]
        logps.append((torch.log_softmax(logits, -1).gather(1, ids[1:, None]).squeeze(1) * mask[1:]).sum())
    logps, ref = torch.stack(logps), torch.tensor(got["reference"], dtype=torch.float64)
    desirable = torch.tensor(got["desirable"])
    assert 0 < int(desirable.sum()) < len(desirable)  # both kinds in the step
    losses, z = reference_kto(logps[0::2], ref[0::2], desirable, logps[1::2], ref[1::2], 0.5, 1.5, 0.8)
    # the shifted reference makes the KL estimate positive; the trainer's is a mean of fp32 log-prob differences
    # of sums near -100, exact to ~1e-6 absolute (4e-6 relative was seen): 2e-5 relative, far below a wrong z's
    assert z > 0 and abs(got["kl"] - z) <= 2e-5 * z, (got["kl"], z)
    assert_loss_and_grads_match(got, losses.mean(), model)


def fact_examples(held_out: bool) -> list[dict]:
    """Unpaired examples that teach a fact (TRL's shape): "It is Vesk." desirable, other cities undesirable, more of
    them than desirable ones (the examples are not pairs). Train: strings; held out: messages, another phrasing and
    cities no training example used."""
    prompts = FACT_PROMPTS[3:] if held_out else FACT_PROMPTS[:3]
    wrongs = WRONG_CAPITALS[5:] if held_out else WRONG_CAPITALS[:5]
    rows = [(p, "It is Vesk.", True) for p in prompts for _ in range(3 if held_out else 4)]
    rows += [(p, f"It is {w}.", False) for p in prompts for w in wrongs]
    rows.sort(key=lambda r: math.sin(len(r[0]) * 7 + len(r[1]) * 3 + hash(r[2]) % 5))  # mixed, deterministic
    if held_out:
        return [{"prompt": [{"role": "user", "content": p}], "completion": [{"role": "assistant", "content": c}],
                 "label": label} for p, c, label in rows]  # fmt: skip
    return [{"prompt": p, "completion": c, "label": label} for p, c, label in rows]


def save_unpaired(path: Path) -> Path:
    import datasets

    columns = lambda rows: {k: [r[k] for r in rows] for k in ("prompt", "completion", "label")}  # noqa: E731
    splits = {name: datasets.Dataset.from_dict(columns(fact_examples(held_out)))
              for name, held_out in (("train", False), ("validation", True))}  # fmt: skip
    datasets.DatasetDict(splits).save_to_disk(str(path))
    return path


FACT_RUN = ["--lr", "3e-3", "-b", "1", "--num-epochs", "3", "--max-steps", "16", "--eval-freq", "8", "--ckpt-freq", "5"]


@pytest.fixture(scope="module")
def fact_run(kto_inputs) -> tuple[list[str], Path, str]:
    """An uninterrupted 2-process KTO run on unpaired examples (--objective auto finds kto): the baseline."""
    model_dir, _, root = kto_inputs
    data = save_unpaired(root / "facts_data")
    args = [*trainer_args("facts", data, model_dir, root / "fact_runs"), *KTO_FLAGS[2:], *FACT_RUN]
    proc = run_trainer(args)
    assert proc.returncode == 0, output_of(proc)
    return args, root / "fact_runs" / "facts", output_of(proc)


@pytest.mark.slow
def test_kto_learns_a_fact_on_held_out_unpaired_examples(fact_run):
    _, exp, log = fact_run
    assert "--objective kto (auto: the dataset has prompt, completion and label columns)" in log
    assert "reference: precomputed once by the starting model for every example and KL sequence" in log
    rows = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in rows if "val_rewards/accuracies" in r]
    first, last = evaluations[0], evaluations[-1]
    assert first["step"] == 0 and first["val_rewards/accuracies"] == 0.5 and first["val_loss"] == pytest.approx(0.5)
    assert last["step"] == 16 and last["val_rewards/accuracies"] >= 0.9, evaluations
    assert last["val_rewards/margins"] > 0 and last["val_loss"] < 0.5
    assert any(r.get("kl", 0) > 0 for r in rows) and all(r.get("kl", 0) >= 0 for r in rows)


@pytest.mark.slow
def test_kill9_rerun_on_one_process_continues_the_run(fact_run, tmp_path):
    """z is taken over the global batch, so the rerun on 1 process x accumulation 2 continues the 2-process run;
    the killed run split each sequence over its 2 processes (--context-parallel 2). Both take their reference from a
    live frozen copy (computed in the z pass and kept for the step's loss), which gives the precomputed baseline's
    losses."""
    args, baseline, _ = fact_run
    args = [*args, "--reference", "live"]
    args[args.index("--save-dir") + 1] = str(tmp_path)
    first = killed_at_step([*args, "--context-parallel", "2", "--grad-accum-steps", "2"], tmp_path / "facts", 7)
    assert "each sequence split over 2 processes" in first
    rerun = run_trainer([*args, "--grad-accum-steps", "2"], nproc=1)
    log = output_of(rerun)
    assert rerun.returncode == 0, log
    assert "at step 5" in log and "world size changed (2 -> 1)" in log
    assert "reference: a frozen FSDP-sharded copy" in log and "computed by the starting model" not in log
    expected, got = losses_by_step(baseline), losses_by_step(tmp_path / "facts")
    for step in range(1, 17):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step
    # the live reference is read from -m again by every resume: other weights there would be another reference
    model = Path(args[args.index("-m") + 1])
    changed = tmp_path / "model_retrained"
    shutil.copytree(model, changed)
    for path in changed.glob("*.safetensors"):
        weights = load_file(path)
        save_file({k: v * 1.01 for k, v in weights.items()}, path, metadata={"format": "pt"})
    args[args.index("-m") + 1] = str(changed)
    refused = run_trainer([*args, "--grad-accum-steps", "2", "--max-steps", "20"], nproc=1)
    assert refused.returncode != 0 and "the frozen reference's weights (--model-name's files" in output_of(refused)


@pytest.mark.slow
def test_bad_kto_flags_and_data_are_refused(kto_inputs, tmp_path, capsys):
    import fsdp_train

    model_dir, pairs, root = kto_inputs
    base = [*trainer_args("bad", pairs, model_dir, tmp_path), *KTO_FLAGS[2:]]
    for extra, message in [
        (["--objective", "kto", "--kto-desirable-weight", "-1"], "--kto-desirable-weight must be a number >= 0"),
        (["--objective", "kto", "--kto-desirable-weight", "0", "--kto-undesirable-weight", "0"], "both 0"),
        (["--objective", "kto", "--dpo-loss", "ipo"], "--dpo-loss applies to --objective dpo"),
        (["--objective", "dpo", "--kto-undesirable-weight", "2"], "--kto-undesirable-weight needs --objective kto"),
    ]:
        assert fsdp_train.main([*base, *extra]) == 2  # before any process group
        assert message in capsys.readouterr().out, extra
        assert not (tmp_path / "bad").exists()


def test_the_dataset_decides_and_a_wrong_objective_is_refused():
    from fsdp_lib.config import TrainConfig
    from fsdp_lib.data.objective import resolve_objective
    from fsdp_lib.errors import TrainError

    unpaired, pairs = ["prompt", "completion", "label"], ["prompt", "chosen", "rejected"]
    assert resolve_objective(TrainConfig(objective="auto"), unpaired, "u") == "kto"
    assert resolve_objective(TrainConfig(objective="kto"), pairs, "p") == "kto"  # pairs, unpaired
    for objective, columns, message, extra in [
        ("lm", unpaired, "train them with --objective kto", {}),
        ("lm", ["prompt", "answer"], "holds prompts only .* train them with --objective grpo and --reward", {}),
        ("dpo", unpaired, "train them with --objective kto", {}),
        ("kto", ["text"], "it needs prompt, completion and label", {}),
        # auto choosing kto: another objective's flags are refused, not ignored (simpo would have no reference)
        ("auto", unpaired, "--dpo-loss does not apply to --objective kto", {"dpo_loss": "simpo"}),
        ("auto", unpaired, "--num-iterations does not apply to --objective kto", {"num_iterations": 2}),
        ("auto", unpaired, "--num-generations, --reward do not apply", {"reward": ["accuracy"], "num_generations": 4}),
        ("auto", unpaired, "needs --document-masking on", {"document_masking": "off"}),
        ("auto", pairs, "--kto-desirable-weight applies to --objective kto", {"kto_desirable_weight": 2.0}),
        # GRPO flags on pairs: named as such, not range-checked as if this were GRPO (--max-new-tokens 256 was
        # said not to fit --seq-length 128 on a DPO run)
        ("auto", pairs, "--reward applies to --objective grpo, on prompts only", {"reward": ["a"], "seq_length": 128}),
        # auto choosing grpo: what an explicit --objective grpo refuses before any process group (checks.py)
        (
            "auto",
            ["prompt", "answer"],
            "--dpo-beta applies to --objective dpo; .* drop them",
            {"reward": ["accuracy"], "dpo_beta": 0.5},
        ),
        (
            "auto",
            ["prompt", "answer"],
            "--fp8 emulate: .* generation through float8 layers is not built",
            {"reward": ["accuracy"], "fp8": "emulate"},
        ),
        # and its ranges, checked once the dataset has made auto grpo (not before, when it might not be)
        ("auto", ["prompt", "answer"], "--max-new-tokens 256 leaves no room", {"reward": ["a"], "seq_length": 128}),
        ("auto", ["prompt", "answer"], "--num-generations must be at least 2", {"reward": ["a"], "num_generations": 1}),
    ]:
        with pytest.raises(TrainError, match=message):
            resolve_objective(TrainConfig(objective=objective, **extra), columns, "d")
    # the same conflicts (config.grpo_conflicts) for an explicit --objective grpo, before any process group
    from fsdp_lib.checks import validate_config

    explicit = TrainConfig(objective="grpo", reward=["accuracy"], dpo_beta=0.5, fp8="emulate", loss_on="all")
    problems = validate_config(explicit, 1)
    assert "--dpo-beta applies to --objective dpo; this run is --objective grpo: drop them" in problems, problems
    assert any(
        p.startswith("--loss-on all: this run is --objective grpo, whose loss is on the sampled") for p in problems
    )
    assert any(p.startswith("--fp8 emulate: this run is --objective grpo, and generation through") for p in problems)
    deferred = validate_config(TrainConfig(objective="auto", reward=["a"], seq_length=128), 1)  # the data decides
    assert not any("--max-new-tokens" in p for p in deferred), deferred


def test_a_text_column_of_conversations_is_refused_by_name():
    import datasets

    from fsdp_lib.records.dataset import use_as_text

    split = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "2+2?"}]], "answer": ["4"]})
    with pytest.raises(
        ValueError,
        match=r"--text-column prompt: the column 'prompt' of d's train split holds lists \(conversations\?\)",
    ):
        use_as_text(split, "prompt", "train", "d")
    assert use_as_text(split, "answer", "train", "d")["text"] == ["4"]
