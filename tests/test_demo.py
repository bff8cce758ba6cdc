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
