"""The bounded reader of users' JSON: every hostile file is one StackError in one style, and nothing escapes as a
RecursionError, OverflowError or bare ValueError; the stack's own files read back unchanged."""

import json
import math

import pytest

from stack.errors import StackError
from stack.safe_values import escaped
from stack.user_json import MAX_DEPTH, nesting_depth, parse_json, read_json

FIX = "write it again"


def _refusal(tmp_path, content: bytes, **kwargs) -> str:
    path = tmp_path / "report.json"
    path.write_bytes(content)
    with pytest.raises(StackError) as caught:
        read_json(path, "a test report", FIX, **kwargs)
    message = str(caught.value)
    assert message.startswith(f"{path}: expected a test report") and message.endswith(FIX), message
    assert "\n" not in message, "one line"
    return message


@pytest.mark.parametrize("content, names", [
    (b"[" * 100_000 + b"]" * 100_000, "nested more than 64 levels deep"),
    (b'{"n": 1e999}', "the number 1e999"),
    (b'{"n": -1e400}', "the number -1e400"),
    (b'{"n": Infinity}', "the number Infinity"),
    (b'{"n": ' + b"9" * 5000 + b"}", "(5000 digits)"),
    (b'{"n": 1', "invalid JSON at line 1"),
    (b"\xff\xfe\x00binary", "binary data"),
    (b"[1, 2]", "found a JSON array"),
])
def test_hostile_json_is_one_clean_refusal(tmp_path, content, names):
    assert names in _refusal(tmp_path, content)


def test_a_file_larger_than_the_limit_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "report.json"
    with path.open("wb") as handle:  # sparse: a huge size costs no disk, and reading it would take minutes
        handle.truncate(2 * 1024 ** 4)
    with pytest.raises(StackError, match="found 2097152 MiB"):
        read_json(path, "a test report", FIX)


def test_a_folder_or_nothing_is_named(tmp_path):
    with pytest.raises(StackError, match="found a folder"):
        read_json(tmp_path, "a test report", FIX)
    with pytest.raises(StackError, match="found nothing"):
        read_json(tmp_path / "absent.json", "a test report", FIX)


def test_the_stacks_own_json_reads_back_unchanged(tmp_path):
    written = {"rows": [{"policy": "network", "seed": 3, "metrics": {"ds": 0.734, "pdms": -0.5}}], "low": math.nan,
               "meta": {"clock_ns": 1_764_000_000_000_000_000, "brackets in text": "[[{{", "nested": [[[[1]]]]}}
    path = tmp_path / "drive.json"
    path.write_text(json.dumps(written, indent=2))
    read = read_json(path, "a drive report", FIX)
    assert math.isnan(read.pop("low")) and read == {key: value for key, value in written.items() if key != "low"}


def test_depth_counts_brackets_outside_strings_only():
    assert nesting_depth('{"a": "[[[[\\"[[", "b": [[1]]}') == 3
    assert parse_json("[" * MAX_DEPTH + "]" * MAX_DEPTH, "text", "an array", FIX, expect=list)


def test_printed_names_are_escaped():
    assert escaped("car\x1b[2J\rname") == "car\\x1b[2J\\rname"
    assert escaped("x" * 500, limit=10) == "x" * 10 + "..."
    path_with_escape = "evil\x1b]0;owned\x07.json"
    with pytest.raises(StackError) as caught:
        read_json(path_with_escape, "a test report", FIX)
    assert "\x1b" not in str(caught.value) and "\\x1b" in str(caught.value)


def test_what_the_stack_writes_at_its_limits_reads_back(tmp_path):
    """A 64-bit seed and, where the caller allows it (gate.json's infinite drop), Infinity."""
    path = tmp_path / "gate.json"
    path.write_text(json.dumps({"seed": 2 ** 64 - 1, "drop": math.inf}))
    assert read_json(path, "a gate record", FIX, infinity=True) == {"seed": 2 ** 64 - 1, "drop": math.inf}
    with pytest.raises(StackError, match="found the number Infinity"):
        read_json(path, "a gate record", FIX)
