"""--objective grpo's rewards: the functions of --reward (FILE.py:FUNCTION, or a built-in by name), their weights
(--reward-weights), and scoring a batch of completions with them.

A reward function has TRL's signature, so existing ones work unchanged: `f(prompts, completions, **columns)` returns
one float per completion, or None where it does not apply. `prompts` and `completions` are strings, or for chat
prompts lists of messages (a completion is [{"role": "assistant", "content": text}]); `columns` holds every other
column of the prompt dataset (the reference answer, test cases), one value per completion. Built-ins:
  accuracy: 1.0 when the completion's answer (the content of its last \\boxed{...}, else its last number) equals the
            reference's (the `answer`, `solution`, `ground_truth`, `target` or `reference` column, read the same
            way, so "#### 42" and "\\boxed{42}" both give 42), else 0.0; None for a row without a reference.
  format:   1.0 when the whole completion matches --reward-pattern (default: <think>...</think> then
            <answer>...</answer>), else 0.0.
A function that raises, returns the wrong number of values or runs past --reward-timeout-s stops the run with an
error naming it."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect
import math
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from fsdp_lib.interrupts import ABANDONED
from fsdp_lib.records.prompts import REFERENCE_COLUMNS

BUILT_IN = ("accuracy", "format")
MAX_REWARD = 1e12  # larger rewards overflow the group statistics (a 1e300 reward crashed the std with a traceback)


@dataclass(frozen=True)
class RewardFunction:
    name: str  # as given to --reward: FILE.py:FUNCTION or a built-in's name
    function: Callable[..., Any]
    weight: float
    identity: str  # what a resume pins: the built-in's name and pattern, or the file's name and content hash
    label: str = ""  # in metric names (rewards/LABEL): the built-in's or the function's name, else the whole spec


def edited_rewards(was: Any, now: Any) -> str:
    """' (the file of --reward F:FN changed)' where two GRPO fingerprints' rewards ([[identity, weight], ...], a
    file's RewardFunction.identity being FILE:FUNCTION:CONTENT_HASH) differ in a file's contents only; '' otherwise
    (what checkpoint.py's refusal of a resume adds to the difference)."""
    try:
        pairs = [(a[0].rsplit(":", 1), b[0].rsplit(":", 1)) for a, b in zip(was, now, strict=True)]
    except (TypeError, ValueError, IndexError, AttributeError):
        return ""
    edited = [a[0] for a, b in pairs if a != b and a[0] == b[0] and ".py:" in a[0]]  # a file's, not format:PATTERN
    if not edited or any(a != b and a[0] != b[0] for a, b in pairs):
        return ""
    return f" (the file of --reward {', '.join(edited)} changed)"


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, at = 0, start + len("\\boxed")
    for i in range(at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[at + 1 : i]
    return None


_FRACTION = re.compile(r"\\[dt]?frac\{\s*(-?[\d.]+)\s*\}\{\s*(-?[\d.]+)\s*\}")  # \frac{1}{2} -> 1/2
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|-?\.\d+")  # 1,234.5 and 3/2 whole
_ANSWER_LEAD = re.compile(r"^(?:(?:so|thus|therefore)\W+)?(?:the\s+)?(?:final\s+)?answer(?:\s+is)?\s*[:=]?\s*", re.I)
_SHORT_ANSWER = 64  # characters: a reference this short, on one line, is the answer itself (3/2, Paris, B)


def final_answer(text: str) -> str | None:
    """A completion's answer: its last \\boxed{} content, else its last number or fraction (commas dropped; LaTeX
    fractions read as a/b), else None."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(_FRACTION.sub(r"\1/\2", text))
    return numbers[-1].replace(",", "").replace(" ", "") if numbers else None


def reference_answer(text: str) -> str | None:
    """A reference's answer: its \\boxed{} content, else what follows GSM8K's '####', else the whole reference when
    it is short, on one line and a number, a fraction or words without digits (3/2, Paris, B: a reference is an
    answer, where its last number would misread a fraction or miss a word), else its last number."""
    boxed = _boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip() or None
    short = text.strip()
    if short and len(short) <= _SHORT_ANSWER and "\n" not in short:
        # a number or fraction as a whole (3/2, \\frac{1}{2}), or a word answer (Paris, B); a short sentence with
        # numbers in it ("The answer is 42.") is read by its last number, as a longer reference is
        if _value(short) is not None or not re.search(r"\d", short):
            return short
    return final_answer(text)


def _value(answer: str) -> float | None:
    """The number an answer states (42, 42.0, 1,234, 3/2, \\frac{3}{2}, $5), or None when it states none."""
    text = _FRACTION.sub(r"\1/\2", answer).replace(",", "").replace(" ", "").strip("$.")
    try:
        if "/" in text:
            numerator, denominator = text.split("/", 1)
            return float(Fraction(numerator) / Fraction(denominator))
        return float(Fraction(text))
    except (ValueError, ZeroDivisionError):
        return None


def _text_answer(completion: str) -> str:
    """A completion's answer to a reference that is no number: its \\boxed{} content, else its last non-empty line
    without a lead such as 'The answer is'."""
    boxed = _boxed(completion)
    if boxed is not None:
        return boxed
    lines = [line.strip() for line in completion.splitlines() if line.strip()]
    return _ANSWER_LEAD.sub("", lines[-1]) if lines else ""


def answers_equal(a: str, b: str) -> bool:
    """Numerically equal when both state numbers (42 = 42.0, 3/2 = 1.5 = \\frac{3}{2}), else equal as text without
    case, spaces, surrounding $ and brackets, or trailing punctuation."""
    va, vb = _value(a), _value(b)
    if va is not None and vb is not None:
        return math.isclose(va, vb, rel_tol=1e-9, abs_tol=1e-9)

    def plain(text: str) -> str:
        return re.sub(r"\s+", "", text).strip("$()[]{}.,;:!?*\"'`").lower()

    return plain(a) == plain(b) != ""


def completion_text(completion: Any) -> str:
    """A completion's text: the string, or the content of a chat completion's messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion)


def accuracy_reward(prompts: list, completions: list, **columns: Any) -> list[float | None]:
    """1.0 when the completion's answer equals the reference's, else 0.0; None where a row has no reference. Each
    row's reference is the first of REFERENCE_COLUMNS it holds (records of one set may name it differently). A
    numeric reference is compared with the completion's boxed answer or last number; any other with its boxed
    answer or last line."""
    present = [columns[name] for name in REFERENCE_COLUMNS if name in columns]
    out: list[float | None] = []
    for row, completion in enumerate(completions):
        reference = next((column[row] for column in present if column[row] is not None), None)
        expected = reference_answer(str(reference)) if reference is not None else None
        if expected is None:
            out.append(None)
            continue
        text = completion_text(completion)
        got = final_answer(text) if _value(expected) is not None else _text_answer(text)
        out.append(1.0 if got is not None and answers_equal(got, expected) else 0.0)
    return out


def format_reward(pattern: str) -> Callable[..., list[float]]:
    compiled = re.compile(pattern, re.DOTALL)

    def reward(prompts: list, completions: list, **columns: Any) -> list[float]:
        return [1.0 if compiled.fullmatch(completion_text(c)) else 0.0 for c in completions]

    return reward


def parse_weights(text: str, count: int) -> list[float] | str:
    """--reward-weights as floats (default: 1 each), or a problem."""
    if not text:
        return [1.0] * count
    try:
        weights = [float(item) for item in text.split(",")]
    except ValueError:
        return f"--reward-weights {text}: expected comma-separated numbers, one per --reward"
    if len(weights) != count:
        return f"--reward-weights {text}: {len(weights)} weight(s) for {count} --reward function(s); give one each"
    if not all(math.isfinite(w) for w in weights):
        return f"--reward-weights {text}: the weights must be finite numbers"
    if not any(weights):  # every reward 0, every advantage 0: steps that train nothing, with exit 0
        return (
            f"--reward-weights {text}: every weight is 0, so no completion is ever rewarded; give one a nonzero weight"
        )
    return weights


def load_reward(spec: str, weight: float, pattern: str) -> RewardFunction:
    """One --reward: a built-in's name, or FILE.py:FUNCTION, imported from the file. Raises ValueError naming the
    flag and the fix."""
    if spec == "accuracy":
        return RewardFunction(spec, accuracy_reward, weight, "accuracy")
    if spec == "format":
        return RewardFunction(spec, format_reward(pattern), weight, f"format:{pattern}")
    path_text, sep, function_name = spec.rpartition(":")
    if not sep or not path_text.endswith(".py") or not function_name:
        raise ValueError(
            f"--reward {spec}: expected FILE.py:FUNCTION (a Python file and a function in it) or a built-in "
            f"({', '.join(BUILT_IN)})"
        )
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(
            f"--reward {spec}: {path} is a folder, not a Python file"
            if path.is_dir()
            else f"--reward {spec}: no file {path}"
        )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    module = _import_reward_file(spec, path, digest)
    function = getattr(module, function_name, None)
    if not callable(function):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:10]
        has = f"it has: {', '.join(found)}" if found else "it defines no function"
        raise ValueError(f"--reward {spec}: {path} has no function {function_name!r} ({has})")
    if inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(type(function).__call__):
        raise ValueError(
            f"--reward {spec}: {function_name} is an async function; give a plain function that returns the rewards"
        )
    return RewardFunction(spec, function, weight, f"{path.name}:{function_name}:{digest}")


_IMPORTED: dict[tuple[str, str], ModuleType] = {}  # (resolved path, content digest) -> the module


def _import_reward_file(spec: str, path: Path, digest: str) -> ModuleType:
    """The reward file as a module, imported once per process and content (the start-up check, the objective and
    several --reward functions of one file share it, so its top level runs once). Its folder goes at the end of
    sys.path, so it imports the modules beside it (those are not in the content hash a resume pins: only
    the file itself is; two files importing a same-named module share the first one's)."""
    key = (str(path.resolve()), digest)
    if key not in _IMPORTED:
        folder = str(path.resolve().parent)
        if folder not in sys.path:  # last: a module beside it never shadows one the trainer imports
            sys.path.append(folder)
        module_name = f"reward_{hashlib.sha256(key[0].encode()).hexdigest()[:12]}"
        try:
            loader = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader)  # type: ignore[arg-type]
            loader.loader.exec_module(module)  # type: ignore[union-attr]
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's file: any error (or exit) in it is theirs
            raise ValueError(f"--reward {spec}: importing {path} failed ({type(exc).__name__}: {exc})") from exc
        _IMPORTED[key] = module
    return _IMPORTED[key]


def load_rewards(specs: list[str], weights_text: str, pattern: str) -> list[RewardFunction]:
    weights = parse_weights(weights_text, len(specs))
    if isinstance(weights, str):
        raise ValueError(weights)
    functions = [load_reward(spec, weight, pattern) for spec, weight in zip(specs, weights)]
    short = [f.name.rpartition(":")[2] for f in functions]
    return [dataclasses.replace(f, label=s if short.count(s) == 1 else f.name) for f, s in zip(functions, short)]


def reward_problems(specs: list[str], weights_text: str, pattern: str) -> list[str]:
    """The --reward, --reward-weights and --reward-pattern problems, each naming the flag (checked before any
    process group: the files are imported here once)."""
    problems = []
    try:
        re.compile(pattern)
    except re.error as exc:
        problems.append(f"--reward-pattern {pattern!r}: not a regular expression ({exc})")
        return problems
    weights = parse_weights(weights_text, len(specs))
    if isinstance(weights, str):
        problems.append(weights)
    for spec in sorted({spec for spec in specs if specs.count(spec) > 1}):  # it would count twice, one metric
        problems.append(
            f"--reward {spec} is given {specs.count(spec)} times; give each function once and weigh it with "
            "--reward-weights"
        )
    for spec in specs:
        try:
            load_reward(spec, 1.0, pattern)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def column_problems(
    functions: list[RewardFunction], columns: tuple[str, ...], train_columns: tuple[str, ...] | None = None
) -> list[str]:
    """Each --reward against the columns of the prompts it will get (train and validation: `columns`; the train
    prompts': `train_columns`, default the same), before the model loads: the accuracy built-in needs a reference
    column among the train prompts', and a function must take prompts, completions and every column as keywords (a
    problem found only at the first step would come after the model loaded)."""
    problems = []
    trained = columns if train_columns is None else train_columns
    for reward in functions:
        if reward.function is accuracy_reward and not set(trained) & set(REFERENCE_COLUMNS):
            problems.append(
                f"--reward accuracy reads each prompt's reference answer from a column named "
                f"{' or '.join(REFERENCE_COLUMNS)}, and the train prompts have {list(trained) or 'no other column'}: "
                "rename the column that holds the answers, or give your own --reward FILE.py:FUNCTION that reads it"
            )
        try:
            signature = inspect.signature(reward.function)
        except (TypeError, ValueError):  # a callable without a signature: its first call tells
            continue
        try:
            signature.bind(prompts=[], completions=[], **dict.fromkeys(columns))
        except TypeError as exc:
            parameters = signature.parameters.values()
            fix = "end its parameters with **kwargs, as TRL's reward functions do"
            if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):  # so a parameter's name is wrong
                fix = "name its first two parameters prompts and completions, as TRL's reward functions do"
                if {"prompts", "completions"} <= set(
                    signature.parameters
                ):  # def r(prompts, completions, solution, **kw)
                    wanted = [p.name for p in parameters if p.default is p.empty and p.kind is not p.VAR_KEYWORD]
                    missing = [n for n in wanted if n not in ("prompts", "completions", *columns)]
                    fix = f"give {', '.join(missing)} a default, or name a column the prompts have"
            problems.append(
                f"--reward {reward.name} cannot be called as f(prompts=..., completions=..., "
                f"{', '.join(f'{c}=...' for c in columns) or 'no columns'}) ({exc}): every column of the prompts "
                f"comes as a keyword; {fix}"
            )
    return problems


class RewardError(Exception):
    """A reward function failed or returned the wrong values; the message names it."""


class _TimedOut(BaseException):
    """Raised by SIGALRM in a reward function past its time; a BaseException, so a function's own `except Exception`
    (common around a grader) does not swallow it."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise _TimedOut in the main thread once `seconds` have passed (0: no limit). A timer signal interrupts Python
    code and the waits Python makes (sleep, a subprocess, a socket), not a C extension that never returns to the
    interpreter; off the main thread or without SIGALRM (Windows) there is no limit."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if seconds <= 0 or not usable or signal.getsignal(signal.SIGALRM) is None:  # None: a handler set from C
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise _TimedOut

    previous = signal.signal(signal.SIGALRM, expired)
    started = time.monotonic()
    # again every second after the first: a function's cleanup that blocks too (a thread pool joining its hung
    # workers on the way out) is interrupted as well, rather than holding every rank until the collective timeout
    earlier = signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        for _ in range(100):  # a repeat firing while the timer is disarmed raises here: disarm again
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                if earlier[0]:  # someone else's timer, set before: what is left of it
                    signal.setitimer(
                        signal.ITIMER_REAL, max(1e-3, earlier[0] - (time.monotonic() - started)), earlier[1]
                    )
                break
            except _TimedOut:
                continue


def score(
    functions: list[RewardFunction], prompts: list, completions: list, columns: dict[str, list], timeout_s: float = 0
) -> np.ndarray:
    """[functions x completions] float64, NaN where a function returned None. Raises RewardError naming the
    function that raised, ran past `timeout_s` (--reward-timeout-s; 0: no limit) or returned something other than
    one number (or None) per completion."""
    out = np.full((len(functions), len(completions)), np.nan)
    for k, reward in enumerate(functions):
        running = set(threading.enumerate())
        try:
            with time_limit(timeout_s):
                values = reward.function(prompts=prompts, completions=completions, **columns)
        except _TimedOut:  # also one that fired as the call returned: its time was up all the same
            ABANDONED.update(t for t in threading.enumerate() if t not in running and t.is_alive())
            raise RewardError(
                f"--reward {reward.name} did not return within --reward-timeout-s {timeout_s:g} (scoring "
                f"{len(completions)} completions); give what it waits on a timeout of its own (a subprocess running "
                "tests: subprocess.run(..., timeout=...)), or raise --reward-timeout-s"
            ) from None
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's function: stop naming it, whatever it raised
            raise RewardError(f"--reward {reward.name} raised {type(exc).__name__}: {exc}") from exc
        if isinstance(values, dict | str | bytes) or not hasattr(values, "__len__"):  # a dict's keys are no rewards
            raise RewardError(
                f"--reward {reward.name} returned {type(values).__name__}, not a list of one float per completion"
            )
        values = list(values)
        if len(values) != len(completions):
            raise RewardError(
                f"--reward {reward.name} returned {len(values)} value(s) for {len(completions)} completions; "
                "return one float (or None) per completion"
            )
        for i, value in enumerate(values):
            if value is None:
                continue
            try:
                if isinstance(value, str | bytes):  # float("1") would pass: a string is the function's mistake
                    raise TypeError(type(value).__name__)
                out[k, i] = float(value)
            except (TypeError, ValueError):
                raise RewardError(
                    f"--reward {reward.name} returned {value!r} for completion {i}; return a float or None"
                ) from None
            if not math.isfinite(out[k, i]) or abs(out[k, i]) > MAX_REWARD:
                raise RewardError(
                    f"--reward {reward.name} returned {value!r} for completion {i}; rewards must be finite numbers of "
                    f"at most {MAX_REWARD:g} in size (their squares and sums must stay finite)"
                )
    return out


def combine(scores: np.ndarray, functions: list[RewardFunction]) -> np.ndarray:
    """Each completion's reward: the weighted sum of its functions' rewards, those that returned None left out (as
    TRL's nansum); 0 for a completion no function applied to."""
    weights = np.asarray([f.weight for f in functions], dtype=np.float64)[:, None]
    return np.nansum(scores * weights, axis=0)
