"""Tool use in conversations: the one schema data_hf.py writes, read back for the chat template.

A chat dataset row (`--format chat`) holds two columns:
- `messages`: a list of turns {role, content, tool_calls, name, tool_call_id, weight, reasoning_content}, all
  strings. `role` is system, user, assistant or tool. `tool_calls`, on an assistant turn that calls tools, is the JSON of a list of calls, each
  {"type": "function", "function": {"name": ..., "arguments": {...}}}, with "id" when the data gave one; `name`
  and `tool_call_id`, on a tool turn (a tool's result), are the called function's name and the call's id when
  known; `weight` is "0" on an assistant turn kept as context and not trained (OpenAI's per-message weight 0);
  `reasoning_content`, on an assistant turn, is its reasoning (a thinking model's trace) given apart from the
  content, as DeepSeek's and Qwen3's APIs and templates name it.
  Fields that do not apply are null.
- `tools`: the JSON of the list of tool schemas the conversation offers, each {"type": "function", "function":
  {"name": ..., "description": ..., "parameters": {...}}}; null when it offers none.
Arrow needs one type per column, hence JSON strings for the free-form schemas and arguments. The trainer decodes
them (template_messages, template_tools): chat templates expect `arguments` as an object and the tools as a list.
"""

from __future__ import annotations

import json
from typing import Any

# the turn fields beside role and content; weight: "0" on an assistant turn not to train (OpenAI's fine-tuning
# format: weight 0 or 1 per assistant message), null otherwise; reasoning_content: an assistant turn's reasoning
TURN_FIELDS = ("tool_calls", "name", "tool_call_id", "weight", "reasoning_content")
# the keys an assistant turn's reasoning is given under: DeepSeek's and Qwen3's, OpenRouter's, gpt-oss's template's
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


class ToolFormatError(ValueError):
    """A tool call or tool list that cannot be read; `reason` is bad_tool_call or bad_tools."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _json_value(value: object, reason: str, what: str) -> object:
    """`value`, decoded first when it is a JSON string."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value) if value.strip() else None
    except json.JSONDecodeError as exc:
        raise ToolFormatError(reason, f"{what} is a string that is not JSON ({exc.msg})") from None


def normalize_call(call: object, where: str) -> dict[str, Any]:
    """One call as {"type": "function", "function": {"name", "arguments"}} (+ "id"). Accepted: that shape, a bare
    {"name", "arguments"} (glaive, ShareGPT function_call turns) or {"name", "parameters"} (Llama 3.1's JSON),
    with the arguments as an object or a JSON string of one (OpenAI's)."""
    call = _json_value(call, "bad_tool_call", where)
    if not isinstance(call, dict):
        raise ToolFormatError("bad_tool_call", f"{where} is {type(call).__name__}, not a call object")
    function = call.get("function", call)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"].strip():
        raise ToolFormatError("bad_tool_call", f"{where} has no function name")
    arguments = function.get("arguments", function.get("parameters", {}))
    arguments = _json_value(arguments, "bad_tool_call", f"the arguments of {where}")
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ToolFormatError(
            "bad_tool_call", f"the arguments of {where} are {type(arguments).__name__}, not an object"
        )
    normalized: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str) and call["id"]:
        normalized["id"] = call["id"]
    return normalized


def normalize_calls(value: object, where: str) -> list[dict[str, Any]]:
    """A turn's calls: a list of calls, one call, or a JSON string of either."""
    value = _json_value(value, "bad_tool_call", where)
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise ToolFormatError("bad_tool_call", f"{where} is an empty list of calls")
    return [normalize_call(call, f"call {number} of {where}") for number, call in enumerate(calls, 1)]


def normalize_tools(value: object, where: str = "'tools'") -> list[dict[str, Any]]:
    """The tool schemas offered: a list (or one schema, or a JSON string of either) of {"type": "function",
    "function": {...}} or bare {"name", "description", "parameters"} schemas (glaive's), each returned wrapped."""
    value = _json_value(value, "bad_tools", where)
    if value is None:
        return []
    schemas = value if isinstance(value, list) else [value]
    tools = []
    for number, schema in enumerate(schemas, 1):
        function = schema.get("function", schema) if isinstance(schema, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolFormatError("bad_tools", f"tool {number} of {where} is not a schema with a name")
        tools.append({"type": schema.get("type", "function"), "function": function})
    return tools


def to_json(value: object) -> str:
    """The compact JSON stored in the dataset (key order kept, non-ASCII as is)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Turns as chat templates read them: fields that are null dropped (templates test `'tool_calls' in message`
    or `is defined`), tool calls decoded, their arguments objects. A dataset with tool calls as Arrow structs
    (a datasets-native one) is read the same way."""
    result = []
    for number, message in enumerate(messages, 1):
        turn = {key: value for key, value in message.items() if value is not None}
        if "tool_calls" in turn:
            turn["tool_calls"] = normalize_calls(turn["tool_calls"], f"the tool calls of turn {number}")
        result.append(turn)
    return result


def template_tools(value: object) -> list[dict[str, Any]] | None:
    """A row's `tools` for apply_chat_template(tools=...): None when it offers none."""
    return normalize_tools(value) or None
