"""The tokenizer of a new model (`model_download.py --init`): a byte-level BPE trained on the text column of the
user's saved dataset (lossless on any UTF-8 text, BOS prepended like Llama 3's), or an existing tokenizer reused
from a folder or the cache, and saving it so that transformers 4.x and 5.x both load it. No torch at import."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from fsdp_lib.hub.console import ToolError, interruptible, log
from fsdp_lib.hub.presets import SizePreset
from fsdp_lib.markers import folder_kind
from fsdp_lib.records.conversation import turn_content
from fsdp_lib.records.dataset import load_text_dataset
from fsdp_lib.records.reasons import BadRecord
from fsdp_lib.records.schema import PREFERENCE_COLUMNS, UNPAIRED_COLUMNS, dataset_kind

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
TEXT_BATCH_SIZE = 1000


def load_tokenizer_corpus(path: Path) -> Any:
    """The train split of a saved dataset (a data_hf.py folder or a cached hub dataset), read as the trainer does."""
    kind = folder_kind(path)
    if kind is not None and kind.kind == "model":
        raise ToolError(
            f"--tokenizer-from {kind.describe(path)}, not a dataset; to reuse its tokenizer pass --tokenizer {path}"
        )
    if kind is not None and kind.kind != "dataset":
        raise ToolError(
            f"--tokenizer-from {kind.describe(path)}, not a dataset: pass a folder data_hf.py wrote (python data_hf.py"
            " --data_folder <your files> --save_dir <a new folder>)"
        )
    if kind is None and path.is_dir():  # not a dataset: maybe the user's raw files, which data_hf.py converts
        raise ToolError(
            f"--tokenizer-from {path} is not a saved dataset (no state.json or dataset_dict.json); if it holds your "
            f"files, convert them first (python data_hf.py --data_folder {path} --save_dir <a new folder>) and pass "
            "that folder"
        )
    try:
        dataset, _ = load_text_dataset(path, column_flag=False)  # model_download.py has no --text-column
    except ValueError as exc:
        raise ToolError(f"--tokenizer-from: {exc}") from exc
    if len(dataset) == 0:
        raise ToolError(f"--tokenizer-from {path} has no rows")
    return dataset


def iter_text_batches(dataset: Any, batch_size: int = TEXT_BATCH_SIZE) -> Iterator[list[str]]:
    """Batches of the dataset's texts read from the memory-mapped Arrow files (the columns are never materialised):
    the text column, or the content of every turn of a chat or preference dataset."""
    kind = dataset_kind(dataset.column_names)
    columns = TEXT_COLUMNS.get(kind or "text", ["text"])
    for batch in dataset.select_columns(columns).iter(batch_size=batch_size):
        if kind == "text":
            yield [text for text in batch["text"] if text]
        else:  # turns, or a string (TRL's standard prompt and completion columns)
            yield [text for column in columns for turns in batch[column] for text in _texts(turns) if text]


def _texts(turns: object) -> list[str]:
    """The texts of a value of a turns column: a string itself; turns' contents as the trainer reads them (text parts
    joined, a tool result's object as JSON); content that is no text (an image) is left out, not a traceback."""
    if isinstance(turns, str):
        return [turns]
    texts = []
    for number, turn in enumerate(turns or [], 1):
        content = turn.get("content") if isinstance(turn, dict) else None
        try:
            texts.append(turn_content(str(turn.get("role")), content, f"turn {number}") if content is not None else "")
        except BadRecord:
            continue
    return texts


# The columns whose text a tokenizer is trained on, by dataset kind (fsdp_lib/records/schema.py).
TEXT_COLUMNS = {
    "text": ["text"],
    "messages": ["messages"],
    "preference": list(PREFERENCE_COLUMNS),
    "unpaired": list(UNPAIRED_COLUMNS[:2]),
    "prompts": ["prompt"],
}


def train_bpe_tokenizer(
    batches: Iterable[list[str]], vocab_size: int, model_max_length: int, num_texts: int | None = None
) -> Any:
    """A byte-level BPE tokenizer (lossless on any UTF-8 text) that prepends BOS, like Llama 3's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, PAD_TOKEN],  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no unknown tokens, ever
        show_progress=False,
    )
    interruptible(lambda: tokenizer.train_from_iterator(batches, trainer=trainer, length=num_texts))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,  # keeps decode(encode(s)) == s
    )


def build_tokenizer(
    tokenizer_name: str | None, tokenizer_from: str | None, vocab_size: int | None, preset: SizePreset
) -> Any:
    """--tokenizer NAME_OR_DIR loaded offline, else a BPE of `vocab_size` (default: the preset's) trained on the
    --tokenizer-from dataset."""
    if tokenizer_name:
        return load_reused_tokenizer(tokenizer_name)
    dataset = load_tokenizer_corpus(Path(tokenizer_from))
    vocab_size = vocab_size or preset.default_vocab_size
    log(f"training a byte-level BPE tokenizer, vocab {vocab_size}, on {len(dataset):,} texts of {tokenizer_from}")
    texts = [0]

    def counted() -> Iterator[list[str]]:
        for batch in iter_text_batches(dataset):
            texts[0] += len(batch)
            yield batch

    tokenizer = train_bpe_tokenizer(counted(), vocab_size, preset.max_position_embeddings, len(dataset))
    if not texts[0]:
        raise ToolError(
            f"--tokenizer-from {tokenizer_from}: its {len(dataset):,} rows hold no text (every one is empty), so no "
            "tokenizer can be learnt from it; convert a corpus with text (data_hf.py), or reuse a tokenizer with "
            "--tokenizer NAME_OR_DIR"
        )
    if len(tokenizer) < vocab_size:
        log(
            f"note: the corpus supports only {len(tokenizer)} tokens (asked for {vocab_size});"
            " config.vocab_size follows the tokenizer"
        )
    return tokenizer


def load_reused_tokenizer(name: str) -> Any:
    """--tokenizer: a folder, or a hub id already in the cache, given a pad token when it has none."""
    from transformers import AutoTokenizer

    kind = folder_kind(Path(name))
    if kind is not None and kind.kind != "model":
        hint = f"; to train a tokenizer on it pass --tokenizer-from {name}" if kind.kind == "dataset" else ""
        raise ToolError(f"--tokenizer {kind.describe(Path(name))}, not a model or tokenizer folder{hint}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as exc:
        raise ToolError(
            f"--tokenizer {name} does not load offline (pass a folder, or a hub id already in the cache): {exc}"
        ) from exc
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out of the loss, any id will do
        log(f"note: --tokenizer has no pad token; using eos {tokenizer.eos_token!r}")
    return tokenizer


def save_tokenizer(tokenizer: Any, folder: Path, trained_here: bool) -> None:
    tokenizer.save_pretrained(folder)
    if trained_here:
        # transformers 5 writes its internal class name; the public one loads in 4.x and 5.x alike
        config_path = folder / "tokenizer_config.json"
        tokenizer_config = json.loads(config_path.read_text())
        tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
