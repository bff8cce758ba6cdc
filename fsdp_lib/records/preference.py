"""Preference records: the record shapes a preference pair is read from (TRL standard and conversational,
UltraFeedback, implicit prompt, Anthropic HH, ShareGPT, Alpaca), and the one type they become, PreferencePair: the
prompt turns and the chosen and rejected responses, each a list of (role, content) turns (fsdp_lib/records/schema.py
has the columns). parse_preference reads a record, preference_json is the canonical JSON of a pair (what
--val-fraction hashes), record_kind tells an auto run whether a record is a pair, a conversation or neither. The
turns are read by the conversation rules (fsdp_lib/records/conversation.py); a record that cannot be a pair raises
BadRecord with the reason. Pure: no file, no Arrow, no torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from fsdp_lib.records.conversation import (
    alpaca_instruction,
    check_system_turns,
    conversation_shape,
    turns_of_list,
    with_system,
)
from fsdp_lib.records.reasons import BadRecord
from fsdp_lib.records.schema import PREFERENCE_COLUMNS, UNPAIRED_COLUMNS, Turns


@dataclass(frozen=True)
class PreferencePair:
    """One row of a preference dataset (--format preference): the prompt turns, ending with a user turn, and the
    two responses to it, each starting with an assistant turn. The trainer renders prompt + chosen and prompt +
    rejected with the chat template, so the prompt is stored once and never repeated in the responses."""

    prompt: Turns
    chosen: Turns
    rejected: Turns

    @property
    def chars(self) -> int:
        return sum(len(content) for turns in (self.prompt, self.chosen, self.rejected) for _, content in turns)


@dataclass(frozen=True)
class UnpairedExample:
    """One row of an unpaired preference dataset (TRL's unpaired shape, for --objective kto): the prompt turns,
    ending with a user turn, one completion starting with an assistant turn, and whether it is desirable."""

    prompt: Turns
    completion: Turns
    label: bool

    @property
    def chars(self) -> int:
        return sum(len(content) for turns in (self.prompt, self.completion) for _, content in turns)


# Anthropic HH dialogues: "\n\nHuman: ...\n\nAssistant: ..."; a turn marker starts the text or follows a blank line,
# so "Human:" inside a line of a turn is text.
_HH_TURN = re.compile(r"(?:\A\s*|\n\n)(Human|Assistant):")
HH_ROLES = {"Human": "user", "Assistant": "assistant"}


def is_preference_record(record: object) -> bool:
    """Whether `record` is a preference record: an object with `chosen` and `rejected` keys, or with `completion`
    and `label` keys (an unpaired example), in any case. Checked before the conversation shapes, which a ShareGPT
    preference record (conversations) also has."""
    keys = _pair_keys(record)
    return {"chosen", "rejected"} <= keys or (UNPAIRED_KEYS <= keys and not keys & {"chosen", "rejected"})


UNPAIRED_KEYS = {"completion", "label"}


def _pair_keys(record: object) -> set[str]:
    """Which of `chosen`, `rejected`, `completion` and `label` (in any case) the object `record` has."""
    if not isinstance(record, dict):
        return set()
    # len first: this runs on every record of an auto or text run, most of which have none of these keys
    names = {key.lower() for key in record if isinstance(key, str) and len(key) in (5, 6, 8, 10)}
    return names & {"chosen", "rejected", "completion", "label"}


def _lower_keys(value: dict, where: str) -> dict:
    """`value` with its string keys lower-cased, since preference dumps write Prompt/Chosen/Rejected too. Two keys
    that differ only in case make the record ambiguous: which one is meant cannot be told."""
    lowered: dict = {}
    for key, item in value.items():
        name = key.lower() if isinstance(key, str) else key
        if name in lowered:
            raise BadRecord("ambiguous_keys", f"{where} has two keys {name!r} that differ only in case")
        lowered[name] = item
    return lowered


def _preference_turns(value: object, key: str, string_role: str) -> list[tuple[str, str]]:
    """The turns of a prompt or response value: a string is one turn of `string_role`; a list holds turns
    (role/content or from/value, keys in any case); an object is one turn (ShareGPT preference dumps write it)."""
    if isinstance(value, str):
        return [(string_role, value)]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise BadRecord(
            "bad_preference_value", f"{key!r} is {type(value).__name__}, not a string, a list of turns or a turn"
        )
    turns = [_lower_keys(turn, f"turn {number} of {key!r}") if isinstance(turn, dict) else turn
             for number, turn in enumerate(value, 1)]  # fmt: skip
    return turns_of_list(turns, key)


# The key of a pair's prompt, in order: TRL's, ShareGPT's, Alpaca's (+ input), and the question of Orca DPO pairs
# (system, question, chosen, rejected) or of sets that call it a query or an input.
PAIR_PROMPT_KEYS = ("prompt", "conversations", "instruction", "question", "query", "input")


def prompt_turns(value: object, key: str) -> list[tuple[str, str]]:
    """A prompt's turns: a string is one user turn, unless it is an Anthropic HH dialogue ("\n\nHuman: ...
    \n\nAssistant:", as Dahoas/rm-static stores prompts), whose turns are read and the empty answer header dropped
    (kept as one user turn, the template wrapped the literal markers)."""
    if isinstance(value, str) and _HH_TURN.match(value) and len(_HH_TURN.findall(value)) > 1:  # "Human: hi" is text
        turns = _hh_turns(value, key)
        return turns[:-1] if turns[-1] == ("assistant", "") else turns
    return _preference_turns(value, key, "user")


def _hh_turns(text: str, key: str) -> list[tuple[str, str]]:
    """The turns of an Anthropic HH dialogue string ("\\n\\nHuman: ...\\n\\nAssistant: ..."), contents stripped."""
    markers = list(_HH_TURN.finditer(text))
    if not markers or markers[0].start() != 0:
        found = "no '\\n\\nHuman:' or '\\n\\nAssistant:' turn" if not markers else "text before the first turn"
        raise BadRecord("malformed_hh_string", f"{key!r} has {found}")
    ends = [marker.start() for marker in markers[1:]] + [len(text)]
    return [(HH_ROLES[marker[1]], text[marker.end() : end].strip()) for marker, end in zip(markers, ends)]


def _split_shared_prompt(
    chosen: list[tuple[str, str]], rejected: list[tuple[str, str]]
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
    """(prompt, chosen response, rejected response) of two whole conversations: the prompt is their longest common
    prefix of whole turns, cut back to its last user turn so that it ends where a response can start."""
    common = 0
    for chosen_turn, rejected_turn in zip(chosen, rejected):
        if chosen_turn != rejected_turn:
            break
        common += 1
    end = max((number for number in range(1, common + 1) if chosen[number - 1][0] == "user"), default=0)
    if end == 0:
        shared = f"share {common} leading turn(s), none a user turn" if common else "share no leading turn"
        raise BadRecord("no_shared_prompt", f"chosen and rejected {shared}: no common prompt")
    return chosen[:end], chosen[end:], rejected[end:]


def _strip_prompt(response: list[tuple[str, str]], prompts: list[list[tuple[str, str]]]) -> list[tuple[str, str]]:
    """A response without the prompt turns it repeats: UltraFeedback-style `chosen`/`rejected` are whole
    conversations that start with the prompt (with or without the top-level system turn)."""
    return response[repeated_prompt(response, prompts) :]


def repeated_prompt(response: list[tuple], prompts: list[list[tuple]]) -> int:
    """How many leading (role, content) turns of `response` repeat the first of `prompts` it starts with (0: none);
    data_hf.py and the trainer (a hub dataset given straight to it) strip them alike."""
    return next((len(prompt) for prompt in prompts if prompt and response[: len(prompt)] == prompt), 0)


def _check_pair(prompt: list[tuple[str, str]], chosen: list[tuple[str, str]], rejected: list[tuple[str, str]]) -> None:
    """The rules a pair must meet to be trained on: those of _check_prompt_and_responses, and responses that
    differ."""
    _check_prompt_and_responses(prompt, [("chosen", chosen), ("rejected", rejected)])
    if [(role, content.strip()) for role, content in chosen] == [(role, content.strip()) for role, content in rejected]:
        raise BadRecord("identical_responses", f"chosen and rejected are the same {len(chosen)} turn(s)")


def _check_prompt_and_responses(prompt: list[tuple[str, str]], responses: list[tuple[str, list]]) -> None:
    """One leading system turn at most, a prompt that ends with a user turn, and responses that start and end with
    an assistant turn and have assistant text."""
    check_system_turns(prompt, " of the prompt")
    for key, response in responses:
        for number, (role, _) in enumerate(response, 1):
            if role == "system":
                raise BadRecord("misplaced_system_turn", f"turn {number} of the {key} response is a system turn")
    if not prompt or prompt[-1][0] != "user":
        ends = f"ends with a {prompt[-1][0]} turn" if prompt else "has no turns"
        raise BadRecord("prompt_not_ending_with_user", f"the prompt {ends}; it must end with a user turn")
    for key, response in responses:
        if not response:
            problem = "has no turns"
        elif response[0][0] != "assistant":
            problem = f"starts with a {response[0][0]} turn, not an assistant turn"
        elif response[-1][0] != "assistant":  # a trailing user turn is never trained on: it tells nothing apart
            problem = f"ends with a {response[-1][0]} turn, not an assistant turn"
        elif not any(role == "assistant" and content.strip() for role, content in response):
            problem = "has no assistant turn with text"
        else:
            continue
        raise BadRecord("no_assistant_response", f"the {key} response {problem}")


def parse_preference(record: object) -> PreferencePair | UnpairedExample:
    """The prompt and responses of one preference record, keys in any case. Shapes, by the keys beside chosen and
    rejected: `prompt` (TRL standard: strings; conversational: lists of turns, where chosen/rejected may repeat the
    prompt turns first), `conversations` (ShareGPT: the prompt turns; each response one turn object or a string),
    `instruction` (+ `input`: Alpaca), `question`, `query` or `input` (Orca DPO pairs), or none: chosen and rejected
    are whole conversations, lists of turns or Anthropic HH strings, whose shared leading turns are the prompt. A
    prompt string in HH's dialogue form is read as its turns. A top-level `system` string becomes the first
    prompt turn. A record with `completion` and `label` (and no chosen or rejected) is an unpaired example
    (parse_unpaired). Raises BadRecord with the reason when the pair cannot be trained on."""
    if not is_preference_record(record) or not isinstance(record, dict):
        keys = f"the keys {sorted(map(str, record))[:8]}" if isinstance(record, dict) else type(record).__name__
        raise BadRecord("not_a_preference_pair", f"{keys}; expected chosen and rejected (or completion and label)")
    fields = _lower_keys(record, "the record")
    if "chosen" not in fields and "rejected" not in fields:
        return parse_unpaired(fields)
    if key := next((key for key in PAIR_PROMPT_KEYS if fields.get(key) is not None), None):  # null: no prompt
        if key == "conversations":
            given = _preference_turns(fields["conversations"], "conversations", "user")
        elif key == "instruction":
            given = [("user", alpaca_instruction(fields))]
        else:
            given = prompt_turns(fields[key], key)
        prompt = with_system(fields, given)
        chosen, rejected = (
            _strip_prompt(_preference_turns(fields[key], key, "assistant"), [prompt, given])
            for key in ("chosen", "rejected")
        )
    else:
        both = (fields["chosen"], fields["rejected"])
        if all(isinstance(value, list) for value in both):
            whole = [_preference_turns(value, key, "assistant") for key, value in zip(("chosen", "rejected"), both)]
        elif all(isinstance(value, str) for value in both):
            whole = [_hh_turns(value, key) for key, value in zip(("chosen", "rejected"), both)]
        else:
            kinds = " and ".join(type(value).__name__ for value in both)
            raise BadRecord("bad_preference_value", f"chosen and rejected are {kinds} and there is no prompt: "
                            "expected two lists of turns or two Anthropic HH strings")  # fmt: skip
        shared, chosen, rejected = _split_shared_prompt(*whole)
        prompt = with_system(fields, shared)
    _check_pair(prompt, chosen, rejected)
    return PreferencePair(tuple(prompt), tuple(chosen), tuple(rejected))


LABELS = {"true": True, "false": False, "1": True, "0": False}


def parse_unpaired(fields: dict) -> UnpairedExample:
    """An unpaired example (TRL's shape): `prompt` (a string or turns, optionally with a top-level `system`), a
    `completion` (a string or turns) and a `label` (true/false, 1/0, or those as strings) saying whether the
    completion is desirable. The prompt and completion follow a pair's rules (parse_preference)."""
    label = fields["label"]
    if isinstance(label, str):
        label = LABELS.get(label.strip().lower(), label)
    if not isinstance(label, bool) and not (isinstance(label, int | float) and label in (0, 1)):
        raise BadRecord("bad_label", f"'label' is {str(fields['label'])[:40]!r}; expected true or false")
    if "prompt" not in fields:
        raise BadRecord("missing_prompt", "an unpaired example (completion, label) without a 'prompt'")
    given = prompt_turns(fields["prompt"], "prompt")
    prompt = with_system(fields, given)
    completion = _strip_prompt(_preference_turns(fields["completion"], "completion", "assistant"), [prompt, given])
    _check_prompt_and_responses(prompt, [("completion", completion)])
    return UnpairedExample(tuple(prompt), tuple(completion), bool(label))


def preference_json(pair: PreferencePair | UnpairedExample) -> str:
    """The canonical JSON of a pair, its three columns as HF writes messages: what --val-fraction hashes, so a pair
    (and every copy of it) lands in one split, whatever the file order."""
    names = PREFERENCE_COLUMNS if isinstance(pair, PreferencePair) else UNPAIRED_COLUMNS[:2]
    columns: dict[str, object] = {name: [{"role": role, "content": content} for role, content in getattr(pair, name)]
                                  for name in names}  # fmt: skip
    if isinstance(pair, UnpairedExample):
        columns["label"] = pair.label
    return json.dumps(columns, ensure_ascii=False, separators=(",", ":"))


def record_kind(record: object) -> str | None:
    """What an auto run may write a record as: "preference" (chosen and rejected keys, tried first: a ShareGPT
    preference record has a conversation shape too; one of them alone is half a pair, which --format auto reports
    as not_a_preference_pair instead of keeping its strings as text), "chat" (a conversation shape), or None (text
    only). An unpaired example (completion and label keys) is "preference" too; a `label` alone is not (datasets
    for classification have one)."""
    keys = _pair_keys(record)
    if keys & {"chosen", "rejected"} or UNPAIRED_KEYS <= keys:
        return "preference"
    return "chat" if conversation_shape(record) is not None else None
