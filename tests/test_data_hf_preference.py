"""Tests for data_hf.py --format preference (and --format auto on preference records): every record shape becomes
the same prompt/chosen/rejected message lists, bad records are counted skips by reason, the validation split is by
pair, and auto writes pairs only when every record is one."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import yaml
from datasets import DatasetDict, Features, Value, load_from_disk

from data_hf import main
from fsdp_lib.convert import reading, workers
from fsdp_lib.convert.publish import SUMMARY_NAME
from fsdp_lib.convert.results import REASONS
from fsdp_lib.convert.workers import assign_split
from fsdp_lib.records.dataset import load_text_dataset
from fsdp_lib.records.preference import PreferencePair, parse_preference, preference_json, record_kind
from fsdp_lib.records.reasons import BadRecord
from fsdp_lib.records.schema import PREFERENCE_COLUMNS

Turns = tuple[tuple[str, str], ...]


def write_files(root: Path, files: dict[str, str]) -> Path:
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    return root


def jsonl(records: list[object]) -> str:
    return "".join(json.dumps(record) + "\n" for record in records)


def convert(data: Path, out: Path, *extra: str) -> int:
    workers = [] if "--num-proc" in extra else ["--num-proc", "1"]  # a flag given twice is refused
    return main(["--data_folder", str(data), "--save_dir", str(out), *workers, *extra])


def summary_of(out: Path) -> dict:
    return json.loads((out / SUMMARY_NAME).read_text())


def turns(*pairs: str) -> Turns:
    """turns("user", "hi", "assistant", "hello") -> (("user", "hi"), ("assistant", "hello"))"""
    return tuple(zip(pairs[::2], pairs[1::2], strict=True))


def msg(role: str, content: object) -> dict:
    return {"role": role, "content": content}


def row_of(pair: PreferencePair) -> dict[str, list[dict[str, str]]]:
    """A pair as load_from_disk gives it back."""
    return {name: [msg(r, c) for r, c in getattr(pair, name)] for name in PREFERENCE_COLUMNS}


# The pair every shape below describes (some with a system turn or more context).
Q, GOOD, BAD = "What is 2+2?", "4.", "5."
SIMPLE = PreferencePair(turns("user", Q), turns("assistant", GOOD), turns("assistant", BAD))
WITH_SYSTEM = PreferencePair(turns("system", "Be brief.", "user", Q), SIMPLE.chosen, SIMPLE.rejected)
MULTI_TURN = PreferencePair(
    turns("user", "Hi", "assistant", "Hello!", "user", Q), turns("assistant", GOOD), turns("assistant", BAD)
)
HH_CHOSEN = "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: What is 2+2?\n\nAssistant: 4."

SHAPES = [
    ("standard", {"prompt": Q, "chosen": GOOD, "rejected": BAD}, SIMPLE),
    (
        "conversational",
        {"prompt": [msg("user", Q)], "chosen": [msg("assistant", GOOD)], "rejected": [msg("assistant", BAD)]},
        SIMPLE,
    ),
    (  # UltraFeedback-binarized: chosen/rejected are whole conversations that repeat the prompt
        "ultrafeedback",
        {"prompt": Q, "chosen": [msg("user", Q), msg("assistant", GOOD)],
         "rejected": [msg("user", Q), msg("assistant", BAD)], "score_chosen": 8.0},
        SIMPLE,
    ),
    (  # the prompt repeated by one response only, multi-turn context in the prompt list
        "conversational-repeated-once",
        {"prompt": [msg("user", "Hi"), msg("assistant", "Hello!"), msg("user", Q)],
         "chosen": [msg("user", "Hi"), msg("assistant", "Hello!"), msg("user", Q), msg("assistant", GOOD)],
         "rejected": [msg("assistant", BAD)]},
        MULTI_TURN,
    ),
    (  # a top-level system string; the responses repeat the prompt without it
        "system",
        {"system": "Be brief.", "prompt": [msg("user", Q)], "chosen": [msg("user", Q), msg("assistant", GOOD)],
         "rejected": BAD},
        WITH_SYSTEM,
    ),
    (
        "system-repeated",
        {"prompt": [msg("system", "Be brief."), msg("user", Q)],
         "chosen": [msg("system", "Be brief."), msg("user", Q), msg("assistant", GOOD)],
         "rejected": [msg("system", "Be brief."), msg("user", Q), msg("assistant", BAD)]},
        WITH_SYSTEM,
    ),
    (
        "implicit",
        {"chosen": [msg("user", Q), msg("assistant", GOOD)], "rejected": [msg("user", Q), msg("assistant", BAD)]},
        SIMPLE,
    ),
    (  # a longer shared context, ShareGPT turn keys, and a system string
        "implicit-multi-turn",
        {"system": "Be brief.",
         "chosen": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": Q},
                    {"from": "gpt", "value": GOOD}],
         "rejected": [msg("user", "Hi"), msg("assistant", "Hello!"), msg("user", Q), msg("assistant", BAD)]},
        PreferencePair(turns("system", "Be brief.", *sum(MULTI_TURN.prompt, ())), SIMPLE.chosen, SIMPLE.rejected),
    ),
    ("hh", {"chosen": f"\n\nHuman: {Q}\n\nAssistant: {GOOD}", "rejected": f"\n\nHuman: {Q}\n\nAssistant: {BAD}"}, SIMPLE),
    ("hh-multi-turn", {"chosen": HH_CHOSEN, "rejected": HH_CHOSEN.replace("4.", "5.")}, MULTI_TURN),
    (
        "sharegpt",
        {"conversations": [{"from": "human", "value": Q}], "chosen": {"from": "gpt", "value": GOOD},
         "rejected": {"from": "gpt", "value": BAD}},
        SIMPLE,
    ),
    (
        "sharegpt-role-content-and-string",
        {"conversations": [msg("system", "Be brief."), msg("user", Q)], "chosen": msg("assistant", GOOD),
         "rejected": BAD},
        WITH_SYSTEM,
    ),
    ("alpaca", {"instruction": "What is", "input": "2+2?", "chosen": GOOD, "rejected": BAD},
     PreferencePair(turns("user", "What is\n\n2+2?"), SIMPLE.chosen, SIMPLE.rejected)),
    ("alpaca-empty-input", {"instruction": Q, "input": "", "chosen": GOOD, "rejected": BAD}, SIMPLE),
    # Orca DPO pairs (Intel/orca_dpo_pairs): system + question; sets that call the prompt a query or an input
    ("orca", {"system": "Be brief.", "question": Q, "chosen": GOOD, "rejected": BAD}, WITH_SYSTEM),
    ("query", {"query": Q, "chosen": GOOD, "rejected": BAD}, SIMPLE),
    ("null-prompt", {"prompt": None, "question": Q, "chosen": GOOD, "rejected": BAD}, SIMPLE),  # passed over
    # one "Human:" is text, not an HH dialogue (it lost the word)
    ("human-word", {"prompt": "Human: what is 2+2?", "chosen": GOOD, "rejected": BAD},
     PreferencePair(turns("user", "Human: what is 2+2?"), SIMPLE.chosen, SIMPLE.rejected)),
    ("input", {"input": Q, "chosen": GOOD, "rejected": BAD}, SIMPLE),
    # an HH dialogue as the prompt string (Dahoas/rm-static): its turns, the empty answer header dropped
    ("hh-prompt", {"prompt": f"\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: {Q}\n\nAssistant:", "chosen": f" {GOOD}",
                   "rejected": f" {BAD}"}, PreferencePair(MULTI_TURN.prompt, turns("assistant", f" {GOOD}"),
                                                         turns("assistant", f" {BAD}"))),
    (  # keys in any case, in the record and in the turns
        "case-insensitive",
        {"Prompt": [{"Role": "User", "Content": Q}], "CHOSEN": [{"ROLE": "assistant", "CONTENT": GOOD}],
         "Rejected": BAD, "System": "Be brief."},
        WITH_SYSTEM,
    ),
    (
        "content-parts",
        {"prompt": [msg("user", [{"type": "text", "text": "What is"}, "2+2?"])],
         "chosen": [msg("assistant", [{"type": "output_text", "text": GOOD}])],
         "rejected": [msg("assistant", [{"type": "text", "value": BAD}])]},
        PreferencePair(turns("user", "What is\n2+2?"), SIMPLE.chosen, SIMPLE.rejected),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("record", "expected"), [shape[1:] for shape in SHAPES], ids=[shape[0] for shape in SHAPES])
def test_parse_preference_reads_every_record_shape(record: dict, expected: PreferencePair) -> None:
    assert parse_preference(record) == expected
    assert record_kind(record) == "preference"  # auto: before the conversation shapes (ShareGPT, Alpaca)


BAD_PAIRS = [
    ({"prompt": Q, "chosen": GOOD}, "not_a_preference_pair"),
    ("a bare string", "not_a_preference_pair"),
    ({"prompt": Q, "chosen": GOOD, "rejected": BAD, "Chosen": GOOD}, "ambiguous_keys"),
    ({"prompt": Q, "chosen": 5, "rejected": BAD}, "bad_preference_value"),
    ({"prompt": Q, "chosen": GOOD, "rejected": None}, "bad_preference_value"),
    ({"prompt": {"text": Q}, "chosen": GOOD, "rejected": BAD}, "bad_message"),
    ({"chosen": [msg("user", Q), msg("assistant", GOOD)], "rejected": BAD}, "bad_preference_value"),
    ({"chosen": [msg("user", Q), msg("assistant", GOOD)], "rejected": [msg("user", "Other?"), msg("assistant", BAD)]},
     "no_shared_prompt"),
    ({"chosen": [msg("system", "S"), msg("user", Q), msg("assistant", GOOD)],
      "rejected": [msg("system", "S"), msg("user", "Other?"), msg("assistant", BAD)]}, "no_shared_prompt"),
    ({"chosen": f"\n\nHuman: {Q}\n\nAssistant: {GOOD}", "rejected": f"\n\nHuman: Other?\n\nAssistant: {BAD}"},
     "no_shared_prompt"),
    ({"chosen": GOOD, "rejected": BAD}, "malformed_hh_string"),
    ({"chosen": f"Intro\n\nHuman: {Q}\n\nAssistant: {GOOD}", "rejected": f"\n\nHuman: {Q}\n\nAssistant: {BAD}"},
     "malformed_hh_string"),
    ({"prompt": Q, "chosen": " 4. ", "rejected": "4.\n"}, "identical_responses"),
    ({"chosen": HH_CHOSEN, "rejected": HH_CHOSEN}, "identical_responses"),
    ({"prompt": Q, "chosen": [msg("assistant", None)], "rejected": BAD}, "non_string_content"),
    ({"prompt": [msg("user", [{"type": "image_url", "image_url": {"url": "cat.png"}}, "What is it?"])],
      "chosen": "A cat.", "rejected": "A dog."}, "non_text_content"),
    ({"instruction": 7, "chosen": GOOD, "rejected": BAD}, "non_string_content"),
    ({"prompt": Q, "chosen": GOOD, "rejected": BAD, "system": 3}, "non_string_content"),
    ({"prompt": [msg("tool", "{}")], "chosen": GOOD, "rejected": BAD}, "unknown_role"),
    ({"prompt": Q, "chosen": "   ", "rejected": BAD}, "no_assistant_response"),
    ({"prompt": Q, "chosen": [], "rejected": BAD}, "no_assistant_response"),
    ({"prompt": Q, "chosen": [msg("user", "More?"), msg("assistant", GOOD)], "rejected": BAD},
     "no_assistant_response"),
    ({"chosen": HH_CHOSEN + "\n\nHuman: Thanks", "rejected": HH_CHOSEN + "\n\nHuman: Thank you"},
     "no_assistant_response"),  # responses that differ only in a trailing user turn
    ({"prompt": [msg("user", Q), msg("assistant", "Hmm.")], "chosen": GOOD, "rejected": BAD},
     "prompt_not_ending_with_user"),
    ({"prompt": [], "chosen": GOOD, "rejected": BAD}, "prompt_not_ending_with_user"),
    ({"prompt": [msg("user", Q), msg("system", "S"), msg("user", Q)], "chosen": GOOD, "rejected": BAD},
     "misplaced_system_turn"),
    ({"prompt": Q, "chosen": [msg("system", "S"), msg("assistant", GOOD)], "rejected": BAD}, "misplaced_system_turn"),
]  # fmt: skip


@pytest.mark.parametrize(("record", "reason"), BAD_PAIRS)
def test_parse_preference_rejects_bad_records_with_their_reason(record: object, reason: str) -> None:
    with pytest.raises(BadRecord) as caught:
        parse_preference(record)
    assert caught.value.reason == reason and reason in REASONS


def preference_corpus(root: Path) -> Path:
    """Every good shape in every file layout, each bad record in the middle of a JSON Lines file, and a text file."""
    records = [record for _, record, _ in SHAPES]
    return write_files(
        root,
        {
            "a_array.json": json.dumps(records[:3]),
            "b_single.json": json.dumps(records[3]),
            "c_lines.jsonl": jsonl([records[4], *(record for record, _ in BAD_PAIRS), records[5]]) + "{broken\n",
            "d_docs.yaml": yaml.safe_dump_all([records[6], records[7:]]),
            "e_notes.txt": "a text file holds no preference pairs",
        },
    )


def test_format_preference_writes_three_message_columns_and_counts_bad_records(tmp_path: Path, capsys) -> None:
    data = preference_corpus(tmp_path / "data")
    out = tmp_path / "pairs"
    assert convert(data, out, "--format", "preference") == 0
    loaded = load_from_disk(str(out))
    turn = [{"role": Value("string"), "content": Value("string")}]
    assert loaded.features == Features({"prompt": turn, "chosen": turn, "rejected": turn})
    assert [(f.name, str(f.type)) for f in loaded.data.schema] == [  # no tool fields: pairs have no tool turns
        (c, "list<item: struct<role: string, content: string>>") for c in ("prompt", "chosen", "rejected")
    ]
    assert loaded[:] == {name: [row_of(expected)[name] for _, _, expected in SHAPES] for name in PREFERENCE_COLUMNS}
    summary = summary_of(out)
    expected_reasons = Counter(reason for _, reason in BAD_PAIRS)
    expected_reasons.update(["text_file_in_preference_run", "invalid_jsonl_line"])
    assert summary["counts_by_reason"] == dict(expected_reasons)
    assert set(summary["reasons"]) == set(expected_reasons)  # every reason has its description
    assert (summary["column"], summary["columns"]) == ("preference", ["prompt", "chosen", "rejected"])
    assert summary["rows_total"] == len(SHAPES) == summary["pairs_found"] and summary["files_with_rows"] == 4
    first_bad = [p for p in summary["problems"] if p["path"].endswith("c_lines.jsonl")][0]
    assert (first_bad["line"], first_bad["reason"]) == (2, BAD_PAIRS[0][1])
    assert f"-> {len(SHAPES)} preference pairs" in capsys.readouterr().out
    train, validation = load_text_dataset(out)
    assert train.column_names == ["prompt", "chosen", "rejected"] and validation is None


def test_preference_is_the_same_with_workers_and_in_pieces(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(workers, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(reading, "MIN_PIECE_BYTES", 4096)  # the big file is read in pieces by several workers
    records = [
        {"prompt": f"q{i} \u00e9", "chosen": f"yes {i}", "rejected": f"no {i}" * (i % 9 + 1)} for i in range(600)
    ]
    records[450] = {"prompt": "q", "chosen": "same", "rejected": "same"}
    files = {"big.jsonl": jsonl(records), **{f"small/{i:02d}.json": json.dumps(SHAPES[i][1]) for i in range(8)}}
    data = write_files(tmp_path / "data", files)
    outputs = []
    for data_format, num_proc in (("preference", "1"), ("preference", "2"), ("auto", "2")):
        out = tmp_path / f"out_{data_format}{num_proc}"
        cli = ["--data_folder", str(data), "--save_dir", str(out), "--format", data_format, "--num-proc", num_proc]
        assert main([*cli, "--max-chars", "1000"]) == 0
        outputs.append((load_from_disk(str(out))[:], summary_of(out)))
    assert outputs[0][0] == outputs[1][0] == outputs[2][0] and len(outputs[0][0]["prompt"]) == 599 + 8
    assert outputs[0][1]["content_digest"] == outputs[1][1]["content_digest"] == outputs[2][1]["content_digest"]
    for _, summary in outputs:
        assert [(p["reason"], p["line"]) for p in summary["problems"]] == [("identical_responses", 451)]


def test_val_fraction_assigns_each_pair_by_its_content_whatever_the_file_order(tmp_path: Path) -> None:
    records = [{"prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(300)]
    layouts = {
        "a": {"one.jsonl": jsonl(records[:150]), "two.jsonl": jsonl(records[150:])},
        "b": {"one.jsonl": jsonl(records[:150]), "two.jsonl": jsonl(records[150:])},  # a rerun
        "c": {"x.jsonl": jsonl(records[::-1][:100]), "y/z.json": json.dumps(records[::-1][100:])},  # another order
    }
    validation = {}
    for name, files in layouts.items():
        data = write_files(tmp_path / f"data_{name}", files)
        assert convert(data, tmp_path / name, "--format", "preference", "--val-fraction", "0.2") == 0
        loaded = load_from_disk(str(tmp_path / name))
        assert isinstance(loaded, DatasetDict) and loaded["validation"].column_names == ["prompt", "chosen", "rejected"]
        assert len(loaded["train"]) + len(loaded["validation"]) == 300
        validation[name] = sorted(row["prompt"][0]["content"] for row in loaded["validation"])
    assert validation["a"] == validation["b"] == validation["c"] and 30 < len(validation["a"]) < 90
    held_out = load_from_disk(str(tmp_path / "a"))
    for split in ("train", "validation"):
        for row in held_out[split]:
            pair = PreferencePair(*(tuple((t["role"], t["content"]) for t in row[c]) for c in PREFERENCE_COLUMNS))
            assert assign_split(preference_json(pair), 0.2) == split


def test_auto_writes_pairs_when_every_record_is_one(tmp_path: Path, capsys) -> None:
    data = write_files(
        tmp_path / "data",
        {
            "standard.jsonl": jsonl([SHAPES[0][1], {"prompt": Q, "chosen": GOOD, "rejected": GOOD}]),
            "sharegpt.json": json.dumps([SHAPES[10][1]]),  # has `conversations`: a chat record but for chosen/rejected
            "alpaca.yaml": yaml.safe_dump(SHAPES[12][1]),  # instruction but no output: a pair
        },
    )
    assert convert(data, tmp_path / "auto") == 0
    assert convert(data, tmp_path / "pairs", "--format", "preference") == 0
    assert load_from_disk(str(tmp_path / "auto"))[:] == load_from_disk(str(tmp_path / "pairs"))[:]
    assert load_from_disk(str(tmp_path / "auto"))["chosen"][:] == [[msg("assistant", GOOD)]] * 3
    summary = summary_of(tmp_path / "auto")
    assert summary["column"] == "preference" and summary["counts_by_reason"] == {"identical_responses": 1}
    assert summary["rows_total"] == 3 and summary["files_with_rows"] == 3
    assert "--format auto: every record read is a preference pair" in capsys.readouterr().out


def test_auto_with_pairs_and_other_text_stays_text_and_pairs_with_conversations_are_refused(
    tmp_path: Path, capsys
) -> None:
    data = write_files(
        tmp_path / "data",
        {"pairs.jsonl": jsonl([SHAPES[0][1], SHAPES[10][1]]), "notes.txt": "plain text"},
    )
    assert convert(data, tmp_path / "auto") == 0
    assert convert(data, tmp_path / "text", "--format", "text") == 0
    rows = list(load_from_disk(str(tmp_path / "auto"))["text"])
    assert rows == list(load_from_disk(str(tmp_path / "text"))["text"])
    assert rows == ["plain text", Q, GOOD, BAD, "human", Q, "gpt", GOOD, "gpt", BAD]  # files in sorted order
    summary = summary_of(tmp_path / "auto")
    assert summary["column"] == "text" and summary["counts_by_reason"] == {}
    assert summary["preference_records_as_text"] == 2 and summary["conversation_records_as_text"] == 0
    assert summary["preference_text_files"] == {str(data / "pairs.jsonl"): 2}
    printed = capsys.readouterr().out
    assert (
        "2 record(s) look like preference data (pairs: chosen + rejected, or unpaired" in printed
        and "--format preference" in printed
    )
    assert "because the folder also holds other text" in printed
    # pairs beside conversations, without other text: neither kind is written alone, nor their strings as text
    mixed = write_files(tmp_path / "mixed", {"a.jsonl": jsonl([SHAPES[0][1], {"question": Q, "answer": GOOD}])})
    assert convert(mixed, tmp_path / "mixed_out") == 1
    said = capsys.readouterr()
    assert "mixes 1 conversation(s) and 1 preference pair(s) and holds no plain text" in said.err
    assert "--format chat and --format preference" in said.err and not (tmp_path / "mixed_out").exists()
    assert "extracted as text" not in said.out + said.err, "a note that contradicts the refusal"
    assert convert(mixed, tmp_path / "mixed_text", "--format", "text") == 0  # asked for: their strings as text


def test_format_preference_refuses_a_folder_without_pairs(tmp_path: Path, capsys) -> None:
    data = write_files(tmp_path / "data", {"a.txt": "text", "b.md": "# more"})
    assert convert(data, tmp_path / "out", "--format", "preference") == 1
    assert "no preference files" in capsys.readouterr().err
    write_files(data, {"c.jsonl": jsonl([{"messages": [msg("user", Q), msg("assistant", GOOD)]}])})
    assert convert(data, tmp_path / "out", "--format", "preference") == 1
    err = capsys.readouterr()
    assert "no preference pairs were found" in err.err and "not_a_preference_pair" in err.out
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data"]


def test_pairs_longer_than_max_chars_and_repeated_yaml_aliases_are_skipped(tmp_path: Path) -> None:
    data = write_files(
        tmp_path / "data",
        {
            "a.jsonl": jsonl([{"prompt": "p" * 40, "chosen": "c" * 30, "rejected": "r" * 31}, SHAPES[0][1]]),
            "b.yaml": f"- &r {json.dumps(SHAPES[0][1])}\n- *r\n",
        },
    )
    assert convert(data, tmp_path / "out", "--format", "preference", "--max-chars", "100") == 0
    assert load_from_disk(str(tmp_path / "out"))[:] == {k: [v, v] for k, v in row_of(SIMPLE).items()}
    assert summary_of(tmp_path / "out")["counts_by_reason"] == {"pair_too_long": 1, "repeated_yaml_alias": 1}


def test_unpaired_examples_are_written_with_a_boolean_label_and_a_mixed_run_unpairs_its_pairs(
    tmp_path: Path, capsys
) -> None:
    """TRL's unpaired shape (prompt, completion, label; strings or turns; the label a boolean, 1/0 or their strings)
    becomes prompt/completion message lists and a bool label; a bad label or a missing prompt is a counted skip; a
    run that also reads pairs unpairs them (chosen true, rejected false), in --format preference and in auto; the
    trainer's KTO encoder reads the result."""
    from transformers import AutoTokenizer

    from fsdp_lib.data.chat import ChatEncoder
    from fsdp_lib.data.preference import DESIRABLE, UNDESIRABLE, PairEncoder
    from fsdp_lib.data.unpaired import ExampleEncoder
    from tests.fsdp_helpers import make_chat_model

    examples = [
        {"prompt": Q, "completion": GOOD, "label": True},
        {"Prompt": [msg("user", Q)], "Completion": [msg("assistant", BAD)], "Label": "false"},
        {"prompt": Q, "system": "Be brief.", "completion": GOOD, "label": 1},
        {"prompt": Q, "completion": BAD, "label": "maybe"},
        {"completion": GOOD, "label": True},
    ]
    data = write_files(tmp_path / "data", {"kto.jsonl": jsonl(examples)})
    assert convert(data, tmp_path / "out", "--format", "preference") == 0
    dataset = load_from_disk(str(tmp_path / "out"))
    assert dataset.features == Features({"prompt": [{"role": Value("string"), "content": Value("string")}],
                                         "completion": [{"role": Value("string"), "content": Value("string")}],
                                         "label": Value("bool")})  # fmt: skip
    assert dataset["label"][:] == [True, False, True]
    assert dataset["prompt"][2] == [msg("system", "Be brief."), msg("user", Q)]
    assert dataset["completion"][1] == [msg("assistant", BAD)]
    summary = summary_of(tmp_path / "out")
    assert summary["column"] == "unpaired" and summary["unpaired_found"] == 3
    # a pair with an extra label stays a pair; chosen beside completion + label is no pair and no example
    assert isinstance(parse_preference({"prompt": Q, "chosen": GOOD, "rejected": BAD, "label": 1}), PreferencePair)
    with pytest.raises(BadRecord) as refused:
        parse_preference({"prompt": Q, "chosen": GOOD, "completion": BAD, "label": True})
    assert refused.value.reason == "not_a_preference_pair"
    assert summary["counts_by_reason"] == {"bad_label": 1, "missing_prompt": 1}
    assert "-> 3 unpaired examples" in capsys.readouterr().out
    # --format chat does not train them as conversations (a thumbs-down completion would be learnt): counted skips
    assert convert(data, tmp_path / "as_chat", "--format", "chat") == 1  # nothing usable: refused, with the reason
    said = capsys.readouterr()
    assert "unpaired_preference_record" in said.out + said.err and not (tmp_path / "as_chat").exists()
    # with a pair beside them: the pair becomes two examples, in --format preference and in auto alike
    write_files(data, {"pairs.jsonl": jsonl([{"prompt": Q, "chosen": GOOD, "rejected": BAD}])})
    assert convert(data, tmp_path / "mixed", "--format", "preference") == 0
    assert convert(data, tmp_path / "auto") == 0
    mixed = load_from_disk(str(tmp_path / "mixed"))
    assert mixed[:] == load_from_disk(str(tmp_path / "auto"))[:]
    assert mixed["label"][:] == [True, False, True, True, False]
    assert mixed["completion"][3:] == [[msg("assistant", GOOD)], [msg("assistant", BAD)]]
    printed = capsys.readouterr().out
    assert "each pair became two unpaired examples" in printed and "every record read is preference data" in printed
    # the trainer reads it: --objective auto finds kto, and the examples keep their labels
    train, _ = load_text_dataset(str(tmp_path / "mixed"))
    tokenizer = AutoTokenizer.from_pretrained(make_chat_model(tmp_path / "model"))
    encoder = ExampleEncoder(PairEncoder(ChatEncoder(tokenizer, "assistant"), 512))
    encoded = encoder.encode(train[:], {}, {}, 0)
    assert [int(mask.max()) for _, mask, _, _ in encoded] == [DESIRABLE, UNDESIRABLE, DESIRABLE, DESIRABLE,
                                                               UNDESIRABLE]  # fmt: skip
