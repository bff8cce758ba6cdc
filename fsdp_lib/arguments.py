"""The helper CLIs' argument parser (organize_data.py, data_hf.py, model_download.py): a flag given twice with two
values is refused instead of keeping the last one in silence (`--data-folder a --data-folder b` read b alone), and
a list flag given twice is joined (`--extensions txt --extensions json` reads both); fsdp_train.py's --config is
StoreOnce too (its other flags keep argparse's last-wins: `$COMMAND --lr 1e-5` overrides); and the parsers of
fsdp_train.py's text-valued flags (--data-slice, --profile-steps, --data-weights); no torch."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


class OneValueParser(argparse.ArgumentParser):
    """An ArgumentParser whose plain flags (action store, the default) take one value per command line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, StoreOnce)
        self.register("action", "store", StoreOnce)
        self.given: dict[str, tuple[str, Any]] = {}  # dest -> (the flag as written, its value), per parse

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        self.given = {}
        return super().parse_known_args(args, namespace)


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


class StoreOnce(argparse.Action):
    """store, refusing a second value for the same flag (the same value twice is harmless); per parse in a
    OneValueParser, else per parser."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        if not hasattr(parser, "given"):
            parser.given = {}
        given = parser.given
        if self.dest in given and given[self.dest][1] != values:
            first, value = given[self.dest]
            parser.error(
                f"{first} is given twice ({_shown(value)}, then {option_string} {_shown(values)}); pass it once"
            )
        given[self.dest] = (option_string, values)
        setattr(namespace, self.dest, values)


class JoinRepeats(argparse.Action):
    """A list flag (nargs="+") given twice: the values of every use, in order; the first use replaces the default."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        given = getattr(parser, "given", {})
        joined = [*given[self.dest][1], *values] if self.dest in given else list(values)
        given[self.dest] = (option_string, joined)
        setattr(namespace, self.dest, joined)


# Parsers of fsdp_train.py flag values given as text (None where the text is malformed: checks.py says so).


def parse_data_slice(text: str) -> tuple[int, int | None] | None:
    """'START:END' -> (start, end or None); None when malformed."""
    start, sep, end = (part.strip() for part in text.partition(":"))
    if not sep or not all(part.isdecimal() for part in (start, end) if part):
        return None
    return int(start or 0), (int(end) if end else None)


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """--profile-steps 'START:END' (or one step 'N') -> (START, END), 1 <= START <= END; None when malformed."""
    start, sep, end = text.partition(":")
    parts = (start, end) if sep else (start, start)
    if not all(part.strip().isdecimal() for part in parts):
        return None
    first, last = (int(part) for part in parts)
    return (first, last) if 1 <= first <= last else None


def parse_data_weights(text: str) -> list[float] | None:
    """--data-weights as numbers, or None when it does not parse."""
    try:
        return [float(item) for item in text.split(",")]
    except ValueError:
        return None
