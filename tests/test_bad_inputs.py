"""Bad input across the tools, as a careless user gives it: each case is refused with a message naming the flag (or
the folder) and the fix and a non-zero exit, and every byte that existed before is still there afterwards. Most
cases run no training step: the tools refuse before any work. This table holds the cases that cross tools (one tool
pointed at another's folders) and the trainer's; tests/test_bad_inputs_data_hf.py and test_bad_inputs_tools.py hold
data_hf's own and organize_data's and model_download's."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

import data_hf
import fsdp_train
from tests.bad_inputs import (
    Case,
    check_refused,
    data_hf_case,
    make_raw,
    make_user_folders,
    model_download_case,
    organize_case,
    snapshot,
    trainer_case,
    trainer_flags,
)

CASES = [
    data_hf_case(
        "data_hf --overwrite onto a training experiment",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "outputs" / "exp", "--overwrite"],
        "--save_dir",
        "a training experiment of fsdp_train.py",
        "replaces only a dataset",
        "choose another --save_dir",
    ),
    data_hf_case(
        "data_hf --overwrite onto a model folder",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "model", "--overwrite"],
        "--save_dir",
        "a model folder (config.json)",
        "choose another --save_dir",
    ),
    data_hf_case(
        "data_hf --overwrite onto organize_data's split folders",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "splits", "--overwrite"],
        "split folders of organize_data.py",
        "choose another --save_dir",
    ),
    data_hf_case(
        "data_hf --overwrite onto a folder of the user's own files",
        lambda r: ["--data_folder", r / "splits", "--save_dir", r / "raw", "--overwrite"],
        "not a dataset written by data_hf.py",
        "refusing to delete it even with --overwrite",
    ),
    data_hf_case(
        "data_hf reading a dataset it already wrote",
        lambda r: ["--data_folder", r / "dataset", "--save_dir", r / "again"],
        "--data_folder",
        "is a dataset",
        "not raw files",
        "fsdp_train.py -d",
    ),
    data_hf_case(
        "data_hf with --data-folder given twice (the first was dropped in silence)",
        lambda r: ["--data-folder", r / "raw", "--data-folder", r / "splits", "--save_dir", r / "again"],
        "--data-folder is given twice (",
        "raw, then --data-folder ",
        "splits); pass it once",
        exit_code=2,
    ),
    organize_case(
        "organize_data with --dst-root given twice",
        lambda r: ["--src-dir", r / "raw", "--dst-root", r / "a", "--dst_root", r / "b"],
        "--dst-root is given twice",
        "then --dst_root",
    ),
    model_download_case(
        "model_download with --local-dir given twice",
        lambda r: ["--init", "tiny", "--local-dir", r / "a", "--local-dir", r / "b", "--tokenizer-from", r / "dataset"],
        "--local-dir is given twice",
        exit_code=2,
    ),
    data_hf_case(
        "data_hf reading a training experiment",
        lambda r: ["--data_folder", r / "outputs" / "exp", "--save_dir", r / "again"],
        "--data_folder",
        "a training experiment of fsdp_train.py",
        "pass the folder that holds your raw files",
    ),
    data_hf_case(
        "data_hf reading a model folder",
        lambda r: ["--data_folder", r / "model", "--save_dir", r / "again"],
        "--data_folder",
        "a model folder",
        "pass the folder that holds your raw files",
    ),
    data_hf_case(
        "data_hf --format auto on conversations that are all invalid",
        lambda r: ["--data_folder", r / "bad_chat", "--save_dir", r / "again"],
        "--format auto: all 4 record(s) have the shape of conversations or preference pairs but none could be used",
        "unknown_role",
        "pass --format text",
    ),
    data_hf_case(
        "data_hf --format auto on preference pairs whose responses are all identical",
        lambda r: ["--data_folder", r / "same_pairs", "--save_dir", r / "again"],
        "--format auto: all 4 record(s)",
        "identical_responses",
    ),
    model_download_case(
        "model_download --init --overwrite onto a training experiment",
        lambda r: [
            "--init",
            "tiny",
            "--tokenizer-from",
            r / "dataset",
            "--local-dir",
            r / "outputs" / "exp",
            "--overwrite",
        ],
        "--local-dir",
        "a training experiment of fsdp_train.py",
        "--overwrite replaces only a model folder",
    ),
    model_download_case(
        "model_download --init --overwrite onto a dataset",
        lambda r: ["--init", "tiny", "--tokenizer-from", r / "dataset", "--local-dir", r / "dataset", "--overwrite"],
        "--local-dir",
        "is a dataset",
    ),
    data_hf_case(
        "data_hf with a million worker processes",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "again", "--num-proc", "1000000"],
        "--num-proc 1000000 must be between 1 and",
        "each worker is a process with its own memory",
    ),
    organize_case(
        "organize_data with a billion split folders",
        lambda r: ["--src-dir", r / "raw", "--dst-root", r / "new_splits", "--num-dirs", "1000000000", "--dry-run"],
        "--num-dirs must be between 1 and 10,000",
    ),
    organize_case(
        "organize_data with no split folders",
        lambda r: ["--src-dir", r / "raw", "--dst-root", r / "new_splits", "--num-dirs", "0"],
        "--num-dirs must be between 1 and 10,000",
    ),
    trainer_case(
        "fsdp_train on a model whose safetensors file was cut short",
        lambda r: trainer_flags(r, "run", "cut_weights"),
        "--model-name",
        "model.safetensors",
        "truncated",
        "fetch the model again",
    ),
    trainer_case(
        "fsdp_train on a verified model whose weight files were deleted (it would train from random weights)",
        lambda r: trainer_flags(r, "run", "gone_weights"),
        "--model-name",
        "no weight files, but model_download_verified.json lists model.safetensors",
        "moved or deleted",
        "fetch the model again",
    ),
    trainer_case(
        "fsdp_train on a model whose tokenizer.json is not JSON",
        lambda r: trainer_flags(r, "run", "bad_tokenizer"),
        "tokenizer.json is not valid JSON",
        "restore it or fetch the model again",
    ),
    trainer_case(
        "fsdp_train on a model whose embedding is smaller than its tokenizer",
        lambda r: trainer_flags(r, "run", "small_vocab"),
        "the tokenizer has ids up to",
        "but the model's embedding has",
        "Use the model's own tokenizer, or resize the embedding",
    ),
    trainer_case(
        "fsdp_train with --sample-prompts that are not UTF-8",
        lambda r: [*trainer_flags(r, "run"), "--sample-prompts", r / "latin1_prompts.txt"],
        "--sample-prompts",
        "not UTF-8 text (byte 18 is 0xe9)",
        "save it as UTF-8",
    ),
    trainer_case(
        "fsdp_train with a --chat-template that is not UTF-8",
        lambda r: [*trainer_flags(r, "run"), "--chat-template", r / "latin1_prompts.txt"],
        "--chat-template",
        "not UTF-8 text",
    ),
    trainer_case(
        "fsdp_train with the token cache as the experiment",
        lambda r: trainer_flags(r, ".token_cache"),
        "--experiment-name '.token_cache'",
        "the project's own folders",
        "choose a plain name",
    ),
    trainer_case(
        "fsdp_train with an experiment named like a dataset folder under --save-dir",
        lambda r: trainer_flags(r, "corpus"),
        "--experiment-name corpus",
        "is a dataset",
        "not an experiment",
        "choose another --experiment-name or --save-dir",
    ),
    trainer_case(
        "fsdp_train with an experiment named like a file under --save-dir",
        lambda r: trainer_flags(r, "summary"),
        "--experiment-name summary:",
        "is a file, not an experiment folder; choose another --experiment-name or --save-dir",
    ),
    trainer_case(
        "fsdp_train with an experiment named like a folder of the user's own files under --save-dir",
        lambda r: trainer_flags(r, "notes"),
        "--experiment-name notes",
        "holds notes.txt, which fsdp_train.py did not write",
        "choose another --experiment-name or --save-dir",
    ),
    trainer_case(
        "fsdp_train with an experiment named like another tool's run folder (config.yaml, metrics.jsonl)",
        lambda r: trainer_flags(r, "legacy"),
        "holds config.yaml, metrics.jsonl but no checkpoint, state or export, and its config.yaml is not a run's",
        "choose another --experiment-name or --save-dir",
    ),
    trainer_case(
        "fsdp_train rerun on an experiment whose checkpoints were deleted (it would start over and replace final/)",
        lambda r: trainer_flags(r, "lost"),
        "--experiment-name lost",
        "names checkpoint checkpoint/step_00000002 (step 2), but no complete checkpoint is left",
        "would start again from step 0 and replace its final/ and metrics.jsonl",
        "To continue, put the checkpoint back",
        "state.json and its final/ yourself",
    ),
]


def run_flags(*extra: str | Path, e: str = "run", d: str = "dataset", m: str = "model") -> Callable[[Path], list]:
    """The trainer's argv under the user's root: -e, -d ROOT/d, -m ROOT/m (the stand-in model folder unless a case
    names a real one; d="hub:ORG/NAME" is a hub id), --save-dir ROOT/outputs, then the case's flags (a later flag of the same name wins)."""
    dataset = d.removeprefix("hub:") if d.startswith("hub:") else None  # a hub id, not a path under the root
    return lambda r: [
        "-e",
        e,
        "-d",
        dataset or r / d,
        "-m",
        r / m,
        "--save-dir",
        r / "outputs",
        "--seq-length",
        "64",
        *extra,
    ]


def under_root(*parts: str) -> Callable[[Path], list]:
    """Flags whose values are paths under the root: '@name' becomes ROOT/name."""
    return lambda r: [r / part[1:] if part.startswith("@") else part for part in parts]


def flag_case(name: str, flags: tuple[str, ...], *message: str, e: str = "run", d: str = "dataset", m: str = "model"):
    """A trainer case that adds flags ('@path' = a path under the root) to a run that is otherwise fine."""
    return trainer_case(name, lambda r: [*run_flags(e=e, d=d, m=m)(r), *under_root(*flags)(r)], *message)


NOT_A_NUMBER = "invalid int value"
TRAINER_FLAG_CASES = [
    flag_case("--seq-length 0", ("--seq-length", "0"), "--seq-length must be at least 1 (got 0)"),
    flag_case("--seq-length abc", ("--seq-length", "abc"), "--seq-length", NOT_A_NUMBER, "fsdp_train.py --help"),
    flag_case(
        "--seq-length beyond the model's positions",
        ("--seq-length", "100000"),
        "--seq-length 100000 exceeds the model's max_position_embeddings",
        "lower --seq-length",
    ),
    flag_case("--lr negative", ("--lr", "-1"), "--lr must be a positive number (got -1.0)"),
    flag_case("--lr zero", ("--lr", "0"), "--lr must be a positive number"),
    flag_case("--lr nan", ("--lr", "nan"), "--lr must be a positive number (got nan)"),
    flag_case("--lr inf", ("--lr", "inf"), "--lr must be a positive number (got inf)"),
    flag_case("--lr abc", ("--lr", "fast"), "--lr", "invalid float value"),
    # NaN passes `< 0`: --min-lr nan trained NaN weights and exported them with exit 0
    flag_case("--min-lr nan", ("--min-lr", "nan"), "--min-lr must be a finite number (got nan)"),
    flag_case("--grad-clip inf", ("--grad-clip", "inf"), "--grad-clip must be a finite number (got inf)"),
    flag_case("--min-lr above --lr", ("--lr", "1e-4", "--min-lr", "1e-3"), "--min-lr 0.001 is above --lr", "lower"),
    flag_case("-b 0", ("-b", "0"), "--batch-size must be at least 1 (got 0)"),
    flag_case("--grad-accum-steps 0", ("--grad-accum-steps", "0"), "--grad-accum-steps must be at least 1"),
    flag_case(
        "--global-batch-size not a multiple of -b",
        ("--global-batch-size", "3", "-b", "2"),
        "--global-batch-size 3 is not a multiple of processes x --batch-size",
        "choose a multiple of 2",
    ),
    flag_case(
        "--global-batch-size negative", ("--global-batch-size", "-8"), "--global-batch-size must not be negative"
    ),
    flag_case("--max-steps negative", ("--max-steps", "-3"), "--max-steps must not be negative (got -3)"),
    flag_case("--num-epochs 0", ("--num-epochs", "0"), "--num-epochs must be at least 1 (got 0)"),
    flag_case("--warmup-steps negative", ("--warmup-steps", "-1"), "--warmup-steps must not be negative"),
    flag_case("--weight-decay negative", ("--weight-decay", "-0.1"), "--weight-decay must not be negative"),
    flag_case("--grad-clip negative", ("--grad-clip", "-1"), "--grad-clip must not be negative"),
    flag_case("--seed abc", ("--seed", "abc"), "--seed", NOT_A_NUMBER),
    flag_case("--precision fp8", ("--precision", "fp8"), "--precision", "invalid choice: 'fp8'", "'bf16'"),
    flag_case("--precision fp16 without a GPU", ("--precision", "fp16"), "--precision fp16 needs a CUDA GPU", "bf16"),
    flag_case("--sharding zero3", ("--sharding", "zero3"), "--sharding", "invalid choice: 'zero3'", "'full'"),
    flag_case(
        "--hybrid-shard-size that does not divide the world",
        ("--sharding", "hybrid", "--hybrid-shard-size", "3"),
        "--sharding hybrid: world size 1 is not a multiple of the shard group size 3",
        "set --hybrid-shard-size to a divisor of 1",
    ),
    flag_case("--ac-every-n-layers 0", ("--ac-every-n-layers", "0"), "--ac-every-n-layers must be at least 1"),
    flag_case(
        "--loss-chunk-tokens -1", ("--loss-chunk-tokens", "-1"), "--loss-chunk-tokens '-1': expected auto or a whole"
    ),
    flag_case(
        "--max-skipped-fraction above 1", ("--max-skipped-fraction", "2"), "--max-skipped-fraction must be between 0"
    ),
    flag_case("--lora-rank 0", ("--peft", "lora", "--lora-rank", "0"), "--lora-rank must be at least 1", "8-64"),
    flag_case("--lora-alpha negative", ("--peft", "lora", "--lora-alpha", "-8"), "--lora-alpha must be a positive"),
    flag_case("--lora-dropout 1.5", ("--peft", "lora", "--lora-dropout", "1.5"), "--lora-dropout must be in [0, 1)"),
    flag_case("--lora-rank without --peft", ("--lora-rank", "8"), "--lora-rank needs --peft lora or qlora"),
    flag_case(
        "--adapter that is not an adapter",
        ("--peft", "lora", "--adapter", "@raw"),
        "--adapter",
        "not a PEFT adapter folder (no adapter_config.json)",
    ),
    flag_case("--adapter without --peft", ("--adapter", "@raw"), "--adapter needs --peft lora or qlora"),
    flag_case("--export-merged without --peft", ("--export-merged", "on"), "--export-merged needs --peft lora"),
    flag_case("--dpo-beta negative", ("--objective", "dpo", "--dpo-beta", "-1"), "--dpo-beta must be a positive"),
    flag_case(
        "--dpo-label-smoothing 0.7", ("--dpo-label-smoothing", "0.7"), "--dpo-label-smoothing must be in [0, 0.5)"
    ),
    flag_case("--sft-weight negative", ("--sft-weight", "-1"), "--sft-weight must not be negative"),
    flag_case("--simpo-gamma negative", ("--dpo-loss", "simpo", "--simpo-gamma", "-1"), "--simpo-gamma must not be"),
    flag_case(
        "--simpo-gamma without --dpo-loss simpo",
        ("--simpo-gamma", "1.0"),
        "--simpo-gamma applies to --dpo-loss simpo (got --dpo-loss sigmoid)",
    ),
    flag_case(
        "--reference live with a reference-free loss",
        ("--dpo-loss", "orpo", "--reference", "live"),
        "--reference live: --dpo-loss orpo is reference-free",
        "leave --reference out",
    ),
    flag_case(
        "--sft-weight with orpo, which has its own NLL",
        ("--dpo-loss", "orpo", "--sft-weight", "1"),
        "--dpo-loss orpo already adds the chosen response's NLL",
    ),
    flag_case(
        "--dpo-loss that does not exist", ("--dpo-loss", "kto"), "--dpo-loss", "invalid choice: 'kto'", "'simpo'"
    ),
    flag_case(
        "--grpo-beta with --peft and --adapter",
        ("--objective", "grpo", "--reward", "accuracy", "--peft", "lora", "--adapter", "@raw", "--grpo-beta", "0.1"),
        "takes the KL to the model with its adapters off, which is the base without --adapter",
        "or set --grpo-beta 0",
    ),
    flag_case(
        "--objective grpo without --reward", ("--objective", "grpo"), "--objective grpo needs at least one --reward"
    ),
    flag_case(
        "--num-generations 1",
        ("--objective", "grpo", "--reward", "accuracy", "--num-generations", "1"),
        "--num-generations must be at least 2",
    ),
    flag_case(
        "--temperature 0",
        ("--objective", "grpo", "--reward", "accuracy", "--temperature", "0"),
        "--temperature must be",
    ),
    flag_case(
        "--reward-timeout-s past --collective-timeout-s",
        ("--objective", "grpo", "--reward", "accuracy", "--reward-timeout-s", "900", "--collective-timeout-s", "600"),
        "--reward-timeout-s 900 is not below --collective-timeout-s 600",
        "lower --reward-timeout-s or raise --collective-timeout-s",
    ),
    flag_case(
        "--reward-timeout-s negative",
        ("--objective", "grpo", "--reward", "accuracy", "--reward-timeout-s", "-1"),
        "--reward-timeout-s must be a number of seconds, 0 or more (got -1.0)",
    ),
    flag_case(
        "--max-new-tokens as long as --seq-length",
        ("--objective", "grpo", "--reward", "accuracy", "--max-new-tokens", "512", "--seq-length", "512"),
        "--max-new-tokens 512 leaves no room for a prompt in --seq-length 512",
    ),
    flag_case(
        "--num-generations with --objective lm",
        ("--objective", "lm", "--num-generations", "4"),
        "--num-generations needs --objective grpo (got --objective lm)",
    ),  # fmt: skip
    flag_case(
        "--reward file that does not exist", ("--reward", "@nowhere.py:score", "--max-new-tokens", "8"), "no file"
    ),
    flag_case(
        "--reward that is not FILE:FUNCTION",
        ("--reward", "lengthy", "--max-new-tokens", "8"),
        "expected FILE.py:FUNCTION",
    ),
    flag_case(
        "--reward-pattern without --reward format",
        ("--objective", "grpo", "--reward", "accuracy", "--reward-pattern", "<answer>.*</answer>"),
        "--reward-pattern is what --reward format checks; add --reward format or drop --reward-pattern",
    ),
    flag_case(
        "--reward-weights not one per --reward",
        ("--reward", "accuracy", "--reward", "format", "--reward-weights", "1", "--max-new-tokens", "8"),
        "--reward-weights 1: 1 weight(s) for 2 --reward function(s)",
    ),
    flag_case(  # every advantage 0: steps that trained nothing, with exit 0
        "--reward-weights all 0",
        ("--reward", "accuracy", "--reward-weights", "0", "--max-new-tokens", "8"),
        "--reward-weights 0: every weight is 0, so no completion is ever rewarded",
    ),
    flag_case(
        "--chat-template that does not exist",
        ("--chat-template", "@nope.jinja"),
        "--chat-template",
        "no such file (a Jinja chat template)",
    ),
    flag_case(
        "--chat-template that is a folder", ("--chat-template", "@raw"), "--chat-template", "a folder, not a file"
    ),
    flag_case(
        "--chat-template with a Jinja syntax error",
        ("--chat-template", "@trainer/broken.jinja"),
        "--chat-template",
        "not a valid Jinja template (line 1:",
        "fix it",
    ),
    flag_case(
        "--chat-template that is empty",
        ("--chat-template", "@trainer/empty.jinja"),
        "--chat-template",
        "empty.jinja: the file is empty; write the Jinja chat template in it",
    ),
    flag_case(
        "--sample-prompts that does not exist", ("--sample-prompts", "@nope.txt"), "--sample-prompts", "no such file"
    ),
    flag_case(
        "--sample-prompts that is a folder", ("--sample-prompts", "@raw"), "--sample-prompts", "a folder, not a file"
    ),
    flag_case(
        "--sample-prompts with no prompt in it",
        ("--sample-prompts", "@trainer/blank_prompts.txt"),
        "--sample-prompts",
        "holds no prompt",
        "one prompt per line",
    ),
    flag_case(
        "--sample-max-new-tokens 0", ("--sample-max-new-tokens", "0"), "--sample-max-new-tokens must be at least"
    ),
    flag_case(
        "--sample-max-new-tokens beyond the model's positions",
        ("--sample-prompts", "@trainer/prompts.txt", "--sample-max-new-tokens", "5000"),
        "--sample-max-new-tokens 5000 leaves no room for a prompt within the model's max_position_embeddings 2048",
    ),
    flag_case("--log-freq 0", ("--log-freq", "0"), "--log-freq must be at least 1"),
    flag_case("--ckpt-freq negative", ("--ckpt-freq", "-1"), "--ckpt-freq must not be negative"),
    flag_case("--eval-freq negative", ("--eval-freq", "-1"), "--eval-freq must not be negative"),
    flag_case("--eval-max-blocks negative", ("--eval-max-blocks", "-1"), "--eval-max-blocks must not be negative"),
    flag_case("--keep-last 0", ("--keep-last", "0"), "--keep-last must be at least 1"),
    flag_case("--peak-tflops negative", ("--peak-tflops", "-1"), "--peak-tflops must not be negative"),
    flag_case("--max-bad-steps negative", ("--max-bad-steps", "-1"), "--max-bad-steps must be at least 1"),
    flag_case("--collective-timeout-s 0", ("--collective-timeout-s", "0"), "--collective-timeout-s must be at least"),
    flag_case("a flag of another tool", ("--learning-rate", "1e-4"), "unrecognized arguments: --learning-rate"),
    flag_case("a flag of data_hf", ("--data_folder", "@raw"), "unrecognized arguments: --data_folder"),
    flag_case("--data-slice that is not START:END", ("--data-slice", "abc"), "--data-slice 'abc': expected START:END"),
    flag_case("--profile-steps backwards", ("--profile-steps", "5:2"), "--profile-steps '5:2': expected START:END"),
    flag_case(
        "--data-weights with one dataset", ("--data-weights", "1,2"), "--data-weights 1,2 needs two or more datasets"
    ),
    flag_case(
        "--data-weights that do not match the datasets",
        ("-d", "@outputs/corpus", "--data-weights", "1,2,3"),
        "--data-weights 1,2,3: expected 2 numbers separated by commas",
    ),
    flag_case(
        "--data-weights with a zero", ("-d", "@outputs/corpus", "--data-weights", "1,0"), "every weight must be a"
    ),
    flag_case("the same dataset twice", ("-d", "@dataset"), "names a dataset twice", "raise its weight"),
    flag_case(
        "-d ''", ("-d", ""), "--dataset-name/-d is empty: give a dataset folder"
    ),  # it said '-d .: not a dataset'
    flag_case("the same dataset spelt two ways", ("-d", "@outputs/../dataset"), "names a dataset twice"),
    flag_case(
        "--objective dpo on a mixture",
        ("-d", "@outputs/corpus", "--objective", "dpo"),
        "--objective dpo trains on one preference dataset; give -d once",
    ),
    flag_case(
        "--data-slice on a mixture",
        ("-d", "@outputs/corpus", "--data-slice", "0:10"),
        "--data-slice 0:10 selects rows of one dataset; give -d once",
    ),
]

TRAINER_NAME_CASES = [
    trainer_case("-e empty", run_flags(e=""), "--experiment-name/-e is required"),
    trainer_case("-e a path", run_flags(e="a/b"), "--experiment-name 'a/b' must be a plain folder name, not a path"),
    trainer_case("-e ..", run_flags(e=".."), "--experiment-name '..' must be a plain folder name"),
    trainer_case("-e an absolute path", run_flags(e="/tmp/abs"), "must be a plain folder name, not a path"),
    trainer_case(
        "-e with a newline pasted in",
        run_flags(e="my\nexp"),
        "--experiment-name 'my\\nexp' holds a control character",
        "choose a plain name",
    ),
    flag_case(
        "--save-dir that is a file",
        ("--save-dir", "@latin1_prompts.txt"),
        "--save-dir",
        "a file, not a folder; choose a folder for the experiments",
    ),
    flag_case(
        "--save-dir under a file",
        ("--save-dir", "@latin1_prompts.txt/outputs"),
        "latin1_prompts.txt is a file; choose a folder for the experiments",
    ),
    flag_case(
        "--save-dir that is a dataset",
        ("--save-dir", "@dataset"),
        "--save-dir",
        "is a dataset",
        "experiments go under a folder of their own: choose another --save-dir",
    ),
    flag_case("--save-dir that is a model folder", ("--save-dir", "@trainer/good_model"), "is a model folder"),
    flag_case(
        "--save-dir that is an experiment", ("--save-dir", "@outputs/exp"), "is a training experiment", "--save-dir"
    ),
    flag_case("--save-dir that is split folders", ("--save-dir", "@splits"), "is split folders of organize_data.py"),
    flag_case(  # the dataset's own tool replaces it whole; a checkpoint folder is pruned by its run
        "--save-dir inside a dataset", ("--save-dir", "@dataset/outs"), "is inside", "a dataset", "a folder of its own"
    ),
    flag_case(
        "--save-dir inside an experiment", ("--save-dir", "@outputs/exp/checkpoint"), "is inside", "training experiment"
    ),
    flag_case(
        "--save-dir empty (an unset variable)", ("--save-dir", ""), "--save-dir is empty (an unset shell variable?)"
    ),
]

TRAINER_INPUT_CASES = [
    trainer_case(
        "-d that does not exist",
        run_flags(d="no_such_dataset"),
        "--dataset-name",
        "no such folder; create it with data_hf.py --save_dir",
    ),
    trainer_case(
        "-d a file",
        run_flags(d="latin1_prompts.txt"),
        "--dataset-name",
        "a file, not a dataset folder",
        "python data_hf.py --data_folder",
    ),
    trainer_case(  # it said to convert the file with data_hf.py
        "-d a file of a dataset",
        run_flags(d="dataset/dataset_info.json"),
        "a file of the dataset",
        "pass the folder: -d",
    ),
    trainer_case(
        "-m the token cache",
        run_flags(m="outputs/.token_cache"),
        "fsdp_train.py's token cache",
        "pass the model folder as -m",
    ),
    trainer_case(
        "-d raw files",
        run_flags(d="raw"),
        "--dataset-name",
        "not a dataset written by data_hf.py",
        "python data_hf.py --data_folder",
        "then pass -d DATASET",
    ),
    trainer_case(
        "-d organize_data's split folders",
        run_flags(d="splits"),
        "is split folders of organize_data.py",
        "convert them with: python data_hf.py --data_folder",
        "(every split into one dataset), then pass -d DATASET",
    ),
    trainer_case(
        "-d an experiment",
        run_flags(d="outputs/exp"),
        "--dataset-name",
        "is a training experiment of fsdp_train.py",
        "-d takes the dataset it was trained on",
    ),
    trainer_case(
        "-d a model folder", run_flags(d="trainer/good_model"), "is a model folder", "pass it as -m/--model-name"
    ),
    trainer_case(
        "-d a hub dataset that was never downloaded",
        run_flags(d="hub:org/never-downloaded"),
        "--dataset-name/-d",
        "org/never-downloaded",
        "model_download.py",
    ),
    trainer_case(
        "-m that does not exist",
        run_flags(m="no_such_model"),
        "--model-name",
        "no such folder",
        "give a hub id as org/name",
    ),
    trainer_case("-m a file", run_flags(m="latin1_prompts.txt"), "--model-name", "not a folder"),
    trainer_case("-m a dataset", run_flags(m="dataset"), "--model-name", "is a dataset", "not a model; pass it as -d"),
    trainer_case(
        "-m an experiment",
        run_flags(m="outputs/exp"),
        "--model-name",
        "is a training experiment of fsdp_train.py",
        "its exported model is -m",
    ),
    trainer_case("-m raw files", run_flags(m="raw"), "folder has no config.json", "model_download.py fetches one"),
    trainer_case(
        "-m that is neither a path nor a hub id",
        lambda r: [*run_flags()(r), "-m", "my model/v2"],
        "--model-name 'my model/v2': neither a folder here nor a hub id",
    ),
    trainer_case(
        "-m a hub id that was never downloaded",
        lambda r: [*run_flags()(r), "-m", "org/never-downloaded"],
        "--model-name org/never-downloaded: not in the local cache",
        "python model_download.py --model-name org/never-downloaded",
    ),
    trainer_case(
        "-m whose config.json is not JSON",
        run_flags(m="trainer/config_not_json"),
        "config.json",
        "restore it, or fetch the model again",
    ),
    trainer_case(
        "-m whose model type transformers does not know",
        run_flags(m="trainer/unknown_type"),
        "frobnicator",
        "upgrade transformers, or check model_type in config.json",
    ),
    trainer_case(
        "-m without tokenizer files",
        run_flags(m="trainer/no_tokenizer"),
        "no tokenizer files (tokenizer.json",
        "copy them from the model",
    ),
    trainer_case(
        "--lora-target-modules that the model does not have",
        run_flags("--peft", "lora", "--lora-target-modules", "qkv_proj", m="trainer/good_model"),
        "--lora-target-modules 'qkv_proj': no Linear layer named qkv_proj",
        "its Linear layers are:",
    ),
]

CONFIG_CASES = [
    flag_case("--config that does not exist", ("--config", "@nope.yaml"), "--config", "nope.yaml: no such file"),
    flag_case(  # the second file replaced the first in silence
        "--config twice", ("--config", "@trainer/broken.yaml", "--config", "@nope.yaml"), "--config is given twice ("
    ),
    flag_case("--config a folder", ("--config", "@raw"), "--config", "cannot read it as YAML", "Is a directory"),
    flag_case(
        "--config that is not UTF-8",
        ("--config", "@latin1_prompts.txt"),
        "--config",
        "not UTF-8 text (byte 18 is 0xe9); save it as UTF-8 YAML",
    ),
    flag_case("--config that is not YAML", ("--config", "@trainer/broken.yaml"), "--config", "cannot read it as YAML"),
    flag_case(
        "--config that is a list", ("--config", "@trainer/list.yaml"), "expected a mapping of flag names to values"
    ),
    flag_case(
        "--config with a key of another tool",
        ("--config", "@trainer/unknown_key.yaml"),
        "unknown key 'learning_rate'",
        "keys are the flag names",
    ),
    flag_case(
        "--config with a value of the wrong type",
        ("--config", "@trainer/wrong_type.yaml"),
        "key 'lr' has value 'fast'; expected float",
    ),
    flag_case(
        "--config that sets a flag twice",
        ("--config", "@trainer/twice.yaml"),
        "'max_steps' sets the same flag as 'max-steps' above; keep one",
        "line 3",
    ),
    flag_case(
        "--config with a comma-separated flag written as a list",
        ("--config", "@trainer/list_value.yaml"),
        "key 'data-weights' has value [0.7, 0.3]; expected str, e.g. data-weights: \"0.7,0.3\"",
    ),
    flag_case(
        "--config with a choice that does not exist",
        ("--config", "@trainer/bad_choice.yaml"),
        "key 'precision' has value 'fp8'; expected one of auto, bf16, fp16, fp32",  # with its type errors, not after
    ),
]

CASES += TRAINER_FLAG_CASES + TRAINER_NAME_CASES + TRAINER_INPUT_CASES + CONFIG_CASES


def trainer_inputs(root: Path, model: Path) -> None:
    """What the trainer's cases read besides the user's folders: damaged copies of a real model, a broken template,
    a blank prompts file and YAML files that go wrong in the ways people write them."""
    import shutil

    folder = root / "trainer"
    for name in ("good_model", "config_not_json", "unknown_type", "no_tokenizer"):
        shutil.copytree(model, folder / name)
    (folder / "config_not_json" / "config.json").write_text('{"model_type": ')
    config = json.loads((folder / "unknown_type" / "config.json").read_text())
    (folder / "unknown_type" / "config.json").write_text(json.dumps({**config, "model_type": "frobnicator"}))
    for path in (folder / "no_tokenizer").glob("tokenizer*"):
        path.unlink()
    (folder / "broken.jinja").write_text("{% for m in messages %}{{ m.content }")
    (folder / "empty.jinja").write_text("\n")
    (folder / "blank_prompts.txt").write_text("\n  \n\n")
    (folder / "prompts.txt").write_text("The capital of Norland is\n")
    (folder / "broken.yaml").write_text("lr: [1, 2\nseed: :\n")
    (folder / "list.yaml").write_text("- lr\n- 1e-4\n")
    (folder / "unknown_key.yaml").write_text("learning_rate: 1e-4\n")
    (folder / "wrong_type.yaml").write_text("lr: fast\n")
    (folder / "list_value.yaml").write_text("data-weights: [0.7, 0.3]\n")
    (folder / "twice.yaml").write_text("max-steps: 3\nlr: 1.0e-4\nmax_steps: 2\n")
    (folder / "bad_choice.yaml").write_text("precision: fp8\n")


@pytest.fixture(scope="module")
def user_folders(tmp_path_factory, inputs) -> Path:
    root = make_user_folders(tmp_path_factory.mktemp("user"), inputs[1])
    trainer_inputs(root, inputs[1])
    return root


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_refused_by_name_and_touches_nothing(case: Case, user_folders: Path, capsys) -> None:
    check_refused(case, user_folders, capsys)


def test_a_full_disk_is_named_even_when_the_library_lost_the_errno(tmp_path: Path, monkeypatch) -> None:
    """torch's zip writer turns ENOSPC into 'unexpected pos 704 vs 598'; the OS error is said in words either way."""
    import shutil
    from collections import namedtuple

    from fsdp_lib.errors import explain_write_error

    usage = namedtuple("usage", "total used free")
    lost = RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing file "
                        "data/0: unexpected pos 704 vs 598")  # fmt: skip
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * 2**30, 100 * 2**30 - 2**20, 2**20))
    said = explain_write_error(lost, tmp_path)
    assert "unexpected pos 704 vs 598" in said and f"only 1 MiB are free on the file system of {tmp_path}" in said
    assert said.endswith("no space left on device?")
    wrapped = RuntimeError("write failed")
    wrapped.__cause__ = OSError(30, "Read-only file system", str(tmp_path / "x.distcp"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * 2**30, 2**30, 99 * 2**30))
    assert explain_write_error(wrapped, tmp_path) == (
        f"Read-only file system: {tmp_path / 'x.distcp'} (RuntimeError: write failed)"
    )
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * 2**30, 100 * 2**30 - 2**20, 2**20))
    assert "no space left on device?" not in explain_write_error(wrapped, tmp_path)  # the errno says what it was
    # torch.distributed.checkpoint gathers each rank's error into one exception whose str() is every traceback
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise OSError(28, "No space left on device", str(tmp_path / "__1_0.distcp"))
    except OSError as exc:
        full = CheckpointException("write failed", {1: _wrap_exception(exc)})
    said = explain_write_error(full, tmp_path)
    assert said.startswith(f"No space left on device: {tmp_path / '__1_0.distcp'} (OSError: [Errno 28]"), said
    assert "Traceback" not in said
    # a file-size limit (ulimit -f) is named as one; numpy's short write (the token cache) has no errno at all
    too_big = OSError(27, "File too large", str(tmp_path / "x.distcp"))
    assert explain_write_error(too_big, tmp_path).startswith(
        f"File too large (a file-size limit: ulimit -f): {tmp_path}"
    )
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(100 * 2**30, 2**30, 99 * 2**30))
    short = explain_write_error(OSError("92672 requested and 51200 written"), tmp_path)
    assert f"92672 requested and 51200 written (writing under {tmp_path}); a short write: the disk is full" in short


@pytest.mark.parametrize("signum, expected", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_ends_data_hf_and_model_download_with_one_line(
    signum: int, expected: int, tmp_path: Path, monkeypatch, capsys, ctrl_c_raises
) -> None:
    """Interrupted mid-run: one line, the shell's exit code, no traceback, nothing half-written left behind."""
    import model_download

    def interrupted(*args, **kwargs) -> None:
        os.kill(os.getpid(), signum)

    raw = make_raw(tmp_path / "raw")
    monkeypatch.setattr(data_hf, "print_summary", interrupted)  # after the conversion, before the publish
    assert data_hf.main(["--data_folder", str(raw), "--save_dir", str(tmp_path / "ds")]) == expected
    assert capsys.readouterr().err.strip().splitlines()[-1] == "data_hf: interrupted; nothing was written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]  # no dataset, no temporary folder

    monkeypatch.setattr(model_download, "run_download", interrupted)
    assert model_download.main(["--model-name", "org/name", "--local-dir", str(tmp_path / "m")]) == expected
    said = capsys.readouterr()
    assert (
        said.out.strip().splitlines()[-1].startswith("model_download.py: interrupted; rerun the same command to resume")
    )
    assert "Traceback" not in said.out + said.err
    monkeypatch.setattr(model_download, "run_init", interrupted)  # --init has nothing to resume: it starts again
    assert (
        model_download.main(["--init", "tiny", "--tokenizer-from", str(raw), "--local-dir", str(tmp_path / "m")])
        == expected
    )
    said = capsys.readouterr().out.strip().splitlines()[-1]
    assert said.startswith("model_download.py: interrupted; rerun the same command to start again"), said


def test_ctrl_c_during_the_tokenizers_training_stops_at_once(ctrl_c_raises) -> None:
    """model_download.py --init trains its BPE tokenizer in Rust, whose merges do not look at signals: a Ctrl-C
    waited for the training to end (5-9 s of a 56 MB corpus at a 32,000-token vocabulary, by hand). The training
    now runs in a worker thread: the waiting thread raises at once, the work still running; its errors still
    reach the caller."""
    import threading

    from fsdp_lib.hub.console import interruptible

    started, release = threading.Event(), threading.Event()

    def work() -> None:  # stands for the merges: blind to signals, done only when released
        started.set()
        release.wait(60)

    threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            interruptible(work)
        assert started.is_set() and not release.is_set(), "it returned while the work still ran"
    finally:
        release.set()

    def fails() -> None:
        raise ValueError("a bad batch")

    with pytest.raises(ValueError, match="a bad batch"):
        interruptible(fails)


def test_an_os_error_in_the_trainer_is_one_message_with_the_path(inputs, tmp_path: Path, monkeypatch, capsys) -> None:
    """A read-only --save-dir (the lock file cannot be created): the OS error in words, no traceback. Simulated: the
    tests run as root, whom no permission stops."""
    from fsdp_lib import lock

    dataset, model = inputs

    def read_only(*args, **kwargs) -> None:
        raise OSError(30, "Read-only file system", str(tmp_path / "outputs" / "run" / "run.lock"))

    monkeypatch.setattr(lock.ExperimentLock, "acquire", read_only)
    argv = ["-e", "run", "-d", str(dataset), "-m", str(model), "--save-dir", str(tmp_path / "outputs")]
    assert fsdp_train.main([*argv, "--seq-length", "64"]) == 1
    said = capsys.readouterr().out
    assert f"Read-only file system: {tmp_path / 'outputs' / 'run' / 'run.lock'}" in said
    assert "fix it and rerun the same command" in said and "Traceback" not in said


def as_a_user_the_os_stops() -> list[str]:
    """The command prefix under which file permissions hold: none for a normal user; for root (CI, containers), root
    without the two capabilities that bypass them (it still owns the files, so their owner bits apply)."""
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []


def test_folders_without_permission_are_said_in_words_with_the_path(
    user_folders: Path, tmp_path: Path, python_exe: str, repo_root: Path
) -> None:
    """Real permissions, not a simulation: an unreadable input folder or file and an output under a read-only
    parent, in each tool. Each is one message with the OS's words and the path, no traceback, nothing changed."""
    import shutil
    import subprocess

    root = tmp_path / "user"
    for name in ("raw", "dataset", "trainer/good_model"):
        shutil.copytree(user_folders / name, root / "readable" / Path(name).name)
    locked, read_only = root / "locked", root / "read_only"
    for name in ("raw", "dataset", "good_model"):
        shutil.copytree(root / "readable" / name, locked / name)
    (root / "readable" / "raw" / "secret.txt").write_text("not for you\n")
    read_only.mkdir()
    ok, out = root / "readable", tmp_path / "outputs"
    cases = [
        ("data_hf", ["--data_folder", locked / "raw", "--save_dir", out / "a"], 1, "--data_folder", "cannot be read"),
        ("data_hf", ["--data_folder", ok / "raw", "--save_dir", read_only / "ds"], 1, "--save_dir", "folder you can"),
        ("data_hf", ["--data_folder", ok / "raw", "--save_dir", out / "b"], 0, "secret.txt: read_error: Permission"),
        ("organize_data", ["--src-dir", locked / "raw", "--dst-root", out / "c", "--num-dirs", "2"], 2, "--src-dir"),
        ("organize_data", ["--src-dir", ok / "raw", "--dst-root", read_only / "s", "--num-dirs", "2"], 1, "rerun"),
        (
            "model_download",
            ["--init", "tiny", "--tokenizer-from", ok / "dataset", "--local-dir", read_only / "m"],
            1,
            "rerun the same command",
        ),
        ("fsdp_train", ["-d", locked / "dataset", "-m", ok / "good_model", "--save-dir", out], 2, "--dataset-name"),
        ("fsdp_train", ["-d", ok / "dataset", "-m", locked / "good_model", "--save-dir", out], 2, "--model-name"),
        ("fsdp_train", ["-d", ok / "dataset", "-m", ok / "good_model", "--save-dir", read_only], 1, "rerun the same"),
    ]
    specs = [
        {
            "tool": tool,
            "argv": [str(a) for a in argv] + (["-e", "run", "--seq-length", "64"] if tool == "fsdp_train" else []),
        }
        for tool, argv, *_ in cases
    ]
    (tmp_path / "cases.json").write_text(json.dumps(specs))
    before = snapshot(root)
    for path in (locked / "raw", locked / "dataset", locked / "good_model", ok / "raw" / "secret.txt"):
        path.chmod(0)
    read_only.chmod(0o555)
    try:
        proc = subprocess.run(
            [*as_a_user_the_os_stops(), python_exe, str(repo_root / "tests/workers/run_mains.py"), str(tmp_path / "cases.json")],
            capture_output=True, text=True, cwd=repo_root, timeout=300,
        )  # fmt: skip
    finally:
        for path in (locked / "raw", locked / "dataset", locked / "good_model", ok / "raw" / "secret.txt"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        read_only.chmod(0o755)
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for (tool, argv, code, *parts), result in zip(cases, results, strict=True):
        said = result["said"]
        assert result["code"] == code and "Traceback" not in said, f"{tool} {argv}: {said}"
        assert all(part in said for part in parts), f"{tool} {argv}: {parts} not in {said}"
        assert "Permission denied" in said, f"{tool} {argv}: {said}"
    assert snapshot(root) == before


def refused_after_tokenising(python_exe: str, repo_root: Path, argv: list) -> str:
    """One process of fsdp_train.py (no torchrun, whose own report would add a traceback) refused with exit 1 and
    one message, no traceback: what it said."""
    import subprocess

    proc = subprocess.run(
        [python_exe, repo_root / "fsdp_train.py", *argv, "--seq-length", "64", "--max-steps", "1"],
        capture_output=True, text=True, cwd=repo_root, timeout=300,
    )  # fmt: skip
    said = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in said, said
    return said


def test_an_added_token_the_embedding_lacks_is_refused_when_the_data_holds_it(
    inputs, tmp_path: Path, python_exe: str, repo_root: Path
) -> None:
    """A tokenizer with an added token beyond the embedding's rows passes the model-folder check (the data may never
    hold it); data that holds it is refused after tokenising, naming the id, the token and the fix, before any step
    (it was an IndexError at the first forward, a device-side assert on a GPU)."""
    import shutil

    from transformers import AutoTokenizer

    model = tmp_path / "model"
    shutil.copytree(inputs[1], model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = len(tokenizer)
    tokenizer.add_tokens(["<|tool_result|>"], special_tokens=True)
    tokenizer.save_pretrained(model)
    make_raw(tmp_path / "raw")
    (tmp_path / "raw" / "tools.txt").write_text("\n\n".join(f"Call {i}: <|tool_result|> {i}." for i in range(40)))
    assert data_hf.main(["--data_folder", str(tmp_path / "raw"), "--save_dir", str(tmp_path / "dataset")]) == 0
    argv = ["-e", "run", "-d", tmp_path / "dataset", "-m", model, "--save-dir", tmp_path / "outputs"]
    said = refused_after_tokenising(python_exe, repo_root, argv)
    assert f"the data holds token id {rows:,} ('<|tool_result|>'), an added token of the tokenizer" in said
    assert f"embedding has {rows:,} rows" in said and "resize_token_embeddings(len(tokenizer))" in said
    assert not (tmp_path / "outputs" / "run").exists(), "a refused run leaves no empty experiment folder"


def test_a_sample_prompt_too_long_for_the_model_is_refused_before_training(inputs, tmp_path: Path, capsys) -> None:
    """A prompt whose tokens and --sample-max-new-tokens pass the model's positions would fail at the first samples,
    mid-run, with learned position embeddings: refused with the prompt's number, its length and both fixes."""
    from transformers import AutoTokenizer

    from fsdp_lib.config import TrainConfig
    from fsdp_lib.errors import TrainError
    from fsdp_lib.train.samples import load_sample_prompts

    (tmp_path / "prompts.txt").write_text("short\n" + "word " * 60 + "\n")
    cfg = TrainConfig(sample_prompts=str(tmp_path / "prompts.txt"), sample_max_new_tokens=64)
    tokenizer = AutoTokenizer.from_pretrained(inputs[1])
    assert len(load_sample_prompts(cfg, tokenizer, max_positions=1024)) == 2
    with pytest.raises(TrainError) as refused:
        load_sample_prompts(cfg, tokenizer, max_positions=128)
    said = str(refused.value)
    assert f"--sample-prompts {tmp_path / 'prompts.txt'}, prompt 2:" in said and "+ --sample-max-new-tokens 64" in said
    assert "exceed the model's max_position_embeddings 128; shorten the prompt or lower --sample-max-new-tokens" in said
    # and before any process group, as a flag problem (exit 2), by the run and its --dry-run alike
    import fsdp_train

    (tmp_path / "chat.jsonl").write_text(json.dumps([{"role": "user", "content": "hi"}]) + "\n")
    base = [
        "-e",
        "x",
        "-d",
        str(inputs[0]),
        "-m",
        str(inputs[1]),
        "--save-dir",
        str(tmp_path / "out"),
        "--seq-length",
        "32",
    ]
    for prompts, said in [
        ("prompts.txt", "tokens + --sample-max-new-tokens 100 exceed the model's max_position_embeddings 128"),
        ("chat.jsonl", "conversations need a chat template; the tokenizer has none (--chat-template FILE)"),
    ]:
        for dry in ([], ["--dry-run"]):
            argv = [*base, "--sample-prompts", str(tmp_path / prompts), "--sample-max-new-tokens", "100", *dry]
            assert fsdp_train.main(argv) == 2
            assert said in capsys.readouterr().out, (prompts, dry)
    assert not (tmp_path / "out").exists()


def test_a_config_that_does_not_match_its_weights_is_refused_by_tensor(
    inputs, tmp_path: Path, python_exe: str, repo_root: Path
) -> None:
    """config.json edited by hand (or copied from another model) passes the folder check but builds tensors of
    other shapes: refused when the weights are read, naming the tensor, both shapes and the fix (it was a bare size
    mismatch from the checkpoint reader, with a traceback). A size below 1 is refused before any process group."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(inputs[1], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 8}))
    argv = ["-e", "run", "-d", inputs[0], "-m", model, "--save-dir", tmp_path / "outputs"]
    said = refused_after_tokenising(python_exe, repo_root, argv)
    rows, cols = config["hidden_size"], config["intermediate_size"]
    assert f"--model-name {model}: config.json does not match the weights: model.layers.0.mlp." in said, said
    down = f"model.layers.0.mlp.down_proj.weight is [{rows}, {cols}] in model.safetensors, [{rows}, {cols + 8}] by"
    assert down in said and "(and 3 more)" in said and "restore it, or fetch the model again" in said, said
    assert not (tmp_path / "outputs" / "run").exists()
    (model / "config.json").write_text(json.dumps({**config, "hidden_size": -8}))
    assert fsdp_train.main([str(a) for a in argv]) == 2


def test_an_experiment_folder_s_own_temporaries_and_launch_logs_are_not_the_user_s(tmp_path: Path) -> None:
    """What a run or its launch leaves in outputs/EXP before the folder reads as an experiment does not block it:
    the trainer's temporaries (the lock's too), logs a launch writes there (tee, Slurm's --output), file-system
    debris; anything else is named. An unreadable checkpoint folder is left to the run's own reads."""
    from fsdp_lib.experiment_dir import foreign_entries, lost_checkpoint

    folder = tmp_path / "exp"
    folder.mkdir()
    for name in ("config.yaml", ".run.lock.host.123", ".state.json.tmp77", ".final.old", "train.log", "9.out"):
        (folder / name).write_text("")
    (folder / ".nfs000123").write_text("")
    assert foreign_entries(folder) == []
    from fsdp_lib.experiment_dir import same_names_not_ours

    assert same_names_not_ours(folder) == ["config.yaml"]  # an empty config.yaml is not a run's settings
    (folder / "config.yaml").write_text("experiment_name: exp\nlr: 0.001\n")  # a run that stopped before step 1
    assert same_names_not_ours(folder) == []
    (folder / "report.txt").write_text("mine")
    assert foreign_entries(folder) == ["report.txt"]
    (folder / "state.json").write_text('{"latest_checkpoint": "checkpoint/step_00000004", "step": 4}')
    (folder / "checkpoint").mkdir()
    assert "names checkpoint checkpoint/step_00000004 (step 4)" in lost_checkpoint(folder)
    (folder / "checkpoint" / "step_00000004").mkdir()
    assert lost_checkpoint(folder) is None


def test_ctrl_c_while_the_trainer_loads_its_libraries_is_one_line(
    inputs, tmp_path: Path, python_exe: str, repo_root: Path
) -> None:
    """The trainer spends seconds importing torch and transformers before main(); Ctrl-C there printed their import
    traceback (35-43 lines). Now: one line, exit 130, nothing written."""
    import subprocess
    import time

    argv = ["-e", "run", "-d", inputs[0], "-m", inputs[1], "--save-dir", tmp_path / "outputs"]
    proc = subprocess.Popen(
        [python_exe, repo_root / "fsdp_train.py", *argv],
        cwd=repo_root,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip  (a terminal's Ctrl-C, also when the suite runs as a background job, which ignores SIGINT)
    time.sleep(1.0)  # the interpreter is up and torch (~2 s here) is loading
    proc.send_signal(signal.SIGINT)
    said, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, said
    assert said == "fsdp_train.py: stopped by Ctrl-C while loading its libraries; nothing was written\n", said
    assert not (tmp_path / "outputs").exists()


def test_a_user_s_files_in_final_survive_a_new_export_and_a_file_there_is_refused(tmp_path: Path, capsys) -> None:
    """A rerun with nothing to train exports again, replacing final/: a model card or notes the user put there were
    deleted with it; an earlier export's own files (other shards, an adapter's config, a tokenizer file) still go. A file named final (or a link)
    was renamed aside and every later export failed with 'Not a directory': refused before the run now."""
    from fsdp_lib.config import TrainConfig
    from fsdp_lib.experiment_dir import experiment_dir_problems
    from fsdp_lib.model.hf_weights import export_step, replace_folder, warn_stale_export

    final, new = tmp_path / "exp" / "final", tmp_path / "exp" / ".final.tmp"
    for name, text in [("README.md", "my card"), ("notes/run.txt", "mine"), ("config.json", "old"),
                       ("model-00001-of-00002.safetensors", ""), ("model.safetensors.index.json", ""),
                       ("adapter_config.json", ""), ("tokenizer.model", "")]:  # fmt: skip
        (final / name).parent.mkdir(parents=True, exist_ok=True)
        (final / name).write_text(text)

    def export(step: int, text: str, *names: str) -> None:
        """A new export of `names` (each holding `text`) swapped into final/ at `step`."""
        new.mkdir()
        for name in names:
            (new / name).write_text(text)
        replace_folder(new, final, step)

    export(4, "new", "config.json", "model.safetensors", "tokenizer.json")  # the earlier export has no record: by names
    assert sorted(p.name for p in final.iterdir()) == [".export.json", "README.md", "config.json",
                                                      "model.safetensors", "notes", "tokenizer.json"]  # fmt: skip
    assert (final / "README.md").read_text() == "my card" and (final / "config.json").read_text() == "new"
    assert not new.exists() and not (tmp_path / "exp" / ".final.old").exists()
    assert export_step(final) == 4

    # With the record, a file of an export's kind the user added (a quantised copy, training args) is theirs too:
    # the names alone deleted them. What the earlier export wrote and this one does not is said.
    for name in ("model-q4_k_m.safetensors", "training_args.bin"):
        (final / name).write_text("mine")
    export(6, "newer", "config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json")
    said = capsys.readouterr().out
    assert sorted(p.name for p in final.iterdir()) == [".export.json", "README.md", "config.json",
                                                      "model-00001-of-00002.safetensors", "model-q4_k_m.safetensors",
                                                      "model.safetensors.index.json", "notes", "training_args.bin"]  # fmt: skip
    assert "kept in" in said and "model-q4_k_m.safetensors, notes, training_args.bin" in said
    assert "removed with the earlier export" in said and "model.safetensors, tokenizer.json (this export" in said

    # A weights file a loader takes by its name (a model.safetensors the user saved there, an adapter) was kept
    # beside the export, and transformers loaded it instead of the export's index: moved into not_exported/.
    for name in ("model.safetensors", "adapter_model.safetensors", "adapter_config.json"):
        (final / name).write_text("stale")
    export(7, "newer", "config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json")
    said = capsys.readouterr().out
    assert not (final / "model.safetensors").exists() and not (final / "adapter_config.json").exists()
    assert sorted(p.name for p in (final / "not_exported").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "model.safetensors",
    ]
    assert "WARNING" in said and "model.safetensors" in said and "not_exported" in said
    assert (final / "model-q4_k_m.safetensors").exists() and (final / "README.md").read_text() == "my card"
    # the next export with another such file: the earlier not_exported/ is carried and the file joins it (the two
    # collided: ENOTEMPTY, then the first one was deleted with the old folder)
    (final / "model.safetensors").write_text("staler")
    export(8, "newest", "config.json")
    assert sorted(p.name for p in (final / "not_exported").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "model.safetensors",
        "model.safetensors.1",
    ]
    assert (final / "not_exported" / "model.safetensors.1").read_text() == "staler"
    shutil.rmtree(final / "not_exported")

    # A kill between the swap's two renames left the earlier export (and the user's files) only in .final.old.
    os.rename(final, final.with_name(".final.old"))
    export(8, "newest", "config.json")
    assert (final / "README.md").read_text() == "my card" and (final / "model-q4_k_m.safetensors").exists()
    assert export_step(final) == 8 and not final.with_name(".final.old").exists()
    warn_stale_export(final, 10)
    assert f"WARNING: {final} holds step 8, not step 10 as final/ beside it now does" in capsys.readouterr().out

    cfg = TrainConfig(experiment_name="exp", save_dir=str(tmp_path))
    (tmp_path / "exp" / "checkpoint" / "step_00000004").mkdir(parents=True)
    assert experiment_dir_problems(cfg) == []
    shutil.rmtree(final)
    final.write_text("notes")
    (problem,) = experiment_dir_problems(cfg)
    assert f"{final} is a file, where this run writes its export (a folder): move it aside" in problem
    final.unlink()
    final.symlink_to(tmp_path)
    assert "is a link, where this run writes its export" in experiment_dir_problems(cfg)[0]


def test_config_yaml_holds_absolute_paths_for_an_export_from_any_folder(tmp_path: Path, monkeypatch) -> None:
    """`-e EXP --export-only` reads the run's config.yaml: a -m ./model typed in another folder said `--model-name
    ./model: no such folder`, a flag the exporting user never typed. Local paths are written absolute; hub ids and
    built-in rewards as given."""
    from fsdp_lib.config import TrainConfig
    from fsdp_lib.experiment_dir import run_settings

    monkeypatch.chdir(tmp_path)
    for folder in ("model", "data"):
        (tmp_path / folder).mkdir()
    (tmp_path / "mine.py").write_text("def f(prompts, completions, **kw): return [0.0] * len(completions)\n")
    cfg = TrainConfig(model_name="model", dataset_name=["data", "org/hub-set"], reward=["mine.py:f", "accuracy"],
                      save_dir="outputs", chat_template="")  # fmt: skip
    settings = run_settings(cfg)
    assert settings["model_name"] == str(tmp_path / "model")
    assert settings["dataset_name"] == [str(tmp_path / "data"), "org/hub-set"]
    assert settings["reward"] == [f"{tmp_path / 'mine.py'}:f", "accuracy"]
    assert settings["save_dir"] == "outputs" and settings["chat_template"] == ""  # (not there yet; not given)


def test_a_resume_the_flags_alone_refuse_is_refused_before_any_data_is_read(tmp_path: Path, monkeypatch) -> None:
    """The full resume check runs once the data and the model are built (minutes into a large run); what the
    flags alone decide is read from the newest checkpoint's train_state.json first: --seq-length, --seed, the
    global batch (processes x -b x accumulation, or --global-batch-size), an --objective given by name, --peft and
    the adapters' rank/alpha/dropout (not with --adapter, whose folder sets them), --data-slice."""
    from fsdp_lib.config import TrainConfig
    from fsdp_lib.experiment_dir import experiment_dir_problems, resume_outlook, resume_refusal

    step = tmp_path / "exp" / "checkpoint" / "step_00000004"
    step.mkdir(parents=True)
    adapters = {"mode": "lora", "rank": 8, "alpha": 16.0, "dropout": 0.0, "start": "init"}
    fingerprint = {"seq_length": 32, "seed": 3, "global_batch_size": 8, "objective": "lm", "peft": adapters}
    fingerprint["dataset"] = "9a02/"
    config = {"data_slice": "", "adapter": "", "context_parallel": 1}
    (step / "train_state.json").write_text(json.dumps({"fingerprint": fingerprint, "config": config}))
    (tmp_path / "exp" / "checkpoint" / "step_00000002").mkdir()  # older: not the one compared
    same = dict(experiment_name="exp", save_dir=str(tmp_path), seq_length=32, seed=3, batch_size=2)
    same |= dict(peft="lora", lora_rank=8, lora_alpha=16.0)
    cfg = TrainConfig(**same)
    assert experiment_dir_problems(cfg) == [] and resume_refusal(cfg, 4) == []  # 4 processes x -b 2 = 8
    assert resume_outlook(tmp_path / "exp") == f"a run would resume from {step} (verified against its checksums first)"
    cfg.seq_length, cfg.seed = 64, 4
    (problem,) = resume_refusal(cfg, 4)
    assert f"cannot resume from {step}: --seq-length: checkpoint 32 vs now 64; --seed: checkpoint 3 vs now 4" in problem
    assert "--force-resume" in problem
    cfg.force_resume = True
    assert resume_refusal(cfg, 4) == []
    cfg.force_resume, cfg.export_only = False, True  # an export trains nothing: --seq-length is not its concern
    assert resume_refusal(cfg, 4) == []
    # another process count: the global batch, with the flag that keeps it
    (problem,) = resume_refusal(TrainConfig(**same), 2)
    assert "the global batch: checkpoint 8 vs now 4 (2 processes x -b 2 x --grad-accum-steps 1; " in problem
    assert "--global-batch-size 8 keeps it on any process count that divides it)" in problem
    # where -b does not divide the batch over the processes, --global-batch-size alone was advised and then refused
    odd = {**same, "batch_size": 3}
    assert (
        "--global-batch-size 8 -b 2 keeps it on 2 data-parallel processes" in resume_refusal(TrainConfig(**odd), 2)[0]
    )
    assert "8 sequences do not split over 3 data-parallel processes" in resume_refusal(TrainConfig(**odd), 3)[0]
    assert resume_refusal(TrainConfig(**same, global_batch_size=8, grad_accum_steps=2), 2) == []
    assert resume_refusal(TrainConfig(**same), None) == []  # a --dry-run without torchrun: the count is not known
    from fsdp_lib.checks import validate_config

    monkeypatch.delenv("WORLD_SIZE", raising=False)  # plain `python fsdp_train.py`: one process, known
    assert any("the global batch: checkpoint 8 vs now 2" in p for p in validate_config(TrainConfig(**same), 1))
    dry = validate_config(TrainConfig(**same, dry_run=True), 1)  # a --dry-run without torchrun: not known
    assert not any("the global batch" in p for p in dry)
    assert "checkpoint 8 vs now 6" in resume_refusal(TrainConfig(**same, global_batch_size=6), None)[0]
    (problem,) = resume_refusal(TrainConfig(**same, context_parallel=2), 4)
    assert "vs now 4 (2 processes x -b 2 x --grad-accum-steps 1; --context-parallel 1 then, 2 now;" in problem
    # a degree that does not divide the processes is its own refusal: no "0 processes ... now 0" beside it
    assert resume_refusal(TrainConfig(**same, context_parallel=2), 1) == []
    assert resume_refusal(TrainConfig(**same, context_parallel=4), 6) == []
    # the objective by name (auto is resolved against the data, later), the adapters, the slice
    refused = {
        "--objective: checkpoint lm vs now dpo": {"objective": "dpo"},
        "--peft: checkpoint lora vs now none": {"peft": "none"},
        "--lora-rank: checkpoint 8 vs now 16; --lora-alpha: checkpoint 16.0 vs now 32.0": {"lora_rank": 16, "lora_alpha": 32.0},
        "--data-slice: checkpoint '' vs now '0:100'": {"data_slice": "0:100"},
    }  # fmt: skip
    for said, change in refused.items():
        (problem,) = resume_refusal(TrainConfig(**(same | change)), 4)
        assert f"step_00000004: {said}. These change the math" in problem, problem
    assert resume_refusal(TrainConfig(**same, objective="lm"), 4) == []
    # a chat run from before whole packing (its data format without the marker), resumed with the default
    fingerprint["data_format"] = "chat:9f1e:loss-on-assistant:document-masking-on"
    (step / "train_state.json").write_text(json.dumps({"fingerprint": fingerprint, "config": config}))
    (problem,) = resume_refusal(TrainConfig(**same), 4)
    assert "--packing: checkpoint stream vs now whole (" in problem and "--packing stream resumes this run" in problem
    assert resume_refusal(TrainConfig(**same, packing="stream"), 4) == []
    fingerprint["data_format"] = "text:document-masking-on"  # text streams by default
    (step / "train_state.json").write_text(
        json.dumps({"fingerprint": fingerprint, "config": {**config, "packing": "auto"}})
    )
    assert resume_refusal(TrainConfig(**same), 4) == []
    assert "leave --packing out resumes this run" in resume_refusal(TrainConfig(**same, packing="whole"), 4)[0]
    # with --adapter the rank and alpha are the adapter folder's, not the flags'
    assert resume_refusal(TrainConfig(**(same | {"lora_rank": 16, "adapter": str(tmp_path)})), 4) == []
    # an unreadable train_state.json: the run's own reads say what is wrong with it
    (step / "train_state.json").write_text("[1, 2]")
    assert resume_refusal(TrainConfig(**(same | {"seed": 9})), 4) == []


def test_a_runs_config_yaml_reused_on_another_process_count_keeps_its_global_batch(tmp_path: Path) -> None:
    """config.yaml held the accumulation validate_config derived from --global-batch-size for the run's process
    count (1 x -b 2 -> 4): reused with --config on 2 processes it was refused ('--grad-accum-steps 4 contradicts
    --global-batch-size 8'), flags the user never passed."""
    import yaml

    from fsdp_lib.checks import _batch_problems
    from fsdp_lib.config import TrainConfig, load_config
    from fsdp_lib.experiment_dir import run_settings

    cfg = TrainConfig(batch_size=2, global_batch_size=8)
    assert _batch_problems(cfg, 1) == [] and cfg.grad_accum_steps == 4
    (tmp_path / "reuse.yaml").write_text(yaml.safe_dump(run_settings(cfg), sort_keys=False))
    again = load_config(["--config", str(tmp_path / "reuse.yaml")])
    assert _batch_problems(again, 2) == [] and again.grad_accum_steps == 2


def test_a_lora_experiment_as_the_model_is_told_to_pass_its_base_and_adapter(tmp_path: Path) -> None:
    """-m a LoRA run's experiment said "its exported model is -m EXP/final", itself an adapter that is refused."""
    from fsdp_lib.offline import _no_config

    exp = tmp_path / "lora1"
    (exp / "final").mkdir(parents=True)
    (exp / "run.lock").write_text("")
    (exp / "final" / "adapter_config.json").write_text('{"base_model_name_or_path": "/models/base"}')
    said = _no_config(str(exp), exp)
    assert "is a training experiment of fsdp_train.py" in said and "its exported model" not in said, said
    assert "is a LoRA adapter, not a model: pass its base, -m /models/base, with --peft lora --adapter" in said, said
