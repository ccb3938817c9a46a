"""`parse_json_object`: the value of a flag that holds a JSON object, as text or a dict."""

from __future__ import annotations

from typing import Any

import pytest

from paged.runner.json_flag import parse_json_object


def test_text_and_mappings_give_a_dict_with_string_keys() -> None:
    assert parse_json_object('{"a": 1, "b": {"c": [2]}}', "flag") == {"a": 1, "b": {"c": [2]}}
    given = {"a": 1}
    parsed = parse_json_object(given, "flag")
    assert parsed == given and parsed is not given  # a copy: the caller's dict is not kept
    odd: dict[Any, Any] = {1: "x"}
    assert parse_json_object(odd, "flag") == {"1": "x"}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{a: 1}", r"^my_flag: not valid JSON \(Expecting property name"),
        ("", r"^my_flag: not valid JSON \("),
        ("[1, 2]", r"^my_flag: must be a JSON object, got list$"),
        ("null", r"^my_flag: must be a JSON object, got NoneType$"),
        (["a"], r"^my_flag: must be a JSON object, got list$"),
    ],
)
def test_anything_else_is_a_value_error_naming_the_flag(value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_json_object(value, "my_flag")
