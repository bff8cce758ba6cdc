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


def run_quick(repo_root: Path, script: str, results_dir: Path, *extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(repo_root / "bench" / script), "--quick", "--results-dir", str(results_dir), *extra],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
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
    for ratio in result["ratios"].values():  # time ratios: measured, never asserted (a loaded machine reads 8x)
        assert 0 < ratio < math.inf, result["ratios"]


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
def test_chat_packing_quick(repo_root, tmp_path):
    """The stream cuts most of the demo's conversations at 128 tokens; packed whole none is cut, some positions
    are padding, and both runs trained (a finite held-out loss of their exports)."""
    result = run_quick(repo_root, "bench_chat_packing.py", tmp_path)
    stream, whole = result["runs"]["stream 128"], result["runs"]["whole 128"]
    assert stream["straddling_pct"] > 30 and whole["straddling_pct"] == 0
    assert stream["fill_pct"] == 100 and 50 < whole["fill_pct"] < 100
    assert all(0 < r["held_out_assistant_loss"] < 20 for r in (stream, whole))
    assert set(result["ratios"]["128"]) == {"held_out_assistant_loss", "tokens_per_s", "trained_tokens_per_s"}


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
    assert len(settings) == len(p["micro_batches"]) * len(p["activation_checkpointing"]) * len(p["compile"]) >= 1
    for r in settings:
        assert r["status"] == "ok", r
        assert r["windows"] == p["steps"] // p["log_freq"] - 1, "the warm-up window is skipped"
        # mfu is fsdp_train's own: tokens/s x flops per token over the peak given with --peak-tflops, attention
        # counted over each packed document (shorter than the row, so between no attention and whole rows)
        low, high = (
            r["tokens_per_s"] * result[k] / 1e12 for k in ("flops_per_token_without_attention", "flops_per_token")
        )
        assert 0.95 * low < r["mfu"] < 0.99 * high, (low, r["mfu"], high)
        assert r["mem_peak_alloc_gb"] > 0 and r["time_forward_ms"] > 0 and r["time_backward_ms"] > 0
        assert 0 < r["last_loss"] < 2 * math.log(1024), "a tiny model trains from a random start"


@pytest.mark.slow
def test_compare_strategies_quick(repo_root, tmp_path):
    result = run_quick(repo_root, "compare_strategies.py", tmp_path)
    ran = {(r["sharding"], r["cpu_offload"], r["activation_checkpointing"]) for r in result["results"].values()}
    # --quick: the two ends of the memory range and the recomputation switch (the full grid: without --quick)
    assert ran == {("none", "off", "on"), ("full", "on", "off")}, ran
    assert any("hybrid: skipped, one node" in note for note in result["skipped"])
    losses = []
    for key, r in result["results"].items():
        assert r["status"] == "ok", (key, r)
        assert r["tokens_per_s"] > 0 and 0.05 < r["mem_peak_alloc_gb"] < 50
        losses.append(r["final_loss"])
    # same data, seed and batch: sharding and recomputation change speed and memory, not the math
    assert max(losses) - min(losses) < 1e-3 * max(losses), losses
    assert 0 < losses[0] < 2 * math.log(1024)
    assert result["recommended"] in result["results"]
    table = (tmp_path / "compare_strategies.md").read_text()
    assert f"Recommended: {result['recommended']}" in table and "Rule: the fastest setting" in table
    assert table.count("\n| ") == 1 + len(result["results"]), "a header row and one row per setting"
    assert (tmp_path / "compare_strategies.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_data_hf_quick(repo_root, tmp_path):
    result = run_quick(repo_root, "bench_data_hf.py", tmp_path)
    routes = {r["route"]: r for r in result["results"]}
    assert set(routes) == {"data_hf", "standard", "standard_num_proc", "data_hf_all"}
    for name, r in routes.items():
        assert r["returncode"] == 0 and r["output_bytes"] > 0, (name, r)
        assert r["seconds"] > 0 and r["peak_tree_rss_mb"] > 0, (name, r)
    assert routes["data_hf"]["input_bytes"] == routes["standard"]["input_bytes"] < routes["data_hf_all"]["input_bytes"]
    assert [len(runs) for runs in result["runs"].values()] == [1] * 4, "--quick: one repetition per route"


def load_compare_strategies(repo_root: Path):
    sys.path.insert(0, str(repo_root / "bench"))
    try:
        import compare_strategies
    finally:
        sys.path.remove(str(repo_root / "bench"))
    return compare_strategies


def test_profile_peft_reads_the_device_s_busy_time_from_a_trace(repo_root):
    sys.path.insert(0, str(repo_root / "bench"))
    try:
        from profile_peft import trace_summary
    finally:
        sys.path.remove(str(repo_root / "bench"))
    kernel = lambda name, ts, dur: {"cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [  # one step: a matmul and an overlapping copy, a gap (the host), an elementwise kernel and the update
        {"cat": "gpu_user_annotation", "name": "forward", "ts": 0, "dur": 4000},
        kernel("nvjet_sm90_tst_128x256", 0, 2000),
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 1000, "dur": 2000},
        kernel("void at::native::vectorized_elementwise_kernel<8>", 6000, 1000),
        {"cat": "gpu_user_annotation", "name": "update", "ts": 8000, "dur": 2000},
        kernel("void at::native::multi_tensor_apply_kernel", 8000, 1000),
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50},
    ]
    got = trace_summary(events, steps=1)
    assert got["span_ms"] == 9.0 and got["busy_ms"] == 5.0  # 0-3, 6-7, 8-9 ms: 4 ms of the 9 waited
    assert got["kernel_ms"] == {"matmul": 2.0, "copy": 2.0, "elementwise": 1.0, "optimizer": 1.0}
    assert got["phases_ms"] == {"forward": {"window": 4.0, "kernels": 4.0}, "update": {"window": 2.0, "kernels": 1.0}}
    assert trace_summary([e for e in events if e["cat"] == "cpu_op"], steps=1) == {}  # a CPU run has no kernels


def test_compare_strategies_recommendation_rule(repo_root):
    cs = load_compare_strategies(repo_root)

    def ok(tokens_per_s: float, mem: float) -> dict:
        return {"status": "ok", "tokens_per_s": tokens_per_s, "mem_peak_alloc_gb": mem, "final_loss": 1.0}

    results = {"none": ok(1000, 9.0), "grad-op": ok(990, 6.0), "full": ok(800, 4.0), "bad": {"status": "OOM"}}
    assert cs.recommend(results, 10.0)[0] == "grad-op", "within 5% of the fastest, less memory"
    assert cs.recommend(results, 5.0)[0] == "full", "the only one that fits"
    key, reason = cs.recommend(results, 1.0)
    assert key == "full" and "no setting fits in 1.00 GiB" in reason
    assert cs.recommend({"bad": {"status": "failed"}}, 1.0) == (None, "no setting ran")


def test_last_loss_passes_over_windows_without_trained_tokens(repo_root):
    """A log window in which no token was trained logs loss null: the benches report the last real loss (they
    crashed formatting None)."""
    last_loss = load_compare_strategies(repo_root).last_loss  # bench/common.py's, as every bench imports it
    assert last_loss([{"loss": 2.5}, {"loss": None}]) == 2.5
    assert math.isnan(last_loss([{"loss": None}])) and math.isnan(last_loss([]))


def test_compare_strategies_hybrid_only_with_nodes(repo_root, monkeypatch):
    cs = load_compare_strategies(repo_root)
    monkeypatch.delenv("NNODES", raising=False)
    monkeypatch.setenv("SLURM_NNODES", "4")
    assert cs.detect_nnodes(0) == 4 and cs.detect_nnodes(2) == 2
    monkeypatch.delenv("SLURM_NNODES")
    assert cs.detect_nnodes(0) == 1
    one, skipped = cs.strategy_settings(1)
    assert len(one) == 8 and "hybrid" not in {s.sharding for s in one} and skipped
    quick, _ = cs.strategy_settings(1, quick=True)
    assert [s.key for s in quick] == ["none ac=on", "full+offload ac=off"]
    two, skipped = cs.strategy_settings(2)
    assert {s.key for s in two} - {s.key for s in one} == {"hybrid ac=on", "hybrid ac=off"} and not skipped


@pytest.mark.slow
def test_peft_bench_quick(repo_root, tmp_path):
    result = run_quick(repo_root, "bench_peft.py", tmp_path)
    assert result["gpu"] == "not measured (--quick)"
    runs, summary = result["cpu"]["runs"], result["cpu"]["summary"]
    p = result["params"]["cpu"]
    for mode in ("none", "lora", "qlora"):
        (run,) = runs[mode]
        assert run["status"] == "ok", (mode, run)
        assert len(run["windows_tokens_per_s"]) == p["steps"] // p["log_freq"], "one window per metric line"
        assert run["tokens_per_s"] > 0 and 0 < run["idle_rss_gib"] < run["peak_gib"] <= run["run_peak_rss_gib"]
        assert 0 < run["last_loss"] < 2 * math.log(p["vocab"]), "every mode trains the same small model"
    figures = summary["figures"]
    assert figures["none"]["trainable"] == figures["none"]["total"], "full fine-tuning trains every weight"
    assert 0 < figures["lora"]["trainable"] == figures["qlora"]["trainable"] < figures["lora"]["total"] / 10
    assert figures["lora"]["base_dtypes"] == "bfloat16" and figures["qlora"]["base_dtypes"] == "bfloat16+nf4"
    # NF4 is ~0.52 bytes per weight against bf16's 2: a QLoRA run whose base silently stayed bf16 would read ~1.0
    assert summary["decoder_linear"]["qlora_over_lora"] == pytest.approx(0.258, abs=0.01)
    assert set(result["cpu"]["goal_met"]) == {
        "lora_over_full_peak",
        "qlora_over_lora_base",
        "lora_over_full_tokens_per_s",
    }
    for ratio in summary["ratios"].values():
        assert 0.1 < ratio < 10, summary["ratios"]


@pytest.mark.slow
def test_dpo_bench_quick(repo_root, tmp_path):
    result = run_quick(repo_root, "bench_dpo.py", tmp_path)
    assert result["gpu"] == "not measured (--quick)"
    runs, summary = result["cpu"]["runs"], result["cpu"]["summary"]
    assert runs["lora"] == [], "--quick runs ours (full weights) and the baseline"
    for mode in ("full", "baseline"):
        (run,) = runs[mode]
        assert run["status"] == "ok", (mode, run)
        assert run["pairs_per_s"] > 0 and 0 < run["idle_rss_gib"] < run["peak_gib"] <= run["run_peak_rss_gib"]
        assert 0 < run["last_loss"] < 5, "every side trains the same small model from ln 2"
    figures = summary["figures"]
    assert figures["full"]["precompute_s"] > 0, "full weights precompute the reference"
    check = figures["full"]["token_check"]
    # both sides train the same response tokens, and our precomputed reference is the baseline's live one
    assert check["response_tokens_equal"] == check["sequences"] == check["baseline_sequences"] > 0, check
    assert check["reference"]["max_rel_diff"] < 0.01, check["reference"]
    assert set(result["cpu"]["goal_met"]) == {"full_over_baseline_peak", "full_over_baseline_pairs_per_s"}
    for ratio in summary["ratios"].values():
        assert 0.1 < ratio < 10, summary["ratios"]


@pytest.mark.slow
def test_grpo_bench_quick(repo_root, tmp_path):
    # the tokenizer learns all 1,024; completions of up to 20 tokens (--quick's 16 + 4), the sequence grown as much
    result = run_quick(repo_root, "bench_grpo.py", tmp_path, "--vocab", "1024", "--max-new-tokens", "20")
    assert result["gpu"].startswith("not measured") and result["data"]["cpu"]["vocab"] == 1024
    quick = result["params"]["cpu"]
    assert quick["max_new_tokens"] == 20 and quick["seq"] == 64 + 4, quick  # --quick: seq 64 for 16 tokens
    runs, summary = result["cpu"]["runs"], result["cpu"]["summary"]
    p = result["params"]["cpu"]
    completions = p["nproc"] * p["prompts_per_rank"] * p["num_generations"]
    assert runs["ours_off"] == [], "--quick runs ours and the baseline (the GRPO tests compare on and off)"
    for mode in ("ours", "baseline"):
        (run,) = runs[mode]
        assert run["status"] == "ok", (mode, run)
        assert run["steps"] == p["steps"], "one window per optimizer step"
        assert 0 < run["generation_s"] < run["step_s"], "generation is a part of the step"
        assert run["generation_tokens_per_s"] > 0 and run["tokens_per_s"] > 0
        assert 0 < run["idle_rss_gib"] < run["peak_gib"] <= run["run_peak_rss_gib"]
        # every completion has 1 to --max-new-tokens tokens, counted the same way on both sides
        assert completions <= run["generated_tokens_per_step"] <= completions * p["max_new_tokens"]
        assert all(0 <= r <= 1 for r in run["rewards"]), "the accuracy reward is 0 or 1 per completion"
        assert all(abs(x) < 1 for x in run["losses"]), "ratio 1: the loss is advantages x length terms, near 0"
    figures = summary["figures"]
    assert figures["ours"]["layers_kept_gathered"] == "yes"
    assert figures["baseline"]["refresh_s"] > 0, "the baseline gathers its copy's weights every step"
    check = summary["prompts"]
    assert check["equal"] == check["steps"] == p["steps"], "both sides train the same prompts at every step"
    assert set(result["cpu"]["goal_met"]) == {
        "ours_over_baseline_step_s",
        "ours_over_baseline_peak",
        "ours_over_baseline_generation_tokens_per_s",
    }
    for ratio in summary["ratios"].values():
        assert 0.1 < ratio < 10, summary["ratios"]


@pytest.mark.slow
def test_gpu_check_dry_run(repo_root, tmp_path):
    """bench/gpu_check.py --dry-run: every section's plumbing on CPU (launches, metrics, claims, JSON, markdown);
    its claims are marked dry run and only a crashed section or launch fails it."""
    proc = subprocess.run(
        [sys.executable, str(repo_root / "bench" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path)],
        cwd=repo_root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = result["sections"]
    names = ["kernels", "mfu", "peft", "dpo", "resume", "fp8", "grpo", "longctx", "scale"]
    assert result["dry_run"] and list(sections) == names
    for name, section in sections.items():
        assert section["error"] is None and section["rows"], (name, section)
        assert f"{name}: launches" in [c["name"] for c in section["claims"]], name
    assert all(c["dry_run"] for c in result["claims"]) and result["exit_code"] == 0
    (mfu,) = sections["mfu"]["rows"]
    assert mfu["status"] == "ok" and mfu["tokens_per_s"] > 0 and 0 < mfu["mfu"] < 1, mfu  # nominal 1 TFLOP/s peak
    assert [r["status"] for r in sections["peft"]["rows"]] == ["not measured"] * 6  # its launches: bench_peft --quick
    assert [r["status"] for r in sections["grpo"]["rows"]] == ["not measured"] * 2  # its launch: bench_grpo --quick
    assert [r["status"] for r in sections["fp8"]["rows"]] == ["not measured"] * 4  # tests/test_fsdp_train_float8.py
    # longctx: the plain row is not launched, the offload + tiled-MLP row trains (the longest that fits: reported)
    plain, offload = sections["longctx"]["rows"]
    assert plain["status"] == "not measured" and offload["status"] == "ok" and offload["tokens_per_s"] > 0, offload
    longest = {c["name"]: c for c in sections["longctx"]["claims"]}["longest sequence, offload"]
    assert longest["measured"].startswith("512 tokens train"), longest
    # scale: the 8B-shaped model's route (--init with size overrides and weights) with LoRA's flags, on a tiny preset
    assert [r["status"] for r in sections["scale"]["rows"]] == ["not measured", "not measured", "ok"]
    assert sections["scale"]["rows"][2]["tokens_per_s"] > 0
    twice = {c["name"]: c for c in sections["resume"]["claims"]}["steps trained twice"]
    assert twice["passed"] is True and twice["value"] == 0, twice  # the resumed steps' losses, bit for bit
    text = (tmp_path / "gpu_check.md").read_text()
    assert "## Claims" in text and all(f"## {name} (" in text for name in sections)


@pytest.mark.slow
def test_optimizer_quick(repo_root, tmp_path):
    """The optimizer step on local shards against the DTensor step it replaced (2 processes): both ran, and
    from the same state they move the parameters to the same values (the clip: a multiply on one side, a divide
    in the fused kernel on the other)."""
    result = run_quick(repo_root, "bench_optimizer.py", tmp_path)
    assert all(len(times) == result["reps"] for times in result["times"].values())
    assert result["max_param_difference"] < 1e-6


@pytest.mark.slow
def test_lora_kernel_quick(repo_root, tmp_path):
    result = run_quick(repo_root, "bench_lora_kernel.py", tmp_path)
    assert result["fused"] == result["adapted"] == 7, "every projection of the layer runs the fused kernel"
    assert result["max_output_difference"] < 1e-5 and result["max_input_grad_difference"] < 1e-5  # fp32
    assert result["saved_bytes"]["fused"] <= result["saved_bytes"]["peft"]
    assert 0 < result["speedup"] < math.inf  # a time ratio: measured, not asserted (8.3 on a loaded machine)


@pytest.mark.slow
def test_profile_peft_quick(repo_root, tmp_path):
    """bench/profile_peft.py --quick: full fine-tuning and LoRA profiled on CPU through fsdp_train.py --profile-steps,
    each run's operator table parsed (LoRA's through the fused kernel)."""
    result = run_quick(repo_root, "profile_peft.py", tmp_path)
    full, lora = result["runs"]["full"], result["runs"]["lora"]
    assert full["tokens_per_s"] > 0 and lora["tokens_per_s"] > 0
    assert "aten::mm" in full["ops"] and "LoRALinearBackward" in lora["ops"], lora["ops"]  # microseconds per operator
    assert (tmp_path / "profile_peft" / "lora" / "rank0.txt").is_file()
