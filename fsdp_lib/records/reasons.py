"""Why a record is skipped: BadRecord, raised by the record parsers (conversation.py, preference.py, prompts.py), and
RECORD_REASONS, each reason a record can be skipped for with the explanation the run summary prints beside it."""

from __future__ import annotations

RECORD_REASONS = {
    # Conversation records (--format chat, or auto): each bad record is skipped and counted, never fragmented.
    "not_a_conversation": "a record with none of the conversation shapes (messages, conversations, instruction + "
    "output, prompt + completion/response, question + answer)",
    "bad_message": "a turn that is not an object with role/content (or ShareGPT from/value), or a messages or "
    "conversations value that is not a list",
    "unknown_role": "a role other than system/user/assistant/tool (or the aliases human, gpt, bot, model; "
    "function_call, observation, function, ipython for tool use; tool roles in --format chat only)",
    "non_string_content": "a turn, instruction, prompt, answer or system prompt that is not a string or a list of "
    "text parts (e.g. null, a number, a tool call in a preference record)",
    "bad_tool_call": "an assistant turn's tool call that is not a call object with a function name and arguments "
    "(an object, or a JSON string of one)",
    "bad_tools": "a `tools` value that is not a list of tool schemas with names (or a JSON string of one)",
    "non_text_content": "a turn whose content parts include one that is not text (an image, audio, a file)",
    "misplaced_system_turn": "a system turn that is not the first turn",
    "bad_turn_weight": "an assistant turn whose `weight` (OpenAI's fine-tuning format) is not 0 or 1, or a weight 0 "
    "in a preference record",
    "unpaired_preference_record": "a prompt + completion record with a label (TRL's unpaired KTO shape) in --format "
    "chat: its completion may be an undesirable one, so it is not trained as a conversation; use --format "
    "preference",
    "no_assistant_turn": "a conversation without an assistant turn that has text: nothing to learn from",
    "conversation_too_long": "a conversation longer than --max-chars characters (a conversation is never split)",
    "repeated_yaml_alias": "a YAML alias repeating a conversation already read; read once",
    # Preference records (--format preference, or auto): the conversation reasons above apply to their turns too.
    "not_a_preference_pair": "a record without both chosen and rejected keys, or completion and label keys (an "
    "unpaired example), in --format preference",
    "ambiguous_keys": "a preference or prompt record with two keys that differ only in case (e.g. chosen and Chosen)",
    "bad_preference_value": "prompt, chosen or rejected that is not a string or a list of turns (or one turn "
    "object), or, without a prompt, chosen and rejected that are not both lists of turns or both HH strings",
    "malformed_hh_string": "chosen/rejected strings without a prompt that are not Anthropic HH dialogues "
    "('\\n\\nHuman: ...\\n\\nAssistant: ...')",
    "no_shared_prompt": "chosen and rejected as whole conversations that share no leading turns ending with a user "
    "turn: there is no common prompt",
    "prompt_not_ending_with_user": "a prompt without turns, or whose last turn is not a user turn (e.g. it ends "
    "with an assistant turn)",
    "no_assistant_response": "a chosen or rejected response that does not start and end with an assistant turn, or "
    "has no assistant turn with text",
    "identical_responses": "chosen and rejected responses that are the same (ignoring surrounding whitespace): "
    "nothing to prefer",
    "pair_too_long": "a pair (prompt + chosen + rejected) longer than --max-chars characters (a pair is never split)",
    "bad_label": "an unpaired example (completion + label) whose label is not true or false (1/0 and the strings "
    "'true'/'false' are read too)",
    "missing_prompt": "an unpaired example (completion + label) without a prompt",
    "example_too_long": "an unpaired example (prompt + completion) longer than --max-chars characters",
    # Prompt records (--format prompts): the conversation reasons above apply to a prompt's turns too.
    "not_a_prompt_record": "a record without a prompt, question, problem, instruction, messages or conversations key (--format prompts)",
    "empty_prompt": "a prompt whose last user turn is empty or whitespace",
    "non_json_field": "a field JSON cannot hold (e.g. a YAML date), so the record's columns cannot be kept",
    "prompt_too_long": "a prompt record (its prompt and other fields) longer than --max-chars characters",
    "reward_argument_field": "a prompt record with a field named 'prompts' or 'completions', a reward function's "
    "own arguments (rename the field)",
}


class BadRecord(Exception):
    """A record that cannot be a conversation row or a preference pair; `reason` is a key of RECORD_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
