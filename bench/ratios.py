"""The ratios of sides measured in the same run, and their goals, shared by the bench/ scripts.

Routes (bench_tokenize, bench_chat_tokenize): each route is timed with a Stopwatch, the baseline route's median
wall and CPU seconds over fsdp_train's are the ratios. Modes (bench_peft, bench_dpo): each mode is a launch whose
run is a dict with "status" ("ok", "OOM", "failed") and its figures; the ratios are of the modes' medians, and of
the repetitions that ran next to each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common import interleaved, median, print_table

Goals = dict[str, tuple[str, float, str]]  # ratio key -> (comparison "<=" or ">=", bound, description)


# --- Routes timed against each other (bench_tokenize, bench_chat_tokenize) ---------------------------


def run_routes(reps: int, routes: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Every route `reps` times in ABBA order (interleaved), each run's wall, CPU time and tokens printed."""
    return interleaved(reps, routes, summary=wall_cpu_tokens)


def wall_cpu_tokens(result: dict[str, Any]) -> str:
    """interleaved()'s summary of a Stopwatch result that counts tokens."""
    return f"wall {result['seconds']:.2f}s, CPU {result['cpu_seconds']:.2f}s, {result['tokens']:,} tokens"


def route_table(
    runs: dict[str, list[dict[str, Any]]], baseline: str, ours: str, labels: dict[str, str], amount: float, extra: str
) -> tuple[dict[str, float], dict[str, float], dict[str, float], list[list[Any]]]:
    """Median wall and CPU seconds of every side's Stopwatch results, baseline / ours for each, and a table row
    per side in `labels` (name -> label): median wall, `amount` per second, median CPU, the last run's tokens and
    `extra` count ("-" if it has none), and every repetition's wall time."""
    seconds = {name: median([r["seconds"] for r in rs]) for name, rs in runs.items()}
    cpu = {name: median([r["cpu_seconds"] for r in rs]) for name, rs in runs.items()}
    ratio = {"wall": seconds[baseline] / seconds[ours], "cpu": cpu[baseline] / cpu[ours]}
    rows = []
    for name, label in labels.items():
        last = runs[name][-1]
        rows.append(
            [
                label,
                seconds[name],
                amount / seconds[name],
                cpu[name],
                f"{last['tokens']:,}",
                f"{last[extra]:,}" if extra in last else "-",
                ", ".join(f"{r['seconds']:.1f}" for r in runs[name]),
            ]
        )
    return seconds, cpu, ratio, rows


def report_routes(
    runs: dict[str, list[dict[str, Any]]],
    baseline: str,
    labels: dict[str, str],
    headers: list[str],
    amount: float,
    extra: str,
    goal: float,
) -> dict[str, Any]:
    """Print route_table's rows under `headers` and the goal (baseline / fsdp_train >= `goal`, wall-clock and CPU
    time); returns the results' figures: ratios, goal, goal_met, seconds and cpu_seconds (median per route)."""
    seconds, cpu, ratio, rows = route_table(runs, baseline, "fsdp_train", labels, amount, extra)
    print_table(headers, rows)
    for key, label in (("wall", "wall-clock"), ("cpu", "CPU time")):
        verdict = "met" if ratio[key] >= goal else "NOT met"
        print(f"{baseline} / fsdp_train, {label}: {ratio[key]:.2f} (goal >= {goal}: {verdict})")
    goal_met = {key: value >= goal for key, value in ratio.items()}
    return {"ratios": ratio, "goal": f">= {goal}", "goal_met": goal_met, "seconds": seconds, "cpu_seconds": cpu}


# --- Modes compared: medians, ratios and goals (bench_peft, bench_dpo) ------------------------------------------


def mode_figures(
    runs: dict[str, list[dict[str, Any]]], median_keys: tuple[str, ...], first_keys: tuple[str, ...]
) -> dict[str, dict[str, Any]]:
    """Per mode, over its "ok" runs: the median of each figure in `median_keys` that every one of them has, and
    the first one's value of each figure in `first_keys` it has (counts and checks that repeat every run)."""
    figures: dict[str, dict[str, Any]] = {}
    for mode, mode_runs in runs.items():
        ok = [r for r in mode_runs if r["status"] == "ok"]
        figures[mode] = {
            k: median([r[k] for r in ok]) for k in median_keys if ok and all(r.get(k) is not None for r in ok)
        }
        figures[mode] |= {k: ok[0][k] for k in first_keys if ok and k in ok[0]}
    return figures


def mode_ratios(
    figures: dict[str, dict[str, Any]], runs: dict[str, list[dict[str, Any]]], pairs: dict[str, tuple[str, str, str]]
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """For each ratio key -> (numerator mode, denominator mode, figure): the ratio of the medians, and the ratios
    of the repetitions that ran next to each other (repetition i of each mode)."""
    ratios, per_rep = {}, {}
    for key, (a, b, k) in pairs.items():
        if k in figures[a] and k in figures[b] and figures[b][k]:
            ratios[key] = figures[a][k] / figures[b][k]
            per_rep[key] = [ra[k] / rb[k] for ra, rb in zip(runs[a], runs[b]) if ra.get(k) and rb.get(k)]
    return ratios, per_rep


def goal_verdicts(ratios: dict[str, float], goals: Goals) -> dict[str, bool | None]:
    """Each goal (ratio key -> (comparison "<=" or ">=", bound, description)) met or not; None if not measured."""
    verdicts: dict[str, bool | None] = {}
    for key, (op, bound, _) in goals.items():
        verdicts[key] = None if key not in ratios else (ratios[key] <= bound if op == "<=" else ratios[key] >= bound)
    return verdicts


def print_goal_ratios(label: str, summary: dict[str, Any], goals: Goals) -> None:
    """One line per goal: the ratio of the medians, the per-repetition ratios and the verdict."""
    ratios, per_rep, verdicts = summary["ratios"], summary["ratios_per_rep"], goal_verdicts(summary["ratios"], goals)
    for key, (op, bound, what) in goals.items():
        if key not in ratios:
            print(f"{label}: {what}: not measured")
            continue
        reps = ", ".join(f"{r:.3f}" for r in per_rep[key])
        verdict = "met" if verdicts[key] else "NOT met"
        print(f"{label}: {what}: {ratios[key]:.3f} (per rep {reps}; goal {op} {bound}: {verdict})")


def print_reported_ratios(label: str, summary: dict[str, Any], keys: Any, goals: Goals) -> None:
    """One line per ratio of `keys` that is measured and not a goal: the ratio of the medians, per repetition."""
    ratios, per_rep = summary["ratios"], summary["ratios_per_rep"]
    for key in keys:
        if key in ratios and key not in goals:
            reps = ", ".join(f"{r:.3f}" for r in per_rep[key])
            print(f"{label}: {key.replace('_', ' ')}: {ratios[key]:.3f} (per rep {reps}; reported)")


def device_results(runs: dict[str, list[dict[str, Any]]], summary: dict[str, Any], goals: Goals) -> dict[str, Any]:
    """One device's part of the results JSON: the summary, every run, and the goals met."""
    return {"summary": summary, "runs": runs, "goal_met": goal_verdicts(summary["ratios"], goals)}


def numbered_runs(device: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every run under a name "<device> <mode> <repetition>", for report_failures."""
    return {f"{device} {mode} {i}": r for mode, mode_runs in runs.items() for i, r in enumerate(mode_runs)}


def failure_text(r: dict[str, Any]) -> str | None:
    """A failed run's status (and error) for interleaved()'s summary; None for a run that is "ok"."""
    if r["status"] == "ok":
        return None
    return r["status"] + (f": {r['error']}" if "error" in r else "")
