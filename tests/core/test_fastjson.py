"""ctxfold.fastjson: orjson where it reads and writes what the standard library would, json elsewhere."""

from __future__ import annotations

import json

import pytest

from ctxfold import fastjson


@pytest.mark.parametrize("text", [
    '{"a": 123456789012345678901234567890}',  # beyond 64 bits: orjson refuses, json reads it
    '{"a": -9223372036854775809, "b": 18446744073709551616, "c": -9223372036854775808}',  # just past orjson's range
    '{"a": NaN, "b": -Infinity}', '{"a": "\\ud800 lone surrogate"}', '{"a": [1.5e300, -0.0, "\u00e9\u4e2d"]}',
    '{"a": 1, "a": 2}',
])
def test_fast_json_reads_what_json_reads(text: str) -> None:
    assert repr(fastjson.loads(text.encode())) == repr(json.loads(text))
    assert repr(fastjson.loads(text)) == repr(json.loads(text))


@pytest.mark.parametrize("text", [
    '{"a": [1, -2, 3.25, true, null], "b": "\u00e9\u4e2d\\n\\"q\\"", "c": {"d": []}}',
    '{"a": 123456789012345678901234567890}', '{"a": NaN}', '{"a": "\\ud800"}',
])
def test_fast_json_writes_what_it_read(text: str) -> None:
    value, fast = fastjson.loads_tagged(text.encode())
    out = fastjson.dumps(value, fast=fast)
    assert repr(json.loads(out.decode("utf-8", "surrogatepass"))) == repr(json.loads(text))
    assert out == fastjson.dumps(value) or fast  # the standard library's bytes unless orjson read it


def test_fast_json_refuses_what_json_refuses() -> None:
    with pytest.raises(json.JSONDecodeError):
        fastjson.loads(b'{"a": }')
    with pytest.raises(UnicodeDecodeError):
        fastjson.loads(b'{"a": "\xff"}')


@pytest.mark.parametrize("value", [
    {"seq": 1, "message": {"role": "user", "content": "plain \u00e9\u4e2d", "usage": None}},
    {"a": "lone \ud800 surrogate", "b": [1, 2]},
    {"a": float("nan"), "b": None},  # orjson would write NaN as null: json writes it
    {"a": [float("inf"), {"b": -float("inf")}], "null": "null"},
    {"a": 123456789012345678901234567890},
    {1: "an int key"},
])
def test_a_record_reads_back_as_the_value_and_is_valid_utf8(value: object) -> None:
    out = fastjson.dumps_record(value)
    out.decode("utf-8")  # strict: a lone surrogate is escaped, not written raw
    assert b"\n" not in out  # one record, one line
    assert repr(fastjson.loads(out)) == repr(json.loads(json.dumps(value)))


def test_a_record_without_a_non_finite_float_is_written_by_orjson() -> None:
    value = {"usage": {"cached_prompt_tokens": None, "ratio": 0.5}, "text": "x" * 1000}
    out = fastjson.dumps_record(value)
    assert json.loads(out) == value
    if fastjson.orjson is not None:
        assert out == fastjson.orjson.dumps(value)


def test_only_long_numbers_outside_strings_leave_orjson() -> None:
    if fastjson.orjson is None:
        pytest.skip("orjson is not installed: json reads everything")
    digits = "123456789012345678901234567890"
    assert fastjson.loads_tagged(f'{{"id": "{digits}", "t": "\\" {digits}"}}'.encode())[1] is True
    assert fastjson.loads_tagged(f'{{"n": {digits}}}'.encode()) == ({"n": int(digits)}, False)
    assert fastjson.loads_tagged(f'["\\\\", {digits}]') == (["\\", int(digits)], False)
