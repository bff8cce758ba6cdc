"""Each benchmark in bench/ still runs end to end: `python bench/bench_X.py --quick`, a tiny model and one
repetition, its JSON checked for the figures a broken measurement would get wrong. Timing figures are not
asserted beyond sanity bounds: on a shared CPU machine they are noise at these sizes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest


def run_quick(repo_root: Path, script: str, results_dir: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, str(repo_root / "bench" / script), "--quick", "--results-dir", str(results_dir)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = list(results_dir.glob("*.json"))
    assert len(written) == 1, written
    return json.loads(written[0].read_text())


@pytest.mark.slow
def test_trainer_overhead_quick(repo_root, tmp_path):
    result = run_quick(repo_root, "bench_trainer_overhead.py", tmp_path)
    p = result["params"]
    for side in ("fsdp_train", "minimal"):
        (run,) = result["runs"][side]
        assert len(run["windows_s"]) == p["steps"] // p["log_freq"], "one window per metric line"
        assert 0 < run["last_loss"] < 2 * math.log(p["vocab"]), "both sides train the same small model"
    for ratio in result["ratios"].values():
        assert 0.2 < ratio < 5, result["ratios"]


@pytest.mark.slow
def test_tokenize_quick(repo_root, tmp_path):
    result = run_quick(repo_root, "bench_tokenize.py", tmp_path)
    check = result["token_check"]
    assert check["fsdp_stream_equals_docs_plus_eos"], check
    assert check["eos_added"] == check["documents"] == result["params"]["documents"]
    (clm,) = result["runs"]["run_clm"]
    (fsdp,) = result["runs"]["fsdp_train"]
    assert fsdp["tokens"] == check["document_tokens"] + check["eos_added"]
    assert check["document_tokens"] - clm["tokens"] < result["params"]["seq"] * math.ceil(check["documents"] / 1000)
    assert all(r > 0 for r in result["ratios"].values())


@pytest.mark.slow
def test_checkpoint_quick(repo_root, tmp_path):
    result = run_quick(repo_root, "bench_checkpoint.py", tmp_path)
    assert result["checkpoint_bytes"] > 0
    assert all(v > 0 for v in result["gb_per_s"].values())
    assert 0 < result["checksum_share_of_save"] < 1, "checksums are part of every save, never all of it"
    blocked = result["blocked"]
    assert blocked["sync (--async-ckpt off)"]["runs_completed"] == 1
    assert blocked["async (--async-ckpt on)"]["runs_completed"] == 1, "async saves must not deadlock"


@pytest.mark.slow
def test_loading_quick(repo_root, tmp_path):
    result = run_quick(repo_root, "bench_loading.py", tmp_path)
    for dtype in result["params"]["dtypes"]:
        for mode in ("sharded", "full"):
            one = result["summary"][f"{dtype} x1"]["figures_mb"][mode]["own_shard_mb"]
            two = result["summary"][f"{dtype} x2"]["figures_mb"][mode]["own_shard_mb"]
            assert two == pytest.approx(one / 2, rel=0.05), "two processes each hold half the parameters"
        assert result["summary"][f"{dtype} x2"]["full_over_sharded_private_peak"] > 0


@pytest.mark.slow
def test_chat_tokenize_quick(repo_root, tmp_path):
    result = run_quick(repo_root, "bench_chat_tokenize.py", tmp_path)
    check = result["check"]
    conversations = result["params"]["conversations"]
    assert check["conversations"] == check["fsdp_documents"] == conversations
    assert check["ids_equal"] == check["masks_equal"] == conversations, check
    assert 0 < check["trained_tokens"] < check["tokens"], "assistant-only: some tokens carry loss, not all"
    (fsdp,) = result["runs"]["fsdp_train"]
    (trl,) = result["runs"]["trl"]
    (floor,) = result["runs"]["tokenizer_floor"]
    assert fsdp["tokens"] == trl["tokens"] == floor["tokens"] == check["tokens"]
    assert fsdp["trained_tokens"] == check["trained_tokens"]
    assert all(r > 0 for r in result["ratios"].values())


@pytest.mark.slow
def test_loss_quick(repo_root, tmp_path):
    result = run_quick(repo_root, "bench_loss.py", tmp_path)
    p = result["params"]
    (summary,) = result["summaries"]
    assert summary["agree"], summary["max_rel_diff"]
    assert 0.5 * math.log(p["vocab"]) < summary["mean_loss"] < 2 * math.log(p["vocab"]), "a random model's loss"
    # 512 tokens x 32k vocab: the full logits (64 MiB) and their gradient dwarf a 64-token chunk's, so a chunked
    # side that silently fell back to full logits would break this.
    assert summary["logits_share_full_over_chunked"] > 2, summary["figures"]
    assert summary["figures"]["full"]["logits_share_gib"] > 0.1, "the full side holds the fp32 logits"
    assert 0.05 < summary["step_time_chunked_over_full"] < 20


@pytest.mark.slow
def test_mfu_quick(repo_root, tmp_path):
    result = run_quick(repo_root, "bench_mfu.py", tmp_path)
    p = result["params"]
    assert result["mfu_is_nominal"] and p["peak_tflops"] == 1.0
    settings = list(result["results"].values())
    assert len(settings) == len(p["micro_batches"]) * len(p["activation_checkpointing"]) * len(p["compile"]) >= 2
    for r in settings:
        assert r["status"] == "ok", r
        assert r["windows"] == p["steps"] // p["log_freq"] - 1, "the warm-up window is skipped"
        # mfu is fsdp_train's own: tokens/s x flops per token over the peak given with --peak-tflops
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * result["flops_per_token"] / 1e12, rel=0.05)
        assert r["mem_peak_alloc_gb"] > 0 and r["time_forward_ms"] > 0 and r["time_backward_ms"] > 0
        assert 0 < r["last_loss"] < 2 * math.log(1024), "a tiny model trains from a random start"
