"""Conversations to trained tokens: rendering with the tokenizer's chat template and marking the assistant tokens
that carry loss (--loss-on), for datasets with a `messages` column."""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fsdp_lib.checks import chat_template_problems, conversation_prompts
from fsdp_lib.config import TrainConfig
from fsdp_lib.errors import TrainError
from fsdp_lib.experiment_dir import resumes
from fsdp_lib.records.conversation import as_stored, is_trained_weight
from fsdp_lib.records.reasons import BadRecord
from fsdp_lib.records.schema import TOOL_CALL_ROLES, TOOL_RESULT_ROLES, dataset_kind
from fsdp_lib.records.tool_calls import REASONING_KEYS, ToolFormatError, template_messages, template_tools, to_json
from fsdp_lib.runtime import log


class ChatFormatError(ValueError):
    """A conversation the chat template cannot render, or renders inconsistently; the row is skipped and counted."""


@dataclass
class ChatEncoder:
    """Renders conversations with the tokenizer's chat template and marks the tokens that carry loss.

    With loss_on="assistant", the trained tokens are those of each assistant turn: its content and the template's
    end-of-turn marker. Templates rarely mark those spans (`{% generation %}`), so they are derived by rendering
    prefixes: turn i's span runs from the end of render(turns[:i], add_generation_prompt=True) to the end of
    render(turns[:i+1]). A token is trained when it ends inside a span: a token that straddles the span's start
    ("Assistant: " + "Five" -> "▁Five") carries the answer's first word and is trained; one that straddles its end
    would carry the next turn's text and is not.

    Templates that render earlier turns differently from the last one (Qwen3 strips reasoning from earlier
    assistant turns and gives the final one an empty <think></think> block): such a conversation becomes one
    sample per assistant turn, turns[:i+1], each trained on its last turn exactly as the template renders a final
    turn (the earlier turns are context). A conversation whose prefixes match no render at all is a counted skip,
    never a wrong mask. A conversation that starts with an assistant turn trains that turn's answer only: the
    span starts after the template's empty generation prompt where it renders one, else at the answer's text.

    Tool use (fsdp_lib/records/tool_calls.py): every render of a conversation gets its tools (apply_chat_template(tools=));
    an assistant turn that calls tools is an assistant turn like any other, its calls trained as the template
    renders them; tool results (role "tool") are context, never trained.

    A row batch is rendered in two apply_chat_template calls per distinct tool list (every prefix without, then
    with, the generation prompt): one call per render costs ~40% more (bench/bench_chat_tokenize.py). When a
    batched call raises, the batch is rendered conversation by conversation, so a conversation the template refuses
    is one counted skip.
    """

    tokenizer: Any
    loss_on: str  # "assistant" or "all"
    expanded: int = 0  # conversations trained as one sample per assistant turn (see above), for the log
    _empty_prompt: str | None = ""  # render([], add_generation_prompt=True); "" = not tried yet, None = refused

    # of the masks this class writes: part of the token cache key (3: no conversation without a reply; 4: content
    # parts as text, role aliases, an empty assistant turn among others not trained; 5: weight 0 not trained)
    VERSION = 5

    def render(self, conversations: list[list[dict]], generation_prompt: bool, tools: list | None = None) -> list[str]:
        try:
            return self.tokenizer.apply_chat_template(
                conversations, tools=tools, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as exc:  # noqa: BLE001 - jinja raises TemplateError, templates raise their own messages
            raise ChatFormatError(f"the chat template refused it ({str(exc)[:120]})") from exc

    def prefixes(self, messages: list[dict]) -> list[tuple[int, bool]]:
        """The renders that place a conversation's assistant turns: (number of leading turns, generation prompt)."""
        needed = {(len(messages), False)}
        if self.loss_on == "assistant":
            for i, turn in enumerate(messages):
                if turn.get("role") == "assistant":
                    needed |= {(i, True), (i + 1, False)}
        needed.discard((0, True))  # the empty conversation's prompt: the same for all, rendered once (empty_prompt)
        return sorted(needed)

    def render_prefixes(
        self, conversations: list[list[dict]], tools: list[list | None] | None = None
    ) -> list[dict[tuple[int, bool], str] | ChatFormatError]:
        """Every prefix render of every conversation (with its `tools`), batched per tool list; per conversation
        (a ChatFormatError in its place) when the template refuses one of them."""
        tools = tools or [None] * len(conversations)
        groups: dict[str, list[int]] = {}
        for row, offered in enumerate(tools):
            groups.setdefault(to_json(offered), []).append(row)
        rendered: list[dict[tuple[int, bool], str] | ChatFormatError] = [{} for _ in conversations]
        for rows in groups.values():
            wanted = [(row, n, prompt) for row in rows for n, prompt in self.prefixes(conversations[row])]
            try:
                for prompt in (False, True):
                    keys = [(row, n) for row, n, p in wanted if p == prompt]
                    if keys:
                        texts = self.render([conversations[row][:n] for row, n in keys], prompt, tools[rows[0]])
                        for (row, n), text in zip(keys, texts):
                            rendered[row][(n, prompt)] = text
            except ChatFormatError:
                for row in rows:
                    try:
                        rendered[row] = {}
                        for n, prompt in self.prefixes(conversations[row]):
                            rendered[row][(n, prompt)] = self.render([conversations[row][:n]], prompt, tools[row])[0]
                    except ChatFormatError as exc:
                        rendered[row] = exc
        return rendered

    def empty_prompt(self) -> str | None:
        if self._empty_prompt == "":
            try:
                self._empty_prompt = self.render([[]], True)[0]
            except ChatFormatError:  # e.g. a template that reads messages[0]
                self._empty_prompt = None
        return self._empty_prompt

    def turn_span(self, messages: list[dict], i: int, renders: dict[tuple[int, bool], str]) -> tuple[int, int]:
        """Assistant turn i's characters in render(turns[:i+1]): from the end of the generation prompt to the end."""
        through = renders[(i + 1, False)]
        if i > 0:
            before = renders[(i, True)]
            if not through.startswith(before):
                raise ChatFormatError("the chat template renders a conversation's start differently from the whole")
            return len(before), len(through)
        empty = self.empty_prompt()
        if empty and through.startswith(empty):
            return len(empty), len(through)
        answer = str(messages[0].get("content") or "").strip()
        start = through.rfind(answer) if answer else -1
        if start < 0:
            raise ChatFormatError("the chat template hides the answer of a conversation that starts with it")
        return start, len(through)

    def samples(self, messages: list[dict], renders: dict[tuple[int, bool], str]) -> list[tuple[str, list]]:
        """(text, trained character spans) of a conversation: the whole render with every assistant span, or, when
        the template renders earlier turns differently from the whole, one sample per assistant turn."""
        full = renders[(len(messages), False)]
        if self.loss_on == "all":
            return [(full, [])]
        turns = [i for i, turn in enumerate(messages) if turn.get("role") == "assistant"]
        if not turns:  # it trained as context carrying no loss, and a dataset of them was blamed on the template
            raise ChatFormatError("no assistant turn: nothing to train with --loss-on assistant")
        said = [i for i in turns if says_something(messages[i])]  # an empty reply among others is context
        if not said:
            raise ChatFormatError("every assistant turn is empty: it would teach empty answers")
        said = [i for i in said if not weighted_out(messages[i])]  # OpenAI's weight 0: context, not trained
        if not said:
            raise ChatFormatError("every assistant turn has weight 0: nothing to train")
        spans = [self.turn_span(messages, i, renders) for i in said]
        if all(full.startswith(renders[(i + 1, False)]) for i in turns):
            return [(full, spans)]
        self.expanded += 1
        return [(renders[(i + 1, False)], [span]) for i, span in zip(said, spans)]

    def encode(
        self,
        conversations: list[list[dict]],
        skipped: dict[str, int],
        first_skipped: dict[str, int] | None = None,
        tools: list[object] | None = None,
    ) -> list[tuple[list[int], np.ndarray]]:
        """(token ids, trained mask) per sample, in conversation order (one per conversation, or one per assistant
        turn, see samples()); `tools`: each conversation's `tools` value (a `tools` column). A conversation that
        cannot be encoded is counted in skipped by reason, and first_skipped records the index of the first
        conversation skipped for each reason."""
        conversations, offered, unreadable = _readable(conversations, tools)
        texts, all_spans = [], []
        renders_of = self.render_prefixes(conversations, offered)
        for row, (messages, renders) in enumerate(zip(conversations, renders_of)):
            try:
                if row in unreadable:
                    raise unreadable[row]
                if isinstance(renders, ChatFormatError):
                    raise renders
                for text, spans in self.samples(messages, renders):
                    texts.append(text)
                    all_spans.append(spans)
            except ChatFormatError as exc:
                skipped[str(exc)] = skipped.get(str(exc), 0) + 1
                if first_skipped is not None:
                    first_skipped.setdefault(str(exc), row)
        encodings = self.tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        return [(encoding.ids, self.trained_mask(encoding, spans)) for encoding, spans in zip(encodings, all_spans)]

    def trained_mask(self, encoding: Any, spans: list[tuple[int, int]]) -> np.ndarray:
        """1 for the tokens that end inside an assistant span (a < end <= b). Token end offsets never decrease, so
        each span's tokens are one run, found by binary search on the offsets without listing them all (building
        encoding.offsets costs more than the rest of the mask)."""
        n = len(encoding)
        if self.loss_on == "all":
            return np.ones(n, dtype=np.uint8)
        mask = np.zeros(n, dtype=np.uint8)
        end_of = lambda t: encoding.token_to_chars(t)[1]  # noqa: E731
        for a, b in spans:
            mask[bisect.bisect_right(range(n), a, key=end_of) : bisect.bisect_right(range(n), b, key=end_of)] = 1
        return mask


def weighted_out(turn: dict) -> bool:
    """An assistant turn with OpenAI's weight 0 ("0" as data_hf.py stores it, 0 or False in a dataset made
    elsewhere): kept as context, not trained. A weight other than 0 or 1 is a counted skip, as in data_hf.py."""
    trained = is_trained_weight(turn.get("weight"))
    if trained is None:
        raise ChatFormatError(f"a turn weight other than 0 or 1 ({turn.get('weight')!r}; OpenAI's format)")
    return not trained


def says_something(turn: dict) -> bool:
    """A turn with text that is not blank, or tool calls (an assistant reply that only calls a tool says something)."""
    return bool(str(turn.get("content") or "").strip() or turn.get("tool_calls"))


def _readable(
    conversations: list[list[dict]], tools: list[object] | None
) -> tuple[list[list[dict]], list[list | None], dict[int, ChatFormatError]]:
    """(messages as templates read them, each row's tool list, rows that cannot be read: an empty conversation in
    their place and the error, so they become counted skips)."""
    messages_of, offered, unreadable = [], [], {}
    for row, messages in enumerate(conversations):
        try:
            readable = (
                as_stored(template_messages(list(messages))),
                (template_tools(tools[row]) if tools is not None else None),
            )
        except ToolFormatError as exc:
            readable = [], None
            unreadable[row] = ChatFormatError(f"unreadable tool use ({exc.detail[:120]})")
        except BadRecord as exc:
            readable = [], None
            text = exc.reason in ("non_string_content", "non_text_content")  # as_stored leaves other roles be
            what = "content that is not text" if text else "a turn that cannot be read"
            unreadable[row] = ChatFormatError(f"{what} ({exc.reason}; data_hf.py --format chat skips and counts these)")
        messages_of.append(readable[0])
        offered.append(readable[1])
    return messages_of, offered, unreadable


# A conversation that uses every part of tool use, to see whether a chat template renders them (check_tool_support).
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "probe_lookup",
            "description": "probe tool description",
            "parameters": {
                "type": "object",
                "properties": {"probe_key": {"type": "string"}},
                "required": ["probe_key"],
            },
        },
    }
]
_PROBE = [
    {"role": "user", "content": "probe question"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call12345", "type": "function",
     "function": {"name": "probe_lookup", "arguments": {"probe_key": "probe argument value"}}}]},
    {"role": "tool", "name": "probe_lookup", "tool_call_id": "call12345", "content": "probe tool result"},
    {"role": "assistant", "content": "probe answer"},
]  # fmt: skip
_PROBE_PARTS = {
    "the tools offered": "probe tool description",
    "the assistant's tool calls": "probe argument value",
    "the tool results": "probe tool result",
}


def check_tool_support(tokenizer: Any, where: str) -> None:
    """Refuse a chat template that cannot render tool use (it would drop the calls, and the model would learn
    empty answers): it must render a probe conversation's tools, tool call and tool result."""
    try:
        text = tokenizer.apply_chat_template(_PROBE, tools=_PROBE_TOOLS, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - templates raise their own errors
        text, refused = "", f" (it raised: {str(exc)[:160]})"
    else:
        refused = ""
    missing = [part for part, marker in _PROBE_PARTS.items() if marker not in text]
    if missing:
        raise TrainError(
            f"{where} holds tool-calling conversations, but the chat template does not render "
            f"{', '.join(missing)}{refused}; pass --chat-template FILE with a template that supports tools "
            f"(apply_chat_template(..., tools=...)), e.g. the one of a tool-calling instruct model"
        )


# One exchange rendered to see where a template puts the assistant's header and its end of turn.
_PROBE_EXCHANGE = [{"role": "user", "content": "probe question"}, {"role": "assistant", "content": "probe answer"}]


def refuse_new_run(said: str, resuming: bool) -> None:
    """A check of the data that this version added: a new run is refused; a run resuming a checkpoint is warned,
    as it trained so from its start and the fix would change its data, which a resume refuses."""
    if not resuming:
        raise TrainError(said)
    log(f"WARNING: {said} (a new run would be refused; this one resumes as it began)")


def check_generation_prompt(tokenizer: Any, where: str, pairs: bool = False, resuming: bool = False) -> None:
    """Refuse a chat template without an add_generation_prompt branch whose assistant turns open with a header
    (Vicuna's `ASSISTANT:`, a ChatML loop that writes `<|im_start|>assistant`): the trained span of a turn starts
    where the generation prompt ends, so the header would carry loss, against --loss-on assistant's promise. A
    template that writes the header after every user turn (the same render either way, nothing before the answer)
    and one that refuses the probe pass. Also one whose generation prompt is not where the reply begins in the
    render of a whole conversation (DeepSeek-R1's `<think>\\n`): every conversation would be a counted skip. A run
    resuming a checkpoint is warned, not stopped: it trained so from its start, and either fix changes its data,
    which a resume refuses."""
    asked = _PROBE_EXCHANGE[:1]
    try:
        prompt, plain = (
            tokenizer.apply_chat_template(asked, tokenize=False, add_generation_prompt=g) for g in (True, False)
        )
        whole = tokenizer.apply_chat_template(_PROBE_EXCHANGE, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses the probe is judged on the data's own conversations
        return
    header = whole[len(prompt) :].partition(_PROBE_EXCHANGE[1]["content"])[0] if whole.startswith(prompt) else ""
    shared = len(os.path.commonprefix([prompt, whole]))
    said = ""
    if prompt[shared:].strip():  # the generation prompt is not where the reply begins in the whole render
        said = (
            f"{where}: the chat template's generation prompt ends with {prompt[shared:]!r}, which its render of a "
            f"conversation with the reply does not hold there ({whole[shared : shared + 40]!r} follows; a "
            "DeepSeek-R1-style template opens a generated reply with a think block and leaves it out of the rendered "
            "conversation), so no reply's trained span can be placed and every conversation "
            f"{'is' if resuming else 'would be'} skipped; pass --chat-template FILE with a template whose assistant turns begin with its generation "
            "prompt (for R1, render '<think>\\n' before each reply's content)"
            + ("" if pairs else ", or --loss-on all to train every token")
        )
    elif prompt == plain and header.strip():
        said = (
            f"{where}: the chat template renders no generation prompt (add_generation_prompt changes nothing), so "
            f"the assistant header {header.strip()!r} {'is' if resuming else 'would be'} trained as part of every "
            "reply; pass --chat-template FILE with a template that writes the header when add_generation_prompt is "
            "true (as the templates of instruct models do)"
            + ("" if pairs else ", or --loss-on all to train every token")
        )
    if said:
        refuse_new_run(said, resuming)


def uses_tools(split: Any) -> bool:
    """Whether a conversation split offers tools or has tool turns or tool calls, read from its Arrow columns
    (no rows decoded)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = split.data.table if hasattr(split, "data") else split
    if "tools" in table.column_names and table.column("tools").null_count < len(table):
        return True
    for turns, names in _turn_chunks(table):
        role_type = turns.field("role").type if "role" in names else None
        if role_type is not None and (pa.types.is_string(role_type) or pa.types.is_large_string(role_type)):
            roles = pc.utf8_lower(pc.utf8_trim_whitespace(turns.field("role")))
            if pc.any(pc.is_in(roles, value_set=pa.array(TOOL_RESULT_ROLES + TOOL_CALL_ROLES))).as_py():
                return True
        for field in ("tool_calls", "function_call"):
            if field in names and turns.field(field).null_count < len(turns):
                calls = turns.field(field)
                if not pa.types.is_list(calls.type) or pc.any(pc.greater(pc.list_value_length(calls), 0)).as_py():
                    return True
    return False


def _turn_chunks(table: Any) -> Iterator[tuple[Any, set[str]]]:
    """(the turns of a chunk of the `messages` column, flattened into one struct array; its field names)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if "messages" not in table.column_names:
        return
    for chunk in table.column("messages").chunks:
        turns = pc.list_flatten(chunk)
        if len(turns) and pa.types.is_struct(turns.type):
            yield turns, {turns.type.field(i).name for i in range(turns.type.num_fields)}


def reasoning_keys(split: Any) -> set[str]:
    """The REASONING_KEYS under which some turn of a conversation split gives reasoning apart from its content (a
    non-blank string), read from its Arrow columns (no rows decoded)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    found = set()
    for turns, names in _turn_chunks(split.data.table if hasattr(split, "data") else split):
        for key in (key for key in REASONING_KEYS if key in names and key not in found):
            values = turns.field(key)
            if values.null_count == len(values) or not (
                pa.types.is_string(values.type) or pa.types.is_large_string(values.type)
            ):
                continue
            if pc.any(pc.greater(pc.utf8_length(pc.utf8_trim_whitespace(values)), 0)).as_py():
                found.add(key)
    return found


def check_reasoning_support(tokenizer: Any, where: str, keys: set[str], resuming: bool = False) -> None:
    """Refuse a chat template that renders none of the `keys` an assistant turn's reasoning is given under apart
    from its content (transformers fills reasoning_content and thinking from the others for the template, where its
    version does): every reasoning trace would be dropped, and the model trained to answer without them. A run
    resuming a checkpoint is warned, not stopped: it trained so from its start."""

    def renders(key: str) -> bool:
        exchange = [_PROBE_EXCHANGE[0], {**_PROBE_EXCHANGE[1], key: "probe reasoning"}]
        try:
            return "probe reasoning" in tokenizer.apply_chat_template(exchange, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that refuses the probe is judged on the data's own conversations
            return True

    if not keys or any(renders(key) for key in sorted(keys)):
        return
    said = (
        f"{where} holds assistant turns with reasoning given apart from their content (under {', '.join(sorted(keys))}), "
        f"which the chat template does not render: every trace {'is' if resuming else 'would be'} dropped from "
        "training. Pass --chat-template FILE with a template that renders message.reasoning_content (Qwen3's, GLM's) "
        "or message.thinking (gpt-oss's), or make the data again with the reasoning inside the content (e.g. "
        "<think>...</think> before the answer)"
    )
    refuse_new_run(said, resuming)


def chat_template_hash(tokenizer: Any) -> str:
    template = json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True)
    return hashlib.sha256(template.encode()).hexdigest()[:16]


def use_template_file(cfg: TrainConfig, tokenizer: Any) -> None:
    """--chat-template FILE replaces the tokenizer's own template (and is exported with it)."""
    if cfg.chat_template:
        tokenizer.chat_template = Path(cfg.chat_template).read_text(encoding="utf-8")


def warn_unused_template(cfg: TrainConfig, templated: bool) -> None:
    """--chat-template with data the template renders nothing of (`templated`: conversations, pairs or prompts) and
    no conversations in --sample-prompts: said, since the export then keeps the model folder's own template."""
    if cfg.chat_template and not templated and not (cfg.sample_prompts and conversation_prompts(cfg.sample_prompts)):
        log(
            f"WARNING: --chat-template {cfg.chat_template} is not used: the data is plain text (no conversations, "
            "pairs or prompts) and --sample-prompts holds no conversations, so nothing is rendered with it and the "
            "export keeps the model folder's own template; leave it out, or train on conversations"
        )


def chat_encoder(
    cfg: TrainConfig,
    tokenizer: Any,
    columns: list[str],
    tools: bool = False,
    dataset: str = "",
    pairs: bool = False,
    reasoning: set[str] | None = None,
) -> ChatEncoder | None:
    """A ChatEncoder when the dataset holds conversations (a `messages` column), or preference pairs or examples
    (`pairs`: rendered with the template too), after checking the template (and its tool support when the dataset
    uses tools, its reasoning support when turns give reasoning apart, under the keys `reasoning`)."""
    if dataset_kind(columns) != "messages" and not pairs:
        return None
    dataset = dataset or cfg.datasets_label
    use_template_file(cfg, tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        what = (
            "preference data, whose prompts and responses (strings too: one turn each) are"
            if pairs
            else ("conversations, which are")
        )
        raise TrainError(
            f"--dataset-name {dataset} holds {what} rendered with the chat template, but the tokenizer of "
            f"--model-name {cfg.model_name} has none; pass --chat-template FILE (a Jinja chat template, e.g. the one "
            f"of the model's instruct version)"
        )
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise TrainError(f"--model-name {cfg.model_name}: chat training needs a fast (Rust) tokenizer, tokenizer.json")
    if tools:
        check_tool_support(tokenizer, f"--dataset-name {dataset}")
    resuming = resumes(cfg)  # the checks below warn a run that began before them
    if reasoning:
        check_reasoning_support(tokenizer, f"--dataset-name {dataset}", reasoning, resuming)
    if cfg.loss_on == "assistant" or pairs:
        check_generation_prompt(tokenizer, f"--dataset-name {dataset}", pairs, resuming)
    return ChatEncoder(tokenizer, cfg.loss_on)


# The chat templates a run rendered its data with, in its checkpoint's data_format (plan.load_source, prompt_source)
TRAINED_TEMPLATES = re.compile(r"(?:chat|pairs|prompts):([0-9a-f]{16})")


def export_tokenizer(cfg: TrainConfig, model_dir: Path, saved: dict) -> Any:
    """--export-only's tokenizer, as the run's own export wrote it, without reading the dataset: the model folder's,
    with the chat template the run's tokenizer held (`saved`: the checkpoint's fingerprint keeps it, so a moved or
    edited --chat-template file changes nothing; a file that differs from it is warned about). A checkpoint of an
    earlier version keeps only data_format: the file is applied where the run applied it (conversations, pairs,
    and GRPO's prompts of either kind), and a template other than the one the run trained with is warned about."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    data_format = saved.get("data_format", "")
    trained = sorted(set(TRAINED_TEMPLATES.findall(data_format)))
    if "chat_template" in saved:
        tokenizer.chat_template = saved["chat_template"]
        given = Path(cfg.chat_template) if cfg.chat_template else None
        if (
            given
            and trained
            and not chat_template_problems(given)
            and given.read_text(encoding="utf-8") != saved["chat_template"]
        ):
            log(
                f"WARNING: --export-only: --chat-template {given} is not the template the run trained with "
                f"({', '.join(trained)}); the export writes the run's, kept in its checkpoint"
            )
        return tokenizer
    if cfg.chat_template and (trained or "prompts:" in data_format):
        if problems := chat_template_problems(Path(cfg.chat_template)):
            raise TrainError(f"{problems[0]}; the run rendered its data with it, and the export writes it")
        use_template_file(cfg, tokenizer)
    if trained and chat_template_hash(tokenizer) not in trained:
        now = f"--chat-template {cfg.chat_template}" if cfg.chat_template else "the model folder's own"
        log(
            f"WARNING: --export-only: the run trained with chat template {', '.join(trained)}, and the exported "
            f"tokenizer gets {chat_template_hash(tokenizer)} ({now}): the model would be served with a template it "
            "did not learn; pass the run's --chat-template FILE and export again"
        )
    return tokenizer


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The token the chat template closes an assistant turn with, where that is one special token other than EOS
    (ChatML's <|im_end|>, Llama 3's <|eot_id|>, Gemma's <end_of_turn>); None otherwise (no template, a template
    that ends turns with EOS, or with plain text)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        whole = tokenizer.apply_chat_template(_PROBE_EXCHANGE, tokenize=False)
        tail = whole.rpartition(_PROBE_EXCHANGE[1]["content"])[2].strip()
    except Exception:  # noqa: BLE001 - a template that refuses the probe: nothing to add
        return None
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail else []
    if not ids or ids[0] == tokenizer.eos_token_id or ids[0] not in tokenizer.all_special_ids:
        return None
    return int(ids[0])


def add_end_of_turn_stop(folder: Path, tokenizer: Any, model_config: Any) -> None:
    """Make generate() stop at the end of a reply: the template's end-of-turn token (end_of_turn_id) joins the
    eos_token_id of FOLDER/generation_config.json (one is written from the model's config where the folder has
    none). A base model fine-tuned with ChatML whose EOS is another token otherwise talks on past its turn."""
    stop = end_of_turn_id(tokenizer)
    if stop is None:
        return
    path = folder / "generation_config.json"
    names = ("bos_token_id", "eos_token_id", "pad_token_id")  # what transformers takes from the model's config
    kept = {name: getattr(model_config, name) for name in names if getattr(model_config, name, None) is not None}
    settings = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else kept
    eos = settings.get("eos_token_id")
    ids = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
    if stop in ids:
        return
    settings["eos_token_id"] = [*ids, stop]
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    log(
        f"generation_config.json: eos_token_id {ids} + {stop} ({tokenizer.convert_ids_to_tokens(stop)}, the chat "
        "template's end of turn), so generate() stops at the end of a reply"
    )
