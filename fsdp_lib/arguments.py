"""The helper CLIs' argument parser (organize_data.py, data_hf.py, model_download.py): a flag given twice with two
values is refused instead of keeping the last one in silence (`--data-folder a --data-folder b` read b alone), and
a list flag given twice is joined (`--extensions txt --extensions json` reads both); fsdp_train.py's --config is
StoreOnce too (its other flags keep argparse's last-wins: `$COMMAND --lr 1e-5` overrides); no torch."""

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
