"""Prompts for --objective grpo: a dataset with a `prompt` column (a string, or a list of {role, content} messages,
TRL's prompt-only shapes; data_hf.py --format prompts writes messages) and any other columns, which the reward
functions receive (data_hf.py keeps a record's other fields in one `columns_json` column, handed over as the
columns it holds). Each prompt is tokenised once at start-up: a string as it is; messages with the chat template
and its generation prompt, or, for a tokenizer without one, a system + user prompt as its plain text. The DataPlan
draws prompts like blocks: a global batch is a number of prompts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from fsdp_lib.data.cache import report_skipped
from fsdp_lib.errors import TrainError
from fsdp_lib.records.conversation import as_stored
from fsdp_lib.records.prompts import REWARD_ARGUMENTS
from fsdp_lib.records.reasons import BadRecord
from fsdp_lib.records.tool_calls import template_messages

PROMPT_COLUMN = "prompt"
COLUMNS_JSON = "columns_json"  # data_hf.py --format prompts: a record's other fields as one JSON object


@dataclass
class PromptBatch:
    """One micro-batch of prompts: their indices in the PromptSet (the sampling keys), token ids, the prompts as
    the reward functions get them and every other column's values."""

    indices: list[int]
    ids: list[list[int]]
    prompts: list[Any]
    columns: dict[str, list[Any]]


@dataclass
class PromptSet:
    ids: list[list[int]]  # per kept prompt
    rows: np.ndarray  # each kept prompt's row in the split
    split: Any  # the datasets.Dataset (its other columns are read per batch)
    conversational: bool  # prompts are message lists (completions are then message lists too)
    columns: tuple[str, ...] = ()  # the columns the reward functions get (kept ones and those of columns_json)

    def __len__(self) -> int:
        return len(self.ids)

    def gather(self, indices: list[int]) -> PromptBatch:
        records = self.split.select(self.rows[indices].tolist()).to_dict() if indices else {}
        prompts = records.pop(PROMPT_COLUMN, [])
        if not self.conversational:  # the text the model continued, as the completions are text: never turns
            prompts = [prompt if isinstance(prompt, str) else prompt_text(prompt, None)[0] for prompt in prompts]
        if COLUMNS_JSON in records:  # the fields data_hf.py kept, as the columns they were
            fields = [json.loads(text or "{}") for text in records.pop(COLUMNS_JSON)]
            for name in dict.fromkeys(name for row in fields for name in row):
                records.setdefault(name, [row.get(name) for row in fields])
        # every column of the set in every batch, None where a row has none (as TRL passes them): a field only some
        # records hold was missing from the batches without it, and a reward that names it failed mid-run
        for name in self.columns:
            records.setdefault(name, [None] * len(indices))
        return PromptBatch(list(indices), [self.ids[i] for i in indices], prompts, records)

    def trained_tokens(self, indices: list[int]) -> int:
        """Prompts (the objective counts its own normaliser once the completions exist)."""
        return len(indices)


def prompt_text(prompt: Any, tokenizer: Any) -> tuple[str, bool]:
    """(the text the model continues, whether it went through the chat template). A string stays as it is; a list
    of messages is rendered with the template's generation prompt, or, without a template, a user turn (after an
    optional system turn) becomes its plain text (system text, a blank line, user text)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("an empty prompt")
        return prompt, False
    if not isinstance(prompt, list):
        raise ValueError(f"a prompt is {type(prompt).__name__}, not a string or a list of messages")
    if not prompt:
        raise ValueError("a prompt is an empty list of messages")
    if not isinstance(prompt[-1], dict):
        raise ValueError(f"a prompt's last turn is {type(prompt[-1]).__name__}, not a message ({{role, content}})")
    content = prompt[-1].get("content")
    if content is None or (isinstance(content, str) and not content.strip()):
        raise ValueError("an empty prompt")
    try:  # as data_hf.py stores turns: text parts joined, role aliases mapped (with a template or without)
        prompt = as_stored(template_messages(prompt))
    except BadRecord as exc:
        raise ValueError(f"a prompt's {exc.detail}") from None
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True), True
    roles = [turn.get("role") for turn in prompt]
    if roles not in (["user"], ["system", "user"]):
        raise ValueError(
            f"a prompt of turns {roles} needs a chat template, and the tokenizer has none (--chat-template)"
        )
    return "\n\n".join(str(turn.get("content") or "") for turn in prompt), False


TOKENIZE_BATCH = 1024  # prompts per tokenizer call


def check_reward_columns(split: Any, name: str, what: str) -> tuple[str, ...]:
    """The columns the reward functions get, checked before the model loads: `columns_json` holds a JSON object on
    every row (data_hf.py --format prompts writes one), and no column, kept or from that JSON, is named like a
    reward function's own argument (it would reach the function twice). Returns their names, sorted."""
    names = set(split.column_names) - {PROMPT_COLUMN, COLUMNS_JSON}
    if COLUMNS_JSON in split.column_names:
        for row, text in enumerate(split[COLUMNS_JSON]):
            try:
                fields = json.loads(text or "{}")
            except (TypeError, ValueError) as exc:
                fields = exc
            if not isinstance(fields, dict):
                raise TrainError(
                    f"--dataset-name {name}: row {row} of the {what} split's {COLUMNS_JSON} column is "
                    f"{str(text)[:60]!r}, not a JSON object of the record's other fields (as data_hf.py --format "
                    "prompts writes it); fix that column or convert the records again with data_hf.py"
                )
            names.update(fields)
    if clash := sorted(names & set(REWARD_ARGUMENTS)):
        raise TrainError(
            f"--dataset-name {name}: the {what} prompts have a column {clash[0]!r}, the name of a reward function's "
            "own argument (f(prompts, completions, **columns)); rename that column in the data"
        )
    return tuple(sorted(names))


def load_prompts(
    split: Any, tokenizer: Any, max_prompt_tokens: int, name: str, what: str, max_skipped: float = 1.0
) -> PromptSet:
    """Every prompt of `split` tokenised; a prompt that cannot be rendered or is longer than max_prompt_tokens
    (--seq-length minus --max-new-tokens) is a counted skip, logged with its first row. More than `max_skipped`
    (--max-skipped-fraction) of them skipped stops the run, as for conversations and pairs."""
    if PROMPT_COLUMN not in split.column_names:
        raise TrainError(
            f"--dataset-name {name}: --objective grpo needs a 'prompt' column (columns: {split.column_names}); "
            "convert prompts with: python data_hf.py --format prompts ..."
        )
    columns = check_reward_columns(split, name, what)
    rendered: dict[bool, list[tuple[int, str]]] = {False: [], True: []}  # templated -> (row, text)
    skipped: dict[str, list[int]] = {}
    for row, prompt in enumerate(split[PROMPT_COLUMN]):
        try:
            text, templated = prompt_text(prompt, tokenizer)
        except Exception as exc:  # noqa: BLE001 - a bad prompt is a counted skip, as in data_hf.py
            skipped.setdefault(str(exc)[:300], []).append(row)
            continue
        rendered[templated].append((row, text))
    tokenised: list[tuple[int, list[int], bool]] = []
    for templated, items in rendered.items():  # a batch per call: the fast tokenizers' parallel path
        for start in range(0, len(items), TOKENIZE_BATCH):
            batch = items[start : start + TOKENIZE_BATCH]
            encoded = tokenizer([text for _, text in batch], add_special_tokens=not templated)["input_ids"]
            tokenised += [(row, tokens, templated) for (row, _), tokens in zip(batch, encoded)]
    ids, rows, kinds = [], [], set()
    for row, tokens, templated in sorted(tokenised, key=lambda item: item[0]):
        if not tokens:
            skipped.setdefault("an empty prompt", []).append(row)
        elif len(tokens) > max_prompt_tokens:
            reason = f"longer than {max_prompt_tokens} tokens (--seq-length minus --max-new-tokens)"
            skipped.setdefault(reason, []).append(row)
        else:
            ids.append(tokens)
            rows.append(row)
            kinds.add(templated)
    counts = {"conversations": len(split), "expanded": 0, "skipped": {r: len(rows) for r, rows in skipped.items()}}
    counts["first_row"] = {reason: min(where) for reason, where in skipped.items()}
    report_skipped(counts, f"the {what} split of {name}", max_skipped, "prompts")
    if len(kinds) > 1:
        raise TrainError(
            f"--dataset-name {name}: the {what} prompts mix plain strings and conversations; the completions the "
            "reward functions get would differ in kind. Convert them all to one kind"
        )
    kinds = kinds or {templated for templated, items in rendered.items() if items}  # all skipped: as they were
    return PromptSet(ids, np.asarray(rows, dtype=np.int64), split, kinds == {True}, columns)


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """The special tokens the chat template writes right after an assistant turn's text (Llama 3's <|eot_id|>,
    ChatML's <|im_end|>, Gemma's <end_of_turn>, or EOS): a sampled completion of a templated prompt ends there."""
    marker = "Zq7mark"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False
        )
    except Exception:  # noqa: BLE001 - a template that renders no such conversation has no end to find
        return set()
    tail = text[text.find(marker) + len(marker) :] if marker in text else ""
    special = set(tokenizer.all_special_ids)
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    return {next((i for i in ids if i in special), None)} - {None}
