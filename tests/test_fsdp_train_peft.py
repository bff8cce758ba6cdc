"""--peft lora/qlora: LoRA under FSDP2 equals peft on the unsharded model, the base never changes, checkpoints hold
only what trains and resume exactly (kill -9, another process count), the adapter export loads with
PeftModel.from_pretrained and the merged one equals merge_and_unload, --adapter continues from it, QLoRA's base is
4-bit in memory, and the other paths (chat SFT, MoE, CPU offload, compile) train. Bad flags exit 2, writing nothing."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fsdp_lib.testing import llama_sizes, save_model, tiny_config
from tests.fsdp_helpers import (
    REPO_ROOT,
    killed_at_step,
    launch_env,
    losses_by_step,
    make_chat_dataset,
    make_chat_model,
    make_dataset,
    make_model,
    output_of,
    read_metrics,
    run_trainer,
    trainer_args,
)

pytestmark = pytest.mark.slow

WORKERS = REPO_ROOT / "tests" / "workers"
STEPS = 8
TARGETS = "q_proj,v_proj,down_proj"
# constant learning rate: a run stopped at step 4 and resumed to step 8 has the schedule of one run to step 8
LORA = ["--peft", "lora", "--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", TARGETS]
COMMON = ["--max-steps", str(STEPS), "--ckpt-freq", "4", "--lr-schedule", "constant", "--warmup-steps", "0"]


@pytest.fixture(scope="module")
def peft_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A corpus and a Llama wide enough for NF4 (each rank's part of every Linear holds whole 64 x 256 blocks)."""
    root = tmp_path_factory.mktemp("peft_inputs")
    model = make_model(root / "model", with_weights=True, tied=False, dtype="bfloat16", sizes=llama_sizes(256, 2))
    return make_dataset(root / "corpus"), model


def lora_args(peft_inputs, save: Path, exp: str = "run", *extra: str) -> list[str]:
    dataset, model = peft_inputs
    return [*trainer_args(exp, dataset, model, save), *LORA, *COMMON, *extra]


@pytest.fixture(scope="module")
def lora_run(peft_inputs, tmp_path_factory) -> Path:
    """The uninterrupted 2-process LoRA run (with the merged export) the other tests compare with."""
    save = tmp_path_factory.mktemp("lora_run")
    proc = run_trainer(lora_args(peft_inputs, save, "run", "--export-merged", "on"), script=WORKERS / "peft_check.py")
    assert proc.returncode == 0, output_of(proc)
    # the run the reference (peft's own modules, unsharded) is compared with runs the fused kernel everywhere
    assert "6 of 6 adapted Linear modules run the fused LoRA kernel" in output_of(proc)
    return save / "run"


def test_lora_on_two_processes_equals_peft_on_the_unsharded_model(peft_inputs, lora_run, tmp_path):
    args = lora_args(peft_inputs, tmp_path, "ref", "--grad-accum-steps", "2")  # the global batch of 2 processes
    reference = run_trainer(args, nproc=1, script=WORKERS / "lora_reference.py")
    assert reference.returncode == 0, output_of(reference)
    expected = json.loads((tmp_path / "ref" / "reference.json").read_text())
    losses = losses_by_step(lora_run)
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in expected["losses"].items():
        assert losses[int(step)] == pytest.approx(loss, rel=1e-5), step
    assert losses[STEPS] < losses[1]
    from safetensors.torch import load_file

    exported = load_file(str(lora_run / "final" / "adapter_model.safetensors"))
    assert len(exported) == len(expected["adapters"]) == 2 * 2 * 3  # A and B of 3 targets in 2 layers
    # readable as the export's other files are (safetensors' save_file made it 0600: no serving account read it)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (lora_run / "final").iterdir() if p.is_file()}
    assert modes["adapter_model.safetensors"] == modes["adapter_config.json"], modes
    for key, value in expected["adapters"].items():
        want, got = torch.tensor(value), exported[f"base_model.model.{key}"]
        # per tensor, relative to its norm: AdamW's first steps move each weight by about lr x sign(gradient), so
        # a gradient within rounding of 0 (summed in another order over 2 ranks) can move one element differently
        assert (got - want).norm() / want.norm() < 2e-5, (key, ((got - want).norm() / want.norm()).item())


def test_only_adapters_train_and_the_checkpoint_holds_only_them(lora_run):
    report = json.loads((lora_run / "peft_check.json").read_text())
    assert report["base_unchanged"] and report["frozen_count"] > 0
    assert report["optimizer_params"] and all(".lora_A." in n or ".lora_B." in n for n in report["optimizer_params"])
    assert len(report["optimizer_params"]) == 12
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(lora_run / "checkpoint" / f"step_{STEPS:08d}")).read_metadata()
    model_keys = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys), model_keys[:5]
    state = json.loads((lora_run / "checkpoint" / f"step_{STEPS:08d}" / "train_state.json").read_text())
    assert state["fingerprint"]["peft"]["mode"] == "lora" and state["fingerprint"]["peft"]["base_weights"] != "none"


def test_kill9_rerun_is_bit_identical_and_one_process_continues_it(peft_inputs, lora_run, tmp_path):
    """kill -9 at step 5 (checkpoints every 2 steps here, which the resume does not pin); the same command resumes at
    4 and trains steps 5-6 bit for bit as the uninterrupted run, until it is killed right after saving step 6 (a
    fault point); then one process (--grad-accum-steps 2: the same global batch) continues to the end."""
    args = lora_args(peft_inputs, tmp_path, "run", "--ckpt-freq", "2")
    killed_at_step(args, tmp_path / "run", 5)
    rerun = run_trainer(args, env={"FSDP_TRAIN_FAULT": "kill_after_rename@0:6"})
    assert rerun.returncode != 0 and "at step 4" in output_of(rerun), output_of(rerun)
    assert "loaded pretrained weights" in output_of(rerun), "the checkpoint holds the adapters: the base is read"
    expected, resumed = losses_by_step(lora_run), losses_by_step(tmp_path / "run")
    assert all(resumed[s] == expected[s] for s in range(5, 7)), (resumed, expected)
    one = run_trainer([*args, "--grad-accum-steps", "2"], nproc=1)
    assert one.returncode == 0, output_of(one)
    assert "world size changed (2 -> 1)" in output_of(one) and "at step 6" in output_of(one)
    got = losses_by_step(tmp_path / "run")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(7, STEPS + 1):
        assert got[step] == pytest.approx(expected[step], rel=1e-5), step


def test_exported_adapter_loads_with_peft_and_merged_equals_merge_and_unload(peft_inputs, lora_run):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _, model_dir = peft_inputs
    config = json.loads((lora_run / "final" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(model_dir.resolve()) and config["r"] == 4
    assert (lora_run / "final" / "tokenizer.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, lora_run / "final")
    report = json.loads((lora_run / "peft_check.json").read_text())
    with torch.no_grad():
        logits = peft_model(input_ids=torch.tensor(report["inputs"])).logits
    torch.testing.assert_close(logits, torch.tensor(report["logits"]), rtol=1e-5, atol=1e-5)
    merged = peft_model.merge_and_unload().state_dict()
    exported = {}
    for path in sorted((lora_run / "final-merged").glob("*.safetensors")):
        exported.update(load_file(str(path)))
    assert set(exported) == set(merged) - {"lm_head.weight"} | ({"lm_head.weight"} & set(exported))
    for key, value in exported.items():  # --export-dtype auto: the model's own bf16
        torch.testing.assert_close(value.float(), merged[key].to(value.dtype).float(), rtol=1e-5, atol=1e-5)


def test_adapter_flag_continues_from_an_exported_adapter(peft_inputs, lora_run, tmp_path):
    args = lora_args(peft_inputs, tmp_path, "more", "--adapter", str(lora_run / "final"))
    args[args.index("--max-steps") + 1] = "2"
    proc = run_trainer(args)
    assert proc.returncode == 0, output_of(proc)
    assert f"adapters from {lora_run / 'final'}" in output_of(proc)
    rows = [json.loads(line) for line in (tmp_path / "more" / "metrics.jsonl").read_text().splitlines()]
    start = next(r["val_loss"] for r in rows if r["step"] == 0)
    trained = [json.loads(line) for line in (lora_run / "metrics.jsonl").read_text().splitlines()]
    end = [r["val_loss"] for r in trained if "val_loss" in r][-1]
    assert start == pytest.approx(end, rel=1e-5)  # the continued run starts where the first one ended


def test_qlora_base_is_4bit_in_memory_trains_and_exports(peft_inputs, tmp_path):
    dataset, model_dir = peft_inputs
    args = [*trainer_args("q", dataset, model_dir, tmp_path), "--peft", "qlora", "--lora-rank", "4", "--max-steps", "8"]
    proc = run_trainer([*args, "--export-merged", "on"], script=WORKERS / "peft_check.py")
    out = output_of(proc)
    assert proc.returncode == 0, out
    assert "frozen base stored as float32+nf4" in out
    assert "0 of 14 adapted Linear modules run the fused LoRA kernel" in out  # NF4 bases keep peft's forward
    report = json.loads((tmp_path / "q" / "peft_check.json").read_text())
    assert report["base_unchanged"]
    rows = read_metrics(tmp_path / "q")
    assert rows[-1]["loss"] < rows[0]["loss"]
    # rank 0's NF4 weights: 4-bit codes + an 8-bit scale per 64 + an fp32 factor per 256 scales = 0.516 B/weight
    assert report["nf4_numel"] > 0 and report["nf4_bytes"] / report["nf4_numel"] < 0.55
    assert "kept in the compute dtype" not in out  # 256 and 640 wide: every decoder Linear is whole NF4 blocks
    # each rank read and quantised its own rows of every NF4 weight (none whole), and holds exactly the rows that
    # quantising the whole weight gives (the double quantisation's tensor-wide mean from every rank's scales)
    assert report["nf4_fills"]["rows"] == 2 * 7 and report["nf4_fills"]["whole"] == 0, report["nf4_fills"]
    assert report["nf4_as_whole"]
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(base, tmp_path / "q" / "final")
    assert loaded(input_ids=torch.tensor([[3, 4, 5]])).logits.isfinite().all()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "q" / "final-merged")
    assert merged(input_ids=torch.tensor([[3, 4, 5]])).logits.isfinite().all()
    # Two more steps without --export-merged: final/ holds step 10, and the merged export left from step 8 is named
    more = run_trainer([*args[:-1], "10"])
    assert more.returncode == 0, output_of(more)
    assert f"WARNING: {tmp_path / 'q' / 'final-merged'} holds step 8, not step 10" in output_of(more)
    assert json.loads((tmp_path / "q" / "final" / ".export.json").read_text())["step"] == 10


@pytest.fixture(scope="module")
def moe_chat_model(tmp_path_factory) -> Path:
    """A tiny Mixtral whose tokenizer carries the llama3 chat template."""
    from transformers import AutoTokenizer

    folder = make_chat_model(tmp_path_factory.mktemp("moe") / "model", "llama3")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return save_model(folder, tiny_config("mixtral", len(tokenizer), tokenizer.eos_token_id), with_weights=True)


def test_lora_chat_sft_on_a_moe_model_with_cpu_offload_and_compile(moe_chat_model, tmp_path):
    dataset = make_chat_dataset(tmp_path / "chat")
    args = [*trainer_args("moe", dataset, moe_chat_model, tmp_path), "--peft", "lora", "--lora-rank", "4"]
    proc = run_trainer([*args, "--max-steps", "6", "-b", "2", "--cpu-offload", "on", "--compile", "on"])
    out = output_of(proc)
    assert proc.returncode == 0, out
    assert "loss on assistant tokens" in out and "cpu offload on" in out
    targets = json.loads((tmp_path / "moe" / "final" / "adapter_config.json").read_text())["target_modules"]
    assert set(targets) == {"q_proj", "k_proj", "v_proj", "o_proj"}  # the experts and the router stay frozen
    assert all(math.isfinite(r["loss"]) for r in read_metrics(tmp_path / "moe"))
    from safetensors.torch import load_file

    lora_b = [
        v for k, v in load_file(str(tmp_path / "moe" / "final" / "adapter_model.safetensors")).items() if "lora_B" in k
    ]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b)  # every adapter trained (B starts at 0)
    # the folder loads as the README says (peft 0.22 leaves target_parameters = set(), written as "set()": it did not)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(moe_chat_model, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path / "moe" / "final")
    assert loaded(input_ids=torch.tensor([[3, 4, 5]])).logits.isfinite().all()


def test_target_modules_that_peft_would_misread_are_named_whole_or_refused():
    """auto on Qwen2-MoE selects the attention and the shared expert's MLP; by leaf name (down_proj) peft also
    wrapped the stacked experts' down_proj parameter, and the run died telling the user to re-download the model:
    the names are given whole there. lm_head of a tied model is the embedding: a merged export dropped its adapter
    in silence (the head re-tied to the unchanged embedding); refused."""
    from transformers import AutoModelForCausalLM

    from fsdp_lib.model.adapters import resolve_targets
    from fsdp_lib.model.anatomy import find_decoder_layers
    from fsdp_lib.model.build import parameters_on_meta

    def built(arch: str, **kw):
        with parameters_on_meta():
            model = AutoModelForCausalLM.from_config(tiny_config(arch, 256, 0, **kw))
        return model, find_decoder_layers(model)

    targets, problem = resolve_targets("auto", *built("qwen2_moe"))
    assert problem is None and isinstance(targets, list) and "model.layers.0.mlp.shared_expert.down_proj" in targets
    assert not any(".experts." in t for t in targets) and "down_proj" not in targets
    targets, problem = resolve_targets("auto", *built("mixtral"))  # no name shared with the experts: leaf names
    assert problem is None and targets == ["k_proj", "o_proj", "q_proj", "v_proj"]
    tied = built("llama")
    assert tied[0].get_output_embeddings().weight is tied[0].get_input_embeddings().weight
    _, problem = resolve_targets("q_proj,lm_head", *tied)
    assert problem and "lm_head of LlamaForCausalLM is tied to the input embedding" in problem, problem


def test_qlora_keeps_weights_that_are_not_whole_blocks_and_refuses_uneven_splits():
    from transformers import AutoModelForCausalLM

    from fsdp_lib.errors import TrainError
    from fsdp_lib.model.anatomy import find_decoder_layers
    from fsdp_lib.model.build import parameters_on_meta
    from fsdp_lib.model.quantize import quantize_linears_on_meta

    def layers():
        config = tiny_config("llama", 256, 0, sizes=llama_sizes(128, 1))  # q_proj 128 x 128 = 1 block; MLP 320 wide
        with parameters_on_meta():
            return find_decoder_layers(AutoModelForCausalLM.from_config(config))

    nf4, kept = quantize_linears_on_meta(layers(), torch.float32, 1)
    assert "self_attn.q_proj.weight" in nf4 and [k.split()[0] for k in kept] == [
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    with pytest.raises(TrainError, match=r"q_proj.weight \(128, 128\) cannot be sharded as NF4 over 2 processes"):
        quantize_linears_on_meta(layers(), torch.float32, 2)  # half a block per rank: refused, never kept


# --- bad input: exit 2, nothing written ---------------------------------------------------------------------------


def config_problems(args: list[str]) -> list[str]:
    from fsdp_lib.checks import validate_config
    from fsdp_lib.config import load_config
    from fsdp_lib.model.build import peft_problems

    cfg = load_config(args)
    return validate_config(cfg, 2) or peft_problems(cfg)


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--peft", "lora", "--lora-rank", "0"], "--lora-rank must be at least 1"),
        (["--peft", "lora", "--lora-target-modules", "q_proj,qkv"], "no Linear layer named qkv"),
        (["--lora-rank", "8"], "--lora-rank needs --peft lora or qlora"),
        (["--peft", "qlora", "--sharding", "hybrid", "--hybrid-shard-size", "2"], "1-D mesh only"),
    ],
)
def test_bad_peft_flags_are_named(peft_inputs, tmp_path, extra, expected):
    dataset, model = peft_inputs
    problems = config_problems([*trainer_args("bad", dataset, model, tmp_path), *extra])
    assert any(expected in p for p in problems), problems
    if "qkv" in expected:
        assert "gate_proj" in problems[0] and "o_proj" in problems[0]  # the model's Linear names are listed


@pytest.mark.parametrize(
    "extra,said",
    [
        ({"target_modules": ["q_proj", "embed_tokens"]}, "adapters on embeddings (model.embed_tokens)"),
        ({"use_dora": True}, "DoRA (use_dora)"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head'] (whole trained copies of those modules)"),
        ({"bias": "lora_only"}, "trained biases (bias 'lora_only')"),
    ],
)
def test_an_adapter_made_elsewhere_with_what_the_trainer_does_not_build_is_named(peft_inputs, tmp_path, extra, said):
    """An embedding adapter died with a traceback ('Embedding' object has no attribute 'num_embeddings'); DoRA and
    modules_to_save were refused as "trained on another base"."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dataset, model = peft_inputs
    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "task_type": "CAUSAL_LM", **extra})
    get_peft_model(AutoModelForCausalLM.from_pretrained(model), config).save_pretrained(tmp_path / "adapter")
    args = [*trainer_args("bad", dataset, model, tmp_path), "--peft", "lora", "--adapter", str(tmp_path / "adapter")]
    (problem,) = config_problems(args)
    assert said in problem and "which this trainer does not train or export" in problem, problem


def test_lora_flags_the_adapter_overrides_are_refused_when_they_differ(peft_inputs, lora_run, tmp_path):
    """With --adapter the adapter's config sets rank, alpha, dropout and targets: flags that said otherwise were
    ignored in silence (exit 0, rank 4 trained after --lora-rank 8); the same values pass."""
    dataset, model = peft_inputs
    same = lora_args(peft_inputs, tmp_path, "more", "--adapter", str(lora_run / "final"))
    assert config_problems(same) == []
    other = [*same, "--lora-rank", "8", "--lora-target-modules", "q_proj"]
    problems = config_problems(other)
    assert len(problems) == 2 and problems[0].startswith("--lora-rank 8 differs from --adapter"), problems
    assert "'s 4: the adapter's own adapter_config.json sets" in problems[0] and "drop --lora-rank" in problems[0]
    assert problems[1].startswith("--lora-target-modules ['q_proj'] differs from --adapter"), problems


def test_an_adapter_folder_given_as_the_model_says_how_to_use_it(peft_inputs, lora_run, tmp_path):
    """-m outputs/EXP/final of a LoRA run (the README's DPO example after a LoRA SFT) said only "folder has no
    config.json"."""
    dataset, model = peft_inputs
    problems = config_problems(trainer_args("bad", dataset, lora_run / "final", tmp_path))
    assert any(
        f"is a LoRA adapter, not a model: pass its base, -m {model}, with --peft lora --adapter {lora_run / 'final'}"
        f", or the merged model -m {lora_run / 'final-merged'}" in p
        for p in problems
    ), problems


def test_qlora_on_a_model_without_linear_layers_is_refused(peft_inputs, tmp_path):
    """GPT-2's Conv1D layers: --peft qlora quantised nothing and said nothing (it trained as LoRA)."""
    dataset, _ = peft_inputs
    gpt2 = make_model(tmp_path / "gpt2", arch="gpt2")
    (problem,) = config_problems([*trainer_args("bad", dataset, gpt2, tmp_path), "--peft", "qlora"])
    assert "GPT2LMHeadModel's decoder layers have none (Conv1D" in problem and "use --peft lora" in problem, problem


def test_qlora_without_torchao_is_refused(peft_inputs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    dataset, model = peft_inputs
    problems = config_problems([*trainer_args("bad", dataset, model, tmp_path), "--peft", "qlora"])
    assert any("--peft qlora needs the torchao package" in p for p in problems), problems


def test_adapter_of_another_base_exits_2_and_writes_nothing(peft_inputs, lora_run, tmp_path):
    dataset, _ = peft_inputs
    other = make_model(tmp_path / "other", with_weights=True, tied=False, sizes=llama_sizes(128, 2))
    args = [
        *trainer_args("bad", dataset, other, tmp_path / "out"),
        "--peft",
        "lora",
        "--adapter",
        str(lora_run / "final"),
    ]
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "fsdp_train.py"), *args],
        capture_output=True,
        text=True,
        env=launch_env(),
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert proc.returncode == 2, output_of(proc)
    assert "--adapter" in output_of(proc) and "another base" in output_of(proc)
    assert not (tmp_path / "out").exists()


def test_qlora_on_one_process_trains_and_resumes_on_two(peft_inputs, tmp_path):
    """A shard group of one process (one GPU): FSDP2 skips the all-gather there, which NF4 cannot take, so its
    frozen weights are left out of FSDP; the checkpoint (adapters and optimizer) then resumes on two processes."""
    dataset, model_dir = peft_inputs
    args = [*trainer_args("q1", dataset, model_dir, tmp_path), "--peft", "qlora", "--lora-rank", "4"]
    args += ["--ckpt-freq", "3", "--global-batch-size", "2"]  # accumulation 2 on one process, 1 on two
    first = run_trainer([*args, "--max-steps", "3"], nproc=1)
    assert first.returncode == 0, output_of(first)
    assert "frozen base stored as float32+nf4" in output_of(first)
    resumed = run_trainer([*args, "--max-steps", "5"])
    out = output_of(resumed)
    assert resumed.returncode == 0, out
    assert "world size changed (1 -> 2)" in out and (tmp_path / "q1" / "final" / "adapter_config.json").is_file()
    assert sorted(losses_by_step(tmp_path / "q1")) == [1, 2, 3, 4, 5]
