"""`LLM.generate` under constraints, on a tiny random model: outputs always satisfy them.

The schemas are random but bounded (strings have maxLength, integers a range,
arrays maxItems, objects no additional properties), so every constrained
output must end by itself with finish_reason "stop" well inside max_tokens.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest

from paged.scheduler import SamplingParams, StructuredOutputsParams
from paged.server.errors import InvalidRequestError

NUM_SCHEMAS = 100
WORDS = ["alpha", "beta", "gamma", "delta", "x y", "é", 'q"t']


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    kinds = ["string", "integer", "boolean", "enum", "null"]
    if depth < 3:
        kinds += ["array", "object", "object"]
    kind = rng.choice(kinds)
    if kind == "string":
        lo = rng.randint(0, 2)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 6)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        return {"enum": rng.sample([*WORDS, 1, 2, True], rng.randint(1, 4))}
    if kind == "array":
        lo = rng.randint(0, 1)
        items = random_schema(rng, depth + 1)
        return {"type": "array", "items": items, "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    names = rng.sample(["id", "name", "tags", "info", "n", "ok", "child"], rng.randint(1, 3))
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


def _json_params(schema: dict[str, Any], seed: int) -> SamplingParams:
    constraint = StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True)
    return SamplingParams(max_tokens=600, seed=seed, structured_outputs=constraint)


def test_random_json_schemas_always_validate(tiny_llm: Any) -> None:
    rng = random.Random(1234)
    schemas = [random_schema(rng, depth=1 if i % 4 else 2) for i in range(NUM_SCHEMAS)]
    schemas = [
        s
        if s.get("type") == "object"
        else {
            "type": "object",
            "properties": {"v": s},
            "required": ["v"],
            "additionalProperties": False,
        }
        for s in schemas
    ]
    params = [_json_params(s, seed=i) for i, s in enumerate(schemas)]
    outs = tiny_llm.generate(["Answer in JSON:"] * len(schemas), params, use_tqdm=False)
    for schema, out in zip(schemas, outs, strict=True):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
    # The random model wrote varied, non-trivial JSON (not one short answer).
    texts = {o.outputs[0].text for o in outs}
    assert len(texts) > NUM_SCHEMAS // 2
    assert sum(len(t) for t in texts) / len(texts) > 10


@pytest.mark.parametrize(
    "pattern", [r"[a-c]{2,5}-\d\d", r"(yes|no)!?", r"[a-z0-9_]{1,6}@[a-z]{1,4}\.(com|org)"]
)
def test_regex_outputs_fullmatch(tiny_llm: Any, pattern: str) -> None:
    params = [
        SamplingParams(
            max_tokens=64, seed=s, structured_outputs=StructuredOutputsParams(regex=pattern)
        )
        for s in range(8)
    ]
    outs = tiny_llm.generate(["hi"] * 8, params, use_tqdm=False)
    for out in outs:  # bounded patterns: every output ends by itself
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text


def test_choice_outputs_are_one_of_the_choices(tiny_llm: Any) -> None:
    choices = ["red", "green", "blue sky", "日本"]
    constraint = StructuredOutputsParams(choice=choices)
    params = [
        SamplingParams(max_tokens=16, seed=s, structured_outputs=constraint) for s in range(16)
    ]
    outs = tiny_llm.generate(["colour?"] * 16, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert set(texts) <= set(choices) and len(set(texts)) > 1


def test_unconstrained_outputs_unchanged_by_constrained_neighbours(tiny_llm: Any) -> None:
    """The issue's batch of 32: 12 unconstrained (greedy and seeded) beside 20 constrained."""
    words = ["hello world", "the quick brown fox", "0123456789", "abc"]
    prompts = [f"{words[i % 4]} {i}" for i in range(12)]
    free = [
        SamplingParams(max_tokens=24, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
        for i in range(12)
    ]
    alone = tiny_llm.generate(prompts, free, use_tqdm=False)
    rng = random.Random(7)
    constrained = [_json_params(random_schema(rng, depth=2), seed=i) for i in range(14)]
    constrained += [
        SamplingParams(max_tokens=24, seed=i, structured_outputs=StructuredOutputsParams(regex=r))
        for i, r in enumerate([r"[a-c]{2,5}-\d\d", r"(yes|no)!?", r"\d+"] * 2)
    ]
    batch = [*prompts, *["json:"] * 20]
    mixed = tiny_llm.generate(batch, [*free, *constrained], use_tqdm=False)
    assert len(mixed) == 32
    assert [o.outputs[0].token_ids for o in mixed[:12]] == [o.outputs[0].token_ids for o in alone]


def test_llm_refuses_bad_constraints(tiny_llm: Any) -> None:
    with pytest.raises(InvalidRequestError, match="unclosed group"):
        tiny_llm.generate(
            ["x"],
            SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b")),
            use_tqdm=False,
        )
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        bad = StructuredOutputsParams(json='{"type": "array", "uniqueItems": true}')
        tiny_llm.generate(["x"], SamplingParams(structured_outputs=bad), use_tqdm=False)
    # The engine still serves.
    out = tiny_llm.generate(["x"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_structural_tag_output_holds_every_tag(tiny_llm: Any, tokenizer: Any) -> None:
    """Pushed towards the trigger (logit_bias), the random model opens tags again and
    again; each one is `begin`, JSON valid for its schema, `end`."""
    schema = {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x"],
        "additionalProperties": False,
    }
    tag = {
        "structures": [{"begin": "<f=get>", "schema": schema, "end": "</f>"}],
        "triggers": ["<f"],
    }
    lt, f = (tokenizer.encode(c, add_special_tokens=False)[0] for c in "<f")
    so = StructuredOutputsParams(structural_tag=json.dumps(tag))
    params = [
        SamplingParams(max_tokens=80, seed=i, structured_outputs=so, logit_bias={lt: 8, f: 8})
        for i in range(6)
    ]
    outs = tiny_llm.generate(["go"] * len(params), params, use_tqdm=False)
    tags = 0
    for out in outs:
        text = out.outputs[0].text
        for m in re.finditer("<f", text):
            body = text[m.start() :]
            if "</f>" not in body:
                continue  # the last tag, cut by max_tokens
            assert body.startswith("<f=get>"), text
            payload = body[len("<f=get>") : body.index("</f>")]
            jsonschema.validate(json.loads(payload), schema)
            tags += 1
    assert tags >= 6  # the trigger really fired
