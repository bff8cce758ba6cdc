"""scripts/make_demo_corpus.py: deterministic, every format present and parseable, prompts taught unambiguously."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("make_demo_corpus", REPO_ROOT / "scripts" / "make_demo_corpus.py")
make_demo_corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_demo_corpus)

SMALL = 300  # documents: enough for every file to get several, fast to generate


@pytest.fixture(scope="module")
def corpus() -> dict[str, bytes]:
    return make_demo_corpus.generate_corpus(seed=0)  # the default size, as `make demo` uses it


def strings_in(value: object) -> Iterator[str]:
    """Every string value in parsed JSON/YAML, the way a data tool extracts text (keys excluded)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings_in(item)


def texts_of(path: str, data: bytes) -> list[str]:
    """Parse one good file by its ending; raises if it does not parse."""
    text = data.decode("utf-8")
    assert "\x00" not in text
    if path.endswith(".json"):
        return list(strings_in(json.loads(text)))
    if path.endswith(".jsonl"):
        return [s for line in text.splitlines() if line.strip() for s in strings_in(json.loads(line))]
    if path.endswith((".yaml", ".yml")):
        return [s for doc in yaml.safe_load_all(text) for s in strings_in(doc)]
    return [text]


def test_same_seed_same_bytes_other_seed_other_bytes() -> None:
    first = make_demo_corpus.generate_corpus(seed=3, num_docs=SMALL)
    assert first == make_demo_corpus.generate_corpus(seed=3, num_docs=SMALL)
    other = make_demo_corpus.generate_corpus(seed=4, num_docs=SMALL)
    assert other.keys() == first.keys() and other != first


def test_every_format_nested_folders_and_name_collisions(corpus: dict[str, bytes]) -> None:
    endings = {Path(p).suffix for p in corpus}
    assert {".txt", ".md", ".json", ".jsonl", ".yaml", ".yml"} <= endings
    assert max(p.count("/") for p in corpus) >= 2
    names = Counter(Path(p).name for p in corpus)
    assert names["notes.txt"] >= 2 and names["facts.jsonl"] >= 2
    multi = [p for p in corpus if p.endswith((".yaml", ".yml")) and len(list(yaml.safe_load_all(corpus[p]))) > 1]
    assert multi, "one YAML file should hold several documents"
    json_file = json.loads(corpus["atlas/countries.json"])
    assert isinstance(json_file["collection"]["pages"][0]["body"]["paragraphs"], list)  # strings nested 4 deep
    assert 1_000_000 <= sum(len(data) for data in corpus.values()) <= 3_000_000


def test_good_files_parse_and_bad_files_do_not(corpus: dict[str, bytes]) -> None:
    for path, data in corpus.items():
        if path not in make_demo_corpus.BAD_FILES:
            assert texts_of(path, data), path
    with pytest.raises(json.JSONDecodeError):
        json.loads(corpus["misc/broken.json"])
    binary = corpus["misc/scan_0001.txt"]
    assert b"\x00" in binary
    with pytest.raises(UnicodeDecodeError):
        binary.decode("utf-8")
    clean = make_demo_corpus.generate_corpus(seed=0, num_docs=SMALL, bad_files=False)
    assert not set(make_demo_corpus.BAD_FILES) & clean.keys()


def test_every_prompt_is_taught_often_and_always_with_its_completion(corpus: dict[str, bytes]) -> None:
    texts = [t for p, d in corpus.items() if p not in make_demo_corpus.BAD_FILES for t in texts_of(p, d)]
    assert make_demo_corpus.DEMO_PROMPTS == list(make_demo_corpus.DEMO_COMPLETIONS)
    for prompt, completion in make_demo_corpus.DEMO_COMPLETIONS.items():
        followers = Counter(
            text[match.end() : match.end() + len(completion)]
            for text in texts
            for match in re.finditer(re.escape(prompt), text)
        )
        assert followers == {completion: followers[completion]}, f"{prompt!r} is followed by {followers}"
        assert followers[completion] >= 200, f"{prompt!r} is taught only {followers[completion]} times"


def test_main_writes_reruns_and_refuses_a_foreign_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "raw"
    assert make_demo_corpus.main(["--out", str(out), "--num-docs", str(SMALL)]) == 0
    expected = make_demo_corpus.generate_corpus(seed=0, num_docs=SMALL)
    written = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert written.pop(make_demo_corpus.RECORD_NAME)
    assert written == expected
    # A rerun without the bad files removes the ones the first run wrote, and their folder.
    assert make_demo_corpus.main(["--out", str(out), "--num-docs", str(SMALL), "--no-bad-files"]) == 0
    assert not (out / "misc").exists()
    assert {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} == (
        expected.keys() - set(make_demo_corpus.BAD_FILES)
    ) | {make_demo_corpus.RECORD_NAME}
    capsys.readouterr()

    foreign = tmp_path / "mine"
    (foreign / "keep.txt").parent.mkdir()
    (foreign / "keep.txt").write_text("not a corpus")
    assert make_demo_corpus.main(["--out", str(foreign)]) == 2
    assert "--out" in capsys.readouterr().err
    assert [p.name for p in foreign.iterdir()] == ["keep.txt"]
    assert make_demo_corpus.main(["--out", str(tmp_path / "x"), "--num-docs", "3"]) == 2
    assert "--num-docs" in capsys.readouterr().err


def test_imports_no_torch() -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(REPO_ROOT / 'scripts')!r}); import make_demo_corpus; "
        "sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# --- The conversation corpus (--chat-out) -------------------------------------------------------------------


def records_of(conversations: dict[str, bytes]) -> list[dict]:
    return [json.loads(line) for line in conversations[make_demo_corpus.CHAT_FILE].decode().splitlines()]


def test_conversations_use_every_shape_and_state_the_corpus_facts(corpus: dict[str, bytes]) -> None:
    from fsdp_lib.records.conversation import conversation_shape, parse_conversation
    from fsdp_lib.records.reasons import BadRecord

    conversations = make_demo_corpus.generate_conversations(seed=0)
    assert conversations == make_demo_corpus.generate_conversations(seed=0)
    assert conversations != make_demo_corpus.generate_conversations(seed=1)
    records = records_of(conversations)
    good = [r for r in records if r not in make_demo_corpus.BAD_CHAT_RECORDS]
    assert 300 <= len(good) <= 1000 and len(records) - len(good) == 2
    assert {conversation_shape(r) for r in good} == {
        "messages",
        "conversations",
        "alpaca",
        "prompt",
        "question",
    }
    assert any("system" in r for r in good) and any(r.get("messages", [{}])[0].get("role") == "system" for r in good)
    with pytest.raises(BadRecord, match="none from the assistant"):
        parse_conversation(make_demo_corpus.BAD_CHAT_RECORDS[0])
    with pytest.raises(BadRecord, match="narrator"):
        parse_conversation(make_demo_corpus.BAD_CHAT_RECORDS[1])
    # Every answer is a sentence of the text corpus: chat and text teach the same, consistent facts.
    texts = " ".join(t for p, d in corpus.items() if p not in make_demo_corpus.BAD_FILES for t in texts_of(p, d))
    answers = Counter()
    for record in good:
        for role, content in parse_conversation(record):
            if role == "assistant":
                assert content in texts, content
                answers[content] += 1
    for question, answer in make_demo_corpus.DEMO_CHAT_ANSWERS.items():
        asked = [r for r in good if r.get("messages", [{}])[-2:][0].get("content") == question]
        assert asked and answers[answer] >= 1, question
    clean = records_of(make_demo_corpus.generate_conversations(seed=0, bad_records=False))
    assert not [r for r in clean if r in make_demo_corpus.BAD_CHAT_RECORDS]


def test_chat_out_is_written_apart_and_converts_with_format_chat(tmp_path: Path, capsys) -> None:
    import data_hf

    raw, chat = tmp_path / "raw", tmp_path / "chat"
    assert make_demo_corpus.main(["--out", str(raw), "--num-docs", str(SMALL)]) == 0
    assert not chat.exists() and not list(raw.rglob(make_demo_corpus.CHAT_FILE))  # the text demo is unchanged
    assert make_demo_corpus.main(["--out", str(raw), "--num-docs", str(SMALL), "--chat-out", str(chat)]) == 0
    assert sorted(p.name for p in chat.iterdir()) == sorted([make_demo_corpus.CHAT_FILE, make_demo_corpus.RECORD_NAME])
    assert not list(raw.rglob(make_demo_corpus.CHAT_FILE))
    out = tmp_path / "hf_chat"
    assert (
        data_hf.main(["--data_folder", str(chat), "--save_dir", str(out), "--format", "chat", "--num-proc", "1"]) == 0
    )
    summary = json.loads((out / data_hf.SUMMARY_NAME).read_text())
    assert summary["counts_by_reason"] == {"no_assistant_turn": 1, "unknown_role": 1}
    assert summary["rows_total"] == len(records_of(make_demo_corpus.generate_conversations(seed=0))) - 2
    capsys.readouterr()
    for inside in (raw / "chat", tmp_path):  # inside --out, or holding it: the text run would read conversations
        assert make_demo_corpus.main(["--out", str(raw), "--chat-out", str(inside)]) == 2
        assert "--chat-out" in capsys.readouterr().err
    assert make_demo_corpus.main(["--out", str(raw), "--chat-out", str(chat), "--num-conversations", "-1"]) == 2
