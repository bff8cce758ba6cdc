"""--objective grpo: sampling streams keyed by (seed, epoch, prompt, completion, token), inverse-CDF sampling with
top-p, the advantages and the clipped token loss against their formulas, the built-in rewards and every way a reward
file or function can be wrong; then real runs on CPU (2 processes, gloo): one step's loss and every parameter's
gradient against a float64 implementation written here, for each --grpo-loss; a model that answers right about half
of the time learns to answer right nearly always; a kill -9 and rerun (also on one process) gives the same completions
and losses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import data_hf
from fsdp_lib.train.grpo import STD_EPS, Share, context_rows, group_advantages, token_losses
from fsdp_lib.train.rewards import (
    RewardError,
    RewardFunction,
    accuracy_reward,
    column_problems,
    final_answer,
    format_reward,
    load_reward,
    load_rewards,
    reward_problems,
    score,
)
from fsdp_lib.train.rollout import Completions, sample_tokens, sampling_uniforms
from tests.fsdp_helpers import (
    BASE_FLAGS,
    io_args,
    killed_at_step,
    make_chat_model,
    make_model,
    output_of,
    read_metrics,
    run_trainer,
)
from tests.workers.grpo_grads import perturbation

WORKERS = Path(__file__).parent / "workers"
PROMPT = "3 plus 4 is "
REWARDS = """
import os

def distinct(prompts, completions, answer, **columns):
    assert len(answer) == len(completions) and all(a.isdigit() for a in answer)  # the dataset's column, per completion
    return [float(len(set(c))) for c in completions]

def chat(prompts, completions, answer, **columns):
    assert isinstance(prompts[0], list) and prompts[0][-1]["role"] == "user", prompts[0]
    assert isinstance(completions[0], list) and completions[0][0]["role"] == "assistant", completions[0]
    return [float(len(c[0]["content"]) % 3) for c in completions]

def tally(prompts, completions, **columns):  # which rank scored how many completions
    with open(os.environ["GRPO_TALLY"], "a") as f:
        f.write(f"{os.environ['RANK']} {len(completions)}\\n")
    return [0.0 for c in completions]

def fails_on_rank_1(prompts, completions, **columns):
    if os.environ.get("RANK") == "1":
        raise KeyError("solution")
    return [0.0 for c in completions]

def hangs_on_rank_1(prompts, completions, **columns):
    if os.environ.get("RANK") == "1":
        import time
        time.sleep(3600)
    return [0.0 for c in completions]
"""


# -- sampling -----------------------------------------------------------------------------------------------------


def test_sampling_streams_are_keyed_by_prompt_and_completion_not_by_batch():
    prompts, gens = np.array([5, 5, 9, 2]), np.array([0, 1, 0, 3])
    u = sampling_uniforms(7, 1, prompts, gens, 16)
    assert u.shape == (4, 16) and u.dtype == torch.float64 and float(u.min()) >= 0 and float(u.max()) < 1
    # the same key in another batch, at another row, draws the same numbers
    again = sampling_uniforms(7, 1, np.array([2, 5]), np.array([3, 1]), 16)
    assert torch.equal(again[0], u[3]) and torch.equal(again[1], u[1])
    # every part of the key matters
    for other in (sampling_uniforms(8, 1, prompts, gens, 16), sampling_uniforms(7, 2, prompts, gens, 16)):
        assert not torch.equal(other, u)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[:, 0], u[:, 1])
    many = sampling_uniforms(0, 0, np.arange(2000), np.zeros(2000, dtype=np.int64), 8).flatten()
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.var()) - 1 / 12) < 0.005


def test_inverse_cdf_sampling_follows_the_distribution_and_top_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(4000, 1)
    u = torch.rand(4000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    picked, entropy = sample_tokens(logits, u, 1.0, 1.0)
    freq = torch.bincount(picked, minlength=4).double() / 4000
    assert torch.allclose(freq, probs.double(), atol=0.03), freq
    assert torch.allclose(entropy, -(probs * probs.log()).sum().expand(4000), atol=1e-5)
    # top-p 0.7 keeps 0.5 and 0.3 (the mass before the third token, 0.8, is over 0.7), renormalised
    picked, _ = sample_tokens(logits, u, 1.0, 0.7)
    freq = torch.bincount(picked, minlength=4).double() / 4000
    assert freq[2] == 0 and freq[3] == 0 and abs(float(freq[0]) - 0.625) < 0.03
    # a low temperature is nearly greedy; u = 0 and u -> 1 stay in range
    picked, _ = sample_tokens(logits[:2], torch.tensor([0.0, 1 - 2**-53], dtype=torch.float64), 0.05, 1.0)
    assert picked.tolist()[0] == 0 and 0 <= picked.tolist()[1] < 4


def test_a_context_group_splits_the_completions_into_contiguous_shares_and_joins_them_in_rank_order():
    for rows, size in ((8, 2), (7, 3), (2, 4), (16, 1)):
        shares = [context_rows(rows, size, rank) for rank in range(size)]
        assert shares[0][0] == 0 and shares[-1][1] == rows and all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
        assert max(b - a for a, b in shares) - min(b - a for a, b in shares) <= 1
    assert context_rows(2, 4, 0) == (0, 0) and context_rows(2, 4, 1) == (0, 1)  # fewer rows than ranks: empty shares

    def share(tokens: list[list[int]], entropy: float, error: str | None = None) -> Share:
        done = Completions(tokens, [t[-1] == 9 for t in tokens], entropy, forwards=3, seconds=1.0)
        return Share(done, [str(t) for t in tokens], np.array([[float(len(t)) for t in tokens]]), error)

    shares = [share([[1, 9], [2]], 0.5), share([], 0.0), share([[3, 3, 9]], 0.25, "boom")]
    joined = Share.joined(shares, shares[1])
    assert joined.done.tokens == [[1, 9], [2], [3, 3, 9]] and joined.done.stopped == [True, False, True]
    assert joined.done.entropy_sum == 0.75 and joined.completions == ["[1, 9]", "[2]", "[3, 3, 9]"]
    assert joined.scores.tolist() == [[2.0, 1.0, 3.0]]
    # a reward function's failure stays with the rank whose share it failed on (the stop message names that rank)
    assert joined.error is None and Share.joined(shares, shares[2]).error == "boom"


# -- the objective's formulas, in float64 -------------------------------------------------------------------------


def test_group_advantages_are_normalised_within_each_prompts_group():
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    scaled = group_advantages(rewards, 4, scale=True)
    first = rewards[:4]
    assert np.allclose(scaled[:4], (first - first.mean()) / (first.std(ddof=1) + STD_EPS), atol=1e-12)
    assert np.allclose(scaled[4:], 0.0)  # a group of equal rewards teaches nothing
    assert np.allclose(group_advantages(rewards, 4, scale=False)[:4], first - 0.5)


def test_token_losses_clip_the_ratio_and_add_the_k3_kl():
    g = torch.Generator().manual_seed(0)
    logps = torch.randn(64, dtype=torch.float64, generator=g).requires_grad_()
    old = logps.detach() + 0.3 * torch.randn(64, dtype=torch.float64, generator=g)
    ref = logps.detach() + 0.5 * torch.randn(64, dtype=torch.float64, generator=g)
    adv = torch.randn(64, dtype=torch.float64, generator=g)
    losses, clipped, kl = token_losses(logps, old, adv, 0.2, 0.28, beta=0.04, reference=ref)
    ratio = torch.exp(logps - old)
    want = -torch.min(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
    want_kl = torch.exp(ref - logps) - (ref - logps) - 1
    assert torch.allclose(losses, want + 0.04 * want_kl, rtol=1e-12, atol=1e-12)
    assert torch.equal(clipped, ((ratio < 0.8) & (adv < 0)) | ((ratio > 1.28) & (adv > 0))) and clipped.any()
    losses.sum().backward()
    # a clipped token passes no gradient through the ratio (only the KL's)
    kl_grad = 0.04 * (1 - torch.exp(ref - logps.detach()))
    assert torch.allclose(logps.grad[clipped], kl_grad[clipped], atol=1e-12)
    assert torch.all(kl >= 0)


# -- rewards --------------------------------------------------------------------------------------------------------


def test_builtin_rewards_read_boxed_answers_last_numbers_and_the_format():
    assert final_answer("so it is \\boxed{\\frac{1}{2}} indeed") == "\\frac{1}{2}"
    assert final_answer("3 + 4 = 7, then 1,234.5 left") == "1234.5" and final_answer("none") is None
    completions = ["The answer is 7.", "\\boxed{7.0}", "8", [{"role": "assistant", "content": "so 7"}], "x"]
    got = accuracy_reward([""] * 5, completions, solution=["#### 7", "7", "7", "\\boxed{7}", None])
    assert got == [1.0, 1.0, 0.0, 1.0, None]
    assert accuracy_reward(["a"], ["7"]) == [None]  # no reference column: not applicable
    # references that are answers, not traces: fractions (a last number read 3/2 as 2), words and letters
    completions = ["2", "2", "\\boxed{3/2}", "Paris", "The answer is (B).", "\\boxed{B}", "so 1/2", "x = 0.5"]
    references = ["3/2", "\\frac{1}{2}", "3/2", "paris", "B", "B", "\\frac{1}{2}", "1/2"]
    assert accuracy_reward([""] * 8, completions, answer=references) == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    # a short reference that is a sentence with numbers is read by its last number, as before
    got = accuracy_reward([""] * 3, ["42", "5", "so 3/2"], answer=["The answer is 42.", "5 apples", "x = \\frac{3}{2}"])
    assert got == [1.0, 1.0, 1.0]
    # each row's own reference column (records of one set name it differently; None where a row has none)
    got = accuracy_reward([""] * 3, ["4", "4", "4"], answer=[None, "4", None], solution=["#### 4", None, None])
    assert got == [1.0, 1.0, None]
    fmt = format_reward(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*")
    assert fmt([], ["<think>a\nb</think> <answer>7</answer>", "<answer>7</answer>"]) == [1.0, 0.0]


def test_a_reward_file_is_imported_once_per_process_and_content(tmp_path):
    """The start-up check, the objective and two functions of one file share one import (its top level runs once);
    a file whose content changed is imported again."""
    log = tmp_path / "imports.txt"
    body = f"open({str(log)!r}, 'a').write('imported\\n')\ndef f(prompts, completions, **kw):\n    return [1.0] * len(completions)\n"
    path = tmp_path / "counted.py"
    path.write_text(body + "g = f\n")
    specs = [f"{path}:f", f"{path}:g"]
    assert reward_problems(specs, "", ".*") == []
    functions = load_rewards(specs, "", ".*")
    assert [r.label for r in functions] == ["f", "g"] and log.read_text() == "imported\n"
    path.write_text(body + "g = f  # edited\n")
    load_rewards(specs, "", ".*")
    assert log.read_text() == "imported\n" * 2


def test_reward_files_and_functions_that_are_wrong_are_named(tmp_path):
    good = tmp_path / "rewards.py"
    good.write_text(REWARDS)
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    assert reward_problems([f"{good}:distinct", "accuracy", "format"], "1,0.5,2", ".*") == []
    problems = reward_problems(
        [f"{tmp_path}/missing.py:f", f"{good}:nope", f"{broken}:f", "lengthy", f"{good}:"], "1,2", "("
    )
    assert len(problems) == 1 and "--reward-pattern '('" in problems[0]
    problems = reward_problems([f"{tmp_path}/missing.py:f", f"{good}:nope", f"{broken}:f", "lengthy"], "1,2", ".*")
    assert "--reward-weights 1,2: 2 weight(s) for 4 --reward function(s)" in problems[0]
    assert f"no file {tmp_path}/missing.py" in problems[1]
    assert "has no function 'nope' (it has: chat, distinct, fails_on_rank_1" in problems[2]
    assert "importing" in problems[3] and "ModuleNotFoundError" in problems[3]
    assert "expected FILE.py:FUNCTION" in problems[4] and "accuracy, format" in problems[4]
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(3)\n")  # was a silent exit 3 of the whole run
    (problem,) = reward_problems([f"{exits}:f"], "", ".*")
    assert f"importing {exits} failed (SystemExit: 3)" in problem
    (problem,) = reward_problems(["accuracy", "format", "accuracy"], "", ".*")
    assert problem.startswith("--reward accuracy is given 2 times; give each function once and weigh it with")

    def reward(spec: str, body: str):
        path = tmp_path / f"{spec}.py"
        path.write_text(body)
        return load_reward(f"{path}:f", 1.0, ".*")

    cases = {
        "raises": ("def f(prompts, completions, **kw):\n    raise ValueError('bad answer column')\n", "raised ValueError: bad answer column"),
        "short": ("def f(prompts, completions, **kw):\n    return [1.0]\n", "returned 1 value(s) for 2 completions"),
        "word": ("def f(prompts, completions, **kw):\n    return ['a', 1]\n", "returned 'a' for completion 0"),
        "digits": ("def f(prompts, completions, **kw):\n    return [1, '1']\n", "returned '1' for completion 1"),
        "scalar": ("def f(prompts, completions, **kw):\n    return 1.0\n", "returned float, not a list"),
        "nan": ("def f(prompts, completions, **kw):\n    return [float('nan'), 1]\n", "rewards must be finite"),
        "quits": ("import sys\ndef f(prompts, completions, **kw):\n    sys.exit('no')\n", "raised SystemExit: no"),
        "huge": ("def f(prompts, completions, **kw):\n    return [1e300, 1]\n", "at most 1e+12 in size"),  # overflowed
        "keyed": ("def f(prompts, completions, **kw):\n    return {0: 1.0, 1: 0.0}\n", "returned dict, not a list"),
    }  # fmt: skip
    for name, (body, message) in cases.items():
        with pytest.raises(RewardError, match="--reward .*" + name) as err:
            score([reward(name, body)], ["p", "p"], ["a", "b"], {})
        assert message in str(err.value), name
    nones = reward("nones", "def f(prompts, completions, **kw):\n    return [None, 2]\n")
    assert np.isnan(score([nones], ["p", "p"], ["a", "b"], {})[0, 0])


def test_a_reward_function_past_its_time_is_stopped_naming_it():
    """A function that hangs (a grader waiting on a test that never ends) held every rank until
    --collective-timeout-s (30 minutes), then died with no word of it; now it stops at --reward-timeout-s, also
    through the function's own `except Exception`, and a function within its time leaves the SIGALRM handler and
    the timer as they were."""
    import signal
    import time

    def hangs(prompts, completions, **kw):
        time.sleep(60)

    def swallows(prompts, completions, **kw):
        try:
            time.sleep(60)
        except Exception:  # noqa: BLE001 - a reward's usual guard: it must not hide the timeout
            return [0.0] * len(completions)

    def spins(prompts, completions, **kw):
        while True:
            pass

    def pooled(prompts, completions, **kw):  # a grader's thread pool, whose exit joins its hung workers
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(lambda c: time.sleep(4) or 1.0, completions))

    def quick(prompts, completions, **kw):
        return [1.0] * len(completions)

    mine = signal.signal(signal.SIGALRM, signal.SIG_IGN)
    try:
        for function in (hangs, swallows, spins, pooled):
            started = time.monotonic()
            with pytest.raises(RewardError) as err:
                score([RewardFunction(function.__name__, function, 1.0, "")], ["p"] * 3, ["a", "b", "c"], {}, 0.3)
            assert time.monotonic() - started < 3, function.__name__  # pooled: once more a second later
            assert str(err.value).startswith(
                f"--reward {function.__name__} did not return within --reward-timeout-s 0.3 (scoring 3 completions)"
            ), err.value
            assert "or raise --reward-timeout-s" in str(err.value)
        assert score([RewardFunction("quick", quick, 1.0, "")], ["p"], ["a"], {}, 5.0).tolist() == [[1.0]]
        assert signal.getsignal(signal.SIGALRM) is signal.SIG_IGN
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.signal(signal.SIGALRM, mine)
    # the default follows a lower --collective-timeout-s (a run with 300 was refused over a flag it never gave)
    from fsdp_lib.config import TrainConfig
    from fsdp_lib.objective_flags import grpo_range_problems, reward_timeout

    lower = TrainConfig(objective="grpo", reward=["accuracy"], collective_timeout_s=300)
    assert reward_timeout(lower) == 150 and not any("--reward-timeout-s" in p for p in grpo_range_problems(lower))
    assert reward_timeout(TrainConfig()) == 600 and reward_timeout(TrainConfig(reward_timeout_s=900)) == 900


def test_rewards_are_checked_against_the_prompts_columns_before_the_model_loads(tmp_path):
    """The accuracy built-in needs a reference column (without one it applied to nothing and the run trained on
    zero rewards in silence); a function must take every column as a keyword; an async function, a folder and a
    file importing a module beside it (as `python FILE.py` would)."""
    path = tmp_path / "mine.py"
    (tmp_path / "helper_beside_it.py").write_text("def value():\n    return 2.0\n")
    path.write_text(
        "from helper_beside_it import value\n"
        "def keywords(prompts, completions, **kw):\n    return [value()] * len(completions)\n"
        "def named(prompts, completions, answer):\n    return [1.0] * len(completions)\n"
        "def strict(prompts, completions):\n    return [1.0] * len(completions)\n"
        "async def waits(prompts, completions, **kw):\n    return []\n"
        "def renamed(x, y, **kw):\n    return [1.0] * len(y)\n"
        "def wants(prompts, completions, solution, **kw):\n    return [1.0] * len(completions)\n"
    )
    functions = load_rewards(["accuracy", f"{path}:keywords", f"{path}:named", f"{path}:strict"], "", ".*")
    assert column_problems(functions, ("answer",)) == [column_problems(functions[3:], ("answer",))[0]]
    assert "strict" in column_problems(functions[3:], ("answer",))[0]
    assert "end its parameters with **kwargs" in column_problems(functions[3:], ("answer",))[0]
    # with **kwargs already, the fix is the names (it advised adding the **kwargs the function had)
    (renamed,) = column_problems(load_rewards([f"{path}:renamed"], "", ".*"), ("answer",))
    assert "name its first two parameters prompts and completions" in renamed and "**kwargs, as" not in renamed
    (wants,) = column_problems(load_rewards([f"{path}:wants"], "", ".*"), ("answer",))
    assert "give solution a default, or name a column the prompts have" in wants
    assert score(functions[1:2], ["p"], ["c"], {"answer": ["7"]}).tolist() == [[2.0]]
    problems = column_problems(functions, ("result",))
    assert "--reward accuracy reads each prompt's reference answer from a column named answer or" in problems[0]
    assert "the train prompts have ['result']" in problems[0] and "named cannot be called" in problems[1]
    assert len(problems) == 3 and column_problems(functions[:2], ("solution", "x")) == []
    (problem,) = reward_problems([f"{path}:waits"], "", ".*")
    assert "waits is an async function" in problem
    # what fsdp_train.run calls between the data and the model: the prompts' columns, train and validation
    from types import SimpleNamespace

    from fsdp_lib.config import TrainConfig
    from fsdp_lib.data.prompts import PromptSet
    from fsdp_lib.errors import TrainError
    from fsdp_lib.train.grpo import check_reward_fit

    def data(*columns: tuple[str, ...]) -> SimpleNamespace:
        sets = [PromptSet([], np.zeros(0, dtype=np.int64), None, False, c) for c in columns]
        return SimpleNamespace(objective="grpo", train=SimpleNamespace(blocks=sets[0]), validation=sets[1:] and sets[1])

    cfg = TrainConfig(objective="grpo", reward=["accuracy"], dataset_name=["sums"])
    with pytest.raises(TrainError, match=r"--dataset-name sums: --reward accuracy reads .* have \['result'\]"):
        check_reward_fit(cfg, data(("result",)))
    with pytest.raises(TrainError, match="the train prompts have"):  # held-out answers do not train anything
        check_reward_fit(cfg, data(("result",), ("answer",)))
    check_reward_fit(cfg, data(("answer",), ("result",)))
    (tmp_path / "rewards.py").mkdir()
    (problem,) = reward_problems([f"{tmp_path}/rewards.py:f"], "", ".*")
    assert f"{tmp_path}/rewards.py is a folder, not a Python file" in problem


def test_empty_prompts_are_counted_skips():
    from fsdp_lib.data.prompts import prompt_text

    for prompt, reason in [("", "an empty prompt"), ("  \n", "an empty prompt"), ([], "an empty list of messages"),
                           ([{"role": "user", "content": " "}], "an empty prompt")]:  # fmt: skip
        with pytest.raises(ValueError, match=reason):
            prompt_text(prompt, None)
    assert prompt_text("2 + 2 =", None) == ("2 + 2 =", False)


# -- real runs ------------------------------------------------------------------------------------------------------


def answer_half_of_the_time_model(folder: Path) -> Path:
    """A tiny Llama (untied head) whose next token after PROMPT is "7" or "8", each about half of the time: their
    head rows are set so both logits are 8 after the prompt, every other row scaled down to near 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make_model(folder, with_weights=True, tied=False, fill_stored=False)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0, -1]
        head = model.lm_head.weight
        head.mul_(0.01)
        for answer in ("7", "8"):
            (token,) = tokenizer.encode(answer)
            head[token] = 8 * hidden / hidden.dot(hidden)
        probs = torch.softmax(model(input_ids=ids).logits[0, -1], -1)
    assert 0.4 < float(probs[tokenizer.encode("7")[0]]) < 0.5
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def grpo_inputs(tmp_path_factory) -> dict[str, Path]:
    import datasets

    root = tmp_path_factory.mktemp("grpo")
    rewards = root / "rewards.py"
    rewards.write_text(REWARDS)
    sums = [{"question": f"{a} plus {b} is", "answer": str(a + b)} for a in range(4) for b in range(4)]
    (root / "raw").mkdir()
    (root / "raw" / "sums.jsonl").write_text("".join(json.dumps(s) + "\n" for s in sums))
    assert (
        data_hf.main(["--data-folder", str(root / "raw"), "--save-dir", str(root / "sums"), "--format", "prompts"]) == 0
    )
    datasets.Dataset.from_list([{"prompt": PROMPT, "answer": "7"}] * 48).save_to_disk(str(root / "seven"))
    return {
        "root": root,
        "rewards": rewards,
        "sums": root / "sums",
        "seven": root / "seven",
        "diverse": make_model(root / "diverse", with_weights=True, fill_stored=False),
        "half": answer_half_of_the_time_model(root / "half"),
    }


@pytest.mark.slow
def test_one_step_loss_and_gradients_equal_a_float64_grpo(grpo_inputs, tmp_path):
    """2 processes x 2 micro-batches x 2 prompts x 4 completions at temperature 0.7, each --grpo-loss: the loss of
    the global batch and every parameter's gradient equal the objective written out below on the unsharded float64
    model, whose log-probabilities are those of the distribution that sampled (logits / temperature)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "grads.pt"
    args = [
        *io_args("grads", grpo_inputs["sums"], grpo_inputs["diverse"], tmp_path), *BASE_FLAGS,
        "--objective", "grpo", "--reward", f"{grpo_inputs['rewards']}:distinct", "--num-generations", "4",
        "--max-new-tokens", "6", "-b", "2", "--grad-accum-steps", "2", "--temperature", "0.7",
    ]  # fmt: skip
    proc = run_trainer(args, script=WORKERS / "grpo_grads.py", env={"GRPO_GRADS_OUT": str(out)})
    assert proc.returncode == 0, output_of(proc)
    results = torch.load(out)
    # decoding over the gathered view (no FSDP hooks) and through FSDP, a layer at a time, sample the same tokens
    assert results.pop("view") == {"used": True, "same_tokens_hooked": True}
    second = results.pop("second_update")
    rollouts = {loss: [row for rank_rows, _ in got["parts"] for row in rank_rows] for loss, got in results.items()}
    assert rollouts["grpo"] == rollouts["dapo"] == rollouts["dr_grpo"]  # the same sampling keys: the same tokens
    model = AutoModelForCausalLM.from_pretrained(grpo_inputs["diverse"], dtype=torch.float64, use_cache=False)
    for loss_type, got in results.items():
        model.zero_grad()
        rows = [row for rank_rows, _ in got["parts"] for row in rank_rows]
        rewards = torch.tensor([r for _, rank_rewards in got["parts"] for r in rank_rewards], dtype=torch.float64)
        assert len(rows) == 32 and len({tuple(c) for _, c in rows}) > 8  # sampled, and not all alike
        grouped = rewards.view(-1, 4)
        advantages = grouped - grouped.mean(1, keepdim=True)
        if loss_type != "dr_grpo":
            advantages = advantages / (grouped.std(1, keepdim=True) + 1e-4)
        advantages = advantages.flatten()
        assert advantages.abs().max() > 0.1
        per_row = []
        for (prompt, completion), advantage in zip(rows, advantages):
            ids = torch.tensor(prompt + completion)
            logits = model(input_ids=ids[None]).logits[0, len(prompt) - 1 : -1] / 0.7  # the sampling temperature
            logps = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)
            ratio = torch.exp(logps - logps.detach())
            per_row.append(-torch.min(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage))
        if loss_type == "grpo":
            loss = torch.stack([r.mean() for r in per_row]).mean()
        elif loss_type == "dapo":
            loss = torch.cat(per_row).sum() / sum(len(r) for r in per_row)
        else:
            loss = torch.cat(per_row).sum() / (len(per_row) * 6)
        loss.backward()
        assert abs(got["loss"] - loss.item()) < 1e-6, (loss_type, got["loss"], loss.item())
        params = dict(model.named_parameters())
        assert set(got["grads"]) == set(params)
        for name, grad in got["grads"].items():
            expected = params[name].grad
            err = (grad.double() - expected).norm() / expected.norm().clamp_min(1e-12)
            assert err < 1e-5, (loss_type, name, err.item())
    # --num-iterations 2: the second update's ratio is to the sampling policy, here the parameters before a known move
    model.zero_grad()
    rows = [row for rank_rows, _ in results["dapo"]["parts"] for row in rank_rows]
    rewards = torch.tensor(
        [r for _, rank_rewards in results["dapo"]["parts"] for r in rank_rewards], dtype=torch.float64
    )
    grouped = rewards.view(-1, 4)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()

    def completion_logps(prompt: list[int], completion: list[int]) -> torch.Tensor:
        ids = torch.tensor(prompt + completion)
        logits = model(input_ids=ids[None]).logits[0, len(prompt) - 1 : -1] / 0.7
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)

    with torch.no_grad():
        old = [completion_logps(p, c) for p, c in rows]
        for name, param in model.named_parameters():
            param.add_(perturbation(name, tuple(param.shape)))
    per_row, outside = [], 0
    for (prompt, completion), advantage, before in zip(rows, advantages, old):
        ratio = torch.exp(completion_logps(prompt, completion) - before)
        outside += int(((ratio < 0.8) | (ratio > 1.2)).sum())
        per_row.append(-torch.min(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage))
    loss = torch.cat(per_row).sum() / sum(len(r) for r in per_row)
    loss.backward()
    assert outside > 0 and second["clipped"] > 0, "the move takes some ratios out of the clip range"
    assert abs(second["loss"] - loss.item()) < 1e-6, (second["loss"], loss.item())
    params = dict(model.named_parameters())
    for name, grad in second["grads"].items():
        err = (grad.double() - params[name].grad).norm() / params[name].grad.norm().clamp_min(1e-12)
        assert err < 1e-5, ("second update", name, err.item())


def learn_args(grpo_inputs: dict[str, Path], save: Path, experiment: str = "learn") -> list[str]:
    return [
        *io_args(experiment, grpo_inputs["seven"], grpo_inputs["half"], save), *BASE_FLAGS,
        "--reward", "accuracy", "--num-generations", "8", "--max-new-tokens", "1", "-b", "1", "--max-steps", "12",
        "--lr", "1e-2", "--lr-schedule", "constant", "--warmup-steps", "0", "--ckpt-freq", "2",
    ]  # fmt: skip


def samples_by_step(exp_dir: Path) -> dict[int, list[tuple[str, float]]]:
    out: dict[int, list] = {}
    for line in (exp_dir / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], []).append((row["completion"], row["reward"]))
    return out


@pytest.fixture(scope="module")
def learned(grpo_inputs) -> Path:
    """The uninterrupted run: 12 steps of 2 processes x 1 prompt x 8 completions (--objective auto: the dataset has a
    prompt column), with a checkpoint every 2 steps."""
    save = grpo_inputs["root"] / "learned"
    proc = run_trainer(learn_args(grpo_inputs, save))
    assert proc.returncode == 0, output_of(proc)
    log = output_of(proc)
    assert "--objective grpo (auto: the dataset has a prompt column)" in log and "rewards accuracy x 1" in log
    return save / "learn"


@pytest.mark.slow
def test_a_model_right_half_of_the_time_learns_to_answer_right(learned, grpo_inputs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    records = [r for r in read_metrics(learned) if "reward" in r]
    assert [r["step"] for r in records] == list(range(1, 13))
    assert 0.15 <= records[0]["reward"] <= 0.85, records[0]
    assert min(r["reward"] for r in records[-3:]) >= 0.85, [r["reward"] for r in records]
    for key in ("reward_std", "completion_length", "entropy", "clip_ratio", "generation_tokens_per_s",
                "rewards/accuracy", "frac_reward_zero_std", "time_generate_ms"):  # fmt: skip
        assert key in records[0], key
    samples = samples_by_step(learned)
    assert len(samples[1]) == 8 and {reward for _, reward in samples[1]} == {0.0, 1.0}
    tokenizer = AutoTokenizer.from_pretrained(learned / "final")
    model = AutoModelForCausalLM.from_pretrained(learned / "final", dtype=torch.float32)
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([tokenizer.encode(PROMPT)])).logits[0, -1], -1)
    assert float(probs[tokenizer.encode("7")[0]]) > 0.95


@pytest.mark.slow
def test_kill9_rerun_and_a_one_process_resume_give_the_same_completions(learned, grpo_inputs, tmp_path):
    args = learn_args(grpo_inputs, tmp_path / "a")
    killed_at_step(args, tmp_path / "a" / "learn", 3)
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # for the one-process resume below
    rerun = run_trainer(args)
    assert rerun.returncode == 0, output_of(rerun)
    assert "resumed from" in output_of(rerun)
    expected = {r["step"]: r for r in read_metrics(learned) if "reward" in r}
    got = {r["step"]: r for r in read_metrics(tmp_path / "a" / "learn") if "reward" in r}
    for step in range(1, 13):
        for key in ("loss", "reward", "grad_norm", "completion_length"):
            assert got[step][key] == expected[step][key], (step, key)
    assert samples_by_step(tmp_path / "a" / "learn") == samples_by_step(learned)
    # the same global batch on one process (2 micro-batches of 1 prompt): the same prompts and sampling keys; and
    # generating one layer at a time (--rollout-unshard off) samples the same completions as with the layers kept
    # gathered (auto: on)
    alone = learn_args(grpo_inputs, tmp_path / "b")
    resumed = run_trainer([*alone, "--grad-accum-steps", "2", "--rollout-unshard", "off"], nproc=1)
    assert resumed.returncode == 0, output_of(resumed)
    assert "world size changed (2 -> 1)" in output_of(resumed)
    assert "generation keeps the layers gathered: no, one layer at a time" in output_of(resumed)
    got = {r["step"]: r for r in read_metrics(tmp_path / "b" / "learn") if "reward" in r}
    first = min(got)
    assert first <= 3 and samples_by_step(tmp_path / "b" / "learn") == samples_by_step(learned)
    for step in range(first, 13):
        assert got[step]["reward"] == expected[step]["reward"]
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_context_parallel_2_samples_and_trains_like_the_data_parallel_run(learned, grpo_inputs, tmp_path):
    """--context-parallel 2: both processes sample the same completions of one prompt per micro-batch (accumulation
    2: the global batch of the 2-process run), each trains its half of every row. Step 1 samples the completions of
    the data-parallel run (counted once, not once per process) and its loss and gradient norm equal that run's;
    later steps sample from weights that differ in the last bits, so a completion may differ. The two processes
    sample and score half of the completions each (a reward of weight 0 tallies who scored what)."""
    args = [*learn_args(grpo_inputs, tmp_path), "--context-parallel", "2", "--grad-accum-steps", "2"]
    args[args.index("--max-steps") + 1] = "2"
    args += ["--reward", f"{grpo_inputs['rewards']}:tally", "--reward-weights", "1,0"]
    tally = tmp_path / "tally.txt"
    proc = run_trainer(args, env={"GRPO_TALLY": str(tally)})
    assert proc.returncode == 0, output_of(proc)
    assert "each sequence split over 2 processes" in output_of(proc)
    calls = [line.split() for line in tally.read_text().splitlines()]
    # 2 steps x 2 micro-batches of 8 completions (and any evaluation): 4 per rank and call, as many calls per rank
    assert len(calls) >= 8 and {n for _, n in calls} == {"4"}, calls
    assert sum(r == "0" for r, _ in calls) == sum(r == "1" for r, _ in calls), calls
    expected = next(r for r in read_metrics(learned) if r["step"] == 1 and "reward" in r)
    got = {r["step"]: r for r in read_metrics(tmp_path / "learn") if "reward" in r}
    assert sorted(got) == [1, 2] and samples_by_step(tmp_path / "learn")[1] == samples_by_step(learned)[1]
    for key in ("reward", "trained_tokens", "completion_length"):
        assert got[1][key] == expected[key], key
    for key in ("loss", "grad_norm", "clip_ratio"):
        assert got[1][key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key


@pytest.mark.slow
def test_context_parallel_4_with_fewer_completions_than_processes_samples_each_once(grpo_inputs, tmp_path):
    """--context-parallel 4 on 4 processes, 2 completions per micro-batch: two processes of the group have no share
    and decode a stand-in that ends at once (the forwards stay in lockstep: no hang); each completion is scored once
    (a weight-0 reward tallies who scored what)."""
    tally = tmp_path / "tally.txt"
    args = [*io_args("cp4", grpo_inputs["sums"], grpo_inputs["diverse"], tmp_path), *BASE_FLAGS,
            "--reward", f"{grpo_inputs['rewards']}:distinct", "--reward", f"{grpo_inputs['rewards']}:tally",
            "--reward-weights", "1,0", "--num-generations", "2", "--max-new-tokens", "12", "-b", "1",
            "--max-steps", "2", "--context-parallel", "4", "--eval-at-start", "off"]  # fmt: skip
    proc = run_trainer(args, nproc=4, env={"GRPO_TALLY": str(tally)}, timeout=240)
    assert proc.returncode == 0, output_of(proc)
    calls = sorted(line.split() for line in tally.read_text().splitlines())
    # per step, one micro-batch of 2 completions: context ranks 1 and 3 (shares [0, 1) and [1, 2)) score one each
    assert [rank for rank, _ in calls] == ["1", "1", "3", "3"] and {n for _, n in calls} == {"1"}, calls
    steps = [r for r in read_metrics(tmp_path / "cp4") if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["completion_length"] > 0 for r in steps)


def test_a_resume_refused_for_an_edited_reward_file_names_that_function(tmp_path):
    """The message after a reward function failed says to fix it and rerun; a fix inside its file changes the
    content hash a resume pins, and the refusal names the function whose file changed, not two whole fingerprints."""
    from fsdp_lib.config import TrainConfig
    from fsdp_lib.train.checkpoint import Checkpointer

    saved = {"objective": "grpo", "rewards": [["r.py:score:aaaa", 1.0], ["accuracy", 0.5]], "beta": 0.0}
    now = {**saved, "rewards": [["r.py:score:bbbb", 1.0], ["accuracy", 0.5]]}
    ckpt = Checkpointer(TrainConfig(experiment_name="x", save_dir=str(tmp_path)), None, {"objective": now})
    said = ckpt._difference("objective", {"fingerprint": {"objective": saved}, "config": {}})
    assert said.startswith("--reward / --reward-weights: checkpoint [['r.py:score:aaaa', 1.0]") and "beta" not in said
    assert said.endswith("(the file of --reward r.py:score changed)"), said
    weights = {**saved, "rewards": [["r.py:score:aaaa", 2.0], ["accuracy", 0.5]]}
    ckpt.fingerprint = {"objective": weights}
    said = ckpt._difference("objective", {"fingerprint": {"objective": saved}, "config": {}})
    assert "changed)" not in said and "2.0" in said, said  # a weight, not a file
    # another objective: named as the flag, not as the five entries of two objectives' settings that follow from it
    dpo = {"loss": "sigmoid", "beta": 0.1, "label_smoothing": 0.0, "sft_weight": 0.0, "reference": "precompute"}
    kto = {"loss": "kto", "beta": 0.1, "desirable_weight": 1.0, "undesirable_weight": 1.0, "reference": "precompute"}
    ckpt.fingerprint = {"objective": kto}
    said = ckpt._difference("objective", {"fingerprint": {"objective": dpo}, "config": {}})
    assert said == "--objective: checkpoint dpo vs now kto", said
    # the global batch of a --context-parallel 2 run, resumed without it, names the flag and the fix
    ckpt.fingerprint = {"global_batch_size": 4}
    said = ckpt._difference(
        "global_batch_size", {"fingerprint": {"global_batch_size": 2}, "config": {"context_parallel": 2}}
    )
    assert "(--context-parallel 2 then, 1 now" in said and "--global-batch-size 2 keeps the run's batch" in said, said


@pytest.mark.slow
@pytest.mark.parametrize(
    "function, said",
    [
        ("fails_on_rank_1", "raised KeyError: 'solution'"),
        # it held both ranks for --collective-timeout-s (30 minutes by default), then died without naming it
        ("hangs_on_rank_1", "did not return within --reward-timeout-s 3 (scoring 2 completions)"),
    ],
)
def test_a_reward_function_failing_on_one_rank_stops_every_rank_naming_it(grpo_inputs, tmp_path, function, said):
    spec = f"{grpo_inputs['rewards']}:{function}"
    args = [*io_args("fails", grpo_inputs["sums"], grpo_inputs["diverse"], tmp_path), *BASE_FLAGS, "--reward", spec,
            "--num-generations", "2", "--max-new-tokens", "2", "-b", "1", "--max-steps", "2",
            "--reward-timeout-s", "3", "--collective-timeout-s", "60"]  # fmt: skip
    proc = run_trainer(args, timeout=120)
    log = output_of(proc)
    assert proc.returncode != 0
    assert f"--reward {spec} {said}" in log
    assert "(rank 1); fix the reward function" in log
    assert "with --force-resume if you edit its file" in log


@pytest.mark.slow
def test_lora_with_a_kl_to_adapters_off_on_chat_prompts_evaluates_held_out_prompts(grpo_inputs, tmp_path):
    """--peft lora, --grpo-beta (the reference: the same model with its adapters off), two updates per rollout
    (--num-iterations 2), conversational prompts rendered with the Llama 3 template (completions reach the reward
    function as messages) and a validation split evaluated at step 0 and at the end."""
    import datasets

    def rows(n: int, start: int) -> list[dict]:
        return [{"prompt": [{"role": "user", "content": f"What is {i} plus 1?"}], "answer": str(i + 1)}
                for i in range(start, start + n)]  # fmt: skip

    data = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows(8, 0)),
                                 "validation": datasets.Dataset.from_list(rows(3, 20))})  # fmt: skip
    data.save_to_disk(str(tmp_path / "chat"))
    model = make_chat_model(tmp_path / "model", with_weights=True)
    rewards = shutil.copy(grpo_inputs["rewards"], tmp_path / "mine.py")
    args = [
        *io_args("lora", tmp_path / "chat", model, tmp_path), *BASE_FLAGS, "--seq-length", "64",
        "--reward", f"{rewards}:chat", "--num-generations", "4", "--max-new-tokens", "6", "-b", "1",
        "--max-steps", "2", "--peft", "lora", "--grpo-beta", "0.04", "--lr", "1e-3", "--num-iterations", "2",
        "--reward", f"{rewards}:tally", "--reward-weights", "1,0",
    ]  # fmt: skip
    tally = tmp_path / "tally.txt"
    proc = run_trainer(args, env={"GRPO_TALLY": str(tally)})
    log = output_of(proc)
    assert proc.returncode == 0, log
    assert "KL beta 0.04 to the model with adapters off" in log and "3 validation prompts" in log
    records = [json.loads(line) for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    evaluations = {r["step"]: r for r in records if "val_reward" in r}
    assert set(evaluations) == {0, 2} and all(r["val_completions"] == 12 for r in evaluations.values())
    # every completion scored once: 2 steps x 2 processes x 4, 2 evaluations x 3 prompts x 4 (the process left
    # without a third prompt decodes a stand-in that no reward function sees)
    assert sum(int(line.split()[1]) for line in tally.read_text().splitlines()) == 16 + 24
    steps = [r for r in records if "reward" in r]
    assert "val_rewards/chat" in evaluations[2] and "rewards/chat" in steps[-1]
    assert len(steps) == 2 and all(r["kl"] >= 0 for r in steps)
    # each step trained its completions twice (the second time with the ratio to the sampling policy)
    assert all(r["trained_tokens"] == pytest.approx(2 * 8 * r["completion_length"]) for r in steps)  # 2 x 4 completions
    # grad_norm: the mean of the two updates' norms, each logged (they differ: the second update's weights moved)
    for r in steps:
        first, second = r["grad_norm/update_1"], r["grad_norm/update_2"]
        assert first != second and r["grad_norm"] == pytest.approx((first + second) / 2, rel=1e-12)
    assert (tmp_path / "lora" / "final" / "adapter_config.json").is_file()
    # `-e EXP --export-only` alone takes the run's settings (--peft lora, the model) from its config.yaml, and an
    # export needs no reward file (it was refused over GRPO's flags and a deleted file) and no dataset: it writes
    # the run's own export again, the chat template included
    final = tmp_path / "lora" / "final"
    exported = {f.name: f.read_bytes() for f in final.iterdir()}
    Path(rewards).unlink()
    (tmp_path / "chat").rename(tmp_path / "chat_moved")
    shutil.rmtree(final)
    proc = run_trainer(["-e", "lora", "--save-dir", str(tmp_path), "--export-only"], nproc=1)
    assert proc.returncode == 0, output_of(proc)
    assert {f.name: f.read_bytes() for f in final.iterdir()} == exported
    assert "chat_template" in json.loads(exported["tokenizer_config.json"]) or "chat_template.jinja" in exported


@pytest.mark.parametrize("template", ["llama3", "qwen2.5", "gemma", "mistral"])
def test_a_templated_completion_ends_at_the_templates_end_of_turn(template, tmp_path):
    from transformers import AutoTokenizer

    from fsdp_lib.data.prompts import end_of_turn_ids

    tokenizer = AutoTokenizer.from_pretrained(make_chat_model(tmp_path / "model", template=template))
    expected = {"llama3": "<|eot_id|>", "qwen2.5": "<|im_end|>", "gemma": "<end_of_turn>", "mistral": "<|eos|>"}[
        template
    ]
    assert end_of_turn_ids(tokenizer) == {tokenizer.convert_tokens_to_ids(expected)}
    tokenizer.chat_template = None
    assert end_of_turn_ids(tokenizer) == set()
