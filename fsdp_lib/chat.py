"""Conversations to trained tokens: rendering with the tokenizer's chat template and marking the assistant tokens
that carry loss (--loss-on), for datasets with a `messages` column."""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fsdp_lib.config import TrainConfig
from fsdp_lib.errors import TrainError


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

    A row batch is rendered in two apply_chat_template calls (every prefix without, then with, the generation
    prompt): one call per render costs ~40% more (bench/bench_chat_tokenize.py). When a batched call raises,
    the batch is rendered conversation by conversation, so a conversation the template refuses is one counted skip.
    """

    tokenizer: Any
    loss_on: str  # "assistant" or "all"
    expanded: int = 0  # conversations trained as one sample per assistant turn (see above), for the log
    _empty_prompt: str | None = ""  # render([], add_generation_prompt=True); "" = not tried yet, None = refused

    VERSION = 2  # of the masks this class writes: part of the token cache key

    def render(self, conversations: list[list[dict]], generation_prompt: bool) -> list[str]:
        try:
            return self.tokenizer.apply_chat_template(
                conversations, tokenize=False, add_generation_prompt=generation_prompt
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

    def render_prefixes(self, conversations: list[list[dict]]) -> list[dict[tuple[int, bool], str]]:
        """Every prefix render of every conversation, batched; per conversation (a ChatFormatError in its place)
        when the template refuses one of them."""
        wanted = [
            (row, n, prompt) for row, messages in enumerate(conversations) for n, prompt in self.prefixes(messages)
        ]
        rendered: list[dict[tuple[int, bool], str] | ChatFormatError] = [{} for _ in conversations]
        try:
            for prompt in (False, True):
                keys = [(row, n) for row, n, p in wanted if p == prompt]
                if keys:
                    texts = self.render([conversations[row][:n] for row, n in keys], prompt)
                    for (row, n), text in zip(keys, texts):
                        rendered[row][(n, prompt)] = text
        except ChatFormatError:
            for row, messages in enumerate(conversations):
                try:
                    for n, prompt in self.prefixes(messages):
                        rendered[row][(n, prompt)] = self.render([messages[:n]], prompt)[0]
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
        spans = [self.turn_span(messages, i, renders) for i in turns]
        if all(full.startswith(renders[(i + 1, False)]) for i in turns):
            return [(full, spans)]
        self.expanded += 1
        return [(renders[(i + 1, False)], [span]) for i, span in zip(turns, spans)]

    def encode(
        self, conversations: list[list[dict]], skipped: dict[str, int], first_skipped: dict[str, int] | None = None
    ) -> list[tuple[list[int], np.ndarray]]:
        """(token ids, trained mask) per sample, in conversation order (one per conversation, or one per assistant
        turn, see samples()); a conversation that cannot be encoded is counted in skipped by reason, and
        first_skipped records the index of the first conversation skipped for each reason."""
        conversations = [list(messages) for messages in conversations]
        texts, all_spans = [], []
        for row, (messages, renders) in enumerate(zip(conversations, self.render_prefixes(conversations))):
            try:
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


def chat_template_hash(tokenizer: Any) -> str:
    template = json.dumps(getattr(tokenizer, "chat_template", None), sort_keys=True)
    return hashlib.sha256(template.encode()).hexdigest()[:16]


def chat_encoder(cfg: TrainConfig, tokenizer: Any, columns: list[str]) -> ChatEncoder | None:
    """A ChatEncoder when the dataset holds conversations (a `messages` column), after checking the template."""
    if "messages" not in columns:
        return None
    if cfg.chat_template:
        tokenizer.chat_template = Path(cfg.chat_template).read_text()
    if not getattr(tokenizer, "chat_template", None):
        raise TrainError(
            f"--dataset-name {cfg.dataset_name} holds conversations, but the tokenizer of --model-name "
            f"{cfg.model_name} has no chat template; pass --chat-template FILE (a Jinja chat template, e.g. the one "
            f"of the model's instruct version)"
        )
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise TrainError(f"--model-name {cfg.model_name}: chat training needs a fast (Rust) tokenizer, tokenizer.json")
    return ChatEncoder(tokenizer, cfg.loss_on)
