"""The dataset schema: the kinds of dataset data_hf.py writes and the trainer reads, their columns, the fields of a
turn, the roles a turn may have, and the rule that tells a saved dataset's kind from its column names.

A dataset is one of five kinds:
- "text": one column `text`, a string per row;
- "messages": `messages`, a list of turns {role, content, tool_calls, name, tool_call_id, weight, reasoning_content}
  per row (one conversation), and `tools`, the JSON of the tool schemas it offers (fsdp_lib/records/tool_calls.py has the tool fields);
- "preference": `prompt`, `chosen` and `rejected`, each a list of {role, content} turns (one preference pair);
- "unpaired" (--objective kto): `prompt`, `completion` and `label`, TRL's unpaired preference shape: the prompt
  and completion as lists of {role, content} turns (the trainer also reads strings), the label a boolean
  (desirable or not). data_hf.py --format preference writes it when it reads unpaired records (and unpairs the
  pairs of such a run);
- "prompts" (--objective grpo): `prompt`, a list of {role, content} turns ending with a user turn, and
  `columns_json`, the record's other fields as one JSON object, which the reward functions read as columns (a
  reference answer, test cases). The trainer also reads a `prompt` column of strings with any other columns
  (TRL's prompt-only datasets).
data_hf.py decides the kind when it writes (and names it in its summary's "column"); the trainer finds it again
from the column names with dataset_kind.
"""

from __future__ import annotations

from collections.abc import Iterable

from fsdp_lib.records.tool_calls import TURN_FIELDS

# Turns of a preference pair: (role, content) with the standard roles; a list of {"role", "content"} structs.
Turns = tuple[tuple[str, str], ...]
# The columns of a preference dataset, each a list of messages like `messages`; the trainer reads these names.
PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")
# The columns of an unpaired preference dataset (--objective kto), TRL's names.
UNPAIRED_COLUMNS = ("prompt", "completion", "label")
# The columns of each kind of dataset ("column" in the summary names the kind).
# The columns of a prompts dataset (--format prompts): the prompt turns and the record's other fields as JSON.
PROMPT_COLUMNS = ("prompt", "columns_json")
DATASET_COLUMNS = {
    "text": ("text",), "messages": ("messages", "tools"), "preference": PREFERENCE_COLUMNS,
    "unpaired": UNPAIRED_COLUMNS, "prompts": PROMPT_COLUMNS,
}  # fmt: skip
# Role names as written in the data -> the standard HF chat roles. "human"/"gpt" are ShareGPT's, "model" is
# Gemma's and Gemini's, "bot" is common in older dumps: all unambiguous. Tool turns: TOOL_RESULT_ROLES and
# TOOL_CALL_ROLES, in --format chat only (a preference record with them is an unknown_role skip).
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
}
# A tool's result: OpenAI/HF "tool", OpenAI's legacy "function", ShareGPT/glaive "observation", Llama 3.1 "ipython".
TOOL_RESULT_ROLES = ("tool", "function", "observation", "ipython")
# ShareGPT/glaive: an assistant turn whose value is the call, a JSON object (or a list of them).
TOOL_CALL_ROLES = ("function_call", "tool_call", "tool_calls")


def turn_fields(column: str) -> tuple[str, ...]:
    """The fields of a turn in `column`: role and content, and for chat rows (`messages`) the tool fields."""
    return ("role", "content", *TURN_FIELDS) if column == "messages" else ("role", "content")


def dataset_kind(columns: Iterable[str]) -> str | None:
    """The kind of a saved dataset told from its column names: "preference" when it has all of
    PREFERENCE_COLUMNS, else "unpaired" when it has all of UNPAIRED_COLUMNS, else "messages" when it has a
    `messages` column (with or without `tools`), else
    "text" when it has a `text` column, else "prompts" when it has a `prompt` column; None when it is none of
    them."""
    names = set(columns)
    if set(PREFERENCE_COLUMNS) <= names:
        return "preference"
    if set(UNPAIRED_COLUMNS) <= names:
        return "unpaired"
    if "messages" in names:
        return "messages"
    if "text" in names:
        return "text"
    return "prompts" if "prompt" in names else None
