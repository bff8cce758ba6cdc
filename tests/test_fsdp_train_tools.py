"""Tool-calling conversations: data_hf.py's tool schema rendered by templates with tool support, the assistant's
calls and answers trained and the tool results not, per template family; a template without tool support refused
naming --chat-template; a real run on a converted tool-calling dataset."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

import data_hf
from fsdp_lib.data.chat import ChatEncoder, check_tool_support, uses_tools
from fsdp_lib.errors import TrainError
from fsdp_lib.records.tool_calls import template_messages, template_tools
from tests.fsdp_helpers import make_chat_model, output_of, read_metrics, run_trainer, trainer_args

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The temperature of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
CITIES = ["Paris", "Vesk", "Oslo", "Lima", "Rome", "Kyiv"]


def tool_records(n: int, seed: int = 0) -> list[dict]:
    """Records as people have them, alternating the OpenAI and the ShareGPT/glaive shape: a user asks a city's
    temperature, the assistant calls get_weather, the tool answers, the assistant reports it; every third record
    is a plain exchange without tools."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        city, temp = rng.choice(CITIES), rng.randrange(-5, 35)
        question, answer = f"How warm is it in {city}?", f"It is {temp} degrees in {city}."
        if i % 3 == 2:
            records.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "?"}]})
        elif i % 2:
            records.append({"conversations": [
                {"from": "human", "value": question},
                {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": city}})},
                {"from": "observation", "value": json.dumps({"temp": temp})},
                {"from": "gpt", "value": answer}], "tools": json.dumps([WEATHER["function"]])})  # fmt: skip
        else:
            records.append({"messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": None, "tool_calls": [{"id": f"call{i:05d}", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                {"role": "tool", "tool_call_id": f"call{i:05d}", "content": json.dumps({"temp": temp})},
                {"role": "assistant", "content": answer}], "tools": [WEATHER]})  # fmt: skip
    return records


def convert(records: list[dict], folder: Path, *flags: str) -> Path:
    raw = folder / "raw"
    raw.mkdir(parents=True)
    (raw / "tools.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    out = folder / "dataset"
    assert data_hf.main(["--data_folder", str(raw), "--save_dir", str(out), "--format", "chat", *flags]) == 0
    return out


@pytest.fixture(scope="module")
def tool_dataset(tmp_path_factory) -> Path:
    return convert(tool_records(96), tmp_path_factory.mktemp("tools"), "--val-fraction", "0.1")


@pytest.fixture(scope="module")
def tool_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tool_models")
    return {name: make_chat_model(root / name, name) for name in ("qwen2.5_tools", "llama3.1_tools", "qwen2.5")}


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


# What each template renders for an assistant turn after its generation prompt: the tokens that carry loss.
def _qwen_call(call: dict) -> str:
    return f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {json.dumps(call["arguments"])}}}\n</tool_call><|im_end|>\n'


def _llama_call(call: dict) -> str:
    return f'{{"name": "{call["name"]}", "parameters": {json.dumps(call["arguments"])}}}<|eot_id|>'


TRAINED = {
    "qwen2.5_tools": {"call": _qwen_call, "text": lambda content: content + "<|im_end|>\n"},
    "llama3.1_tools": {"call": _llama_call, "text": lambda content: content.strip() + "<|eot_id|>"},
}


def expected_trained(messages: list[dict], template: str) -> str:
    spans = []
    for turn in messages:
        if turn["role"] == "assistant" and turn.get("tool_calls"):
            spans.append(TRAINED[template]["call"](turn["tool_calls"][0]["function"]))
        elif turn["role"] == "assistant":
            spans.append(TRAINED[template]["text"](turn["content"]))
    return "".join(spans)


@pytest.mark.parametrize("template", sorted(TRAINED))
def test_trained_tokens_are_the_assistant_calls_and_answers_not_the_tool_results(template, tool_dataset, tool_models):
    from datasets import load_from_disk

    tokenizer = _tokenizer(tool_models[template])
    rows = load_from_disk(str(tool_dataset))["train"]
    assert uses_tools(rows)
    skipped: dict[str, int] = {}
    encoded = ChatEncoder(tokenizer, "assistant").encode(rows["messages"], skipped, None, rows["tools"])
    assert not skipped and len(encoded) == len(rows)
    for row, (ids, mask) in zip(rows, encoded):
        ids, messages, tools = np.asarray(ids), template_messages(row["messages"]), template_tools(row["tools"])
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        assert tokenizer.decode(ids[mask == 1]) == expected_trained(messages, template)
        # one run of trained tokens per assistant turn: the tool result between a call and the answer is not trained
        runs = np.count_nonzero(np.diff(np.concatenate([[0], mask, [0]])) == 1)
        assert runs == sum(turn["role"] == "assistant" for turn in messages)
        if tools:
            result = next(turn["content"] for turn in messages if turn["role"] == "tool")
            assert result in tokenizer.decode(ids) and result not in tokenizer.decode(ids[mask == 1])
            assert "The temperature of a city" in tokenizer.decode(ids[mask == 0])


def test_a_template_that_refuses_a_conversation_skips_only_that_one(tool_models):
    """llama3.1 calls one tool at a time: a turn with two calls is a counted skip naming the template's reason."""
    two_calls = [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}} for c in CITIES[:2]
    ]
    rows = [
        [{"role": "user", "content": "Paris and Vesk?"}, {"role": "assistant", "content": "", "tool_calls": two_calls}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    ]
    skipped: dict[str, int] = {}
    encoded = ChatEncoder(_tokenizer(tool_models["llama3.1_tools"]), "assistant").encode(
        rows, skipped, None, [json.dumps([WEATHER]), None]
    )
    assert len(encoded) == 1 and list(skipped.values()) == [1] and "single tool-calls" in next(iter(skipped))


def test_a_template_without_tool_support_is_refused_naming_the_flag(tool_models):
    check_tool_support(_tokenizer(tool_models["qwen2.5_tools"]), "--dataset-name x")
    check_tool_support(_tokenizer(tool_models["llama3.1_tools"]), "--dataset-name x")
    with pytest.raises(TrainError) as caught:
        check_tool_support(_tokenizer(tool_models["qwen2.5"]), "--dataset-name x")
    message = str(caught.value)
    assert "--chat-template" in message and "the tools offered" in message and "tool calls" in message


@pytest.mark.parametrize("template", sorted(TRAINED))
def test_tool_turns_of_a_dataset_made_elsewhere_train_as_data_hf_stores_them(template, tmp_path, tool_models):
    """A `messages` dataset made without data_hf.py (save_to_disk, the hub) with glaive's function_call/observation
    turns, or OpenAI's legacy function_call field and function role: the template rendered neither the call nor the
    result (the answer trained without them) and uses_tools missed them, so the tool-support check never ran. They
    are read as data_hf.py reads them: the same ids and the same mask."""
    from datasets import Dataset, load_from_disk

    glaive = [
        {"role": "user", "content": "How warm is it in Oslo?"},
        {"role": "function_call", "content": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})},
        {"role": "observation", "content": json.dumps({"temp": 20})},
        {"role": "assistant", "content": "It is 20 degrees in Oslo."},
    ]
    legacy = [
        {"role": "user", "content": "How warm is it in Lima?"},
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "get_weather", "arguments": '{"city": "Lima"}'},
        },
        {"role": "function", "name": "get_weather", "content": json.dumps({"temp": 25})},
        {"role": "assistant", "content": "It is 25 degrees in Lima."},
    ]
    tools = json.dumps([WEATHER])
    stored = load_from_disk(str(convert([{"messages": m, "tools": tools} for m in (glaive, legacy)], tmp_path)))
    elsewhere = [glaive, legacy] if "Lima" not in stored[0]["messages"][0]["content"] else [legacy, glaive]
    assert uses_tools(Dataset.from_list([{"messages": glaive}])) and uses_tools(
        Dataset.from_list([{"messages": legacy}])
    )
    tokenizer = _tokenizer(tool_models[template])
    skipped: dict[str, int] = {}
    reference = ChatEncoder(tokenizer, "assistant").encode(stored["messages"], skipped, None, stored["tools"])
    encoded = ChatEncoder(tokenizer, "assistant").encode(elsewhere, skipped, None, [tools, tools])
    assert len(encoded) == 2 and [(list(i), list(m)) for i, m in encoded] == [(list(i), list(m)) for i, m in reference]
    assert not skipped
    assert "20" in tokenizer.decode(encoded[0][0]) or "20" in tokenizer.decode(encoded[1][0])


def test_plain_conversations_do_not_use_tools(tmp_path):
    plain = convert(tool_records(9)[2::3], tmp_path)
    from datasets import load_from_disk

    assert not uses_tools(load_from_disk(str(plain)))


def test_run_on_tool_calls_trains_and_a_template_without_tools_stops_it(tmp_path, tool_dataset, tool_models):
    """A real run on the converted dataset learns (the loss falls); the same data with a template that cannot
    render tools exits before training, naming the flag."""
    args = trainer_args("tools", tool_dataset, tool_models["qwen2.5_tools"], tmp_path)
    result = run_trainer(args + ["-b", "2", "--seq-length", "128", "--max-steps", "8", "--lr", "3e-3"], nproc=1)
    out = output_of(result)
    assert result.returncode == 0, out
    # blocks of 128 tokens: the tiny tokenizer spends several on the tools' system prompt, so some carry no loss
    assert sum(row["trained_tokens"] for row in read_metrics(tmp_path / "tools")) > 0
    lines = [json.loads(line) for line in (tmp_path / "tools" / "metrics.jsonl").read_text().splitlines()]
    val = [row["val_loss"] for row in lines if "val_loss" in row]
    assert len(val) >= 2 and val[-1] < val[0]
    refused = run_trainer(trainer_args("no_tools", tool_dataset, tool_models["qwen2.5"], tmp_path), nproc=1)
    out = output_of(refused)
    assert refused.returncode != 0 and "tool-calling conversations" in out and "--chat-template" in out


def test_unreadable_tool_use_skips_only_its_own_conversation(tool_models):
    """A datasets-native row with tool calls or tools that are not JSON (data_hf.py never writes one) is a counted
    skip; the rows after it keep their own tools."""
    tokenizer = _tokenizer(tool_models["qwen2.5_tools"])
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    bad_call = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": "{oops"}]
    skipped: dict[str, int] = {}
    tools = ["[oops", None, json.dumps([WEATHER]), None]
    encoded = ChatEncoder(tokenizer, "assistant").encode([plain, bad_call, plain, plain], skipped, None, tools)
    assert len(encoded) == 2 and sum(skipped.values()) == 2 and all("unreadable tool use" in r for r in skipped)
    with_tools, without = (tokenizer.decode(ids) for ids, _ in encoded)
    assert "The temperature of a city" in with_tools and "The temperature of a city" not in without
