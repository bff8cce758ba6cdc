"""Preference pairs to trained tokens, for --objective dpo: a dataset with `prompt`, `chosen` and `rejected` columns
(lists of messages, written by `data_hf.py --format preference`) is rendered with the chat template, each pair as two
sequences (prompt + chosen, prompt + rejected) whose response tokens are marked; the pairs are packed whole into
blocks of --seq-length (the two sequences of a pair are separate documents of one block, so a pair never straddles
a block or a micro-batch), and the reference log-probabilities precomputed for them are stored beside the token
cache with their checksum."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fsdp_lib.data.batch import Batch
from fsdp_lib.data.chat import ChatEncoder, ChatFormatError, says_something
from fsdp_lib.data.packing import best_fit_decreasing, document_starts
from fsdp_lib.integrity import commit_files, staged, staged_writes
from fsdp_lib.records.preference import prompt_turns, repeated_prompt
from fsdp_lib.records.reasons import BadRecord
from fsdp_lib.records.schema import PREFERENCE_COLUMNS
from fsdp_lib.runtime import raise_if_stopped

# --objective kto (unpaired.py): the trained mask's value on a desirable and on an undesirable example's completion
DESIRABLE, UNDESIRABLE = 1, 2


def as_turns(value: object, role: str) -> list[dict]:
    """A prompt or response as turns: a string (TRL's standard shape) is one turn of `role`."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return list(value or [])


def prompt_of(value: object) -> list[dict]:
    """A pair's or example's prompt as turns: a string is one user turn, unless it is an Anthropic HH dialogue
    ("\n\nHuman: ...\n\nAssistant:", Dahoas/rm-static's prompts, given straight to the trainer), whose turns are
    read as data_hf.py reads them (one user turn, the template wrapped the literal markers)."""
    if isinstance(value, str):
        try:
            return [{"role": role, "content": content} for role, content in prompt_turns(value, "prompt")]
        except BadRecord:  # HH markers that do not form a dialogue: the string as it is, as before
            return as_turns(value, "user")
    return as_turns(value, "user")


def response_turns(value: object, prompt: list[dict]) -> list[dict]:
    """A response as turns, without the prompt turns it repeats first: UltraFeedback-style chosen/rejected are whole
    conversations that start with the prompt (with or without its system turn), as data_hf.py strips them; kept,
    every sequence held the prompt twice."""
    response = as_turns(value, "assistant")
    given, said = ([(turn.get("role"), turn.get("content")) for turn in turns] for turns in (prompt, response))
    without_system = given[1:] if given and given[0][0] == "system" else []
    return response[repeated_prompt(said, [given, without_system]) :]


@dataclass
class PairEncoder:
    """Renders prompt + response with the chat template; the trained tokens are the response's assistant turns
    (their content and end-of-turn marker, found as ChatEncoder finds them), never the prompt's.

    A pair whose two sequences together exceed `max_tokens` (one block) loses prompt tokens from the left, the same
    number from both sequences, counted (`cut`: the run's log says how many and how much); a pair that fits only
    with no word of its prompt left (the end of the user's turn and the answer header, `header_tokens`, are markup) or not
    at all is a counted skip, as is a pair whose chosen and rejected tokens are identical."""

    chat: ChatEncoder
    max_tokens: int

    # of the sequences this class writes: part of the token cache key (2: no pair without its prompt; 3: responses
    # without the prompt turns they repeat; 4: HH dialogue prompts read as turns)
    VERSION = 4
    unit = "pairs"
    TOO_LONG, PROMPT_GONE = "too long", "prompt gone"  # why fit() cannot fit one

    @property
    def version(self) -> str:
        """What the token cache key takes from the encoder: prompts are cut to fit a block, so the sequences
        depend on --seq-length."""
        return f"pairs-v{self.VERSION}|chat-v{self.chat.VERSION}|fit-{self.max_tokens}"

    def sequence(self, prompt: list[dict], response: list[dict], renders: dict) -> tuple[str, list[tuple[int, int]]]:
        """(text, trained character spans) of prompt + response."""
        messages = prompt + response
        full = renders[(len(messages), False)]
        turns = [i for i in range(len(prompt), len(messages)) if messages[i].get("role") == "assistant"]
        if not turns:
            raise ChatFormatError("a response has no assistant turn")
        if not any(says_something(messages[i]) for i in turns):
            raise ChatFormatError("a response's assistant turns are empty")
        if not any(str(turn.get("content") or "").strip() for turn in messages[: turns[0]]):  # words, not calls
            raise ChatFormatError("an empty prompt: nothing before the response to answer")
        if not all(full.startswith(renders[(i + 1, False)]) for i in turns):
            raise ChatFormatError("the chat template renders a multi-turn response's earlier turns differently")
        return full, [self.chat.turn_span(messages, i, renders) for i in turns]

    @functools.cached_property
    def header_tokens(self) -> int:
        """The tokens the chat template puts after a prompt's last words and before its answer (the end of the
        user's turn and the generation prompt, e.g. `<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n`),
        tokenised alone: a cut that leaves no more than them has left no word of the prompt. 0 when a probe
        conversation does not render its words."""
        words = "zq9"
        try:
            asking = self.chat.render([[{"role": "user", "content": words}]], True)[0]
        except ChatFormatError:
            return 0
        if (at := asking.rfind(words)) < 0:
            return 0
        return len(self.chat.tokenizer(asking[at + len(words) :], add_special_tokens=False)["input_ids"])

    def unfit(self, why: str) -> str:
        """The skip reason of a pair fit() could not fit."""
        if why == self.PROMPT_GONE:
            return f"the prompt would be cut away whole to fit one block of {self.max_tokens} tokens (--seq-length)"
        return f"the responses alone do not fit one block of {self.max_tokens} tokens (--seq-length)"

    def encode(
        self,
        rows: dict[str, list],
        skipped: dict[str, int],
        first_skipped: dict[str, int],
        row_offset: int,
        cut: list[int] | None = None,
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """(chosen ids, chosen mask, rejected ids, rejected mask) per kept pair of a row batch; `cut` adds up the
        pairs whose prompt lost tokens and the tokens each of their sequences lost."""
        prompts = [prompt_of(value) for value in rows["prompt"]]
        rows = {
            "prompt": prompts,
            **{key: [response_turns(v, p) for v, p in zip(rows[key], prompts)] for key in ("chosen", "rejected")},
        }
        conversations, owners = [], []
        for row, (prompt, chosen, rejected) in enumerate(zip(*(rows[c] for c in PREFERENCE_COLUMNS))):
            for response in (chosen, rejected):
                conversations.append(list(prompt or []) + list(response or []))
                owners.append(row)
        renders = self.chat.render_prefixes(conversations)
        texts: list[str] = []
        spans: list[list[tuple[int, int]]] = []
        kept: list[int] = []

        def skip(reason: str, row: int) -> None:
            skipped[reason] = skipped.get(reason, 0) + 1
            first_skipped.setdefault(reason, row_offset + row)

        for row in range(len(rows["prompt"])):
            prompt = list(rows["prompt"][row] or [])
            try:
                pair = []
                for k, response in enumerate((rows["chosen"][row], rows["rejected"][row])):
                    rendered = renders[2 * row + k]
                    if isinstance(rendered, ChatFormatError):
                        raise rendered
                    pair.append(self.sequence(prompt, list(response or []), rendered))
            except ChatFormatError as exc:
                skip(str(exc), row)
                continue
            for text, trained in pair:
                texts.append(text)
                spans.append(trained)
            kept.append(row)
        encodings = self.chat.tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        out = []
        for j, row in enumerate(kept):
            c, r = encodings[2 * j], encodings[2 * j + 1]
            c_ids, r_ids = np.asarray(c.ids, dtype=np.int64), np.asarray(r.ids, dtype=np.int64)
            c_mask, r_mask = self.chat.trained_mask(c, spans[2 * j]), self.chat.trained_mask(r, spans[2 * j + 1])
            if np.array_equal(c_ids, r_ids):
                skip("chosen and rejected are the same tokens", row)
                continue
            fitted = self.fit(c_ids, c_mask, r_ids, r_mask)
            if isinstance(fitted, str):
                skip(self.unfit(fitted), row)
                continue
            count_cut(cut, len(c_ids) - len(fitted[0]))
            out.append(fitted)
        return out

    def fit(
        self, c_ids: np.ndarray, c_mask: np.ndarray, r_ids: np.ndarray, r_mask: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | str:
        """The pair with prompt tokens cut from the left until both sequences fit one block, or why it cannot:
        TOO_LONG (even the token that predicts the first response token would go), PROMPT_GONE (only the
        template's markup after the prompt's words would be left: DPO would train a pair without its prompt)."""
        if not c_mask.any() or not r_mask.any():
            return self.TOO_LONG
        over = len(c_ids) + len(r_ids) - self.max_tokens
        cut = max(0, -(-over // 2))
        first = min(int(np.argmax(c_mask)), int(np.argmax(r_mask)))  # the first response token of either
        if cut > first - 1:  # the token before the first trained token must stay: it predicts it
            return self.TOO_LONG
        if cut and cut > first - self.header_tokens - 1:
            return self.PROMPT_GONE
        return c_ids[cut:], c_mask[cut:], r_ids[cut:], r_mask[cut:]


def count_cut(cut: list[int] | None, tokens: int) -> None:
    """cut = [units whose prompt lost tokens, tokens they lost], for the run's log (report_skipped)."""
    if cut is not None and tokens:
        cut[0] += 1
        cut[1] += tokens


def tokenize_pairs_to_file(dataset: Any, encoder: Any, paths: dict[str, Path], dtype: np.dtype) -> int:
    """The split's pairs as one token stream, chosen then rejected for each pair (documents 2p and 2p + 1), with
    document ends, the trained mask and the skip counts; written under temporary names, their checksums recorded, and
    renamed, token file last (as data.tokenize_to_file). Returns the number of pairs kept. `encoder`: a
    PairEncoder, or unpaired.ExampleEncoder, whose "pairs" are an example and its KL sequence."""
    names = ("docs", "mask", "tokens")
    total, pairs, rows = 0, 0, 0
    cut = [0, 0]
    skipped: dict[str, int] = {}
    first_skipped: dict[str, int] = {}
    with staged_writes({k: paths[k] for k in names}) as (handles, tmp):
        for batch in dataset.iter(batch_size=500):
            raise_if_stopped()
            encoded = encoder.encode(batch, skipped, first_skipped, rows, cut)
            rows += len(batch["prompt"])
            sequences = [
                (ids, mask)
                for c_ids, c_mask, r_ids, r_mask in encoded
                for ids, mask in ((c_ids, c_mask), (r_ids, r_mask))
            ]
            if sequences:
                np.concatenate([ids for ids, _ in sequences]).astype(dtype).tofile(handles["tokens"])
                np.concatenate([mask for _, mask in sequences]).astype(np.uint8).tofile(handles["mask"])
                (total + np.cumsum([len(ids) for ids, _ in sequences], dtype=np.int64)).tofile(handles["docs"])
                total += sum(len(ids) for ids, _ in sequences)
                pairs += len(encoded)
    # each unit (a pair; for KTO an example, two per pair of a paired dataset) is kept or skipped once
    skips = {
        "conversations": pairs + sum(skipped.values()),
        "expanded": 0,
        "skipped": skipped,
        "first_row": first_skipped,
        "unit": encoder.unit,
        "cut": {"units": cut[0], "tokens": cut[1], "block": getattr(encoder, "pairs", encoder).max_tokens},
    }
    tmp["skips"] = staged(paths["skips"])
    tmp["skips"].write_text(json.dumps(skips, indent=1))
    commit_files({tmp[k]: paths[k] for k in ("skips", "docs", "mask", "tokens")}, paths["sums"])  # tokens last
    return pairs


def pack_pairs(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Pairs (by their two sequences' total length) into blocks of `capacity` tokens, best fit decreasing
    (packing.best_fit_decreasing): each pair, longest first, goes into the fullest block it still fits.
    Deterministic and independent of the process count; each block lists its pairs in data order."""
    return best_fit_decreasing(lengths, capacity)


@dataclass
class PairBlocks:
    """Packed preference pairs: each block of seq_length tokens holds whole pairs, chosen and rejected as separate
    documents (position ids restart at each), the rest padding that carries no loss. The DataPlan treats it like
    PackedBlocks; a block's "trained tokens" are its pairs, what the DPO loss is averaged over.

    A gathered Batch also has, per token, the index of its sequence in the micro-batch (-1: none; sequence 2k is
    the chosen and 2k + 1 the rejected response of the micro-batch's k-th pair), the sequences' indices in the split
    (2 x pair, 2 x pair + 1) and, once computed, their reference log-probabilities."""

    tokens: np.ndarray
    trained: np.ndarray
    doc_ends: np.ndarray  # end offset of every sequence; sequence s spans doc_ends[s-1]..doc_ends[s]
    seq_length: int
    pad_id: int
    reference: np.ndarray | None = None  # float64 per sequence: the reference model's summed response log-probs
    cache_path: Path | None = None  # the token file; the stored reference lies beside it
    kto: bool = False  # each "pair" is a KTO example and its KL sequence (unpaired.py); gather adds the labels

    def __post_init__(self) -> None:
        starts = document_starts(self.doc_ends)
        lengths = np.asarray(self.doc_ends, dtype=np.int64) - starts
        self.starts, self.lengths = starts, lengths
        self.desirable = desirable_flags(self.trained, starts[: len(lengths)]) if self.kto else None
        self.blocks = pack_pairs(lengths[0::2] + lengths[1::2], self.seq_length)
        self.pairs_in = np.asarray([len(b) for b in self.blocks], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def num_pairs(self) -> int:
        return len(self.lengths) // 2

    def sequences(self, block: int) -> list[int]:
        return [s for p in self.blocks[block] for s in (2 * p, 2 * p + 1)]

    def block(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(inputs, labels, position ids, sequence index within the block or -1) of block i."""
        L = self.seq_length
        inputs = np.full(L, self.pad_id, dtype=np.int64)
        labels = np.full(L, -100, dtype=np.int64)
        positions = np.zeros(L, dtype=np.int64)
        owner = np.full(L, -1, dtype=np.int64)
        at = 0
        for k, s in enumerate(self.sequences(i)):
            a, n = int(self.starts[s]), int(self.lengths[s])
            ids = np.asarray(self.tokens[a : a + n], dtype=np.int64)
            trained = np.asarray(self.trained[a + 1 : a + n]) != 0
            inputs[at : at + n] = ids
            labels[at : at + n - 1] = np.where(trained, ids[1:], -100)
            positions[at : at + n] = np.arange(n)
            owner[at : at + n - 1] = np.where(trained, k, -1)
            at += n
        positions[at:] = np.arange(L - at)  # padding: a document of its own
        return inputs, labels, positions, owner

    def gather(self, indices: list[int]) -> Batch:
        parts = [self.block(i) for i in indices]
        inputs, labels, positions, owner = (torch.from_numpy(np.stack([p[k] for p in parts])) for k in range(4))
        offsets, sequences = 0, []
        for row, i in enumerate(indices):
            seqs = self.sequences(i)
            owner[row][owner[row] >= 0] += offsets
            offsets += len(seqs)
            sequences += seqs
        seq_index = torch.tensor(sequences, dtype=torch.int64)
        reference = None if self.reference is None else torch.from_numpy(self.reference[sequences].copy())
        batch = Batch(inputs, labels, positions, owner, seq_index, reference)
        if self.desirable is not None:
            batch.desirable = torch.from_numpy(self.desirable[np.asarray(sequences[0::2], dtype=np.int64) // 2])
        return batch

    def trained_tokens(self, indices: list[int]) -> int:
        """Pairs in these blocks: the DPO loss of a global batch is their mean."""
        return int(self.pairs_in[indices].sum())


# -- reference log-probabilities, stored beside the token cache --------------------------------------------------


def reference_path(tokens_path: Path, key: str) -> Path:
    return tokens_path.with_name(f"{tokens_path.stem}.reference-{key}.f64")


def write_reference(path: Path, values: np.ndarray) -> None:
    """The array and its checksum, written under temporary names and renamed, the checksum file last."""
    data = np.ascontiguousarray(values, dtype=np.float64)
    tmp = staged(path)
    with open(tmp, "wb") as fh:
        data.tofile(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    meta = {"count": int(data.size), "sha256": hashlib.sha256(data.tobytes()).hexdigest()}
    tmp_meta = staged(path.with_name(f"{path.name}.json"))
    tmp_meta.write_text(json.dumps(meta))
    os.replace(tmp_meta, path.with_name(f"{path.name}.json"))


def read_reference(path: Path, count: int) -> np.ndarray | None:
    """The stored array when it is complete and intact (size and checksum as recorded), else None."""
    meta_path = path.with_name(f"{path.name}.json")
    if not path.is_file() or not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        data = np.fromfile(path, dtype=np.float64)
    except (OSError, ValueError):
        return None
    if (
        meta.get("count") != count
        or data.size != count
        or hashlib.sha256(data.tobytes()).hexdigest() != meta.get("sha256")
    ):
        return None
    return data


def desirable_flags(trained: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Per example (the even sequences of a KTO PairBlocks stream): whether it is desirable, read from the trained
    mask's value on its completion (DESIRABLE or UNDESIRABLE)."""
    if len(starts) == 0:
        return np.zeros(0, dtype=bool)
    return np.maximum.reduceat(np.asarray(trained), starts[0::2]) == DESIRABLE
