"""JSON grammar shape: bounded whitespace by default, vLLM's two engine-wide JSON keys."""

from __future__ import annotations

import json
from typing import Any

import pytest

from paged.scheduler import StructuredOutputsParams
from paged.server.structured_output import GrammarCompiler, grammar_key, load_ll_tokenizer
from paged.server.structured_output.json_options import (
    JsonGrammarOptions,
    forbid_additional_properties,
)

SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {}}},
        "required": ["a"],
    }
)


def _accepts(tokenizer: Any, options: JsonGrammarOptions, text: str, **so: Any) -> bool:
    ll = load_ll_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiler = GrammarCompiler(ll, eos_token_ids=[tokenizer.eos_token_id], json_options=options)
    matcher = compiler.new_matcher(grammar_key(StructuredOutputsParams(**so)))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


PRETTY = '{\n  "a": 1,\n  "b": [\n    2\n  ]\n}'
NEWLINES = '{\n\n\n\n\n\n"a": 1}'
SPACES = '{"a":' + " " * 9 + "1}"


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        # paged's default: one line break then at most 8 spaces or tabs.
        (JsonGrammarOptions(), {PRETTY: True, NEWLINES: False, SPACES: False, '{"a":1}': True}),
        (
            JsonGrammarOptions(max_json_whitespace=None),  # vLLM's unbounded whitespace
            {PRETTY: True, NEWLINES: True, SPACES: True, '{"a":1}': True},
        ),
        (
            JsonGrammarOptions(max_json_whitespace=None, disable_any_whitespace=True),
            {PRETTY: False, NEWLINES: False, '{"a": 1}': False, '{"a":1}': True},
        ),
    ],
)
def test_whitespace_between_json_tokens(
    tokenizer: Any, options: JsonGrammarOptions, expected: dict[str, bool]
) -> None:
    for kind in ({"json": SCHEMA}, {"json_object": True}):
        got = {text: _accepts(tokenizer, options, text, **kind) for text in expected}
        assert got == expected, kind


def test_request_flag_still_disables_whitespace(tokenizer: Any) -> None:
    options = JsonGrammarOptions()
    assert not _accepts(tokenizer, options, '{"a": 1}', json=SCHEMA, disable_any_whitespace=True)
    assert _accepts(tokenizer, options, '{"a":1}', json=SCHEMA, disable_any_whitespace=True)


def test_disable_additional_properties_closes_objects(tokenizer: Any) -> None:
    extra = '{"a": 1, "z": 2}'
    assert _accepts(tokenizer, JsonGrammarOptions(), extra, json=SCHEMA)
    closed = JsonGrammarOptions(disable_additional_properties=True)
    assert not _accepts(tokenizer, closed, extra, json=SCHEMA)
    assert _accepts(tokenizer, closed, '{"a": 1}', json=SCHEMA)
    # json_object has no properties to close: any object still goes.
    assert _accepts(tokenizer, closed, extra, json_object=True)


def test_forbid_additional_properties_walks_every_subschema() -> None:
    schema = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "properties": {"x": {}}},
            "list": {"type": "array", "items": {"properties": {"y": {}}}},
            "open": {"properties": {"z": {}}, "additionalProperties": True},
        },
        "anyOf": [{"properties": {"w": {}}}],
        "$defs": {"d": {"properties": {"v": {}}}},
        "default": {"properties": {}},  # data, not a schema: left alone
    }
    got = forbid_additional_properties(schema)
    assert got["additionalProperties"] is False
    assert got["properties"]["inner"]["additionalProperties"] is False
    assert got["properties"]["list"]["items"]["additionalProperties"] is False
    assert got["properties"]["open"]["additionalProperties"] is True
    assert got["anyOf"][0]["additionalProperties"] is False
    assert got["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in got["default"]
    assert "additionalProperties" not in schema  # the input is not mutated


def test_bad_whitespace_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="max_json_whitespace must be >= 0"):
        JsonGrammarOptions(max_json_whitespace=-1)
