"""Tests for data_hf.py --format prompts (the prompts of fsdp_train.py --objective grpo): every record shape becomes
prompt turns plus the record's other fields as JSON, bad records are counted skips by reason, the result is the
same with worker processes and in pieces, the validation split is by record, and the trainer reads the fields back
as the columns they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from datasets import load_from_disk

from fsdp_lib.convert import reading
from fsdp_lib.data.prompts import PromptSet, prompt_text
from fsdp_lib.records.prompts import PromptRecord, parse_prompt_record
from fsdp_lib.records.reasons import BadRecord
from tests.test_data_hf_preference import convert, jsonl, summary_of, write_files

GOOD = [
    ({"question": "What is 2 plus 3?", "answer": "5", "id": 1}, [("user", "What is 2 plus 3?")], {"answer": "5", "id": 1}),
    ({"Problem": "7*6?", "solution": "\\boxed{42}"}, [("user", "7*6?")], {"solution": "\\boxed{42}"}),
    ({"prompt": "plain", "system": "Be brief.", "tests": [[1, 2]]}, [("system", "Be brief."), ("user", "plain")],
     {"tests": [[1, 2]]}),
    ({"prompt": [{"from": "human", "value": "hi"}], "meta": {"a": None}}, [("user", "hi")], {"meta": {"a": None}}),
    ({"instruction": "Add", "input": "1 and 1", "output": "2"}, [("user", "Add\n\n1 and 1")], {"output": "2"}),
    # a null prompt is no prompt (the question is); a conversation is a prompt up to its last user turn, its last
    # reply the answer unless the record has a reference of its own
    ({"prompt": None, "question": "q", "answer": "a"}, [("user", "q")], {"answer": "a"}),
    ({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "2+2?"},
                   {"role": "assistant", "content": "4"}]}, [("system", "S"), ("user", "2+2?")], {"answer": "4"}),
    ({"conversations": [{"from": "human", "value": "hi"}], "solution": "x"}, [("user", "hi")], {"solution": "x"}),
]  # fmt: skip
BAD = [
    ({"chosen": "x", "rejected": "y"}, "not_a_prompt_record"),
    ("just a string", "not_a_prompt_record"),
    ({"question": 5}, "non_string_content"),
    ({"messages": "a string"}, "non_string_content"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "prompt_not_ending_with_user"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "prompt_not_ending_with_user"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]}, "misplaced_system_turn"),
    ({"question": "  "}, "empty_prompt"),
    ({"prompt": "a", "Prompt": "b"}, "ambiguous_keys"),
    ({"prompt": [{"role": "wizard", "content": "q"}]}, "unknown_role"),
    # the trainer calls f(prompts, completions, **columns): a kept field of either name could not reach it
    ({"question": "q", "completions": ["a", "b"]}, "reward_argument_field"),
    ({"prompt": "q", "prompts": "p"}, "reward_argument_field"),
]  # fmt: skip


@pytest.mark.parametrize(("record", "prompt", "columns"), GOOD)
def test_every_prompt_shape_keeps_the_other_fields(record: dict, prompt: list, columns: dict) -> None:
    got = parse_prompt_record(record)
    assert got.prompt == tuple(prompt) and json.loads(got.columns_json) == columns


@pytest.mark.parametrize(("record", "reason"), BAD)
def test_bad_prompt_records_have_their_reason(record: object, reason: str) -> None:
    with pytest.raises(BadRecord) as err:
        parse_prompt_record(record)
    assert err.value.reason == reason


def prompts_corpus(root: Path) -> Path:
    good = [record for record, _, _ in GOOD]
    return write_files(root, {
        "a.jsonl": jsonl(good[:2] + [bad for bad, _ in BAD] + good[2:]),
        "b.json": json.dumps(good),
        "c.yaml": yaml.safe_dump_all(good),
        "notes.txt": "a text file is not read with --format prompts\n",
    })  # fmt: skip


def test_format_prompts_writes_prompt_turns_and_fields_and_counts_bad_records(tmp_path: Path, capsys) -> None:
    assert convert(prompts_corpus(tmp_path / "raw"), tmp_path / "out", "--format", "prompts") == 0
    dataset = load_from_disk(str(tmp_path / "out"))
    assert dataset.column_names == ["prompt", "columns_json"] and len(dataset) == 3 * len(GOOD)
    first = [{"role": r, "content": c} for r, c in GOOD[0][1]]
    assert dataset[0]["prompt"] == first and json.loads(dataset[0]["columns_json"]) == GOOD[0][2]
    summary = summary_of(tmp_path / "out")
    assert summary["column"] == "prompts" and summary["prompts_found"] == 3 * len(GOOD)
    expected = {reason: sum(1 for _, r in BAD if r == reason) for _, reason in BAD}
    assert summary["counts_by_reason"] == {**expected, "text_file_in_prompts_run": 1}
    assert f"-> {3 * len(GOOD)} prompts" in capsys.readouterr().out


def test_prompts_are_the_same_with_workers_in_pieces_and_split_by_record(tmp_path: Path, monkeypatch) -> None:
    raw = write_files(
        tmp_path / "raw", {"big.jsonl": jsonl([{"question": f"q{i}?", "answer": str(i)} for i in range(300)])}
    )
    assert convert(raw, tmp_path / "one", "--format", "prompts", "--val-fraction", "0.2") == 0
    monkeypatch.setattr(reading, "MIN_PIECE_BYTES", 1024)  # the file is read in pieces by two workers
    args = ("--format", "prompts", "--val-fraction", "0.2", "--num-proc", "2")
    assert convert(raw, tmp_path / "two", *args) == 0
    one, two = load_from_disk(str(tmp_path / "one")), load_from_disk(str(tmp_path / "two"))
    for split in ("train", "validation"):
        assert sorted(map(json.dumps, one[split])) == sorted(map(json.dumps, two[split])) and len(one[split]) > 20


def test_the_trainer_reads_the_fields_back_as_columns(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from fsdp_lib.data.prompts import load_prompts
    from tests.fsdp_helpers import make_model

    assert convert(prompts_corpus(tmp_path / "raw"), tmp_path / "out", "--format", "prompts") == 0
    tokenizer = AutoTokenizer.from_pretrained(make_model(tmp_path / "model"))
    prompts = load_prompts(load_from_disk(str(tmp_path / "out")), tokenizer, 1000, "out", "train")
    assert isinstance(prompts, PromptSet) and len(prompts) == 3 * len(GOOD) and not prompts.conversational
    batch = prompts.gather([0, 2, 4])
    assert batch.columns["answer"] == ["5", None, None] and batch.columns["tests"] == [None, [[1, 2]], None]
    assert batch.columns["output"] == [None, None, "2"] and "columns_json" not in batch.columns
    # every column of the set in every batch, None where no row of it has the field (a reward naming one
    # raised "missing 1 required positional argument" in the batches without it)
    assert set(prompts.gather([0]).columns) == set(prompts.columns) == set(batch.columns)
    assert prompts.gather([0]).columns["output"] == [None]
    # without a chat template: system + user as plain text; a string as it is; a turn list with a template
    assert prompt_text([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], tokenizer) == (
        "S\n\nU",
        False,
    )
    parts = [{"role": "human", "content": [{"type": "text", "text": "hi"}]}]  # without a template too
    assert prompt_text(parts, tokenizer) == ("hi", False)
    assert prompt_text("as is", tokenizer) == ("as is", False)
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    assert prompt_text([{"role": "user", "content": "U"}], tokenizer) == ("<user>U<assistant>", True)
    # a prompt made elsewhere: text parts joined and role aliases mapped (the template printed the list's repr)
    parts = [{"role": "human", "content": [{"type": "text", "text": "U"}, {"type": "text", "text": "V"}]}]
    assert prompt_text(parts, tokenizer) == ("<user>U\nV<assistant>", True)
    with pytest.raises(ValueError, match="a prompt's turn 1: content part 1 is 'image_url', not text"):
        prompt_text([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], tokenizer)
    assert isinstance(parse_prompt_record({"prompt": "x"}), PromptRecord)
    # every prompt too long: still conversational prompts (the log said "0 plain-text prompts")
    import datasets

    chats = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "two plus two"}]}] * 2)
    skipped = load_prompts(chats, tokenizer, 1, "d", "train")
    assert len(skipped) == 0 and skipped.conversational
    # more than --max-skipped-fraction skipped stops the run, as for pairs (GRPO only warned, and trained on what
    # was left of the prompts)
    from fsdp_lib.errors import TrainError

    with pytest.raises(TrainError, match=r"2 of 2 prompts \(100.0%\) of the train split of d are skipped, more than "
                       "--max-skipped-fraction 0.05; the most common reason .2.: longer than 1 tokens"):  # fmt: skip
        load_prompts(chats, tokenizer, 1, "d", "train", 0.05)
    # turn-list prompts without a template reach the reward functions as the text the model continued, as their
    # completions are text (the functions got lists of messages beside strings)
    tokenizer.chat_template = None
    plain = load_prompts(chats, tokenizer, 1000, "d", "train")
    assert not plain.conversational and plain.gather([0, 1]).prompts == ["two plus two"] * 2


def test_prompts_tokenised_in_batches_equal_one_at_a_time_and_skips_are_counted(tmp_path: Path, monkeypatch) -> None:
    """load_prompts tokenises TOKENIZE_BATCH prompts per call (here 3, so batches end mid-way): the ids equal the
    tokenizer's one prompt at a time, in row order; an empty prompt and one over the length limit are counted
    skips with their first row."""
    import datasets
    from transformers import AutoTokenizer

    from fsdp_lib.data import cache as cache_module
    from fsdp_lib.data import prompts as prompts_module
    from tests.fsdp_helpers import make_model

    tokenizer = AutoTokenizer.from_pretrained(make_model(tmp_path / "model"))
    texts = ["3 plus 4 is", "", "a much longer prompt " * 30, "x", "the sum of 1 and 2", "", "what is 7?", "ok"]
    split = datasets.Dataset.from_dict({"prompt": texts, "answer": [str(i) for i in range(len(texts))]})
    monkeypatch.setattr(prompts_module, "TOKENIZE_BATCH", 3)
    logged: list[str] = []
    monkeypatch.setattr(cache_module, "log", logged.append)  # the skips are reported as a token cache's are
    got = prompts_module.load_prompts(split, tokenizer, 40, "d", "train")
    kept = [i for i, t in enumerate(texts) if t and len(tokenizer(t)["input_ids"]) <= 40]
    assert got.rows.tolist() == kept and kept == [0, 3, 4, 6, 7]
    assert got.ids == [tokenizer(texts[i])["input_ids"] for i in kept]
    assert "skipped 2 prompt(s) of the train split of d: an empty prompt (first: row 1)" in logged, logged
    assert any("skipped 1 prompt(s) of the train split of d: longer than 40 tokens" in line and "first: row 2" in line
               for line in logged), logged  # fmt: skip


@pytest.mark.parametrize(
    "columns,message",
    [
        ({"columns_json": ['{"answer": "2"}', "{bad"]}, "row 1 of the train split's columns_json column is '{bad'"),
        ({"columns_json": ["[1, 2]", "{}"]}, "row 0 of the train split's columns_json column is '[1, 2]'"),
        ({"completions": ["old", "older"]}, "have a column 'completions', the name of a reward function's own"),
        ({"columns_json": ['{"prompts": 1}', "{}"]}, "have a column 'prompts'"),
    ],
)
def test_reward_columns_that_cannot_reach_the_reward_functions_are_refused_at_load(columns, message) -> None:
    """A columns_json that is not a JSON object, or a column named like a reward function's own argument, stops the
    run when the prompts load (before the model), naming the row or the column; not at the first reward call."""
    import datasets

    from fsdp_lib.data.prompts import load_prompts
    from fsdp_lib.errors import TrainError

    split = datasets.Dataset.from_dict({"prompt": ["What is 1 plus 1?", "And 2 plus 2?"], **columns})
    with pytest.raises(TrainError, match="^--dataset-name d: ") as refused:
        load_prompts(split, None, 40, "d", "train")
    assert message in str(refused.value), refused.value
