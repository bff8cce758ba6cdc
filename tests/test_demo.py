"""`make demo` end to end, shortened: every tool runs for real, training is interrupted and resumed, then the
chat fine-tune trains the exported model on the demo conversations."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.fsdp_helpers import REPO_ROOT


@pytest.mark.slow
def test_demo_pipeline_runs_end_to_end(tmp_path):
    workspace = tmp_path / "ws"
    proc = subprocess.run(
        [sys.executable, "scripts/demo.py", "--workspace", str(workspace), "--max-steps", "40", "--interrupt-at", "15"]
        + ["--chat-steps", "50"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "received SIGTERM" in out and "resumed from" in out
    exp = workspace / "outputs" / "demo"
    rows = [json.loads(x) for x in (exp / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "loss" in r]
    assert steps == sorted(set(steps)) and steps[-1] == 40
    assert any("val_loss" in r for r in rows)
    assert (exp / "loss.png").stat().st_size > 10_000
    assert (exp / "final" / "model.safetensors.index.json").is_file()
    assert "prompts answered as the corpus teaches" in out
    # the chat fine-tune: conversations with two bad records counted, SFT on the assistant turns, a lower loss
    assert "no_assistant_turn 1, unknown_role 1" in out
    assert "SFT on conversations" in out and "loss on assistant tokens" in out
    chat_rows = [
        json.loads(x) for x in (workspace / "outputs" / "demo_chat" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in chat_rows if "loss" in r][-1] == 50
    assert all(0 < r["trained_tokens_per_s"] < r["tokens_per_s"] for r in chat_rows if "loss" in r)
    before, after = map(float, re.search(r"base \(the text model\) ([\d.]+) -> fine-tuned ([\d.]+)", out).groups())
    assert after < 0.6 * before, (before, after)
    assert (workspace / "outputs" / "demo_chat" / "final" / "model.safetensors.index.json").is_file()


def test_the_demo_never_deletes_a_workspace_it_did_not_make(tmp_path):
    """Every demo run deletes its --workspace to start clean: `--workspace outputs` deleted a user's experiments.
    A folder with anything the demo does not write is refused (exit 2, nothing deleted); the demo's own (its
    marker) and an empty one are taken; the demo's folder names alone are not enough (a project has them too)."""
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    import demo

    ws = tmp_path / "outputs"
    (ws / "my_run" / "checkpoint").mkdir(parents=True)
    (ws / "my_run" / "checkpoint" / "weights").write_text("precious")
    proc = subprocess.run(
        [sys.executable, "scripts/demo.py", "--workspace", str(ws)], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "holds files the demo did not mark as its own (my_run)" in proc.stderr, proc.stderr
    assert (ws / "my_run" / "checkpoint" / "weights").read_text() == "precious"
    assert "holds this repository" in demo.workspace_problem(REPO_ROOT)
    assert "holds this repository" in demo.workspace_problem(REPO_ROOT.parent)
    (tmp_path / "file").write_text("x")
    assert "not a folder" in demo.workspace_problem(tmp_path / "file")
    for number, entries in enumerate(((), ("raw", "outputs"), (demo.WORKSPACE_MARKER, "raw", "outputs"))):
        fresh = tmp_path / f"ws{number}"
        fresh.mkdir()
        for name in entries:
            (fresh / name).mkdir()
        # a project's raw/, hf_datasets/, models/, outputs/ without the demo's mark are not the demo's
        assert (demo.workspace_problem(fresh) is None) == (number != 1)
    assert demo.workspace_problem(tmp_path / "new") is None
