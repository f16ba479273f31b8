"""JSON Lines as the format defines it (jsonlines.org): UTF-8 text, one JSON value per
line, lines ended by "\\n" alone.

Python's `str.splitlines()` also splits on U+2028, U+2029, U+0085 and other separators
that may stand unescaped inside a JSON string, which would cut valid lines in two; every
JSONL read in genlib goes through `split_lines` instead. Writing escapes those
characters anyway (`dumps`), so tools that split the same wrong way read genlab's output.
"""

from __future__ import annotations

import json
import re
from typing import Any

# Characters JSON allows raw inside strings that are escaped on output: the line
# separators other than "\n" (U+2028, U+2029, U+0085), and the other C1 controls, which a
# terminal may act on (U+009B starts a control sequence as ESC [ does) when the results
# go to stdout. The JSON C0 controls are escaped by json.dumps itself.
_ESCAPED_ON_OUTPUT = re.compile("[\u0080-\u009f\u2028\u2029]")


class JsonLineError(ValueError):
    """One line is not a JSON value genlab can use; the message says why."""


def split_lines(data: bytes) -> list[bytes]:
    """The lines of `data`, split on b"\\n" only (a final "\\n" ends a line, it does not
    start an empty one). A trailing "\\r" is left in place: JSON ignores it as space."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def decode_line(raw: bytes) -> str:
    """UTF-8 text of one line. Bytes that are not UTF-8 become lone surrogates
    (surrogateescape), which `loads` reports for that line alone, so one bad line does
    not stop a file from being read."""
    return raw.decode("utf-8", errors="surrogateescape")


def syntax_error(exc: json.JSONDecodeError) -> str:
    """json's words for what is wrong, to be followed by " at" and the place: some of its
    messages end in "at" themselves ("Invalid control character at")."""
    return exc.msg.removesuffix(" at")


def loads(text: str, text_only: bool = True) -> Any:
    """Parse one line; JsonLineError with a one-line reason for anything that is not a
    JSON value (made of valid Unicode text unless `text_only` is False: the caller then
    checks with `check_text`, say to name the line's id in the message)."""
    bad = first_surrogate(text)
    if bad is not None:
        index, char = bad
        if 0xDC80 <= ord(char) <= 0xDCFF:  # how decode_line marks a byte that is not UTF-8
            raise JsonLineError(f"not valid UTF-8 (byte 0x{ord(char) - 0xDC00:02x} at "
                                f"character {index + 1})")
        raise JsonLineError(f"holds a lone surrogate (U+{ord(char):04X}) at character "
                            f"{index + 1}, which is not valid Unicode text")
    try:
        value = json.loads(text, object_pairs_hook=_unique_keys, parse_int=read_integer)
    except json.JSONDecodeError as exc:
        raise JsonLineError(f"not valid JSON ({syntax_error(exc)} at column "
                            f"{exc.colno})") from None
    except _DuplicateKey as exc:
        raise JsonLineError(f"has the key {json.dumps(exc.key)} twice in one object; keep "
                            f"one (JSON readers differ on which one counts)") from None
    except RecursionError:
        raise JsonLineError("not usable JSON: nested too deeply for the parser") from None
    except LongInteger as exc:
        raise JsonLineError(f"not usable JSON: an integer of {exc.digits:,} digits, more "
                            f"than Python reads; no setting takes one, so fix or drop the "
                            f"line") from None
    except ValueError as exc:  # nothing else known: json's own words
        raise JsonLineError(f"not usable JSON ({exc})") from None
    if text_only:
        check_text(value)
    return value


class LongInteger(ValueError):
    """An integer with more digits than Python converts (`read_integer`)."""

    def __init__(self, digits: int) -> None:
        super().__init__(digits)
        self.digits = digits


def read_integer(text: str) -> int:
    """json's `parse_int` for any JSON genlab reads: LongInteger, with the digit count,
    where json's own ValueError would advise raising sys.set_int_max_str_digits."""
    try:
        return int(text)
    except ValueError:  # more digits than sys.get_int_max_str_digits()
        raise LongInteger(len(text.lstrip("-"))) from None


def excerpt(value: Any, width: int) -> str:
    """A JSON value as a message quotes it, as JSON writes it (true, null, "text"; other
    scripts' letters as they are), cut to `width` characters."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= width else text[:width - 3] + "..."


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members, refusing a repeated name: Python's reader keeps the last,
    others the first, so a line with both could mean two things."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def check_text(value: Any) -> None:
    """JsonLineError if any string in a parsed value holds a lone surrogate escape."""
    bad = lone_surrogate(value)
    if bad is not None:
        raise JsonLineError(f"holds a lone surrogate escape ({bad}), which is not valid "
                            f"Unicode text; remove it or escape a complete pair")


def first_surrogate(text: str) -> tuple[int, str] | None:
    """(index, character) of the first surrogate code point in `text`, if any."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start, text[exc.start]
    return None


def lone_surrogate(value: Any) -> str | None:
    """The first lone surrogate in any string of a parsed value, as a `\\uXXXX` escape.
    Walked with an explicit stack: a value nested as deep as the parser allows does not
    overflow Python's own stack here."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found = first_surrogate(item)
            if found is not None:
                return f"\\u{ord(found[1]):04x}"
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None


def dumps(record: Any) -> bytes:
    """One record as a JSONL line (UTF-8, ending in "\\n"). Text stays readable (no
    \\u escapes) except the characters above; a record that still holds a lone surrogate
    is written with every non-ASCII character escaped, which is valid JSON and UTF-8."""
    text = json.dumps(record, ensure_ascii=False)
    # Only inside strings, as JSON has no other place for them: escaping keeps the value.
    text = _ESCAPED_ON_OUTPUT.sub(lambda m: f"\\u{ord(m[0]):04x}", text)
    try:
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(record, ensure_ascii=True) + "\n").encode("ascii")
