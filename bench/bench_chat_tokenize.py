"""Chat tokenise, mask and pack: fsdp_train.py's ChatEncoder route against the TRL-style per-example route.

    python bench/bench_chat_tokenize.py            # 50k generated conversations, 3 repetitions per side; 3-6 minutes
    python bench/bench_chat_tokenize.py --quick    # 1,000 conversations, one repetition: proves it still runs

Both sides start from the same saved dataset (a `messages` column, loaded with datasets.load_from_disk as
fsdp_train.py does) and the same fast byte-level BPE tokenizer, which knows the ChatML special tokens
(<|im_start|>, <|im_end|>), in one process, and end with the conversations' token ids and assistant-only label
masks packed into blocks of --seq-length tokens ready to index:

- fsdp_train: `tokenize_to_file(..., chat=ChatEncoder(tokenizer, "assistant"))` with the plain Qwen2.5 ChatML
  template (tests/fixtures/chat_templates/qwen2.5.jinja, no {% generation %} markers: the assistant spans come
  from rendering conversation prefixes) -> token, mask and document-end files, then `PackedBlocks` with the mask
  and document masking over memory maps of them;
- trl: what TRL's SFTTrainer does with `assistant_only_loss=True`: `dataset.map` of a per-example
  `tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)`
  keeping input_ids and assistant_masks, then its "wrapped" packing (pyarrow offsets over the concatenated
  columns, `map(batched=True)` on the arrow format); each map writes its Arrow cache file
  (load_from_cache_file=False, so every repetition does the work). The template is the same one with
  {% generation %} markers (qwen2.5_generation_markers.jinja), which the reference route needs and which
  renders the same text;
- tokenizer floor (for information): the Rust tokenizer's `encode_batch` (with character offsets, as the
  masks need) of the conversations rendered beforehand, in the same row batches: what any route that tokenises
  the rendered conversations with this tokenizer pays at least.

Each side reports wall-clock time and process CPU time over all threads (which other jobs on a shared machine
hardly move). After the timed runs every conversation's token ids and label mask are compared between the two
routes. Goal: trl time / fsdp_train time >= 1.5.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import REPO_ROOT, Stopwatch, bench_arg_parser, fresh_dir, machine_info, work_folder, write_results
from inputs import make_corpus
from ratios import report_routes, run_routes

FULL = {"conversations": 50_000, "vocab": 16384, "seq": 2048, "reps": 3}
QUICK = {"conversations": 1_000, "vocab": 512, "seq": 256, "reps": 1}
BATCH_ROWS = 1000  # both routes' row batch: tokenize_to_file's default and datasets.map's default
TEMPLATES = REPO_ROOT / "tests" / "fixtures" / "chat_templates"
CHATML_TOKENS = ["<|im_start|>", "<|im_end|>"]
# Turn lengths in characters, log-normal (median, sigma): short prompts, longer answers, as in instruction data
# (Alpaca's median instruction is ~60 characters and output ~270; chat data runs longer).
LENGTHS = {"system": (120, 0.5), "user": (150, 0.9), "assistant": (450, 0.8)}


# --- Inputs -------------------------------------------------------------------------------------------------


def make_conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """n conversations of 1-3 user/assistant exchanges (half have one, a third two, the rest three), a system
    turn in 30% of them; turn texts are pieces of a pseudo-prose corpus cut at word ends, log-normal lengths."""
    rng = np.random.default_rng(seed)
    exchanges = rng.choice([1, 2, 3], size=n, p=[0.5, 0.33, 0.17])
    has_system = rng.random(n) < 0.3
    roles = [
        (["system"] if system else []) + ["user", "assistant"] * int(k) for system, k in zip(has_system, exchanges)
    ]
    lengths = {
        role: np.clip(rng.lognormal(np.log(median_chars), sigma, size=n * 3), 8, 6000).astype(np.int64)
        for role, (median_chars, sigma) in LENGTHS.items()
    }
    # A pool of at most 20 M characters, reused from a random point when used up: generating prose is slow.
    needed = sum(int(length.sum()) for length in lengths.values()) // 3
    pool = " ".join(make_corpus(min(needed, 20_000_000) + 100_000, seed=seed))
    conversations, cursor, used = [], 0, dict.fromkeys(LENGTHS, 0)
    for turn_roles in roles:
        turns = []
        for role in turn_roles:
            size = int(lengths[role][used[role]])
            used[role] += 1
            if cursor + size + 20 > len(pool):
                cursor = int(rng.integers(0, 1000))
            end = pool.find(" ", cursor + size)
            end = end if end > 0 else cursor + size
            turns.append({"role": role, "content": pool[cursor:end].strip()})
            cursor = end + 1
        conversations.append(turns)
    return conversations


def make_chatml_tokenizer(folder: Path, texts: list[str], vocab: int) -> None:
    """A byte-level BPE trained on `texts` plus the ChatML special tokens, as a Qwen2.5-style tokenizer has."""
    from transformers import AutoTokenizer

    from fsdp_lib.testing import train_tokenizer

    train_tokenizer(folder, texts, vocab_size=vocab)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": CHATML_TOKENS})
    tokenizer.save_pretrained(folder)


def load_tokenizer(folder: Path, template: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return tokenizer


# --- The two routes -----------------------------------------------------------------------------------------


def fsdp_train_route(dataset: Any, tokenizer: Any, out_dir: Path, seq: int) -> dict[str, Any]:
    from fsdp_lib.data.cache import PackedBlocks, stream_paths, token_dtype, tokenize_to_file
    from fsdp_lib.data.chat import ChatEncoder

    out_dir.mkdir(parents=True)
    path = out_dir / "train.tokens"
    with Stopwatch() as watch:
        tokenize_to_file(dataset, tokenizer, path, batch_rows=BATCH_ROWS, chat=ChatEncoder(tokenizer, "assistant"))
        files = stream_paths(path)
        blocks = PackedBlocks(
            np.memmap(path, dtype=token_dtype(len(tokenizer)), mode="r"),
            seq,
            trained=np.memmap(files["mask"], dtype=np.uint8, mode="r"),
            doc_ends=np.memmap(files["docs"], dtype=np.int64, mode="r"),
        )
        n_blocks = len(blocks)
    return watch.result(tokens=len(blocks.tokens), blocks=n_blocks, trained_tokens=int(blocks.trained.sum()))


def pack_wrapped(table: Any, seq: int) -> Any:
    """TRL's "wrapped" packing: each list column's values concatenated and cut every `seq` elements by new
    offsets (pyarrow, no Python per token)."""
    import pyarrow as pa

    columns = []
    for column in table.columns:
        column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        values = column.values[column.offsets[0].as_py() : column.offsets[-1].as_py()]
        dtype = column.offsets.type.to_pandas_dtype()
        offsets = np.append(np.arange(0, len(values), seq, dtype=dtype), np.array([len(values)], dtype=dtype))
        columns.append(type(column).from_arrays(offsets, values))
    return pa.Table.from_arrays(columns, names=table.column_names)


def trl_route(dataset: Any, tokenizer: Any, out_dir: Path, seq: int) -> dict[str, Any]:
    import pyarrow.compute as pc

    out_dir.mkdir(parents=True)

    def tokenize(example: dict[str, Any]) -> dict[str, list[int]]:
        output = tokenizer.apply_chat_template(
            example["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return {"input_ids": output["input_ids"], "assistant_masks": output["assistant_masks"]}

    with Stopwatch() as watch:
        tokenized = dataset.map(
            tokenize,
            remove_columns=dataset.column_names,
            load_from_cache_file=False,
            cache_file_name=str(out_dir / "tokenized.arrow"),
        )
        packed = (
            tokenized.with_format("arrow")
            .map(
                pack_wrapped,
                batched=True,
                batch_size=BATCH_ROWS,
                fn_kwargs={"seq": seq},
                load_from_cache_file=False,
                cache_file_name=str(out_dir / "packed.arrow"),
            )
            .with_format(None)
        )
        n_blocks = len(packed)
    tokens = int(pc.sum(pc.list_value_length(tokenized.data.column("input_ids"))).as_py())
    return watch.result(tokens=tokens, blocks=n_blocks)


def render_all(dataset: Any, tokenizer: Any) -> list[str]:
    """Every conversation rendered with the chat template (untimed input of the tokenizer floor)."""
    return [
        text
        for batch in dataset.iter(batch_size=BATCH_ROWS)
        for text in tokenizer.apply_chat_template(list(batch["messages"]), tokenize=False)
    ]


def tokenizer_floor(texts: list[str], tokenizer: Any) -> dict[str, Any]:
    tokens = 0
    with Stopwatch() as watch:
        for start in range(0, len(texts), BATCH_ROWS):
            encodings = tokenizer.backend_tokenizer.encode_batch(
                texts[start : start + BATCH_ROWS], add_special_tokens=False
            )
            tokens += sum(len(encoding.ids) for encoding in encodings)
    return watch.result(tokens=tokens)


def compare_routes(fsdp_dir: Path, trl_dir: Path, tokenizer: Any) -> dict[str, Any]:
    """Per conversation: are fsdp_train's token ids and trained mask those of transformers' generation-marker
    route? fsdp_train's stream is split at its document ends; no conversation is skipped here, so the i-th
    document is the i-th conversation."""
    import datasets

    from fsdp_lib.data.cache import stream_paths, token_dtype

    files = stream_paths(fsdp_dir / "train.tokens")
    tokens = np.fromfile(files["tokens"], dtype=token_dtype(len(tokenizer))).astype(np.int64)
    mask = np.fromfile(files["mask"], dtype=np.uint8)
    doc_ends = np.fromfile(files["docs"], dtype=np.int64)
    reference = datasets.Dataset.from_file(str(trl_dir / "tokenized.arrow"))
    ref_ids = reference.data.column("input_ids").combine_chunks()
    ref_mask = reference.data.column("assistant_masks").combine_chunks()
    ids_offsets, mask_offsets = ref_ids.offsets.to_numpy(), ref_mask.offsets.to_numpy()
    ids_values, mask_values = ref_ids.values.to_numpy(), ref_mask.values.to_numpy()
    starts = np.concatenate([[0], doc_ends[:-1]])
    ids_equal = masks_equal = 0
    for i, (a, b) in enumerate(zip(starts, doc_ends)):
        if i >= len(reference):
            break
        ours_ids, ours_mask = tokens[a:b], mask[a:b]
        theirs_ids = ids_values[ids_offsets[i] : ids_offsets[i + 1]]
        theirs_mask = mask_values[mask_offsets[i] : mask_offsets[i + 1]]
        ids_equal += bool(np.array_equal(ours_ids, theirs_ids))
        masks_equal += bool(len(ours_mask) == len(theirs_mask) and np.array_equal(ours_mask, theirs_mask))
    return {
        "conversations": len(reference),
        "fsdp_documents": len(doc_ends),
        "ids_equal": ids_equal,
        "masks_equal": masks_equal,
        "all_equal": ids_equal == masks_equal == len(reference) == len(doc_ends),
        "tokens": len(tokens),
        "trained_tokens": int(mask.sum()),
    }


LABELS = {
    "fsdp_train": "fsdp_train ChatEncoder + tokenize_to_file + PackedBlocks",
    "trl": "trl map(apply_chat_template, assistant mask) + wrapped packing",
    "tokenizer_floor": "tokenizer floor: encode_batch of pre-rendered conversations",
}


def routes(
    dataset: Any, ours_tokenizer: Any, trl_tokenizer: Any, work: Path, seq: int
) -> dict[str, Callable[[], dict[str, Any]]]:
    """The routes over the same conversations, each writing to a fresh folder under work; the conversations the
    floor tokenizes are rendered here, once, untimed."""
    rendered = render_all(dataset, ours_tokenizer)
    return {
        "fsdp_train": lambda: fsdp_train_route(dataset, ours_tokenizer, fresh_dir(work, "fsdp"), seq),
        "trl": lambda: trl_route(dataset, trl_tokenizer, fresh_dir(work, "trl"), seq),
        "tokenizer_floor": lambda: tokenizer_floor(rendered, ours_tokenizer),
    }


# --- main ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = bench_arg_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=0, help="how many (0 = 50,000, or 1,000 with --quick)")
    args = parser.parse_args(argv)
    p = dict(QUICK if args.quick else FULL)
    p["conversations"] = args.conversations or p["conversations"]
    reps = args.reps or p["reps"]
    info = machine_info()
    import datasets

    datasets.disable_progress_bars()
    with work_folder(args, "bench_chat_tokenize_") as work:
        start = time.perf_counter()
        conversations = make_conversations(p["conversations"])
        texts = [turn["content"] for conversation in conversations[:2000] for turn in conversation]
        make_chatml_tokenizer(work / "tokenizer", texts, p["vocab"])
        shutil.rmtree(work / "dataset", ignore_errors=True)
        datasets.Dataset.from_dict({"messages": conversations}).save_to_disk(str(work / "dataset"))
        turns = sum(len(c) for c in conversations)
        chars = sum(len(t["content"]) for c in conversations for t in c)
        del conversations, texts
        dataset = datasets.load_from_disk(str(work / "dataset"))
        ours_tokenizer = load_tokenizer(work / "tokenizer", "qwen2.5")
        trl_tokenizer = load_tokenizer(work / "tokenizer", "qwen2.5_generation_markers")
        print(
            f"inputs: {len(dataset):,} conversations, {turns:,} turns, {chars / 1e6:.1f} M characters of content; "
            f"tokenizer vocab {len(ours_tokenizer):,}; made in {time.perf_counter() - start:.0f}s"
        )

        runs = run_routes(reps, routes(dataset, ours_tokenizer, trl_tokenizer, work, p["seq"]))
        check = compare_routes(work / "fsdp", work / "trl", ours_tokenizer)
    headers = ["route", "wall (s)", "conversations/s", "CPU (s)", "tokens", "blocks", "wall per rep (s)"]
    figures = report_routes(runs, "trl", LABELS, headers, check["conversations"], "blocks", goal=1.5)
    # What each route spends besides the tokenizer (rendering, masks, dataset writes), in CPU seconds.
    cpu = figures["cpu_seconds"]
    beyond_floor = {name: cpu[name] - cpu["tokenizer_floor"] for name in ("fsdp_train", "trl")}
    print(
        f"CPU seconds beyond the tokenizer floor: fsdp_train {beyond_floor['fsdp_train']:.1f}, "
        f"trl {beyond_floor['trl']:.1f}; the tokenizer alone is {cpu['tokenizer_floor'] / cpu['trl']:.0%} of trl's CPU time"
    )
    print(
        f"check: token ids equal in {check['ids_equal']:,} and label masks equal in {check['masks_equal']:,} of "
        f"{check['conversations']:,} conversations ({check['trained_tokens']:,} of {check['tokens']:,} tokens carry loss)"
    )
    write_results(
        args.results_dir,
        "chat_tokenize",
        {
            "machine": info,
            "params": {**p, "reps": reps, "turns": turns, "content_chars": chars},
            **figures,
            "cpu_seconds_beyond_tokenizer_floor": beyond_floor,
            "check": check,
            "runs": runs,
        },
    )
    return 0 if check["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
