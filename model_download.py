"""Fetch a Hugging Face causal LM for offline training, or create a new one from a size preset.

Training machines have no internet. Run this once where there is a connection; it fills the Hugging Face
cache (HF_HOME) or a plain folder with exactly what training needs, then verifies offline that the model
loads and that every weight is present. After that everything works with HF_HUB_OFFLINE=1.

    # download into the cache ($HF_HOME/hub), then copy HF_HOME to the training machine
    export HF_HOME=$PWD/.cache/huggingface
    python model_download.py --model-name meta-llama/Llama-3.2-3B-Instruct      # token: HF_TOKEN or --token

    # download into a plain folder instead, at a pinned revision
    python model_download.py --model-name Qwen/Qwen2.5-0.5B --revision main --local-dir models/qwen0.5b

    # re-check an existing download without any network
    HF_HUB_OFFLINE=1 python model_download.py --model-name meta-llama/Llama-3.2-3B-Instruct --verify-only

    # a hub dataset into the cache, verified to load with HF_DATASETS_OFFLINE=1 (then fsdp_train.py -d ORG/NAME)
    python model_download.py --dataset ORG/NAME

    # a new model from scratch: Llama architecture + a BPE tokenizer trained on a data_hf.py dataset
    python model_download.py --init tiny --tokenizer-from hf_datasets/my_corpus --local-dir models/tiny --with-weights

Exit status: 0 on success, 1 when the download or the verification fails, 2 for invalid flags.

This file holds the flags, their validation and the four commands; the work is done in fsdp_lib/hub/ (presets,
plan, weights, verify, download, dataset, tokenizer, scratch).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from fsdp_lib.arguments import OneValueParser
from fsdp_lib.hub.console import ToolError
from fsdp_lib.hub.dataset import download_dataset, report_dataset, verify_dataset
from fsdp_lib.hub.download import (
    cached_model_folder,
    check_download_target,
    check_fetched,
    download_model,
    explained_hub_errors,
    hub_id_problem,
    mark_complete,
    refuse_unfinished,
)
from fsdp_lib.hub.presets import SIZE_FLAGS, SIZE_PRESETS, preset_parameter_count, size_problems
from fsdp_lib.hub.scratch import InitRequest, create_model_folder
from fsdp_lib.hub.verify import report_verified, reverify_folder, verify_and_record
from fsdp_lib.interrupts import exit_without_teardown, interrupt_exit_code, sigterm_as_interrupt
from fsdp_lib.noise import quiet_optional_imports

MAX_VOCAB_SIZE = 1_048_576  # --vocab-size: four times the largest published vocabulary
MAX_SEED = 2**32 - 1  # --seed: what every seeded generator accepts

# ---------------------------------------------------------------------------------------------------------
# the flags
# ---------------------------------------------------------------------------------------------------------


def size_overrides(args: argparse.Namespace) -> dict[str, int]:
    """The size flags the user passed, as {flag: value}."""
    given = {flag: getattr(args, flag[2:].replace("-", "_")) for flag in SIZE_FLAGS}
    return {flag: value for flag, value in given.items() if value is not None}


def init_size_help() -> str:
    counts = {name: preset_parameter_count(p, p.default_vocab_size) for name, p in SIZE_PRESETS.items()}
    return ", ".join(f"{name} {count:,}" for name, count in counts.items())


def build_parser() -> argparse.ArgumentParser:
    parser = OneValueParser(
        prog="model_download.py",
        description="Fetch a Hugging Face causal LM for offline training (HF_HOME cache or --local-dir), verify it"
        " offline, or create a new Llama-architecture model from a size preset with --init.",
    )
    source = parser.add_argument_group("download / verify")
    source.add_argument("--model-name", help="hub repository id, e.g. meta-llama/Llama-3.2-3B-Instruct")
    source.add_argument(
        "--dataset",
        metavar="ORG/NAME",
        help="download a hub dataset repository into the HF_HOME cache instead, and verify it loads offline",
    )
    source.add_argument("--revision", help="branch, tag or commit hash to fetch (default: main)")
    source.add_argument(
        "--local-dir", help="write a plain folder instead of the HF_HOME cache (the --init output folder)"
    )
    source.add_argument(
        "--token", default=None, help="hub access token for gated/private repos (default: HF_TOKEN or a saved login)"
    )
    source.add_argument(
        "--verify-only", action="store_true", help="only re-run the offline verification of an existing download"
    )
    source.add_argument(
        "--force-download",
        action="store_true",
        help="re-fetch every file even if already present (repairs a corrupt file)",
    )
    source.add_argument(
        "--checksums",
        action="store_true",
        help="with --verify-only, also compare every file's bytes with the hub's checksums (SHA-256 of the weights;"
        " a download always does): finds a file corrupted at its own size, at the cost of reading the whole model",
    )
    scratch = parser.add_argument_group("new model from scratch")
    scratch.add_argument(
        "--init",
        type=lambda name: next((preset for preset in SIZE_PRESETS if preset.lower() == name.lower()), name),
        choices=list(SIZE_PRESETS),
        help="create a new Llama model folder of this size in --local-dir; exact parameter counts with a 32000 vocab"
        f" (1024 for tiny): {init_size_help()}",
    )
    for flag, config_field in SIZE_FLAGS.items():
        scratch.add_argument(
            flag, type=int, default=None, metavar="N", help=f"with --init: {config_field} instead of the preset's"
        )
    scratch.add_argument(
        "--tokenizer-from",
        metavar="DATASET",
        help="train a byte-level BPE tokenizer on this data_hf.py dataset (its text, or every turn of a chat or "
        "preference dataset)",
    )
    scratch.add_argument(
        "--tokenizer", metavar="NAME_OR_DIR", help="reuse this tokenizer (a folder, or a hub id already cached) instead"
    )
    scratch.add_argument(
        "--vocab-size", type=int, default=None, help="BPE vocabulary size (default: 1024 for tiny, 32000 otherwise)"
    )
    scratch.add_argument(
        "--with-weights",
        action="store_true",
        help="also write random-initialised safetensors (else the trainer initialises them)",
    )
    scratch.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        help="dtype of --with-weights (default: bfloat16)",
    )
    scratch.add_argument("--seed", type=int, help="seed of --with-weights' initialisation (default: 0)")
    scratch.add_argument("--overwrite", action="store_true", help="replace an existing model folder in --local-dir")
    return parser


def value_problems(args: argparse.Namespace) -> list[str]:
    """The values that cannot be right whatever the command: hub ids, the revision, the seed."""
    problems = [
        problem
        for problem in (
            hub_id_problem("--model-name", args.model_name, "Qwen/Qwen2.5-0.5B"),
            hub_id_problem("--dataset", args.dataset, "ORG/NAME", parts=(2,)),
        )
        if problem
    ]
    if args.revision is not None and (not args.revision.strip() or any(c.isspace() for c in args.revision)):
        problems.append(
            f"--revision {args.revision!r} is not a branch, tag or commit hash (empty, or with spaces); leave it out"
            " for main"
        )
    if args.seed is not None and not 0 <= args.seed <= MAX_SEED:
        problems.append(f"--seed {args.seed} must be between 0 and {MAX_SEED:,}")
    return problems


def validate_args(args: argparse.Namespace) -> list[str]:
    """Every flag problem at once, each naming the flag and the fix."""
    problems = []
    scratch_flags = {
        "--tokenizer-from": args.tokenizer_from,
        "--tokenizer": args.tokenizer,
        "--vocab-size": args.vocab_size,
        "--with-weights": args.with_weights,
        "--dtype": args.dtype,
        "--seed": args.seed,
        "--overwrite": args.overwrite,
        **size_overrides(args),
    }
    download_flags = {"--revision": args.revision, "--token": args.token, "--force-download": args.force_download}
    if args.dataset:
        if args.model_name or args.init or args.verify_only or args.local_dir:
            problems.append(
                "--dataset downloads a dataset into the HF_HOME cache: drop --model-name/--init/--verify-only/--local-dir"
            )
    problems += value_problems(args)
    if args.verify_only and args.local_dir and args.revision:
        problems.append(
            "--revision applies to downloads and the cache: --verify-only --local-dir checks that folder as it is; "
            "drop --revision"
        )
    if args.checksums and args.init:
        problems.append("--checksums compares a downloaded model's files with the hub's; --init has none to compare: "
                        "drop --checksums")  # fmt: skip
    elif args.checksums and args.dataset:
        problems.append(
            "--checksums: a --dataset download compares every file with the hub's checksums anyway: drop it"
        )
    if args.verify_only and args.force_download:
        problems.append("--force-download fetches every file again, --verify-only fetches nothing: drop one of them")
    if args.init:
        if args.model_name or args.verify_only:
            problems.append("--init creates a new model: drop --model-name/--verify-only")
        if not args.local_dir:
            problems.append("--init needs --local-dir DIR for the new model folder")
        if bool(args.tokenizer_from) == bool(args.tokenizer):
            problems.append(
                "--init needs exactly one of --tokenizer-from DATASET (train a tokenizer) or --tokenizer NAME_OR_DIR"
            )
        if args.vocab_size is not None and args.tokenizer:
            problems.append("--vocab-size applies to --tokenizer-from only; a reused --tokenizer keeps its vocabulary")
        if args.vocab_size is not None and args.vocab_size < 259:
            problems.append(f"--vocab-size {args.vocab_size} is below 259 (256 byte tokens + bos, eos, pad)")
        if args.vocab_size is not None and args.vocab_size > MAX_VOCAB_SIZE:
            problems.append(
                f"--vocab-size {args.vocab_size:,} is above {MAX_VOCAB_SIZE:,}; real vocabularies hold 32,000 to"
                " 262,144 tokens (the default: 1024 for tiny, 32000 otherwise)"
            )
        if not args.with_weights and (unused := [f for f in ("--dtype", "--seed") if scratch_flags[f] is not None]):
            verb, them = ("applies", "it") if len(unused) == 1 else ("apply", "them")
            problems.append(
                f"{' and '.join(unused)} {verb} to --with-weights only (without it the trainer initialises the "
                f"weights, from its own --seed): drop {them}, or add --with-weights"
            )
        if used := [flag for flag, value in download_flags.items() if value not in (None, False)]:
            verb, them = ("applies", "it") if len(used) == 1 else ("apply", "them")
            problems.append(f"{', '.join(used)} {verb} to downloads only; --init fetches nothing: drop {them}")
        problems += size_problems(args.init, size_overrides(args))
    else:
        used = [flag for flag, value in scratch_flags.items() if value not in (None, False)]
        if used:
            weights = " --with-weights" if {"--dtype", "--seed"} & set(used) else ""
            problems.append(f"{', '.join(used)} only appl{'ies' if len(used) == 1 else 'y'} with --init SIZE{weights}")
        if args.model_name is None and args.dataset is None and not (args.verify_only and args.local_dir):
            problems.append(
                "pass --model-name NAME (download), --dataset ORG/NAME, --verify-only with --model-name or"
                " --local-dir, or --init SIZE"
            )
    return problems


# ---------------------------------------------------------------------------------------------------------
# the four commands: download, --dataset, --verify-only, --init
# ---------------------------------------------------------------------------------------------------------


def run_download(args: argparse.Namespace) -> int:
    local_dir = Path(args.local_dir).resolve() if args.local_dir else None
    if local_dir is not None:
        check_download_target(local_dir, args.model_name)
    with explained_hub_errors(args.model_name, args.revision):
        folder, snapshot = download_model(
            args.model_name, args.revision, local_dir, args.token, args.force_download, rerun_command(args)
        )
    check_fetched(snapshot, folder)  # what this run fetched, every byte against the hub's checksums
    source = {"model_name": args.model_name, "revision": args.revision, "commit": snapshot.commit}
    # verify exactly as training will load it: by hub id from the cache, offline, or as a folder
    load_name, revision = (args.model_name, args.revision) if local_dir is None else (str(folder), None)
    verify_and_record(folder, load_name, revision, source, True)
    mark_complete(folder)
    return 0


def rerun_command(args: argparse.Namespace) -> str:
    """The command that finishes this download, for the marker an interrupted one leaves."""
    words = ["python", "model_download.py"]
    words += ["--dataset", args.dataset] if args.dataset else ["--model-name", args.model_name]
    words += ["--revision", args.revision] if args.revision != "main" else []
    words += ["--local-dir", str(Path(args.local_dir).resolve())] if args.local_dir else []
    return shlex.join(words)


def run_dataset_download(args: argparse.Namespace) -> int:
    with explained_hub_errors(args.dataset, args.revision, flag="--dataset"):
        folder, snapshot = download_dataset(
            args.dataset, args.revision, args.token, args.force_download, rerun_command(args)
        )
    check_fetched(snapshot, folder)
    report_dataset(args.dataset, args.revision, verify_dataset(args.dataset, args.revision))
    mark_complete(folder)
    return 0


def run_verify_only(args: argparse.Namespace) -> int:
    if args.local_dir:
        refuse_unfinished(Path(args.local_dir).resolve())
        reverify_folder(Path(args.local_dir).resolve(), args.model_name, args.checksums)
        return 0
    folder = cached_model_folder(args.model_name, args.revision)
    refuse_unfinished(folder)
    source = {"model_name": args.model_name, "revision": args.revision, "commit": folder.name}
    verify_and_record(folder, args.model_name, args.revision, source, True, args.checksums)
    return 0


def run_init(args: argparse.Namespace) -> int:
    request = InitRequest(
        args.init,
        size_overrides(args),
        args.tokenizer_from,
        args.tokenizer,
        args.vocab_size,
        args.with_weights,
        args.dtype,
        args.seed,
    )
    verified = create_model_folder(request, Path(args.local_dir).resolve(), args.overwrite)
    report_verified(verified, request.description())
    return 0


def describe_os_error(exc: OSError) -> str:
    where = f": {exc.filename}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


def main(argv: list[str] | None = None) -> int:
    quiet_optional_imports()  # model_download never uses torchao: its import-time warnings are noise here
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on bad flags; callers of main() get the code
        return exc.code if isinstance(exc.code, int) else 2
    problems = validate_args(args)
    args.revision, args.dtype, args.seed = args.revision or "main", args.dtype or "bfloat16", args.seed or 0
    if problems:
        for problem in problems:
            print(f"model_download.py: error: {problem}", file=sys.stderr)
        return 2
    try:
        with sigterm_as_interrupt():
            if args.dataset:
                return run_dataset_download(args)
            if args.init:
                return run_init(args)
            if args.verify_only:
                return run_verify_only(args)
            return run_download(args)
    except ToolError as exc:
        print(f"model_download.py: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. a read-only or full disk: the OS error in words, with the path
        print(f"model_download.py: error: {describe_os_error(exc)}; fix it and rerun the same command", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:  # downloads resume file by file; --init builds in a staging folder
        again = "start again" if args.init else "resume"  # --init builds from scratch each time
        print(f"model_download.py: interrupted; rerun the same command to {again}, nothing half-written is kept")
        return interrupt_exit_code(interrupt)


if __name__ == "__main__":
    exit_without_teardown(main())
