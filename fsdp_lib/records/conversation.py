"""Conversation records: the record shapes a chat row is read from, and the one message type they become.

Every shape in CONVERSATION_SHAPES (OpenAI/HF `messages`, ShareGPT `conversations`, Alpaca instruction/input/output,
prompt/completion or response, question/answer) turns into a Conversation: its turns, (role, content) pairs with the
standard roles (fsdp_lib/records/schema.py) or ToolTurns for tool use (fsdp_lib/records/tool_calls.py has the tool
fields), and the JSON of the tools it offers. parse_conversation reads a record, conversation_json is the canonical
JSON of a conversation (what --val-fraction hashes). A record that cannot be a chat row raises BadRecord with the
reason (fsdp_lib/records/reasons.py). Pure: no file, no Arrow, no torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import NamedTuple

from fsdp_lib.records.reasons import BadRecord
from fsdp_lib.records.schema import ROLE_ALIASES, TOOL_CALL_ROLES, TOOL_RESULT_ROLES
from fsdp_lib.records.tool_calls import REASONING_KEYS, ToolFormatError, normalize_calls, normalize_tools, to_json

# Record shapes, tried in this order: (shape, key groups); a record has the shape when it has one key of each group.
CONVERSATION_SHAPES: tuple[tuple[str, tuple[tuple[str, ...], ...]], ...] = (
    ("messages", (("messages",),)),
    ("conversations", (("conversations",),)),
    ("alpaca", (("instruction",), ("output",))),
    ("prompt", (("prompt",), ("completion", "response"))),
    ("question", (("question",), ("answer",))),
)


def _is_turn(item: object) -> bool:
    """A dict that reads as one turn: a role (or ShareGPT's from) and content (value, or tool calls)."""
    return (
        isinstance(item, dict)
        and ("role" in item or "from" in item)
        and any(key in item for key in ("content", "value", "tool_calls", "function_call"))
    )


def is_turn_list(value: object) -> bool:
    """A conversation written as a bare list of turns (a JSONL line, a record of a list of them, or a whole file),
    not wrapped in {"messages": [...]}."""
    return isinstance(value, list) and bool(value) and all(map(_is_turn, value))


def conversation_shape(record: object) -> str | None:
    """The first of CONVERSATION_SHAPES whose keys `record` has ("messages", "alpaca", ...), "turns" for a bare list
    of turns (is_turn_list), else None."""
    if not isinstance(record, dict):
        return "turns" if is_turn_list(record) else None
    for shape, key_groups in CONVERSATION_SHAPES:
        if all(any(key in record for key in group) for group in key_groups):
            return shape
    return None


def _text_field(record: dict, key: str) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise BadRecord("non_string_content", f"{key!r} is {type(value).__name__}, not a string{_yaml_hint(value)}")
    return value


class ToolTurn(NamedTuple):
    """A turn of tool use (fsdp_lib/records/tool_calls.py has the schema): an assistant turn that calls tools
    (`tool_calls`, JSON) or a tool's result (role "tool", with the function's `name` and the call's `tool_call_id` when known)."""

    role: str
    content: str
    tool_calls: str | None = None
    name: str | None = None
    tool_call_id: str | None = None
    weight: str | None = None  # "0": an assistant turn not trained (OpenAI's weight 0); None: trained as usual
    reasoning_content: str | None = None  # an assistant turn's reasoning given apart from its content


class Conversation(tuple):
    """One chat row: its turns, (role, content) pairs or ToolTurns, and `tools`, the JSON of the tool schemas it
    offers (None: none). Equal to the plain tuple of its turns."""

    tools: str | None
    uses_tools: bool  # offers tools or has a tool turn: written with its tool fields (else all null, fast)

    def __new__(cls, turns: Iterable[tuple[str, str] | ToolTurn], tools: str | None = None) -> Conversation:
        self = super().__new__(cls, turns)
        self.tools = tools
        self.uses_tools = tools is not None or any(isinstance(turn, ToolTurn) for turn in self)
        return self


def turns_of_list(turns: object, key: str, tools_allowed: bool = False) -> list[tuple[str, str]]:
    """(role, content) of a `messages` (role/content) or `conversations` (ShareGPT from/value) list; either key
    pair is accepted in both, as real dumps mix them. With `tools_allowed` (chat rows), tool calls and results
    become ToolTurns; each result without a name or id takes those of the next call still unanswered."""
    if not isinstance(turns, list):
        raise BadRecord("bad_message", f"{key!r} is {type(turns).__name__}, not a list of turns")
    result: list[tuple[str, str]] = []
    unanswered: list[dict] = []  # the calls of the last assistant turn that called tools, in order
    for number, turn in enumerate(turns, 1):
        plain = _plain_turn(turn)
        if plain is not None:  # the common turn, checked cheaply: a standard role, string content, no tool use
            result.append(plain)
            continue
        where = f"turn {number} of {key!r}"
        role_key = "role" if isinstance(turn, dict) and "role" in turn else "from"
        content_key = "content" if isinstance(turn, dict) and "content" in turn else "value"
        if not isinstance(turn, dict) or role_key not in turn:
            raise BadRecord("bad_message", f"{where} is not an object with role/content or from/value")
        if not isinstance(turn[role_key], str):
            raise BadRecord("unknown_role", f"{where} has the role {turn[role_key]!r}")
        role = turn[role_key].strip().lower()
        try:
            if tools_allowed and (role in TOOL_CALL_ROLES or (role in ROLE_ALIASES and _calls_tools(turn))):
                calls = _tool_calls_of(turn, role, content_key, where)
                content = "" if role in TOOL_CALL_ROLES else _optional_content(turn, content_key, where)
                unanswered = list(calls)
                fields = {"weight": _weight(turn, where), "reasoning_content": _reasoning(turn, where)}
                result.append(ToolTurn("assistant", content, to_json(calls), **fields))
                continue
            if tools_allowed and role in TOOL_RESULT_ROLES:
                if content_key not in turn:
                    raise BadRecord("bad_message", f"{where} is a tool result without content")
                given_id = turn.get("tool_call_id") if isinstance(turn.get("tool_call_id"), str) else None
                answered = _answered_call(unanswered, given_id)
                name = (
                    turn.get("name") if isinstance(turn.get("name"), str) else answered.get("function", {}).get("name")
                )
                call_id = given_id or answered.get("id")
                result.append(ToolTurn("tool", _result_text(turn[content_key], where), None, name, call_id))
                continue
        except ToolFormatError as err:
            raise BadRecord(err.reason, err.detail) from None
        if role not in ROLE_ALIASES:
            hint = " (tool turns are read in --format chat only)" if role in TOOL_RESULT_ROLES + TOOL_CALL_ROLES else ""
            raise BadRecord("unknown_role", f"{where} has the role {turn[role_key]!r}{hint}")
        if content_key not in turn:
            raise BadRecord("bad_message", f"{where} is not an object with role/content or from/value")
        content = _content_text(turn[content_key], where)
        # chat rows only: a prompt's or a pair's turns are never trained by turn, so a weight there means nothing
        replies = tools_allowed and ROLE_ALIASES[role] == "assistant"
        weight, reasoning = (_weight(turn, where), _reasoning(turn, where)) if replies else (None, None)
        if weight or reasoning:
            result.append(ToolTurn("assistant", content, weight=weight, reasoning_content=reasoning))
        else:
            result.append((ROLE_ALIASES[role], content))
    return result


def _reasoning(turn: dict, where: str) -> str | None:
    """An assistant turn's reasoning given apart from its content (REASONING_KEYS: reasoning_content, reasoning or
    thinking, the first present); None when it has none or it is blank."""
    key = next((key for key in REASONING_KEYS if turn.get(key) is not None), None)
    if key is None:
        return None
    value = turn[key]
    if not isinstance(value, str):
        raise BadRecord("non_string_content", f"{where} has {type(value).__name__} {key}, not a string")
    return value if value.strip() else None


def _weight(turn: dict, where: str) -> str | None:
    """OpenAI's per-message `weight` on an assistant turn: 0 = context, not trained ("0"), 1 = trained (None)."""
    trained = is_trained_weight(turn.get("weight"))
    if trained is None:
        raise BadRecord(
            "bad_turn_weight", f"{where} has the weight {turn.get('weight')!r}; OpenAI's format takes 0 or 1"
        )
    return None if trained else "0"


def is_trained_weight(value: object) -> bool | None:
    """The verdict on a turn's weight, for data_hf.py and the trainer alike: True for none or 1, False for 0 (an int,
    float, bool or numeric string: "0" as data_hf.py stores it), None for anything else (not OpenAI's format)."""
    if value is None:
        return True
    number: float | None = float(value) if type(value) in (int, float, bool) else None
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    return {1.0: True, 0.0: False}.get(number) if number is not None else None


def _answered_call(unanswered: list[dict], call_id: str | None) -> dict:
    """The call a tool result answers, taken off `unanswered`: the one with its tool_call_id, else the next one in
    order (results without ids answer calls in order); {} when none (a result naming another call's id kept the
    name of the next call, mixing two calls' fields)."""
    if call_id is not None:
        index = next((i for i, call in enumerate(unanswered) if call.get("id") == call_id), None)
        return unanswered.pop(index) if index is not None else {}
    return unanswered.pop(0) if unanswered else {}


def _plain_turn(turn: object) -> tuple[str, str] | None:
    """(role, content) of a turn with a standard role (or alias) and string content that calls no tool; None for
    any other turn (read by the full checks of turns_of_list)."""
    if type(turn) is not dict or "tool_calls" in turn or "function_call" in turn or "weight" in turn:
        return None
    if "reasoning_content" in turn or "reasoning" in turn or "thinking" in turn:  # REASONING_KEYS, read in full
        return None
    role, content = turn.get("role", turn.get("from")), turn.get("content", turn.get("value"))
    if type(role) is not str or type(content) is not str:
        return None
    mapped = ROLE_ALIASES.get(role) or ROLE_ALIASES.get(role.strip().lower())
    return (mapped, content) if mapped is not None else None


def _calls_tools(turn: dict) -> bool:
    """Whether an assistant turn calls tools: OpenAI/HF `tool_calls`, or OpenAI's legacy `function_call`."""
    return bool(turn.get("tool_calls")) or bool(turn.get("function_call"))


def _tool_calls_of(turn: dict, role: str, content_key: str, where: str) -> list[dict]:
    """The calls of a turn that calls tools, normalized (fsdp_lib/records/tool_calls.normalize_calls)."""
    if role in TOOL_CALL_ROLES:
        if content_key not in turn:
            raise BadRecord("bad_message", f"{where} is a {role} turn without the call")
        return normalize_calls(turn[content_key], f"the {role} of {where}")
    if ROLE_ALIASES.get(role) != "assistant":
        raise BadRecord("bad_tool_call", f"{where} is a {role} turn with tool calls; only assistant turns call tools")
    value = turn.get("tool_calls") or turn.get("function_call")
    return normalize_calls(value, f"the tool calls of {where}")


def _optional_content(turn: dict, content_key: str, where: str) -> str:
    """The text of an assistant turn that calls tools: often null or absent (then "")."""
    content = turn.get(content_key)
    return "" if content is None else _content_text(content, where)


def _result_text(content: object, where: str) -> str:
    """A tool result's text: a string or text parts as is; an object or a list of values as its JSON."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, (str, dict)) and _is_text_part(part) for part in content):
        return _content_text(content, where)
    if isinstance(content, (dict, list, int, float, bool)):
        return to_json(content)
    raise BadRecord("non_string_content", f"{where} has {type(content).__name__} content")


def turn_content(role: str, content: object, where: str) -> str:
    """The text of a turn's content as data_hf.py stores it: a tool result's object as its JSON, text parts joined;
    raises BadRecord for content that is no text (an image part, a number)."""
    return _result_text(content, where) if role in TOOL_RESULT_ROLES else _content_text(content, where)


def as_stored(messages: list[dict]) -> list[dict]:
    """Turns as data_hf.py --format chat stores them, for a dataset made elsewhere (save_to_disk, the hub), read as
    data_hf.py reads a file's: a role alias as its role (human -> user, gpt -> assistant; the assistant's turns are
    the trained ones); a tool result's role (function, observation, ipython) as "tool", with the name and call id of
    the call it answers where it has none; a call given as a turn of its own (glaive's function_call, the call as
    its content) or as OpenAI's legacy `function_call` field as an assistant turn's `tool_calls`; content given as
    a list of parts as their text joined (a template would print the list's repr); another role is left to the
    template. Raises BadRecord for content that is no text, ToolFormatError for a call that cannot be read."""
    unanswered: list[dict] = []  # the calls of the last assistant turn that called tools, in order
    for number, turn in enumerate(messages, 1):
        where = f"turn {number}"
        role = turn.get("role")
        name = role.strip().lower() if isinstance(role, str) else None
        if name in TOOL_CALL_ROLES:
            turn["tool_calls"] = _tool_calls_of(turn, name, "content", where)
            turn["role"], turn["content"] = "assistant", ""
        elif name in TOOL_RESULT_ROLES:
            turn["role"] = "tool"
            answered = _answered_call(unanswered, turn.get("tool_call_id"))
            turn.setdefault("name", answered.get("function", {}).get("name"))
            turn.setdefault("tool_call_id", answered.get("id"))
            turn.update({key: None for key in ("name", "tool_call_id") if not isinstance(turn[key], str)})
        elif name in ROLE_ALIASES:
            turn["role"] = ROLE_ALIASES[name]
            if turn["role"] == "assistant" and turn.get("function_call") and not turn.get("tool_calls"):
                turn["tool_calls"] = normalize_calls(turn.pop("function_call"), f"the function_call of {where}")
        # any other role (OpenAI's developer, which some templates render) is left to the template, as it was
        if turn.get("tool_calls"):
            unanswered = list(turn["tool_calls"])
        elif turn.get("content") is None:  # null: a template fails on it ('dict object' has no attribute 'content')
            raise BadRecord("non_string_content", f"{where} has no content")
        content = turn.get("content")
        if content is not None and not isinstance(content, str):
            turn["content"] = turn_content(turn["role"], content, where)
    return [{key: value for key, value in turn.items() if value is not None} for turn in messages]


def _is_text_part(part: object) -> bool:
    return isinstance(part, str) or (isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES)


TEXT_PART_TYPES = ("text", "input_text", "output_text")  # OpenAI's chat and responses APIs name text parts so


def _yaml_hint(value: object) -> str:
    """Why a text field may have come out a boolean or a number: YAML reads an unquoted yes/no/on/off or 1.0 so."""
    return (
        " (from a YAML file? it reads an unquoted yes, no, on, off or number so: quote it)"
        if isinstance(value, (bool, int, float))
        else ""
    )


def _content_text(content: object, where: str) -> str:
    """A turn's content: a string, or a list of parts (OpenAI/HF multimodal style) whose text parts,
    {"type": "text", "text": ...} or with "value" instead of "text" (or plain strings), are joined with a newline.
    A part that is not text (an image, audio, a file) makes the conversation a counted skip."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRecord("non_string_content", f"{where} has {type(content).__name__} content{_yaml_hint(content)}")
    texts = []
    for number, part in enumerate(content, 1):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type", "text") if isinstance(part, dict) else type(part).__name__
        if kind not in TEXT_PART_TYPES:
            raise BadRecord("non_text_content", f"{where}: content part {number} is {kind!r}, not text")
        text = part.get("text", part.get("value"))
        if not isinstance(text, str):
            raise BadRecord("non_string_content", f"{where}: text part {number} has no string text or value")
        texts.append(text)
    return "\n".join(texts)


def alpaca_instruction(record: dict) -> str:
    """The user turn of an Alpaca record: `instruction`, then a blank line and `input` if it is not empty."""
    user = _text_field(record, "instruction")
    extra = record.get("input")
    if extra is not None and not isinstance(extra, str):
        raise BadRecord("non_string_content", f"'input' is {type(extra).__name__}, not a string")
    if extra and extra.strip():
        user = f"{user}\n\n{extra}"
    return user


def _alpaca_history(record: dict) -> list[tuple[str, str]]:
    """The earlier exchanges of a multi-turn Alpaca record (LLaMA-Factory's `history`: [[instruction, response],
    ...]), as the turns before its instruction; [] where it has none."""
    history = record.get("history")
    if history is None:
        return []
    if not isinstance(history, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and all(isinstance(text, str) for text in pair) for pair in history
    ):
        raise BadRecord("bad_message", "'history' is not a list of [instruction, response] string pairs")
    return [turn for asked, answered in history for turn in (("user", asked), ("assistant", answered))]


def _as_context(turn: tuple[str, str]) -> tuple[str, str]:
    """A prompt's assistant turn as context (OpenAI's weight 0): TRL trains a completion alone, never the prompt."""
    if turn[0] != "assistant":
        return turn
    return turn._replace(weight="0") if isinstance(turn, ToolTurn) else ToolTurn("assistant", turn[1], weight="0")


def _turns_of_pair(record: dict, shape: str) -> list[tuple[str, str]]:
    """The user and assistant turns of the single-exchange shapes (Alpaca, prompt/completion, question/answer)."""
    if shape == "alpaca":
        return [
            *_alpaca_history(record),
            ("user", alpaca_instruction(record)),
            ("assistant", _text_field(record, "output")),
        ]
    if shape == "prompt":
        answer_key = "completion" if "completion" in record else "response"
        if isinstance(record["prompt"], list) and isinstance(record[answer_key], list):  # TRL's conversational shape
            prompt = turns_of_list(record["prompt"], "prompt", tools_allowed=True)
            return [*map(_as_context, prompt), *turns_of_list(record[answer_key], answer_key, tools_allowed=True)]
        return [("user", _text_field(record, "prompt")), ("assistant", _text_field(record, answer_key))]
    return [("user", _text_field(record, "question")), ("assistant", _text_field(record, "answer"))]


def parse_conversation(record: object) -> Conversation:
    """The turns of one conversation record, in any of CONVERSATION_SHAPES, with a top-level `system` string
    prepended as a system turn, and its top-level `tools` (tool use: fsdp_lib/records/tool_calls.py has the schema).
    Raises BadRecord with the reason when it cannot be used as a chat row."""
    shape = conversation_shape(record)
    if isinstance(record, dict) and {"completion", "label"} <= {str(k).lower() for k in record}:
        raise BadRecord("unpaired_preference_record", "a completion with a label (an unpaired example, TRL's KTO "
                        "shape): its completion may be an undesirable one; convert it with --format preference")  # fmt: skip
    if shape is None:
        keys = f"the keys {sorted(map(str, record))[:8]}" if isinstance(record, dict) else type(record).__name__
        raise BadRecord("not_a_conversation", f"{keys}; expected messages, conversations, instruction + output, "
                        "prompt + completion/response, question + answer or a list of turns")  # fmt: skip
    if shape == "turns":  # no top-level system or tools beside a bare list
        turns = turns_of_list(record, "the list of turns", tools_allowed=True)
        check_system_turns(turns)
        _check_replies(turns)
        return Conversation(turns, None)
    assert isinstance(record, dict)
    if shape in ("messages", "conversations"):
        turns = turns_of_list(record[shape], shape, tools_allowed=True)
    else:
        turns = _turns_of_pair(record, shape)
    turns = with_system(record, turns)
    check_system_turns(turns)
    _check_replies(turns)
    try:
        tools = normalize_tools(record.get("tools"))
    except ToolFormatError as err:
        raise BadRecord(err.reason, err.detail) from None
    return Conversation(turns, to_json(tools) if tools else None)


def _check_replies(turns: list[tuple[str, str]]) -> None:
    replies = [turn for turn in turns if turn[0] == "assistant" and (turn[1].strip() or calls_json(turn))]
    if not replies:
        raise BadRecord("no_assistant_turn", f"{len(turns)} turn(s), none from the assistant with text or a call")
    if all(getattr(turn, "weight", None) == "0" for turn in replies):
        raise BadRecord("no_assistant_turn", f"every assistant turn of {len(turns)} has weight 0: nothing to train")


def calls_json(turn: tuple[str, str]) -> str | None:
    """The JSON of a turn's tool calls: a ToolTurn's `tool_calls`, None for a plain (role, content) turn."""
    return turn.tool_calls if isinstance(turn, ToolTurn) else None


def with_system(record: dict, turns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """`turns` after the record's top-level `system` string as a system turn (an empty one is ignored)."""
    if record.get("system") is None:
        return turns
    system = _text_field(record, "system")
    return [("system", system), *turns] if system.strip() else turns


def check_system_turns(turns: list[tuple[str, str]], where: str = "") -> None:
    """Only the first turn may be a system turn: chat templates put the system prompt first, or refuse it."""
    for number, turn in enumerate(turns[1:], 2):
        if turn[0] == "system":
            raise BadRecord(
                "misplaced_system_turn", f"turn {number}{where} is a system turn; only the first turn may be"
            )


def conversation_json(conversation: Conversation) -> str:
    """The canonical JSON of a conversation, as HF writes messages (tool fields and tools only where present, so a
    conversation without tool use hashes as before): what --val-fraction hashes."""
    messages = [turn._asdict() if isinstance(turn, ToolTurn) else {"role": turn[0], "content": turn[1]}
                for turn in conversation]  # fmt: skip
    messages = [{key: value for key, value in message.items() if value is not None} for message in messages]
    tools = getattr(conversation, "tools", None)
    value: object = messages if tools is None else {"messages": messages, "tools": tools}
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
