#!/usr/bin/env python3
"""Write the synthetic corpus that `make demo` trains a tiny model on.

    python scripts/make_demo_corpus.py --out demo_workspace/raw
    python scripts/make_demo_corpus.py --out /tmp/corpus --seed 1 --num-docs 500 --no-bad-files

The corpus is a few thousand short, templated facts ("The capital of Norland is Vesk.", "The cow says moo.",
"Monday, Tuesday, Wednesday, Thursday, ...") repeated in varied order: a model of a few hundred thousand
parameters learns them in a few hundred steps, so generating from DEMO_PROMPTS before and after training
shows the difference at a glance (noise first, the right completion after). The facts come in every
format data_hf.py reads (.txt .md .json .jsonl .yaml, one multi-document YAML file) over nested folders,
with same-named files in different folders, plus two deliberately bad files (malformed JSON, binary bytes
in a .txt) that the pipeline must skip; --no-bad-files leaves those out. Same --seed and --num-docs,
same bytes.
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
# CLI
# --------------------------------------------------------------------------------------------------------

# Lists the files of the last run, so a rerun into the same --out can remove what it no longer writes
# (e.g. the bad files after --no-bad-files). Hidden, so data tools skip it.
RECORD_NAME = ".demo_corpus.json"


def write_corpus(out_dir: Path, corpus: dict[str, bytes]) -> None:
    record_path = out_dir / RECORD_NAME
    earlier: list[str] = []
    if record_path.is_file():
        earlier = json.loads(record_path.read_text(encoding="utf-8"))["files"]
    elif out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(
            f"--out {out_dir} is not empty and holds no corpus from this script; choose an empty or new --out"
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
        help=f"leave out the deliberately unreadable files ({', '.join(BAD_FILES)})",
    )
    args = parser.parse_args(argv)
    if args.num_docs < len(CORPUS_FILES):
        print(
            f"make_demo_corpus.py: error: --num-docs must be at least {len(CORPUS_FILES)} (one per file), "
            f"got {args.num_docs}",
            file=sys.stderr,
        )
        return 2
    corpus = generate_corpus(args.seed, args.num_docs, args.bad_files)
    try:
        write_corpus(args.out, corpus)
    except ValueError as exc:
        print(f"make_demo_corpus.py: error: {exc}", file=sys.stderr)
        return 2
    total = sum(len(data) for data in corpus.values())
    print(f"make_demo_corpus.py: wrote {len(corpus)} files, {total / 1e6:.2f} MB to {args.out} (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
