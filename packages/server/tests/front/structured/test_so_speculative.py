"""Structured output with n-gram speculation: every drafted token is checked by the grammar.

Each drafted position is masked by its own grammar row (the scheduler's
bitmask hook builds one per draft), so a draft the grammar forbids is
rejected; outputs must satisfy their constraint exactly as without drafts,
and the drafts must really have been verified (the spec-decoding counters).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from paged.scheduler import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"enum": ["ab", "ab ab", "cd"]}, "maxItems": 4},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def spec_llm(tiny_model_dir: Path) -> Iterator[Any]:
    from paged.server import LLM

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    config = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 2,
    }
    llm = LLM(
        str(tiny_model_dir),
        max_model_len=1024,
        kv_cache_memory_bytes=1 << 24,
        speculative_config=config,
    )
    yield llm
    llm.shutdown()
    torch.set_num_threads(previous)


def test_constrained_outputs_hold_with_drafts(spec_llm: Any) -> None:
    drafted = 0
    original = spec_llm.engine_client.get_output

    def recording() -> Any:
        nonlocal drafted
        outputs = original()
        s = outputs.scheduler_stats
        if s is not None and s.spec_decoding_stats is not None:
            drafted += s.spec_decoding_stats.num_draft_tokens
        return outputs

    spec_llm.engine_client.get_output = recording
    prompts = ["ab ab ab ab ab", "cd cd cd ab ab", "name name name"] * 2
    json_params = [
        SamplingParams(
            max_tokens=300,
            seed=seed,
            structured_outputs=StructuredOutputsParams(
                json=json.dumps(SCHEMA), disable_any_whitespace=True
            ),
        )
        for seed in range(len(prompts))
    ]
    regex = SamplingParams(
        max_tokens=60,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(regex="(ab ){2,6}cd"),
    )
    # One request at a time, so each step's constrained request has drafts or not;
    # mixed batches: test_mixed_batch_of_drafting_and_non_drafting_requests.
    outs = [
        spec_llm.generate([p], [sp], use_tqdm=False)[0]
        for p, sp in zip(prompts, json_params, strict=True)
    ]
    outs += [spec_llm.generate([p], regex, use_tqdm=False)[0] for p in prompts]
    for out in outs[: len(prompts)]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    for out in outs[len(prompts) :]:
        assert re.fullmatch("(ab ){2,6}cd", out.outputs[0].text), out.outputs[0].text
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert drafted > 0


def test_mixed_batch_of_drafting_and_non_drafting_requests(spec_llm: Any) -> None:
    """Constrained requests in one batch where some have drafts and some do not."""
    params = SamplingParams(
        max_tokens=60,
        temperature=0.0,
        structured_outputs=StructuredOutputsParams(regex="(ab ){2,6}cd"),
    )
    outs = spec_llm.generate(
        ["ab ab ab ab ab", "cd cd cd ab ab", "name"] * 2, params, use_tqdm=False
    )
    for out in outs:
        assert re.fullmatch("(ab ){2,6}cd", out.outputs[0].text), out.outputs[0].text
