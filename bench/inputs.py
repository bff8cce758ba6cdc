"""What a benchmark starts from, made here and never downloaded: a generated pseudo-prose corpus, saved text
datasets, and model folders (a tiny Llama from fsdp_lib.testing, or a preset through model_download.py --init).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from common import REPO_ROOT


def make_corpus(total_chars: int, seed: int = 0, mean_doc_chars: int = 3000) -> list[str]:
    """Pseudo-prose documents: words of a 30k-word synthetic vocabulary drawn with Zipf frequencies (as in
    natural text), capitalised sentences, commas and some numbers; document lengths are log-normal."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    letter_p = 1.0 / np.arange(1, 27) ** 0.8
    lengths = rng.integers(2, 11, size=30_000)
    vocab = ["".join(rng.choice(letters, size=n, p=letter_p / letter_p.sum())) for n in lengths]
    vocab[:20] = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it"] + [str(i) for i in range(10)]
    word_cdf = np.cumsum(1.0 / np.arange(1, len(vocab) + 1))
    word_cdf /= word_cdf[-1]
    docs, total = [], 0
    while total < total_chars:
        n_words = max(8, int(rng.lognormal(np.log(mean_doc_chars / 6.5), 0.8)))
        words = [vocab[i] for i in np.searchsorted(word_cdf, rng.random(n_words))]
        sentences, start = [], 0
        for end in np.cumsum(rng.integers(6, 25, size=n_words // 6 + 1)):
            chunk = words[start : min(end, n_words)]
            if not chunk:
                break
            if len(chunk) > 8:
                chunk[len(chunk) // 2] += ","
            sentences.append(chunk[0].capitalize() + " " + " ".join(chunk[1:]) + ".")
            start = end
        doc = " ".join(sentences)
        docs.append(doc)
        total += len(doc)
    return docs


def save_text_dataset(docs: list[str], folder: Path) -> Path:
    """A saved `datasets.Dataset` with a `text` column: the layout data_hf.py writes and fsdp_train.py reads."""
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(folder))
    return folder


def make_llama_folder(
    folder: Path,
    texts: list[str],
    hidden: int,
    layers: int,
    vocab: int,
    max_positions: int = 2048,
    weights_dtype: str | None = None,
) -> Path:
    """A Llama model folder (fsdp_lib.testing.make_model at llama_sizes(hidden, layers)): a byte-level BPE tokenizer
    trained on `texts`, config.json, and with `weights_dtype` ("bfloat16", "float32") random weights as safetensors
    (else fsdp_train.py initialises from scratch)."""
    from fsdp_lib.testing import llama_sizes, make_model

    sizes = llama_sizes(hidden, layers, max_positions)
    weights = {"with_weights": bool(weights_dtype), "dtype": weights_dtype or "float32", "fill_stored": False}
    return make_model(folder, texts=texts, vocab_size=vocab, sizes=sizes, seed=0, **weights)


def make_train_inputs(work: Path, p: dict[str, Any], corpus_chars: int) -> list[str]:
    """What a training benchmark starts from: a generated corpus of `corpus_chars`, saved as work/dataset, and
    work/model, a Llama of p["hidden"], p["layers"] and p["vocab"] whose tokenizer is trained on its first 200
    documents. Returns the documents."""
    docs = make_corpus(corpus_chars)
    make_llama_folder(work / "model", docs[:200], p["hidden"], p["layers"], p["vocab"])
    save_text_dataset(docs, work / "dataset")
    return docs


def init_model_folder(model_dir: Path, preset: str, flags: list[str], timeout: float = 1800) -> Path:
    """`model_download.py --init <preset> <flags> --local-dir <model_dir> --overwrite`: a model folder made from
    a preset, as a user would make one; RuntimeError with the end of its log if it fails."""
    cmd = [sys.executable, str(REPO_ROOT / "model_download.py"), "--init", preset, *flags]
    cmd += ["--local-dir", str(model_dir), "--overwrite"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"model_download.py --init failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return model_dir


def corpus_and_model(work: Path, corpus_chars: int, preset: str, timeout: float = 1800) -> tuple[Path, Path]:
    """A generated corpus saved as work/dataset, and work/model: `--init <preset>` (no weights) with a tokenizer
    trained on that corpus (--tokenizer-from)."""
    dataset = save_text_dataset(make_corpus(corpus_chars), work / "dataset")
    return dataset, init_model_folder(work / "model", preset, ["--tokenizer-from", str(dataset)], timeout)
