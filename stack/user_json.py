"""One bounded reader for the JSON files the stack reads back from users' folders.

Drive reports, bench records, gate.json, shard manifests and reference cards are files a user (or anyone who
can write to their folder) may have edited. Python's `json` has no limits of its own: nesting deeper than the
interpreter's stack escapes as RecursionError, `1e999` parses to inf, a 5,000-digit integer raises a bare
ValueError, and a multi-gigabyte file is read whole before anything is checked. `read_json` / `parse_json`
check the size before reading, the nesting before parsing, refuse infinite and huge numbers while parsing,
and the top-level type after; every refusal is a `StackError` in one style: what the file should be, what
was found, what to do. Standard library only.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from stack.errors import StackError
from stack.safe_values import escaped

MAX_BYTES = 1024 ** 3
"""Largest JSON file read: a drive report holds ~1.5 kB per episode and policy, so the schema's 100,000 episodes
of five policies stay below it; a bench record is a few kB."""
MAX_DEPTH = 64
"""Deepest nesting of objects and arrays (the stack's own files nest at most ~6 levels)."""
MAX_NUMBER = 2.0 ** 64
"""Largest magnitude of a number: any 64-bit seed or hash, a nanosecond clock; far below where floats overflow."""
MAX_DIGITS = 20
"""Longest integer literal (digits) parsed."""


def read_json(path: str | Path, what: str, fix: str, expect: type = dict, max_bytes: int = MAX_BYTES,
              infinity: bool = False):
    """The parsed JSON at `path`, which should be `what` (e.g. "a stack drive report"); `fix` says what to do
    when it is not (e.g. "drive again to rewrite it"). `infinity`: ±Infinity is read (gate.json records an
    infinite drop where a metric is NaN for one model only)."""
    path = Path(path)
    if not path.is_file():
        found = "a folder" if path.is_dir() else "nothing"
        raise StackError(f"{escaped(str(path))}: expected {what} (a JSON file); found {found}. {fix}")
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise StackError(f"{escaped(str(path))}: expected {what} of at most {max_bytes // (1024 * 1024)} MiB; "
                             f"found {size / (1024 * 1024):.0f} MiB, more than the stack writes. {fix}")
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise StackError(f"{escaped(str(path))}: expected {what} (JSON text); found binary data. {fix}") from None
    except OSError as exc:
        raise StackError(f"{escaped(str(path))}: expected {what}; it cannot be read ({exc.strerror or exc}). "
                         f"{fix}") from None
    return parse_json(text, f"{escaped(str(path))}", what, fix, expect, infinity, max_bytes)


def parse_json(text: str | bytes, source: str, what: str, fix: str, expect: type = dict, infinity: bool = False,
               max_bytes: int = MAX_BYTES):
    """`text` (or UTF-8 bytes: a shard member, a file's metadata entry) parsed under the limits above; `source`
    names where it came from in the error."""
    if not isinstance(text, (str, bytes, bytearray, memoryview)):
        raise StackError(f"{source}: expected {what} (JSON text); found {type(text).__name__}. {fix}")
    if len(text) > max_bytes:
        raise StackError(f"{source}: expected {what} of at most {max_bytes:,} bytes; found {len(text):,}. {fix}")
    if not isinstance(text, str):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            raise StackError(f"{source}: expected {what} (JSON text); found binary data. {fix}") from None
    depth = nesting_depth(text)
    if depth > MAX_DEPTH:
        raise StackError(f"{source}: expected {what}; found JSON nested more than {MAX_DEPTH} levels deep (at most "
                         f"{MAX_DEPTH} are read). {fix}")
    try:
        value = json.loads(text, parse_constant=_infinity_read if infinity else _refuse_constant,
                           parse_int=_bounded_int, parse_float=_bounded_float)
    except json.JSONDecodeError as exc:
        raise StackError(f"{source}: expected {what}; found invalid JSON at line {exc.lineno} column {exc.colno} "
                         f"({exc.msg}); the file may be cut short or edited. {fix}") from None
    except _NumberOutOfRange as exc:
        raise StackError(f"{source}: expected {what}; found the number {exc} (numbers are NaN or within "
                         f"±2^64). {fix}") from None
    if not isinstance(value, expect):
        raise StackError(f"{source}: expected {what} (a JSON {_json_type(expect)}); found a JSON "
                         f"{_json_type(type(value))}. {fix}")
    return value


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
"""A JSON string, or an unclosed one to the end of the text (which json refuses anyway): matching those too keeps
the scan linear (a pattern that must close would retry from every later quote)."""
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")


def nesting_depth(text: str, limit: int = MAX_DEPTH + 1) -> int:
    """The deepest nesting of `[`/`{` outside strings (at most `limit`), known before json recurses.

    Strings, then all but brackets, are cut out by regex, then innermost pairs peeled one level a pass: a few
    passes in C for a nuScenes table of hundreds of MB, at most `limit` for a bomb. Brackets that never close
    count as levels (json recurses into them before it finds the end missing)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    depth = 0
    while brackets and depth < limit:
        inner = _INNERMOST.sub("", brackets)
        if inner == brackets:
            break
        brackets, depth = inner, depth + 1
    return min(limit, depth + brackets.count("[") + brackets.count("{"))


class _NumberOutOfRange(ValueError):
    pass


def _refuse_constant(name: str) -> float:
    """NaN stays (the stack writes it for "no value": an interval never computed); ±Infinity does not."""
    if name == "NaN":
        return math.nan
    raise _NumberOutOfRange(name)


def _infinity_read(name: str) -> float:
    return float(name.replace("Infinity", "inf"))


def _bounded_int(literal: str) -> int:
    if len(literal.lstrip("-")) > MAX_DIGITS or abs(int(literal)) > MAX_NUMBER:
        raise _NumberOutOfRange(literal if len(literal) <= 24 else f"{literal[:20]}... ({len(literal)} digits)")
    return int(literal)


def _bounded_float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value) or abs(value) > MAX_NUMBER:
        raise _NumberOutOfRange(literal if len(literal) <= 24 else f"{literal[:20]}...")
    return value


def _json_type(kind: type) -> str:
    return {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
            type(None): "null"}.get(kind, kind.__name__)


def read_json_or_none(path: str | Path, expect: type = dict):
    """The parsed JSON at `path` under the same limits, or None when it is absent, unreadable or refused: for
    callers that treat such a file as "none there" and let the reader that needs it say what is wrong."""
    try:
        return read_json(path, "JSON", "", expect)
    except (StackError, OSError):
        return None
