"""Grammar state beyond one token a step: structural tags, speculative drafts, compile limits.

All on the tiny BPE tokenizer with the real llguidance backend; the
speculative-decoding flow runs the real `Scheduler` with fake runner outputs
(drafts proposed, some accepted, the rest rejected), no model.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from paged.scheduler import StructuredOutputsParams
from paged.scheduler.boundary import ModelRunnerOutput
from paged.scheduler.testing import make_request, make_scheduler
from paged.server.structured_output import (
    GrammarCompiler,
    GrammarError,
    StructuredOutputBackend,
    grammar_key,
    load_ll_tokenizer,
)
from paged.server.structured_output.request_grammar import RequestGrammar

TAG = {
    "type": "structural_tag",
    "structures": [
        {
            "begin": "<f=get>",
            "schema": {
                "type": "object",
                "properties": {"x": {"type": "integer"}},
                "required": ["x"],
                "additionalProperties": False,
            },
            "end": "</f>",
        }
    ],
    "triggers": ["<f"],
}


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    ll = load_ll_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    return GrammarCompiler(ll, eos_token_ids=[tokenizer.eos_token_id])


def _grammar(compiler: GrammarCompiler, so: StructuredOutputsParams) -> RequestGrammar:
    return RequestGrammar(compiler.new_matcher(grammar_key(so)), compiler.eos_token_ids)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


# -- structural tags ---------------------------------------------------------------
def test_structural_tag_allows_free_text_and_enforces_each_tag(
    tokenizer: Any, compiler: GrammarCompiler
) -> None:
    so = StructuredOutputsParams(structural_tag=json.dumps(TAG))
    good = _grammar(compiler, so)
    assert good.accept_tokens(_ids(tokenizer, 'hi <f=get>{"x": 12}</f> and <f=get>{"x":3}</f>!'))
    for bad in ('<f=get>{"x": "s"}', "<f=other>", '<f=get>{"x": 1, "y": 2}', '<f=get>{"x": 1}x'):
        assert not _grammar(compiler, so).accept_tokens(_ids(tokenizer, bad)), bad
    # After "<f" the rest of the begin is forced: the mask allows only its next byte.
    g = _grammar(compiler, so)
    assert g.accept_tokens(_ids(tokenizer, "ok <f"))
    assert g.validate_tokens(_ids(tokenizer, "=get>{")) == len(_ids(tokenizer, "=get>{"))
    assert g.validate_tokens(_ids(tokenizer, "=x")) == 1


@pytest.mark.parametrize(
    ("tag", "fragment"),
    [
        ({"structures": [], "triggers": ["<f"]}, "non-empty 'structures'"),
        ({"structures": [{"begin": "<g>", "schema": {}, "end": ""}], "triggers": ["<f"]}, "none"),
        ({"structures": [{"begin": "<f>"}], "triggers": "<f"}, "triggers"),
        ({"format": {"type": "triggered_tags"}}, "'format' form"),
        (
            {"structures": [{"begin": "<f>", "schema": {"type": "nope"}}], "triggers": ["<f"]},
            "nope",
        ),
    ],
)
def test_bad_structural_tags_name_the_field(
    compiler: GrammarCompiler, tag: dict[str, Any], fragment: str
) -> None:
    so = StructuredOutputsParams(structural_tag=json.dumps(tag))
    with pytest.raises(GrammarError, match=fragment) as info:
        compiler.compile(grammar_key(so))
    assert info.value.param == "structural_tag"


# -- validate / rollback (vLLM's StructuredOutputGrammar API) ----------------------
def test_validate_rollback_and_eos_after_completion(
    tokenizer: Any, compiler: GrammarCompiler
) -> None:
    g = _grammar(compiler, StructuredOutputsParams(regex="[0-9]{4}"))
    one, two, letter = _ids(tokenizer, "1")[0], _ids(tokenizer, "2")[0], _ids(tokenizer, "a")[0]
    eos = tokenizer.eos_token_id
    assert g.validate_tokens([one, two, letter, one]) == 2
    assert g.num_processed_tokens == 0  # validating never moves the state
    assert g.accept_tokens([one, two, one])
    g.rollback(2)
    assert g.num_processed_tokens == 1
    assert g.validate_tokens([two, two, two, eos, eos]) == 5  # completes, then EOS
    assert g.accept_tokens([two, two, two]) and g.is_terminated()
    assert g.validate_tokens([eos, one]) == 1
    assert g.accept_tokens([eos])
    g.rollback(2)  # over the EOS and one digit: the grammar is open again
    assert not g.is_terminated() and g.num_processed_tokens == 3
    assert g.accept_tokens([one]) and g.is_terminated()
    with pytest.raises(ValueError, match="num_tokens"):
        g.rollback(5)
    assert not g.accept_tokens([letter])


def test_drafts_are_truncated_masked_per_position_and_rejections_rolled_back(
    tokenizer: Any, compiler: GrammarCompiler
) -> None:
    """The scheduler side of speculative decoding with a grammar, fake runner outputs."""
    backend = StructuredOutputBackend(compiler)
    sched = make_scheduler(num_lookahead_tokens=4, structured_output=backend)
    digit = {d: _ids(tokenizer, str(d))[0] for d in range(10)}
    letter = _ids(tokenizer, "a")[0]
    so_params = StructuredOutputsParams(regex="[0-9]{6}")
    compiler.compile(grammar_key(so_params))  # cached: admitted in the first step
    sched.add_request(make_request("a", [5, 6, 7], max_tokens=20, structured_outputs=so_params))
    so = sched.schedule()
    assert sched.get_grammar_bitmask(so) is not None
    sched.update_from_output(so, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[digit[1]]]))
    grammar = backend.grammar_of("a")
    assert grammar is not None and grammar.num_processed_tokens == 1
    # The drafter proposes 4 tokens; the third breaks the grammar: two are kept.
    sched.update_draft_token_ids({"a": [digit[2], digit[3], letter, digit[4]]})
    assert sched.state.requests["a"].spec_token_ids == [digit[2], digit[3]]
    so = sched.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [digit[2], digit[3]]}
    masks = sched.get_grammar_bitmask(so)
    assert masks is not None and masks.structured_output_request_ids == ["a", "a", "a"]
    vocab = len(tokenizer)
    for row in masks.grammar_bitmask:  # every position allows digits, never the letter
        allowed = {t for t in range(vocab) if (row[t // 32] >> (t % 32)) & 1}
        assert digit[5] in allowed and letter not in allowed
    assert grammar.num_processed_tokens == 1  # drafts walked through, then rolled back
    # Verification: the first draft accepted, the second rejected, a bonus token.
    mro = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[digit[2], digit[7]]])
    sched.update_from_output(so, mro)
    assert grammar.num_processed_tokens == 3
    assert grammar.validate_tokens([digit[0]] * 4) == 3  # three digits left of six
    req = sched.state.requests["a"]
    assert req.output_token_ids == [digit[1], digit[2], digit[7]] and not req.is_finished()


def test_unconstrained_drafts_are_kept_whole(compiler: GrammarCompiler) -> None:
    backend = StructuredOutputBackend(compiler)
    sched = make_scheduler(num_lookahead_tokens=3, structured_output=backend)
    sched.add_request(make_request("u", [5, 6, 7], max_tokens=20))
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(req_ids=["u"], sampled_token_ids=[[9]]))
    sched.update_draft_token_ids({"u": [1, 2, 3]})
    assert sched.state.requests["u"].spec_token_ids == [1, 2, 3]


# -- compile time bound --------------------------------------------------------------
def test_compile_past_the_timeout_fails_and_is_refused_at_once(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ll = load_ll_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    compiler = GrammarCompiler(ll, compile_timeout_s=0.2)
    release = threading.Event()
    build = compiler._build

    def build_slowly_if_slow(key: Any) -> Any:
        if "slow" in key.text:
            release.wait(10)  # llguidance cannot be interrupted: this compile runs on
        return build(key)

    monkeypatch.setattr(compiler, "_build", build_slowly_if_slow)
    slow = grammar_key(StructuredOutputsParams(regex="slow[0-9]+"))
    t = time.monotonic()
    with pytest.raises(GrammarError, match=r"took longer than 0\.2 s") as info:
        compiler.compile(slow)
    assert info.value.param == "regex" and time.monotonic() - t < 2
    # Meanwhile other grammars compile (the slow one holds only one compile thread).
    compiler.compile(grammar_key(StructuredOutputsParams(regex="fast[0-9]+")))
    t = time.monotonic()
    with pytest.raises(GrammarError, match="took longer"):
        compiler.compile(slow)  # remembered: no second compile, no second wait
    assert time.monotonic() - t < 0.1
    release.set()
    with pytest.raises(GrammarError, match="took longer"):
        compiler.compile(slow)  # a late result is not cached either
    with pytest.raises(ValueError, match="compile_timeout_s"):
        GrammarCompiler(ll, compile_timeout_s=0)
