"""`StructuredOutputsParams` -> the llguidance grammar that enforces it.

One constraint kind per request (`SamplingParams.validate` checks that). The
result is llguidance's grammar text, which `LLMatcher` compiles; nothing here
touches a tokenizer, so the API process can turn bad input into a 400 cheaply.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from paged.scheduler import StructuredOutputsParams
from paged.server.structured_output.json_options import (
    JsonGrammarOptions,
    forbid_additional_properties,
)


class GrammarError(ValueError):
    """The constraint cannot be compiled; `param` names the request field, the message why."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class GrammarKey(NamedTuple):
    """What a compiled grammar is cached under: (kind, text, whitespace flag)."""

    kind: str
    text: str
    disable_any_whitespace: bool


def grammar_key(params: StructuredOutputsParams) -> GrammarKey:
    """The cache key of `params`' single constraint (`GrammarError` if it has none or several)."""
    kinds = params.kinds()
    if len(kinds) != 1:
        raise GrammarError(
            "structured_outputs", f"structured_outputs must set exactly one constraint, got {kinds}"
        )
    kind = kinds[0]
    text: str
    if kind == "json_object":
        text = ""
    elif kind == "choice":
        text = json.dumps(params.choice)
    else:
        value = getattr(params, kind)
        assert isinstance(value, str)
        text = value
    return GrammarKey(kind, text, params.disable_any_whitespace)


def _json_schema(text: str, key: GrammarKey, options: JsonGrammarOptions) -> str:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError("json", f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError("json", "the JSON schema must be an object or a boolean")
    if options.disable_additional_properties and key.kind == "json":
        schema = forbid_additional_properties(schema)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema),
            defaults=options.llguidance_defaults(key.disable_any_whitespace),  # type: ignore[arg-type]
        )
    except ValueError as e:
        raise GrammarError("json", f"invalid JSON schema: {e}") from None


def _choice(text: str) -> str:
    choices = json.loads(text)
    if not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("choice", "choice must be a non-empty list of strings")
    # Lark string literals share JSON's escapes.
    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(c) for c in choices)
    )


def _grammar(text: str) -> str:
    if not text.strip():
        raise GrammarError("grammar", "grammar must not be empty")
    try:
        lark = any_to_lark(text)  # Lark passes through; GBNF/EBNF (llama.cpp's) is converted
    except Exception as e:  # the converter raises bare Exceptions on bad GBNF
        raise GrammarError("grammar", f"cannot parse the grammar: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _structural_tag(text: str) -> str:
    """vLLM's structural tag: free text, in which each trigger starts `begin schema end`.

    The JSON form is `{"type": "structural_tag", "structures": [{"begin", "schema",
    "end"}], "triggers": [...]}` (the `type` key is optional); each structure's
    `begin` must start with one of the triggers, as vLLM's guidance backend
    requires. Triggers are matched as text, never as special tokens, so a
    tag works whatever the tokenizer. The newer xgrammar-only `format` form is
    refused by name.
    """
    param = "structural_tag"
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(param, f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise GrammarError(param, "structural_tag must be a JSON object")
    if "format" in spec:
        raise GrammarError(
            param,
            "structural_tag's 'format' form (xgrammar's) is not supported; "
            "give 'structures' and 'triggers'",
        )
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise GrammarError(param, "structural_tag needs a non-empty 'structures' list")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        raise GrammarError(param, "structural_tag needs 'triggers', a list of non-empty strings")
    tags: list[llguidance.StructTag] = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str):
            raise GrammarError(param, f"structural_tag.structures[{i}] needs a 'begin' string")
        begin, end, schema = s["begin"], s.get("end", ""), s.get("schema", True)
        if not isinstance(end, str):
            raise GrammarError(param, f"structural_tag.structures[{i}].end must be a string")
        if not isinstance(schema, dict | bool):
            raise GrammarError(
                param, f"structural_tag.structures[{i}].schema must be a JSON schema object"
            )
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise GrammarError(
                param,
                f"structural_tag.structures[{i}].begin {begin!r} starts with none of "
                f"the triggers {triggers}",
            )
        # A bare boolean schema is written as its object equivalent (%json needs an object).
        grammar = schema if isinstance(schema, dict) else ({} if schema else {"not": {}})
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=grammar, end=end))
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


def grammar_text(key: GrammarKey, options: JsonGrammarOptions | None = None) -> str:
    """The llguidance grammar for `key` (`GrammarError` for input that is malformed up front).

    `options` shape JSON grammars (default: `JsonGrammarOptions()`). Errors that
    only compilation finds (an unsupported schema keyword, a regex that does not
    parse) come from `GrammarCompiler`.
    """
    kind, text = key.kind, key.text
    options = options or JsonGrammarOptions()
    if kind == "json":
        return _json_schema(text, key, options)
    if kind == "json_object":
        return _json_schema('{"type": "object"}', key, options)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return _choice(text)
    if kind == "grammar":
        return _grammar(text)
    if kind == "structural_tag":
        return _structural_tag(text)
    raise GrammarError(kind, f"structured output kind {kind!r} is not supported yet")
