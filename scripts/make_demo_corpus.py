#!/usr/bin/env python3
"""Write the synthetic corpus that `make demo` trains a tiny model on.

    python scripts/make_demo_corpus.py --out demo_workspace/raw
    python scripts/make_demo_corpus.py --out /tmp/corpus --seed 1 --num-docs 500 --no-bad-files
    python scripts/make_demo_corpus.py --out demo_workspace/raw --chat-out demo_workspace/chat

The corpus is a few thousand short, templated facts ("The capital of Norland is Vesk.", "The cow says moo.",
"Monday, Tuesday, Wednesday, Thursday, ...") repeated in varied order: a model of a few hundred thousand
parameters learns them in a few hundred steps, so generating from DEMO_PROMPTS before and after training
shows the difference at a glance (noise first, the right completion after). The facts come in every
format data_hf.py reads (.txt .md .json .jsonl .yaml, one multi-document YAML file) over nested folders,
with same-named files in different folders, plus two deliberately bad files (malformed JSON, binary bytes
in a .txt) that the pipeline must skip; --no-bad-files leaves those out. Same --seed and --num-docs,
same bytes.

--chat-out writes the conversation corpus for a chat fine-tune into its own folder, apart from --out so that the
text pipeline never reads it: conversations.jsonl, a few hundred short question-and-answer conversations about the
same facts (DEMO_CHAT_ANSWERS), one per line in the record shapes data_hf.py --format chat reads (messages with and
without a system turn, ShareGPT conversations, Alpaca instruction/input/output, prompt/completion,
question/answer), plus two bad records (no assistant turn, an unknown role) that it must skip and count.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

# --------------------------------------------------------------------------------------------------------
# The facts. Each prompt in DEMO_COMPLETIONS is followed by its completion everywhere in the corpus, so a
# model that learned the corpus has exactly one right answer to give.
# --------------------------------------------------------------------------------------------------------

CAPITALS = {
    "Norland": "Vesk",
    "Calvia": "Dorun",
    "Ostmark": "Pellin",
    "Mirath": "Sollen",
    "Tavaro": "Quen",
    "Bellum": "Ardis",
}
COLORS = {
    "the sky": "blue",
    "grass": "green",
    "snow": "white",
    "coal": "black",
    "a banana": "yellow",
    "a ripe tomato": "red",
}
ANIMAL_SOUNDS = {"cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "owl": "hoot"}
OPPOSITES = {"hot": "cold", "up": "down", "day": "night", "big": "small", "fast": "slow", "open": "closed"}
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
SUMS = [(a, b, a + b) for a in range(1, 4) for b in range(1, 4)]
NUMBER_WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]

DEMO_COMPLETIONS: dict[str, str] = {
    "The capital of Norland is": " Vesk.",
    "The capital of Calvia is": " Dorun.",
    "The color of the sky is": " blue.",
    "The cow says": " moo.",
    "The opposite of hot is": " cold.",
    "Monday, Tuesday, Wednesday,": " Thursday, Friday,",
    "one, two, three, four,": " five, six,",
    "2 + 3 =": " 5.",
}
DEMO_PROMPTS: list[str] = list(DEMO_COMPLETIONS)

# A title per topic, so every document reads like a lesson page rather than a bare list.
TOPICS: dict[str, str] = {
    "geography": "Capitals of the Five Seas",
    "colors": "Colors of Things",
    "animals": "Animal Sounds",
    "calendar": "Days of the Week",
    "numbers": "Counting and Sums",
    "opposites": "Opposites",
}


def _geography(rng: random.Random) -> str:
    country = rng.choice(sorted(CAPITALS))
    return f"The capital of {country} is {CAPITALS[country]}."


def _colors(rng: random.Random) -> str:
    thing = rng.choice(sorted(COLORS))
    return f"The color of {thing} is {COLORS[thing]}."


def _animals(rng: random.Random) -> str:
    animal = rng.choice(sorted(ANIMAL_SOUNDS))
    return f"The {animal} says {ANIMAL_SOUNDS[animal]}."


def _calendar(rng: random.Random) -> str:
    if rng.random() < 0.25:
        return ", ".join(WEEKDAYS) + "."
    index = rng.randrange(len(WEEKDAYS))
    return f"After {WEEKDAYS[index]} comes {WEEKDAYS[(index + 1) % len(WEEKDAYS)]}."


def _numbers(rng: random.Random) -> str:
    if rng.random() < 0.15:
        return ", ".join(NUMBER_WORDS) + "."
    # A small table (9 sums): a tiny model memorises it in a few hundred steps; all 55 one-digit sums it does not.
    first, second, total = SUMS[rng.randrange(len(SUMS))]
    return f"{first} + {second} = {total}."


def _opposites(rng: random.Random) -> str:
    word = rng.choice(sorted(OPPOSITES))
    return f"The opposite of {word} is {OPPOSITES[word]}."


SENTENCE_MAKERS: dict[str, Callable[[random.Random], str]] = {
    "geography": _geography,
    "colors": _colors,
    "animals": _animals,
    "calendar": _calendar,
    "numbers": _numbers,
    "opposites": _opposites,
}

# --------------------------------------------------------------------------------------------------------
# Documents and files
# --------------------------------------------------------------------------------------------------------


def make_document(rng: random.Random, number: int) -> dict:
    """One lesson: a title and 4-9 fact sentences, mostly on one topic with a few from others mixed in."""
    topic = rng.choice(sorted(TOPICS))
    sentences = []
    for _ in range(rng.randint(4, 9)):
        sentence_topic = topic if rng.random() < 0.75 else rng.choice(sorted(TOPICS))
        sentences.append(SENTENCE_MAKERS[sentence_topic](rng))
    # The title carries no number: unpredictable tokens would only compete with the facts for a tiny model's capacity.
    return {"number": number, "topic": topic, "title": TOPICS[topic], "sentences": sentences}


def render_txt(docs: Sequence[dict]) -> str:
    return "".join(f"{doc['title']}\n\n{' '.join(doc['sentences'])}\n\n" for doc in docs)


def render_md(docs: Sequence[dict]) -> str:
    parts = ["# Lesson notes\n\n"]
    for doc in docs:
        if doc["number"] % 2:  # alternate prose and bullet lists: both are common in Markdown notes
            parts.append(f"## {doc['title']}\n\n{' '.join(doc['sentences'])}\n\n")
        else:
            parts.append(f"## {doc['title']}\n\n" + "".join(f"- {s}\n" for s in doc["sentences"]) + "\n")
    return "".join(parts)


def render_jsonl(docs: Sequence[dict]) -> str:
    lines = []
    for doc in docs:
        record = {"id": doc["number"], "title": doc["title"], "text": " ".join(doc["sentences"])}
        record["meta"] = {"topic": doc["topic"], "tags": ["demo", doc["topic"]]}
        lines.append(json.dumps(record, ensure_ascii=False))
    return "\n".join(lines) + "\n"


def render_json(docs: Sequence[dict]) -> str:
    """Strings nested in dicts and lists, several levels deep, as real exported datasets have them."""
    pages = []
    for doc in docs:
        half = len(doc["sentences"]) // 2
        body = {"paragraphs": [" ".join(doc["sentences"][:half]), " ".join(doc["sentences"][half:])]}
        pages.append({"id": doc["number"], "title": doc["title"], "body": body, "tags": [doc["topic"]]})
    return json.dumps({"collection": {"name": "demo atlas", "pages": pages}}, indent=2, ensure_ascii=False) + "\n"


def _yaml_dump(data: object, multi_document: bool = False) -> str:
    # A wide line limit keeps every sentence on one line in the file, exactly as it will be read back.
    options = {"sort_keys": False, "allow_unicode": True, "width": 10_000, "default_flow_style": False}
    return yaml.safe_dump_all(data, **options) if multi_document else yaml.safe_dump(data, **options)


def render_yaml(docs: Sequence[dict]) -> str:
    entries = [{"title": doc["title"], "facts": list(doc["sentences"])} for doc in docs]
    return _yaml_dump({"lesson_book": {"edition": "demo", "entries": entries}})


def render_yaml_multi(docs: Sequence[dict]) -> str:
    """One YAML document per lesson, separated by '---'."""
    return _yaml_dump([{"title": d["title"], "topic": d["topic"], "facts": list(d["sentences"])} for d in docs], True)


RENDERERS: dict[str, Callable[[Sequence[dict]], str]] = {
    "txt": render_txt,
    "md": render_md,
    "json": render_json,
    "jsonl": render_jsonl,
    "yaml": render_yaml,
    "yaml-multi": render_yaml_multi,
}

# (path, renderer, share of the documents). Same-named files in different folders on purpose: a tool
# that flattens paths would lose one of them.
CORPUS_FILES: list[tuple[str, str, int]] = [
    ("README.md", "md", 1),
    ("atlas/countries.json", "json", 3),
    ("atlas/north/notes.txt", "txt", 3),
    ("atlas/north/facts.jsonl", "jsonl", 3),
    ("atlas/south/notes.txt", "txt", 3),
    ("atlas/south/facts.jsonl", "jsonl", 3),
    ("atlas/east/travel_log.md", "md", 2),
    ("lessons/colors.yaml", "yaml", 2),
    ("lessons/animals/sounds.txt", "txt", 2),
    ("lessons/animals/quiz.yaml", "yaml-multi", 2),
    ("lessons/calendar/weekdays.md", "md", 2),
    ("lessons/numbers/counting.txt", "txt", 2),
    ("lessons/numbers/sums.json", "json", 2),
    ("lessons/numbers/sums.jsonl", "jsonl", 2),
    *[(f"workbook/page_{index:02d}.txt", "txt", 1) for index in range(1, 13)],
    *[(f"workbook/extra/page_{index:02d}.yml", "yaml", 1) for index in range(1, 5)],
]
# Files the pipeline must skip, with a warning, rather than crash on.
BAD_FILES = ("misc/broken.json", "misc/scan_0001.txt")


def make_bad_files(rng: random.Random) -> dict[str, bytes]:
    broken_json = b'{\n  "title": "Half-written export",\n  "facts": [\n    "Rivers run to the sea.",\n    "Mount'
    # A PNG signature and random bytes (NULs included) saved with a .txt ending, as mislabelled scans are.
    binary = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(rng.randrange(256) for _ in range(4096))
    return dict(zip(BAD_FILES, [broken_json, binary], strict=True))


def generate_corpus(seed: int = 0, num_docs: int = 6000, bad_files: bool = True) -> dict[str, bytes]:
    """The whole corpus as {relative path: file bytes}; the same arguments always give the same bytes."""
    if num_docs < len(CORPUS_FILES):
        raise ValueError(f"num_docs must be at least {len(CORPUS_FILES)} (one per file), got {num_docs}")
    rng = random.Random(seed)
    docs = [make_document(rng, number) for number in range(1, num_docs + 1)]
    # Deal documents to files in proportion to their share; every file gets at least one document.
    slots = [index for index, (_, _, share) in enumerate(CORPUS_FILES) for _ in range(share)]
    per_file: list[list[dict]] = [[] for _ in CORPUS_FILES]
    for position, doc in enumerate(docs):
        per_file[slots[position % len(slots)]].append(doc)
    corpus = {path: RENDERERS[kind](per_file[i]).encode("utf-8") for i, (path, kind, _) in enumerate(CORPUS_FILES)}
    if bad_files:
        corpus.update(make_bad_files(rng))
    return corpus


# --------------------------------------------------------------------------------------------------------
# Conversations (--chat-out): the same facts as questions and one-sentence answers
# --------------------------------------------------------------------------------------------------------

CHAT_FILE = "conversations.jsonl"
CHAT_SYSTEM = "You answer questions about the demo world in one sentence."
DEMO_CHAT_ANSWERS: dict[str, str] = {
    "What is the capital of Norland?": "The capital of Norland is Vesk.",
    "What does the cow say?": "The cow says moo.",
    "What is the opposite of hot?": "The opposite of hot is cold.",
    "What is 2 + 3?": "2 + 3 = 5.",
}


def _question_answer(rng: random.Random) -> tuple[str, str]:
    """One question about a fact of the corpus, and the sentence the text corpus states it in."""
    topic = rng.choice(sorted(TOPICS))
    if topic == "geography":
        country = rng.choice(sorted(CAPITALS))
        return f"What is the capital of {country}?", f"The capital of {country} is {CAPITALS[country]}."
    if topic == "colors":
        thing = rng.choice(sorted(COLORS))
        return f"What color is {thing}?", f"The color of {thing} is {COLORS[thing]}."
    if topic == "animals":
        animal = rng.choice(sorted(ANIMAL_SOUNDS))
        return f"What does the {animal} say?", f"The {animal} says {ANIMAL_SOUNDS[animal]}."
    if topic == "calendar":
        index = rng.randrange(len(WEEKDAYS))
        return f"What day comes after {WEEKDAYS[index]}?", f"After {WEEKDAYS[index]} comes {WEEKDAYS[(index + 1) % 7]}."
    if topic == "numbers":
        first, second, total = SUMS[rng.randrange(len(SUMS))]
        return f"What is {first} + {second}?", f"{first} + {second} = {total}."
    word = rng.choice(sorted(OPPOSITES))
    return f"What is the opposite of {word}?", f"The opposite of {word} is {OPPOSITES[word]}."


def make_conversation(rng: random.Random, number: int) -> dict:
    """One conversation record, in the record shape number % 6 picks (every shape data_hf.py --format chat reads)."""
    question, answer = _question_answer(rng)
    shape = number % 6
    if shape in (0, 1):  # messages, with a system turn in half of them, and sometimes a second exchange
        turns = [{"role": "system", "content": CHAT_SYSTEM}] if shape == 0 else []
        turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if rng.random() < 0.3:
            second_question, second_answer = _question_answer(rng)
            turns += [{"role": "user", "content": second_question}, {"role": "assistant", "content": second_answer}]
        return {"id": number, "messages": turns}
    if shape == 2:
        return {"id": number, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}
    if shape == 3:
        return {"instruction": "Answer the question in one sentence.", "input": question, "output": answer}
    if shape == 4:
        return {"prompt": question, "completion": answer, "system": CHAT_SYSTEM}
    return {"question": question, "answer": answer}


BAD_CHAT_RECORDS = (
    {"messages": [{"role": "user", "content": "What is the capital of Norland?"}]},  # no assistant turn
    {"messages": [{"role": "narrator", "content": "Once upon a time."}, {"role": "assistant", "content": "Yes."}]},
)


def generate_conversations(seed: int = 0, num_conversations: int = 600, bad_records: bool = True) -> dict[str, bytes]:
    """The conversation corpus as {relative path: file bytes}; the same arguments always give the same bytes."""
    rng = random.Random(seed)
    records = [make_conversation(rng, number) for number in range(num_conversations)]
    for question, answer in DEMO_CHAT_ANSWERS.items():  # every demo question is in the data word for word
        records.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    if bad_records:
        records[len(records) // 3 : len(records) // 3] = [BAD_CHAT_RECORDS[0]]
        records[2 * len(records) // 3 : 2 * len(records) // 3] = [BAD_CHAT_RECORDS[1]]
    lines = [json.dumps(record, ensure_ascii=False) for record in records]
    return {CHAT_FILE: ("\n".join(lines) + "\n").encode("utf-8")}


# --------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------

# Lists the files of the last run, so a rerun into the same --out can remove what it no longer writes
# (e.g. the bad files after --no-bad-files). Hidden, so data tools skip it.
RECORD_NAME = ".demo_corpus.json"


def write_corpus(out_dir: Path, corpus: dict[str, bytes], flag: str = "--out") -> None:
    record_path = out_dir / RECORD_NAME
    earlier: list[str] = []
    if record_path.is_file():
        earlier = json.loads(record_path.read_text(encoding="utf-8"))["files"]
    elif out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(
            f"{flag} {out_dir} is not empty and holds no corpus from this script; choose an empty or new {flag}"
        )
    for rel_path in sorted(set(earlier) - set(corpus)):
        stale = out_dir / rel_path
        stale.unlink(missing_ok=True)
        if stale.parent != out_dir and not any(stale.parent.iterdir()):
            stale.parent.rmdir()
    for rel_path, data in corpus.items():
        path = out_dir / rel_path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    record_path.write_text(json.dumps({"files": sorted(corpus)}, indent=1) + "\n", encoding="utf-8")


def _chat_out_problem(out: Path, chat_out: Path | None, num_conversations: int) -> str | None:
    if num_conversations < 0:
        return f"--num-conversations must be 0 or more, got {num_conversations}"
    if chat_out is None:
        return None
    if chat_out.resolve().is_relative_to(out.resolve()) or out.resolve().is_relative_to(chat_out.resolve()):
        return (
            f"--chat-out {chat_out} and --out {out} overlap, so the text pipeline would read the conversations as "
            "text (or the chat one the text); choose a folder beside --out, e.g. --chat-out demo_workspace/chat"
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make_demo_corpus.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder to write the corpus into (empty or earlier corpus)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed; same seed, same bytes (default: 0)")
    parser.add_argument(
        "--num-docs",
        "--num_docs",
        dest="num_docs",
        type=int,
        default=6000,
        help="number of lesson documents, about 250 bytes each (default: 6000, about 1.5 MB)",
    )
    parser.add_argument(
        "--no-bad-files",
        dest="bad_files",
        action="store_false",
        help=f"leave out the deliberately unreadable files ({', '.join(BAD_FILES)}) and bad conversation records",
    )
    parser.add_argument(
        "--chat-out",
        "--chat_out",
        dest="chat_out",
        type=Path,
        help=f"also write {CHAT_FILE}, conversations for a chat fine-tune (data_hf.py --format chat), into this "
        "folder; keep it apart from --out, which the text pipeline reads whole",
    )
    parser.add_argument(
        "--num-conversations",
        dest="num_conversations",
        type=int,
        default=600,
        help="with --chat-out: generated conversations, besides one per DEMO_CHAT_ANSWERS question (default: 600)",
    )
    args = parser.parse_args(argv)
    if args.num_docs < len(CORPUS_FILES):
        print(
            f"make_demo_corpus.py: error: --num-docs must be at least {len(CORPUS_FILES)} (one per file), "
            f"got {args.num_docs}",
            file=sys.stderr,
        )
        return 2
    error = _chat_out_problem(args.out, args.chat_out, args.num_conversations)
    if error:
        print(f"make_demo_corpus.py: error: {error}", file=sys.stderr)
        return 2
    outputs = [("--out", args.out, generate_corpus(args.seed, args.num_docs, args.bad_files))]
    if args.chat_out is not None:
        conversations = generate_conversations(args.seed, args.num_conversations, args.bad_files)
        outputs.append(("--chat-out", args.chat_out, conversations))
    for flag, out_dir, files in outputs:
        try:
            write_corpus(out_dir, files, flag)
        except ValueError as exc:
            print(f"make_demo_corpus.py: error: {exc}", file=sys.stderr)
            return 2
        total = sum(len(data) for data in files.values())
        print(f"make_demo_corpus.py: wrote {len(files)} files, {total / 1e6:.2f} MB to {out_dir} (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
