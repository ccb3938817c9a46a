"""StructuredOutputBackend and GrammarCompiler on the tiny BPE tokenizer (no model)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from paged.scheduler import SamplingParams, StructuredOutputsParams
from paged.scheduler.boundary import SchedulerOutput
from paged.scheduler.request import Request
from paged.server.structured_output import (
    GrammarCompiler,
    GrammarError,
    StructuredOutputBackend,
    grammar_key,
    load_ll_tokenizer,
)


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    ll = load_ll_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    return GrammarCompiler(ll, eos_token_ids=[tokenizer.eos_token_id], cache_size=2)


def _request(rid: str, so: StructuredOutputsParams | None, prompt_len: int = 3) -> Request:
    params = SamplingParams(structured_outputs=so)
    return Request(rid, list(range(5, 5 + prompt_len)), params, 2, max_model_len=64)


def _allowed(row: list[int], vocab: int) -> set[int]:
    return {t for t in range(vocab) if (row[t // 32] >> (t % 32)) & 1}


def _decode_all(tokenizer: Any, allowed: set[int]) -> set[str]:
    return {tokenizer.decode([t]) for t in allowed}


def test_mask_allows_only_grammar_tokens_then_only_eos(tokenizer: Any, compiler: Any) -> None:
    backend = StructuredOutputBackend(compiler)
    req = _request("a", StructuredOutputsParams(choice=["yes"]))
    req.num_computed_tokens = req.num_tokens  # the prefill is done: this step samples
    out = backend.grammar_bitmask([req], SchedulerOutput(num_scheduled_tokens={"a": 3}))
    assert out is not None and out.structured_output_request_ids == ["a"]
    allowed = _allowed(out.grammar_bitmask[0], len(tokenizer))
    assert allowed, "some token must start 'yes'"
    assert all("yes".startswith(s) and s for s in _decode_all(tokenizer, allowed))
    assert tokenizer.eos_token_id not in allowed  # the grammar cannot end yet
    assert backend.accept_tokens("a", tokenizer.encode("yes", add_special_tokens=False))
    out = backend.grammar_bitmask([req], SchedulerOutput(num_scheduled_tokens={"a": 1}))
    assert out is not None
    assert _allowed(out.grammar_bitmask[0], len(tokenizer)) == {tokenizer.eos_token_id}
    assert backend.accept_tokens("a", [tokenizer.eos_token_id])


def test_violating_token_is_rejected_and_unconstrained_ignored(
    tokenizer: Any, compiler: Any
) -> None:
    backend = StructuredOutputBackend(compiler)
    con = _request("c", StructuredOutputsParams(regex="[0-9]+"))
    free = _request("f", None)
    for r in (con, free):
        r.num_computed_tokens = r.num_tokens
    out = backend.grammar_bitmask([free, con], SchedulerOutput(num_scheduled_tokens={"f": 1}))
    assert out is not None and out.structured_output_request_ids == ["c"]
    assert backend.accept_tokens("f", tokenizer.encode("abc", add_special_tokens=False))
    letter = tokenizer.encode("a", add_special_tokens=False)
    assert not backend.accept_tokens("c", letter)
    backend.remove_request("c")
    assert backend.num_requests == 0


def test_partial_prefill_gets_no_mask(compiler: Any) -> None:
    backend = StructuredOutputBackend(compiler)
    req = _request("p", StructuredOutputsParams(regex="a"), prompt_len=10)
    req.num_computed_tokens = 4  # chunk 1 of the prompt: nothing is sampled
    assert backend.grammar_bitmask([req], SchedulerOutput(num_scheduled_tokens={"p": 4})) is None
    assert backend.num_requests == 1  # but its grammar is ready for the last chunk


def test_draft_tokens_get_one_row_per_position(tokenizer: Any, compiler: Any) -> None:
    backend = StructuredOutputBackend(compiler)
    req = _request("d", StructuredOutputsParams(choice=["yes"]))
    req.num_computed_tokens = req.num_tokens
    y = tokenizer.encode("y", add_special_tokens=False)
    so = SchedulerOutput(num_scheduled_tokens={"d": 2}, scheduled_spec_decode_tokens={"d": y})
    out = backend.grammar_bitmask([req], so)
    assert out is not None and out.structured_output_request_ids == ["d", "d"]
    first, second = (
        _decode_all(tokenizer, _allowed(r, len(tokenizer))) for r in out.grammar_bitmask
    )
    assert "y" in first and all("es".startswith(s) and s for s in second)


def test_compile_cache_is_keyed_and_lru_bounded(compiler: Any) -> None:
    before = compiler.num_compiled
    keys = [grammar_key(StructuredOutputsParams(regex=f"x{i}")) for i in range(3)]
    compiler.compile(keys[0])
    compiler.compile(keys[0])
    assert compiler.num_compiled == before + 1  # the second is a cache hit
    compiler.compile(keys[1])
    compiler.compile(keys[2])  # evicts keys[0] (cache_size=2)
    compiler.compile(keys[0])
    assert compiler.num_compiled == before + 4
    whitespace = grammar_key(StructuredOutputsParams(json="{}", disable_any_whitespace=True))
    assert whitespace != grammar_key(StructuredOutputsParams(json="{}"))


@pytest.mark.parametrize(
    ("so", "param", "fragment"),
    [
        (StructuredOutputsParams(json="{not json"), "json", "not valid JSON"),
        (
            StructuredOutputsParams(json='{"type": "array", "uniqueItems": true}'),
            "json",
            "uniqueItems",
        ),
        (StructuredOutputsParams(json='{"type": "strin"}'), "json", "strin"),
        (StructuredOutputsParams(regex="a(b"), "regex", "unclosed group"),
        (StructuredOutputsParams(grammar="start: foo"), "grammar", "foo"),
        (StructuredOutputsParams(structural_tag="{}"), "structural_tag", "structures"),
    ],
)
def test_bad_constraints_raise_naming_the_field(
    compiler: Any, so: StructuredOutputsParams, param: str, fragment: str
) -> None:
    with pytest.raises(GrammarError, match=fragment) as info:
        compiler.compile(grammar_key(so))
    assert info.value.param == param


def test_grammar_in_lark_and_gbnf(tokenizer: Any, compiler: Any) -> None:
    for text in ('start: "ab" | "cd"', 'root ::= "ab" | "cd"'):
        m = compiler.new_matcher(grammar_key(StructuredOutputsParams(grammar=text)))
        assert m.consume_tokens(tokenizer.encode("cd", add_special_tokens=False))
        assert m.is_accepting()


def test_json_object_accepts_objects_only(tokenizer: Any, compiler: Any) -> None:
    key = grammar_key(StructuredOutputsParams(json_object=True))
    ok = compiler.new_matcher(key)
    assert ok.consume_tokens(tokenizer.encode(json.dumps({"a": [1]}), add_special_tokens=False))
    assert ok.is_accepting()
    bad = compiler.new_matcher(key)
    assert not bad.consume_tokens(tokenizer.encode("[1]", add_special_tokens=False))


def test_uncompilable_grammar_in_the_engine_fails_the_request(compiler: Any) -> None:
    # The frontend refuses these; a direct engine user gets a failed request, not a crash.
    backend = StructuredOutputBackend(compiler)
    req = _request("bad", StructuredOutputsParams(regex="a(b"))
    req.num_computed_tokens = req.num_tokens
    assert backend.grammar_bitmask([req], SchedulerOutput(num_scheduled_tokens={"bad": 3})) is None
    assert not backend.accept_tokens("bad", [5])
    backend.remove_request("bad")
    assert backend.num_requests == 0


def test_uncached_grammar_compiles_off_the_loop_until_ready(
    compiler: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading
    import time

    release = threading.Event()
    build = compiler._build
    threads: list[str] = []

    def slow_build(key: Any) -> Any:
        threads.append(threading.current_thread().name)
        release.wait(10)
        return build(key)

    monkeypatch.setattr(compiler, "_build", slow_build)
    backend = StructuredOutputBackend(compiler)
    req = _request("w", StructuredOutputsParams(regex="slow[0-9]"))
    assert not backend.grammar_ready(req)  # compiling: the scheduler leaves it WAITING
    assert not backend.grammar_ready(req)
    release.set()
    deadline = time.monotonic() + 10
    while not backend.grammar_ready(req):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert threads and threads[0].startswith("paged-compile")
    again = _request("w2", StructuredOutputsParams(regex="slow[0-9]"))
    assert backend.grammar_ready(again)  # cached now: ready at once, no thread hop
    assert len(threads) == 1
    req.num_computed_tokens = req.num_tokens
    out = backend.grammar_bitmask([req], SchedulerOutput(num_scheduled_tokens={"w": 3}))
    assert out is not None and out.structured_output_request_ids == ["w"]


def test_a_tokenizer_llguidance_cannot_read_turns_structured_outputs_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A word-level tokenizer without a decoder: llguidance cannot map its tokens to bytes.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from paged.scheduler import SamplingParams, StructuredOutputsParams
    from paged.server.errors import InvalidRequestError
    from paged.server.structured_output import try_load_ll_tokenizer
    from paged.server.structured_output.validate import check_compiles

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(8)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast_cls: Any = PreTrainedTokenizerFast
    hf = fast_cls(tokenizer_object=tk, eos_token="w2")
    with caplog.at_level("WARNING"):
        assert try_load_ll_tokenizer(hf, 8, [2]) is None
    assert "structured outputs are off" in caplog.text
    # The server still serves; a constrained request is a 400 saying why.
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(InvalidRequestError, match="not available on this server") as info:
        check_compiles(None, params)
    assert info.value.param == "structured_outputs"
