"""Runs several cases of the tools' main() in one interpreter and prints, as JSON, each case's exit code and what it
said: the bad-input tests run it where the OS enforces file permissions (as root without the capabilities that
bypass them), which the test process itself cannot give up and get back. Usage: run_mains.py CASES.json"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tools, as the tests import them
from fsdp_lib.interrupts import exit_without_teardown  # noqa: E402


def run_case(tool: str, argv: list[str]) -> dict:
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        try:
            code = importlib.import_module(tool).main(argv)
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 1
        except BaseException:  # noqa: BLE001 - a traceback is what the test looks for
            traceback.print_exc()
            code = -1
    return {"code": code, "said": said.getvalue()}


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        cases = json.load(f)
    print(json.dumps([run_case(case["tool"], case["argv"]) for case in cases]))


if __name__ == "__main__":
    main()
    exit_without_teardown(0)
