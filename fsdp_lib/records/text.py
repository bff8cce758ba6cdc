"""Text records: the strings of a parsed JSON or YAML value (extract_strings: what --format text keeps of a record)
and the cutting of a long text into rows of at most --max-chars characters (split_long_text). Pure functions."""

from __future__ import annotations

from collections.abc import Iterator


def extract_strings(value: object, *, track_shared: bool = False, seen: set[int] | None = None) -> Iterator[str]:
    """Every string value inside `value`, in document order. Dict keys are not text; numbers and booleans are not
    strings. Iterative, so nesting of any depth is walked without recursion.

    track_shared: visit each container object once. YAML aliases make one mapping or list appear in several
    places, or even inside itself; visiting it once stops self-reference loops and "billion laughs" alias
    bombs (an alias to a plain string still repeats the string). `seen`: share the visited set between calls (the
    records of one YAML document).
    """
    seen = set() if seen is None else seen
    stack: list[Iterator[object]] = [iter((value,))]
    while stack:
        for item in stack[-1]:
            if isinstance(item, str):
                yield item
            elif isinstance(item, (dict, list, tuple)):
                if track_shared:
                    if id(item) in seen:
                        continue
                    seen.add(id(item))
                stack.append(iter(item.values()) if isinstance(item, dict) else iter(item))
                break
        else:
            stack.pop()


def split_long_text(text: str, max_chars: int) -> list[str]:
    """Cut `text` into pieces of at most `max_chars` characters, after the last blank line that fits, else after the
    last newline, else hard. Concatenating the pieces gives back `text` exactly."""
    if len(text) <= max_chars:
        return [text]
    pieces = []
    start = 0
    while len(text) - start > max_chars:
        limit = start + max_chars
        blank_lf, blank_crlf = text.rfind("\n\n", start, limit), text.rfind("\n\r\n", start, limit)
        if blank_lf >= 0 or blank_crlf >= 0:
            cut = max(blank_lf + 2 if blank_lf >= 0 else 0, blank_crlf + 3 if blank_crlf >= 0 else 0)
        else:
            newline = text.rfind("\n", start, limit)
            cut = newline + 1 if newline >= 0 else limit
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces
