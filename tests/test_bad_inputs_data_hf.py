"""Bad input to data_hf.py, as a careless user gives it: flags that are missing, empty, out of range or misspelled,
folders that are the wrong thing, and files whose content is broken. Each case is refused with a message naming the
flag or the file and the fix and a non-zero exit, or handled as docs/data.md documents (a skipped file or record,
counted by reason in the summary, and the dataset written: exit 0), and every byte that existed before is still
there afterwards. The cases that cross tools are in tests/test_bad_inputs.py."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

import data_hf
from tests.bad_inputs import Case, check_refused, data_hf_case, make_records, make_user_folders

NEW = "new_ds"  # the --save_dir of the cases that write a dataset (documented handling)
CHAT_OK = {"messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]}


def turns(*pairs: tuple[str, object]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in pairs]}


# --- the user's own inputs, beside the shared folders ------------------------------------------------------------

FILES: dict[str, bytes | str] = {
    "empty_txt/a.txt": "",
    "blank_txt/a.txt": "   \n\t\n  \n",
    "zero_json/a.json": "",
    "number_json/a.json": "42",
    "null_json/a.json": "null",
    "nested_lists/a.json": "[[[[]], []]]",
    "text_not_string/a.jsonl": '{"text": 5}\n{"text": null}\n{"text": [1, 2]}\n',
    "broken_yaml/a.yaml": "key: [unclosed\n  - x: y: z\n",
    "tab_yaml/a.yaml": "key:\n\t- value\n",
    "python_yaml/a.yaml": "!!python/object/apply:os.system ['echo hi']\n",
    "comment_yaml/a.yaml": "# nothing but a comment\n",
    "binary_txt/scan.txt": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x01",
    "nul_in_text/a.txt": b"good text\x00 and more\n",
    "utf16_no_bom/a.txt": "hello world".encode("utf-16-le"),
    "json_comments/a.json": '{\n  // a comment\n  "text": "a",\n}\n',
    "pretty_jsonl/a.jsonl": json.dumps([{"text": "a"}, {"text": "b"}], indent=2),
    "all_bad_jsonl/a.jsonl": "{bad\n{worse\n",
    "blank_jsonl/a.jsonl": "\n\n\n",
    "deep_json/a.json": "[" * 100_000 + "]" * 100_000,
    "huge_int/a.json": "1" * 5000,
    "cut_json/a.json": '[{"text": "one"}, {"text": "tw',
    # one bad element early in a large array: everything after it is lost, and the message says how much
    "array_bad_element/a.json": "["
    + ",".join(['{"text": "ok"}'] * 3 + ["{text: bad}"] + ['{"text": "lost"}'] * 96)
    + "]",
    "one_bad_line/a.jsonl": '{"text": "a"}\n{"text": broken\n{"text": "c"}\n',
    "latin1/a.txt": "caf\u00e9 au lait\n".encode("latin-1"),
    "utf16_bom/a.txt": "hello world\n".encode("utf-16"),
    "utf8_bom/a.txt": b"\xef\xbb\xbfhello with a byte-order mark\n",
    "long_line/a.txt": "x" * 3000,
    "top_string/a.json": '"just one string"',
    "crlf/a.jsonl": '{"text": "a"}\r\n{"text": "b"}\r\n',
    "yaml_bomb/a.yaml": 'a: &a ["lol", "lol"]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\nc: [*b, *b, *b, *b, *b]\n',
    "names/with space.txt": "a file name with a space\n",
    "names/new\nline.txt": "a file name with a newline\n",
    "short/a.txt": "tiny\n",
    "hidden_only/.notes.txt": "hidden\n",
    "unsupported/table.csv": "a,b\n1,2\n",
    "unsupported/paper.pdf": "%PDF-1.4",
    "compressed/a.jsonl.gz": b"\x1f\x8b\x08\x00\x00\x00\x00\x00",
    "table.csv": "a,b\n1,2\n",
    "table.parquet": b"PAR1\x00\x00\x15\x04PAR1",
    "README": "a file without an ending\n",
    "single.txt": "one file given as --data_folder\n",
    "text_and_chat/notes.txt": "plain text beside conversations\n",
    "text_and_chat/chat.jsonl": json.dumps(CHAT_OK) + "\n",
}

RECORDS: dict[str, list[dict]] = {
    "chat_ok": [CHAT_OK],
    "chat_empty_reply": [turns(("user", "hi"), ("assistant", ""))],
    "chat_only_system": [turns(("system", "Be nice."))],
    "chat_role_typos": [turns(("usr", "hi"), ("assistent", "hello"))],
    "chat_system_in_middle": [turns(("user", "hi"), ("system", "Be brief."), ("assistant", "yo"))],
    "chat_null_content": [turns(("user", None), ("assistant", "yo"))],
    "chat_image": [turns(("user", [{"type": "image_url", "image_url": {"url": "x.png"}}]), ("assistant", "a cat"))],
    "chat_messages_string": [{"messages": "user: hi\nassistant: hello"}],
    "chat_bad_tool_args": [
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": "{city: Vesk"}}],
                },  # fmt: skip
                {"role": "tool", "content": "sunny"},
                {"role": "assistant", "content": "Sunny."},
            ]
        }
    ],
    "chat_tools_string": [{**CHAT_OK, "tools": "get_weather"}],
    "sharegpt_typo": [{"conversations": [{"from": "humann", "value": "hi"}, {"from": "gpt", "value": "yo"}]}],
    "chat_one_bad": [CHAT_OK, turns(("usr", "hi"), ("assistant", "yo"))],
    "pair_no_rejected": [{"prompt": "q", "chosen": "a"}] * 3,
    "pair_user_reply": [
        {
            "prompt": [{"role": "user", "content": "q"}],
            "chosen": [{"role": "user", "content": "a"}],
            "rejected": [{"role": "assistant", "content": "b"}],
        }  # fmt: skip
    ],
    "pair_two_chosen": [{"prompt": "q", "chosen": "a", "Chosen": "b", "rejected": "c"}],
    "pair_not_hh": [{"chosen": "just an answer", "rejected": "another answer"}],
    "pair_prompt_ends_assistant": [
        {
            "prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}],
            "chosen": "a",
            "rejected": "b",
        }  # fmt: skip
    ],
    "pair_number": [{"prompt": "q", "chosen": 5, "rejected": "b"}],
    "pair_one_same": [
        {"prompt": "q", "chosen": "a", "rejected": "b"},
        {"prompt": "q2", "chosen": "s", "rejected": "s"},
    ],
    "chat_and_pairs": [CHAT_OK, {"prompt": "q", "chosen": "a", "rejected": "b"}],
}


def make_inputs(root: Path) -> None:
    """The inputs of the table under root/in: broken files, bad records, odd names and links."""
    base = root / "in"
    for name, content in FILES.items():
        path = base / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    for name, records in RECORDS.items():
        make_records(base / name, records)
    (base / "empty_dir").mkdir()
    (base / "non_utf8_name").mkdir()
    with open(os.path.join(os.fsencode(base / "non_utf8_name"), b"caf\xe9.txt"), "wb") as file:
        file.write(b"a file name in Latin-1\n")
    (base / "loop" / "sub").mkdir(parents=True)
    (base / "loop" / "a.txt").write_text("text in a folder that links back to itself\n")
    os.symlink(base / "loop", base / "loop" / "sub" / "back")
    (base / "outside_link").mkdir()
    os.symlink(root / "raw", base / "outside_link" / "raw")
    (base / "with_dataset").mkdir()
    (base / "with_dataset" / "notes.txt").write_text("raw text beside an old dataset\n")
    assert data_hf.main(["--data_folder", str(root / "raw"), "--save_dir", str(base / "with_dataset" / "old")]) == 0
    kept = base / "dataset_and_notes"  # a dataset the user put their own files in, e.g. notes and a backup
    assert data_hf.main(["--data_folder", str(root / "raw"), "--save_dir", str(kept), "--val_fraction", "0.5"]) == 0
    (kept / "NOTES.md").write_text("precious\n")
    (kept / "backup").mkdir()
    (kept / "backup" / "a.txt").write_text("older rows\n")
    (kept / "train" / "scratch.py").write_text("print('mine')\n")
    (base / "with_model").mkdir()
    (base / "with_model" / "notes.txt").write_text("raw text beside a downloaded model\n")
    os.symlink(root / "model", base / "with_model" / "model")


def make_odd_inputs(odd: Path) -> None:
    """What snapshot() cannot read (a pipe blocks, a broken link has no bytes): kept outside the compared root."""
    (odd / "pipe_dir").mkdir()
    os.mkfifo(odd / "pipe_dir" / "pipe.txt")
    (odd / "pipe_dir" / "ok.txt").write_text("text beside a named pipe\n")
    os.mkfifo(odd / "pipe.txt")
    (odd / "broken_link").mkdir()
    os.symlink(odd / "nowhere.txt", odd / "broken_link" / "a.txt")
    (odd / "broken_link" / "b.txt").write_text("text beside a broken link\n")
    os.symlink("loop", odd / "loop")  # a link to itself
    os.symlink(odd / "nowhere", odd / "dangling")


# --- the table ---------------------------------------------------------------------------------------------------


def flag_case(name: str, argv: Callable[[Path], list], *message: str) -> Case:
    """A case argparse refuses (exit 2): a missing, unknown or mistyped flag."""

    return Case(name, lambda root: data_hf.main([str(a) for a in argv(root)]), message, exit_code=2)


def on(folder: str, *flags: object) -> Callable[[Path], list]:
    """argv converting root/in/FOLDER (or root/FOLDER) into root/NEW."""
    return lambda r: ["--data_folder", r / "in" / folder if (r / "in" / folder).exists() else r / folder,
                      "--save_dir", r / NEW, *flags]  # fmt: skip


def written(name: str, folder: str, *message: str, flags: tuple = ()) -> Case:
    """Documented handling: the bad file or record is skipped and counted, the dataset is written, exit 0."""
    return data_hf_case(name, on(folder, *flags), *message, exit_code=0, creates=(NEW,))


def refused_in_auto(name: str, folder: str, reason: str) -> Case:
    """Records shaped like conversations or pairs that all fail: --format auto refuses instead of writing text."""
    return data_hf_case(name, on(folder), reason, "--format auto: all", "none could be used", "pass --format text")


def refused_as(name: str, folder: str, data_format: str, reason: str) -> Case:
    found = {"chat": "conversations", "preference": "preference pairs"}[data_format]
    return data_hf_case(name, on(folder, "--format", data_format), reason, f"no {found} were found", "nothing to save")


def no_rows(name: str, folder: str, reason: str, *detail: str) -> Case:
    """A file that gives nothing: skipped and counted, and a run with nothing else to save is refused."""
    return data_hf_case(
        name, on(folder), reason, *detail, "no rows were extracted from --data_folder", "nothing to save"
    )


FLAG_CASES = [
    flag_case("no flags at all", lambda r: [], "the following arguments are required: --data_folder"),
    flag_case("--save_dir forgotten", lambda r: ["--data_folder", r / "raw"], "required: --save_dir"),
    flag_case(
        "--data_folder followed by another flag",
        lambda r: ["--data_folder", "--save_dir", r / NEW],
        "argument --data_folder/--data-folder: expected one argument",
    ),
    flag_case(
        "--data_folder from an unset shell variable",
        lambda r: ["--data_folder", "", "--save_dir", r / NEW],
        "argument --data_folder/--data-folder: an empty path (an unset shell variable?)",
    ),
    flag_case(
        "--save_dir from an unset shell variable",
        lambda r: ["--data_folder", r / "raw", "--save_dir", ""],
        "argument --save_dir/--save-dir: an empty path",
    ),
    flag_case("--format jsonl", on("raw", "--format", "jsonl"), "argument --format: invalid choice: 'jsonl'"),
    flag_case(
        "--json-mode lines", on("raw", "--json-mode", "lines"), "argument --json-mode/--json_mode: invalid choice"
    ),
    flag_case("--num-proc abc", on("raw", "--num-proc", "abc"), "--num-proc/--num_proc: invalid int value: 'abc'"),
    flag_case("--num-proc 2.5", on("raw", "--num-proc", "2.5"), "invalid int value: '2.5'"),
    flag_case("--max-chars 1e9", on("raw", "--max-chars", "1e9"), "--max-chars/--max_chars: invalid int value"),
    flag_case("--min-chars x", on("raw", "--min-chars", "x"), "--min-chars/--min_chars: invalid int value"),
    flag_case("--val-fraction ten", on("raw", "--val-fraction", "ten"), "invalid float value: 'ten'"),
    flag_case("an unknown flag", on("raw", "--shuffle"), "unrecognized arguments: --shuffle"),
    flag_case("a misspelled --overwrite", on("raw", "--ovewrite"), "unrecognized arguments: --ovewrite"),
]

OPTION_CASES = [
    data_hf_case("--num-proc 0", on("raw", "--num-proc", "0"), "--num-proc 0 must be between 1 and"),
    data_hf_case("--num-proc -1", on("raw", "--num-proc", "-1"), "--num-proc -1 must be between 1 and"),
    data_hf_case("--max-chars 0", on("raw", "--max-chars", "0"), "--max-chars 0 must be between 1 and 100000000"),
    data_hf_case(
        "--max-chars -5", on("raw", "--max-chars", "-5"), "--max-chars -5 must be between", "--max-chars 200000"
    ),
    data_hf_case(
        "--max-chars above the limit", on("raw", "--max-chars", "200000000"), "must be between 1 and 100000000"
    ),
    data_hf_case("--min-chars -1", on("raw", "--min-chars", "-1"), "--min-chars -1 must be 0 or more"),
    data_hf_case(
        "--min-chars above --max-chars", on("raw", "--min-chars", "50", "--max-chars", "10"), "--min-chars 50 exceeds"
    ),
    data_hf_case(
        "--val-fraction 1", on("raw", "--val-fraction", "1"), "--val-fraction 1.0 must be in [0, 1), e.g. 0.01"
    ),
    data_hf_case(
        "--val-fraction as a percent", on("raw", "--val-fraction", "5"), "--val-fraction 5.0 must be in [0, 1)"
    ),
    data_hf_case("--val-fraction -0.1", on("raw", "--val-fraction", "-0.1"), "--val-fraction -0.1 must be in [0, 1)"),
    data_hf_case("--val-fraction nan", on("raw", "--val-fraction", "nan"), "--val-fraction nan must be in [0, 1)"),
    data_hf_case("--extensions ''", on("raw", "--extensions", ""), "--extensions is empty; e.g. --extensions .txt"),
    data_hf_case(
        "--extensions as a glob",
        on("raw", "--extensions", "*.txt"),
        "--extensions *.txt is not a file ending",
        "--extensions txt",
    ),
    data_hf_case("--extensions '.'", on("raw", "--extensions", "."), "--extensions . is not a file ending"),
    data_hf_case(
        "--min-chars above every row",
        on("short", "--min-chars", "100"),
        "no rows were extracted",
        "1 row(s) were shorter than --min-chars 100; lower it",
    ),
    data_hf_case(  # a guessed decoding is no problem the reader can see: Shift JIS read as cp1252 is mojibake
        "--strict with a file that is not UTF-8",
        on("latin1", "--strict"),
        "--strict: 1 file(s) are not UTF-8 and were read as cp1252 (a guess; e.g.",
        "convert them to UTF-8 (iconv -f THEIR_ENCODING -t UTF-8) or drop --strict",
    ),
    data_hf_case(
        "--strict with one bad JSON Lines line",
        on("one_bad_line", "--strict"),
        "invalid_jsonl_line",
        "--strict: 1 problem(s) found (listed above); fix them or drop --strict",
    ),
    data_hf_case(
        "--format chat with --max-chars shorter than the conversation",
        on("chat_ok", "--format", "chat", "--max-chars", "3"),
        "conversation_too_long",
        "> --max-chars 3",
    ),
    data_hf_case(
        "--format chat on plain text",
        on("raw", "--format", "chat"),
        "no conversation files",
        "are not read with --format chat; pass --format text",
    ),
    data_hf_case(
        "--format preference on plain text",
        on("raw", "--format", "preference"),
        "no preference files",
        "pass --format text",
    ),
    refused_as("--format preference on conversations", "chat_ok", "preference", "not_a_preference_pair"),
]

FOLDER_CASES = [
    data_hf_case("--data_folder that does not exist", on("no_such_folder"), "does not exist", "pass the folder"),
    data_hf_case(
        "--data_folder a link that loops",
        lambda r: ["--data_folder", r.parent / "odd" / "loop", "--save_dir", r / NEW],
        "is a symbolic link that leads back to itself (a loop through loop)",
    ),
    data_hf_case(
        "--data_folder under a link that loops",
        lambda r: ["--data_folder", r.parent / "odd" / "loop" / "raw", "--save_dir", r / NEW],
        "is under",
        "a symbolic link that leads back to itself",
    ),
    data_hf_case(
        "--save_dir under a link to nowhere",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r.parent / "odd" / "dangling" / "ds"],
        "--save_dir",
        "nowhere, which does not exist; fix the link, or choose another --save_dir",
    ),
    data_hf_case(
        "--data_folder a link to nowhere",
        lambda r: ["--data_folder", r.parent / "odd" / "dangling", "--save_dir", r / NEW],
        "is a symbolic link to",
        "nowhere, which does not exist",
    ),
    data_hf_case(
        "--data_folder a named pipe",
        lambda r: ["--data_folder", r.parent / "odd" / "pipe.txt", "--save_dir", r / NEW],
        "is neither a folder nor a regular file (a pipe or a device?)",
    ),
    data_hf_case(
        "--data_folder a .csv file", on("table.csv"), "is a file ending in .csv", "pass --extensions csv to read it"
    ),
    data_hf_case("--data_folder a .parquet file", on("table.parquet"), "ending in .parquet", "reads text files only"),
    data_hf_case("--data_folder a file without ending", on("README"), "without an ending", "rename it"),
    data_hf_case("--data_folder an empty folder", on("empty_dir"), "no files with the extensions", "pass --extensions"),
    data_hf_case("--data_folder with only hidden files", on("hidden_only"), "hidden files and folders are skipped"),
    data_hf_case("--data_folder of .csv and .pdf", on("unsupported"), "no files with the extensions .txt .md"),
    data_hf_case("--data_folder of compressed files", on("compressed"), "no files with the extensions"),
    data_hf_case(
        "--save_dir an existing file",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "in" / "single.txt"],
        "exists and is not a folder; choose another --save_dir",
    ),
    data_hf_case(
        "--save_dir under a file",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "in" / "single.txt" / "ds"],
        "single.txt is a file, not a folder; choose a --save_dir under a folder",
    ),
    data_hf_case(
        "--save_dir equal to --data_folder",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "raw"],
        "is not a dataset written by data_hf.py",  # not "pass --overwrite": that would be refused as well
        "choose another --save_dir",
    ),
    data_hf_case(
        "--save_dir equal to --data_folder with --overwrite",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "raw", "--overwrite"],
        "is not a dataset written by data_hf.py",
        "choose another --save_dir",
    ),
    data_hf_case(
        "--save_dir an existing dataset without --overwrite",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "dataset"],
        "--save_dir",
        "already exists; pass --overwrite",
    ),
    data_hf_case(
        "--save_dir a dataset that holds the user's files, with --overwrite",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "in" / "dataset_and_notes", "--overwrite"],
        "is a dataset that also holds NOTES.md, backup/, train/scratch.py, which --overwrite would delete with it",
        "move them out or choose another --save_dir",
    ),
    data_hf_case(
        "--save_dir inside a dataset",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "dataset" / "more"],
        "is inside",
        ", a dataset (data_hf.py or save_to_disk)",
        "choose another --save_dir",
    ),
    data_hf_case(
        "--save_dir inside a training experiment",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "outputs" / "exp" / "data"],
        "is inside",
        "a training experiment of fsdp_train.py",
        "give the dataset a folder of its own",
    ),
    data_hf_case(
        "--save_dir inside a model folder",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "model" / "data"],
        "is inside",
        "a model folder",
    ),
    data_hf_case(
        "--save_dir inside organize_data's split folders",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "splits" / "ds"],
        "is inside",
        "split folders of organize_data.py",
    ),
]

CONTENT_CASES = [
    no_rows("an empty .txt", "empty_txt", "empty_file: 0 bytes"),
    no_rows("a .txt of only whitespace", "blank_txt", "empty_file: only whitespace"),
    no_rows("a 0-byte .json", "zero_json", "a.json: empty_file"),
    no_rows("a JSON Lines file of blank lines", "blank_jsonl", "empty_file"),
    no_rows("JSON whose top level is a number", "number_json", "no_text"),
    no_rows("JSON whose top level is null", "null_json", "no_text"),
    no_rows("JSON of nested empty lists", "nested_lists", "no_text"),
    no_rows("records whose text is not a string", "text_not_string", "no_text"),
    no_rows("YAML that does not parse", "broken_yaml", "invalid_yaml"),
    no_rows("YAML indented with tabs", "tab_yaml", "invalid_yaml", "cannot start any token"),
    no_rows("YAML with a python tag", "python_yaml", "yaml_unsupported_tag"),
    no_rows("YAML of only a comment", "comment_yaml", "no_text"),
    no_rows("a binary file named .txt", "binary_txt", "scan.txt: binary"),
    no_rows("a NUL byte inside text", "nul_in_text", "binary: the file contains NUL bytes"),
    no_rows("UTF-16 without a byte-order mark", "utf16_no_bom", "binary"),
    no_rows("JSON with comments and a trailing comma", "json_comments", "invalid_json"),
    no_rows("pretty-printed JSON named .jsonl", "pretty_jsonl", "invalid_jsonl_line"),
    no_rows("JSON Lines whose every line is broken", "all_bad_jsonl", "a.jsonl:1: invalid_jsonl_line"),
    no_rows("JSON nested 100,000 levels deep", "deep_json", "too_deep"),
    no_rows("JSON of a 5000-digit number", "huge_int", "invalid_json"),
]

RECORD_CASES = [
    refused_in_auto("a conversation whose reply is empty", "chat_empty_reply", "no_assistant_turn"),
    refused_in_auto("a conversation of only a system turn", "chat_only_system", "no_assistant_turn"),
    refused_in_auto("roles misspelled", "chat_role_typos", "unknown_role: turn 1 of 'messages' has the role 'usr'"),
    refused_in_auto("a system turn in the middle", "chat_system_in_middle", "misplaced_system_turn"),
    refused_in_auto("a turn whose content is null", "chat_null_content", "non_string_content"),
    refused_in_auto("an image in a turn", "chat_image", "non_text_content"),
    refused_in_auto("messages as one string", "chat_messages_string", "bad_message"),
    refused_in_auto("a tool call whose arguments are not JSON", "chat_bad_tool_args", "bad_tool_call"),
    refused_in_auto("tools as a bare name", "chat_tools_string", "bad_tools"),
    refused_in_auto("a pair without rejected", "pair_no_rejected", "not_a_preference_pair"),
    refused_in_auto("a pair whose chosen reply is a user turn", "pair_user_reply", "no_assistant_response"),
    refused_in_auto("a pair with chosen and Chosen", "pair_two_chosen", "ambiguous_keys"),
    refused_in_auto("a pair of plain strings without a prompt", "pair_not_hh", "malformed_hh_string"),
    refused_in_auto("a pair whose prompt ends with the assistant", "pair_prompt_ends_assistant", "prompt_not_ending"),
    refused_in_auto("a pair whose chosen is a number", "pair_number", "bad_preference_value"),
    refused_as("a ShareGPT role misspelled, --format chat", "sharegpt_typo", "chat", "has the role 'humann'"),
    refused_as("roles misspelled, --format chat", "chat_role_typos", "chat", "unknown_role"),
    refused_as("a pair without rejected, --format preference", "pair_no_rejected", "preference", "expected chosen"),
]

HANDLED_CASES = [
    written("JSON cut off mid-file", "cut_json", "invalid_json", "read 1 value(s) before it", "1 problems"),
    written(
        "a bad element early in a JSON array",
        "array_bad_element",
        "read 3 value(s) before it; the rest of the file, 1,643 characters (97%), was not read: fix the file there",
        "-> 3 rows",
    ),
    written("one bad line among good JSON Lines", "one_bad_line", "a.jsonl:2: invalid_jsonl_line", "-> 2 rows"),
    written("a Latin-1 file", "latin1", "is not UTF-8; decoded as cp1252"),
    written("UTF-16 with a byte-order mark", "utf16_bom", "is not UTF-8; decoded as utf-16"),
    written("UTF-8 with a byte-order mark", "utf8_bom", "-> 1 rows", "0 problems"),
    written("a line longer than --max-chars", "long_line", "-> 3 rows", flags=("--max-chars", "1000")),
    written("a bare string as the JSON document", "top_string", "-> 1 rows"),
    written("JSON Lines with Windows line ends", "crlf", "-> 2 rows", "0 problems"),
    written("a YAML alias bomb", "yaml_bomb", "0 problems"),
    written("a symlink loop", "loop", "1 files", "-> 1 rows"),
    written("a symlink to a folder outside", "outside_link", "1 files", "-> 1 rows"),
    written("file names with a space and a newline", "names", "2 files", "-> 2 rows"),
    written("a file name that is not UTF-8", "non_utf8_name", "1 files", "-> 1 rows"),
    written("--data_folder a single .txt file", "single.txt", "1 files", "-> 1 rows"),
    written(  # a folder skipped is a problem, not a file
        "a dataset inside --data_folder",
        "with_dataset",
        "not_raw_data",
        "is a dataset",
        "0 files skipped, 1 problems (not_raw_data 1)",
    ),  # fmt: skip
    written("a model folder inside --data_folder", "with_model", "not_raw_data", "is a model folder"),
    written("one bad conversation among good ones", "chat_one_bad", "unknown_role 1", "-> 1 conversations"),
    written("one identical pair among good ones", "pair_one_same", "identical_responses 1", "-> 1 preference pairs"),
    written("conversations beside plain text", "text_and_chat", "because the folder also holds other text"),
    data_hf_case(
        "conversations mixed with pairs",
        on("chat_and_pairs"),
        "--format auto: the folder mixes",
        "holds no plain text",
        "--format chat and --format preference",
    ),
    written(
        "--val-fraction 0.5 of a single row",
        "short",
        "--val-fraction 0.5 gave an empty validation split",
        flags=("--val-fraction", "0.5"),
    ),
    data_hf_case(
        "--save_dir inside --data_folder",
        lambda r: ["--data_folder", r / "raw", "--save_dir", r / "raw" / NEW],
        "1 files",
        "-> 1 rows",
        exit_code=0,
        creates=(f"raw/{NEW}",),
    ),
    data_hf_case(
        "a named pipe among the files",
        lambda r: ["--data_folder", r.parent / "odd" / "pipe_dir", "--save_dir", r / NEW],
        "pipe.txt: read_error: not a regular file",
        "1 files skipped",
        exit_code=0,
        creates=(NEW,),
    ),
    data_hf_case(
        "a broken link among the files",
        lambda r: ["--data_folder", r.parent / "odd" / "broken_link", "--save_dir", r / NEW],
        "a.txt: read_error",
        "a broken link?",
        exit_code=0,
        creates=(NEW,),
    ),
]

CASES = FLAG_CASES + OPTION_CASES + FOLDER_CASES + CONTENT_CASES + RECORD_CASES + HANDLED_CASES


@pytest.fixture(scope="module")
def user_folders(tmp_path_factory, inputs) -> Path:
    base = tmp_path_factory.mktemp("data_hf_bad")
    root = make_user_folders(base / "user", inputs[1])
    make_inputs(root)
    (base / "odd").mkdir()
    make_odd_inputs(base / "odd")
    return root


def test_the_table_has_55_cases_with_distinct_names() -> None:
    assert len(CASES) >= 55 and len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_to_data_hf_is_refused_or_handled(case: Case, user_folders: Path, capsys) -> None:
    check_refused(case, user_folders, capsys)
