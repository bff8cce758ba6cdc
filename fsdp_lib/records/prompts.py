"""Prompt records (data_hf.py --format prompts, for the trainer's --objective grpo): the record shapes a prompt is
read from and the one type they become, PromptRecord: the prompt turns and every other field of the record, kept
as one JSON object so a reward function can read the reference answer or the test cases.

Shapes, keys in any case: `prompt` (TRL's prompt-only records: a string, or a list of turns ending with a user
turn), `question` (question/answer), `problem` (problem/solution, as in math sets), `instruction` (+ `input`,
Alpaca), `messages` or `conversations` (a conversation: its turns up to the last user turn; the last assistant
reply after it, if any, becomes the `answer` column unless the record has a reference column). A top-level `system` string becomes the first turn. A string prompt is one user turn. Pure: no file, no
Arrow, no torch."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fsdp_lib.records.conversation import alpaca_instruction, check_system_turns, turns_of_list, with_system
from fsdp_lib.records.reasons import BadRecord
from fsdp_lib.records.schema import Turns

# The keys a prompt is read from, in the order they are tried; the keys that form it are not kept as columns. A
# conversation (messages, conversations) is a prompt up to its last user turn.
PROMPT_KEYS = ("prompt", "question", "problem", "instruction", "messages", "conversations")
CONVERSATION_KEYS = ("messages", "conversations")
# A reward function's own arguments, f(prompts, completions, **columns): no kept field may take their names.
REWARD_ARGUMENTS = ("prompts", "completions")
# The columns the built-in accuracy reward reads the reference answer from, the first one a row has.
REFERENCE_COLUMNS = ("answer", "solution", "ground_truth", "target", "reference")


@dataclass(frozen=True)
class PromptRecord:
    """One row of a prompts dataset: the prompt turns (ending with a user turn) and the record's other fields as a
    JSON object (`columns_json`), which the trainer hands to the reward functions as columns."""

    prompt: Turns
    columns_json: str

    @property
    def chars(self) -> int:
        return sum(len(content) for _, content in self.prompt) + len(self.columns_json)


def parse_prompt_record(record: object) -> PromptRecord:
    """The prompt and the other fields of one record. Raises BadRecord with the reason when it has no prompt."""
    if not isinstance(record, dict):
        raise BadRecord("not_a_prompt_record", f"a {type(record).__name__}, not an object with a prompt")
    lowered = {key.lower(): key for key in record if isinstance(key, str)}
    if len(lowered) != len([k for k in record if isinstance(k, str)]):
        raise BadRecord("ambiguous_keys", "the record has two keys that differ only in case")
    fields = {name: record[key] for name, key in lowered.items()}
    shape = next((key for key in PROMPT_KEYS if fields.get(key) is not None), None)  # a null prompt is no prompt
    if shape is None:
        keys = sorted(map(str, record))[:8]
        raise BadRecord("not_a_prompt_record", f"the keys {keys}; expected one of {', '.join(PROMPT_KEYS)}")
    used = {shape, "system"} | ({"input"} if shape == "instruction" else set())
    used |= {key for key in PROMPT_KEYS if key in fields and fields[key] is None}
    reply, value = None, fields[shape]
    if shape == "instruction":
        turns = [("user", alpaca_instruction(fields))]
    elif isinstance(value, str) and shape not in CONVERSATION_KEYS:
        turns = [("user", value)]
    elif isinstance(value, (list, dict)):
        turns = turns_of_list([value] if isinstance(value, dict) else value, shape)
    else:
        raise BadRecord("non_string_content", f"{shape!r} is {type(value).__name__}, not a string or turns")
    if shape in CONVERSATION_KEYS:  # the prompt is the conversation up to its last user turn
        last_user = max((i for i, (role, _) in enumerate(turns) if role == "user"), default=-1)
        replies = [content for role, content in turns[last_user + 1 :] if role == "assistant"]
        turns, reply = turns[: last_user + 1], replies[-1] if replies else None
    turns = with_system(fields, turns)
    check_system_turns(turns, " of the prompt")
    if not turns or turns[-1][0] != "user":
        ends = f"ends with a {turns[-1][0]} turn" if turns else "has no turns"
        raise BadRecord("prompt_not_ending_with_user", f"the prompt {ends}; it must end with a user turn")
    if not turns[-1][1].strip():
        raise BadRecord("empty_prompt", f"the {shape!r} text is empty")
    others = {key: value for key, value in record.items() if not (isinstance(key, str) and key.lower() in used)}
    if reply is not None and not set(REFERENCE_COLUMNS) & set(fields):  # the conversation's answer: a reference
        others["answer"] = reply
    if clash := sorted(set(others) & set(REWARD_ARGUMENTS)):
        raise BadRecord(
            "reward_argument_field",
            f"a field {clash[0]!r}: the name of a reward function's own argument (f(prompts, completions, "
            "**columns)), so the trainer could not hand it to one; rename that field",
        )
    try:
        columns = json.dumps(others, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:  # YAML dates and the like: not JSON
        raise BadRecord("non_json_field", f"a field that JSON cannot hold ({exc})") from exc
    return PromptRecord(tuple(turns), columns)


def prompt_json(record: PromptRecord) -> str:
    """The canonical JSON of a prompt record: what --val-fraction hashes."""
    prompt = [{"role": role, "content": content} for role, content in record.prompt]
    return json.dumps({"prompt": prompt, "columns": record.columns_json}, ensure_ascii=False, separators=(",", ":"))
