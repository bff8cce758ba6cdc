"""Unpaired preference examples to trained tokens, for --objective kto: each example is a prompt, a completion and
a label (desirable or not). They come from an unpaired dataset (`prompt`, `completion`, `label`: TRL's unpaired
shape, messages or strings) or from a paired one, each pair unpaired into its chosen response (desirable) and its
rejected one (undesirable).

KTO's reference point z is an estimate of the KL divergence between the policy and the reference, measured on
mismatched prompt/completion pairs, as TRL measures it. So each example travels with a KL sequence: its own prompt
followed by the completion of another example of the same row batch (the next one in data order whose prompt
differs), cut to the example's length. The example and its KL sequence are stored and packed exactly as a DPO pair's
two sequences (preference.PairBlocks), so the packing, the precomputed reference and validation are DPO's. The
trained mask holds 1 on a desirable example's completion tokens and 2 on an undesirable one's (1 on a KL
sequence's): the label travels with the checksummed token cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fsdp_lib.data.chat import ChatFormatError
from fsdp_lib.data.preference import DESIRABLE, UNDESIRABLE, PairEncoder, count_cut, prompt_of, response_turns
from fsdp_lib.records.schema import PREFERENCE_COLUMNS

LABEL_TEXT = {"true": True, "false": False, "1": True, "0": False}

Example = tuple[list[dict], list[dict], bool]  # prompt turns, completion turns, desirable


def as_label(value: object) -> bool | None:
    """An example's label as desirable (True) or not; None when it is not a boolean (bool, 0/1, "true"/"false")."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        return LABEL_TEXT.get(value.strip().lower())
    return None


def row_examples(rows: dict[str, list], row: int) -> list[Example] | str:
    """The examples of one row of a paired or unpaired dataset, or why the row has none."""
    if all(c in rows for c in PREFERENCE_COLUMNS):
        prompt = prompt_of(rows["prompt"][row])
        chosen, rejected = (response_turns(rows[key][row], prompt) for key in ("chosen", "rejected"))
        if [_said(turn) for turn in chosen] == [_said(turn) for turn in rejected]:  # DPO skips them too
            return "chosen and rejected are the same: one text would be trained as desirable and undesirable"
        return [(prompt, chosen, True), (prompt, rejected, False)]
    label = as_label(rows["label"][row])
    if label is None:
        return "the label is not true or false (nor 1/0)"
    prompt = prompt_of(rows["prompt"][row])
    return [(prompt, response_turns(rows["completion"][row], prompt), label)]


def _said(turn: dict) -> tuple:
    return turn.get("role"), str(turn.get("content") or "").strip(), str(turn.get("tool_calls") or "")


@dataclass
class ExampleEncoder:
    """Renders prompt + completion with the chat template (the trained tokens are the completion's assistant turns,
    as for a DPO response), builds each example's KL sequence and fits both into one block as PairEncoder fits a
    pair (prompt tokens cut from the left). An example that does not fit is a counted skip."""

    pairs: PairEncoder

    VERSION = 3  # of the sequences this class writes: part of the token cache key (2: repeated prompts stripped, 3: HH prompts)
    unit = "examples"

    @property
    def version(self) -> str:
        return f"kto-v{self.VERSION}|{self.pairs.version}"

    def encode(
        self,
        rows: dict[str, list],
        skipped: dict[str, int],
        first_skipped: dict[str, int],
        row_offset: int,
        cut: list[int] | None = None,
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """(example ids, mask, KL sequence ids, mask) per kept example of a row batch, in data order."""

        def skip(reason: str, row: int) -> None:
            skipped[reason] = skipped.get(reason, 0) + 1
            first_skipped.setdefault(reason, row_offset + row)

        examples: list[tuple[int, Example]] = []
        for row in range(len(rows["prompt"])):
            found = row_examples(rows, row)
            if isinstance(found, str):
                skip(found, row)
            else:
                examples += [(row, example) for example in found]
        chat = self.pairs.chat
        renders = chat.render_prefixes([prompt + completion for _, (prompt, completion, _) in examples])
        texts, spans, kept = [], [], []
        for (row, (prompt, completion, desirable)), rendered in zip(examples, renders, strict=True):
            try:
                if isinstance(rendered, ChatFormatError):
                    raise rendered
                text, trained = self.pairs.sequence(prompt, completion, rendered)
            except ChatFormatError as exc:
                skip(str(exc), row)
                continue
            texts.append(text)
            spans.append(trained)
            kept.append((row, desirable))
        encodings = chat.tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        sequences = []
        for encoding, trained, (row, desirable) in zip(encodings, spans, kept, strict=True):
            mask = chat.trained_mask(encoding, trained)
            if not mask.any():
                skip("the completion has no trained token", row)
                continue
            value = DESIRABLE if desirable else UNDESIRABLE
            sequences.append((row, np.asarray(encoding.ids, dtype=np.int64), mask * np.uint8(value)))
        out = []
        for k, (row, ids, mask) in enumerate(sequences):
            kl_ids, kl_mask = kl_sequence(sequences, k)
            fitted = self.pairs.fit(ids, mask, kl_ids, kl_mask)
            if fitted == self.pairs.TOO_LONG:
                skip(f"the example and its KL sequence do not fit one block of {self.pairs.max_tokens} tokens "
                     "(--seq-length)", row)  # fmt: skip
                continue
            if isinstance(fitted, str):
                skip(self.pairs.unfit(fitted), row)
                continue
            count_cut(cut, len(ids) - len(fitted[0]))
            out.append(fitted)
        return out


def kl_sequence(sequences: list[tuple[int, np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Example k's KL sequence: its prompt tokens (those before its first trained token) followed by the completion
    tokens of the next example (cyclically; among the next 16) whose prompt differs, else of the next one; cut to
    example k's length. Its trained mask is 1 on the borrowed completion."""
    _, ids, mask = sequences[k]
    start = int(np.argmax(mask != 0))
    n = len(sequences)
    partner = (k + 1) % n
    for step in range(1, min(n, 17)):
        _, other, other_mask = sequences[(k + step) % n]
        other_start = int(np.argmax(other_mask != 0))
        if other_start != start or not np.array_equal(other[:other_start], ids[:start]):
            partner = (k + step) % n
            break
    _, other, other_mask = sequences[partner]
    other_start = int(np.argmax(other_mask != 0))
    kl_ids = np.concatenate([ids[:start], other[other_start:]])[: len(ids)]
    kl_mask = np.concatenate([np.zeros(start, dtype=np.uint8), (other_mask[other_start:] != 0).astype(np.uint8)])
    return kl_ids, kl_mask[: len(ids)]
