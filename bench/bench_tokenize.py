"""Tokenise and pack: fsdp_train.py's tokenize_to_file + PackedBlocks against the Hugging Face run_clm route.

    python bench/bench_tokenize.py            # 20 MB generated corpus, 5 repetitions per side; a few minutes
    python bench/bench_tokenize.py --quick    # 1 MB corpus, one repetition: proves the benchmark still runs

Both sides start from the same saved dataset (a `text` column, loaded with datasets.load_from_disk as
fsdp_train.py does) and the same fast byte-level BPE tokenizer, in one process, and end with blocks of
--seq-length tokens ready to index:

- fsdp_train: `tokenize_to_file` (row batches of 1000 -> one flat uint16/uint32 token file, EOS after each
  document, fsynced) then `PackedBlocks` over a memory map of it;
- run_clm: `dataset.map(tokenize, batched=True, remove_columns=["text"])` then `map(group_texts, batched=True)`,
  exactly as transformers' examples/pytorch/language-modeling/run_clm.py does, each map writing its Arrow
  cache file (load_from_cache_file=False, so every repetition does the work);
- tokenizer floor (for information): fsdp_train's own tokenizer call (`encode_batch`: the Rust backend's
  `encode_batch_fast`, no character offsets) over the same row batches, keeping only the token id lists:
  what any route with this tokenizer pays at least.

Each side reports wall-clock time (the goal's measure; the Rust tokenizer uses every core, the Arrow writes
and Python list work of run_clm one) and process CPU time over all threads, which other jobs on a shared
machine hardly move. The token streams are checked for equality after the timed runs (`check_token_streams`).
Goal: run_clm time / fsdp_train time >= 1.5.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
from common import Stopwatch, bench_arg_parser, fresh_dir, machine_info, work_folder, write_results
from inputs import make_corpus, save_text_dataset
from ratios import report_routes, run_routes

FULL = {"corpus_chars": 20_000_000, "vocab": 16384, "seq": 1024, "reps": 5}
QUICK = {"corpus_chars": 1_000_000, "vocab": 512, "seq": 128, "reps": 1}
BATCH_ROWS = 1000  # both routes' row batch: tokenize_to_file's default and datasets.map's default


def fsdp_train_route(dataset: Any, tokenizer: Any, out_dir: Path, seq: int) -> dict[str, Any]:
    from fsdp_lib.data.cache import PackedBlocks, token_dtype, tokenize_to_file

    out_dir.mkdir(parents=True)
    path = out_dir / "train.tokens"
    with Stopwatch() as watch:
        tokenize_to_file(dataset, tokenizer, path, batch_rows=BATCH_ROWS)
        blocks = PackedBlocks(np.memmap(path, dtype=token_dtype(len(tokenizer)), mode="r"), seq)
        n_blocks = len(blocks)
    return watch.result(tokens=len(blocks.tokens), blocks=n_blocks, trained_tokens=n_blocks * seq)


def run_clm_route(dataset: Any, tokenizer: Any, out_dir: Path, seq: int) -> dict[str, Any]:
    """transformers examples/pytorch/language-modeling/run_clm.py: tokenize_function and group_texts."""
    out_dir.mkdir(parents=True)

    def tokenize_function(examples: dict[str, list]) -> Any:
        return tokenizer(examples["text"])

    def group_texts(examples: dict[str, list]) -> dict[str, list]:
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated[list(examples.keys())[0]])
        total_length = (total_length // seq) * seq  # run_clm drops each map batch's remainder
        result = {k: [t[i : i + seq] for i in range(0, total_length, seq)] for k, t in concatenated.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    with Stopwatch() as watch:
        tokenized = dataset.map(
            tokenize_function,
            batched=True,
            batch_size=BATCH_ROWS,
            remove_columns=dataset.column_names,
            load_from_cache_file=False,
            cache_file_name=str(out_dir / "tokenized.arrow"),
        )
        lm_dataset = tokenized.map(
            group_texts,
            batched=True,
            batch_size=BATCH_ROWS,
            load_from_cache_file=False,
            cache_file_name=str(out_dir / "grouped.arrow"),
        )
        n_blocks = len(lm_dataset)
    # Blocks of seq tokens whose labels are the inputs shifted inside the model: seq - 1 targets each.
    return watch.result(tokens=n_blocks * seq, blocks=n_blocks, trained_tokens=n_blocks * (seq - 1))


def tokenizer_floor(dataset: Any, tokenizer: Any) -> dict[str, Any]:
    from fsdp_lib.data.cache import encode_batch

    tokens = 0
    with Stopwatch() as watch:
        for batch in dataset.iter(batch_size=BATCH_ROWS):
            tokens += sum(map(len, encode_batch(tokenizer, batch["text"])))
    return watch.result(tokens=tokens)


def check_token_streams(fsdp_dir: Path, clm_dir: Path, tokenizer: Any) -> dict[str, Any]:
    """fsdp_train's stream must be run_clm's tokenised documents, in order, with one EOS after each.
    run_clm keeps fewer: it adds no EOS (this tokenizer adds no special tokens) and drops up to seq-1
    tokens at the end of every 1000-row map batch."""
    import datasets

    from fsdp_lib.data.cache import token_dtype

    stream = np.fromfile(fsdp_dir / "train.tokens", dtype=token_dtype(len(tokenizer)))
    eos = tokenizer.eos_token_id
    tokenized = datasets.Dataset.from_file(str(clm_dir / "tokenized.arrow"))
    parts = [np.asarray(ids, dtype=np.int64) for ids in tokenized["input_ids"]]
    expected = np.concatenate([np.append(p, eos) for p in parts])
    return {
        "fsdp_stream_equals_docs_plus_eos": bool(np.array_equal(stream.astype(np.int64), expected)),
        "documents": len(parts),
        "document_tokens": int(sum(map(len, parts))),
        "eos_added": int((stream == eos).sum()),
    }


LABELS = {
    "fsdp_train": "fsdp_train tokenize_to_file + PackedBlocks",
    "run_clm": "run_clm map(tokenize) + map(group_texts)",
    "tokenizer_floor": "tokenizer floor: encode_batch ids only",
}


def routes(dataset: Any, tokenizer: Any, work: Path, seq: int) -> dict[str, Callable[[], dict[str, Any]]]:
    """The routes over the same dataset and tokenizer, each writing to a fresh folder under work."""
    return {
        "fsdp_train": lambda: fsdp_train_route(dataset, tokenizer, fresh_dir(work, "fsdp"), seq),
        "run_clm": lambda: run_clm_route(dataset, tokenizer, fresh_dir(work, "clm"), seq),
        "tokenizer_floor": lambda: tokenizer_floor(dataset, tokenizer),
    }


def main(argv: list[str] | None = None) -> int:
    args = bench_arg_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    p = QUICK if args.quick else FULL
    reps = args.reps or p["reps"]
    info = machine_info()
    import datasets
    from transformers import AutoTokenizer

    from fsdp_lib.testing import train_tokenizer

    datasets.disable_progress_bars()
    with work_folder(args, "bench_tokenize_") as work:
        docs = make_corpus(p["corpus_chars"])
        train_tokenizer(work / "tokenizer", docs[: max(1, len(docs) // 20)], vocab_size=p["vocab"])
        save_text_dataset(docs, work / "dataset")
        corpus_mb = sum(len(d.encode()) for d in docs) / 1e6
        del docs
        tokenizer = AutoTokenizer.from_pretrained(work / "tokenizer")
        dataset = datasets.load_from_disk(str(work / "dataset"))
        print(f"corpus: {len(dataset):,} documents, {corpus_mb:.1f} MB; tokenizer vocab {len(tokenizer):,}")

        runs = run_routes(reps, routes(dataset, tokenizer, work, p["seq"]))
        check = check_token_streams(work / "fsdp", work / "clm", tokenizer)
    headers = ["route", "wall (s)", "MB/s", "CPU (s)", "tokens kept", "target tokens", "wall per rep (s)"]
    figures = report_routes(runs, "run_clm", LABELS, headers, corpus_mb, "trained_tokens", goal=1.5)
    print(
        f"token check: fsdp_train stream == documents + one EOS each: {check['fsdp_stream_equals_docs_plus_eos']} "
        f"({check['document_tokens']:,} document tokens + {check['eos_added']:,} EOS); run_clm keeps "
        f"{runs['run_clm'][-1]['tokens']:,} (no EOS, drops each 1000-row batch's remainder)"
    )
    write_results(
        args.results_dir,
        "tokenize",
        {
            "machine": info,
            "params": {**p, "reps": reps, "corpus_mb": corpus_mb, "documents": check["documents"]},
            **figures,
            "token_check": check,
            "runs": runs,
        },
    )
    return 0 if check["fsdp_stream_equals_docs_plus_eos"] else 1


if __name__ == "__main__":
    sys.exit(main())
