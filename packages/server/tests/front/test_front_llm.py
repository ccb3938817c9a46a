"""LLM (offline, synchronous) over the fake engine."""

from __future__ import annotations

from typing import Any

import pytest

from paged.scheduler import SamplingParams
from paged.server.errors import InvalidRequestError
from paged.server.llm import LLM


def make(tokenizer: Any, engine: Any, **kw: Any) -> LLM:
    return LLM.from_engine_client(engine, tokenizer, max_model_len=64, **kw)


def _echo(tokenizer: Any, prompt: str, n: int) -> str:
    ids = tokenizer.encode(prompt)
    return str(tokenizer.decode([ids[i % len(ids)] for i in range(n)]))


def test_generate_batch_in_order(tokenizer: Any, fake_engine: Any) -> None:
    llm = make(tokenizer, fake_engine)
    prompts = ["hello world", "the quick brown fox", "café"]
    params = [SamplingParams(max_tokens=k) for k in (5, 2, 7)]
    outs = llm.generate(prompts, params, use_tqdm=True)
    assert [o.prompt for o in outs] == prompts
    for o, p, k in zip(outs, prompts, (5, 2, 7), strict=True):
        assert o.finished and o.outputs[0].text == _echo(tokenizer, p, k)
        assert len(o.outputs[0].token_ids) == k


def test_single_prompt_forms(tokenizer: Any, fake_engine: Any) -> None:
    llm = make(tokenizer, fake_engine)
    ids = tokenizer.encode("hello")
    (a,) = llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)
    (b,) = llm.generate(ids, SamplingParams(max_tokens=3), use_tqdm=False)
    (c,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=3), use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids


def test_n_greater_than_one_and_stop_string(tokenizer: Any, engine_cls: Any) -> None:
    script = tokenizer.encode("Paris. STOP here. stop there.")
    engine = engine_cls(script=lambda req: script)
    llm = make(tokenizer, engine)
    (out,) = llm.generate("hi", SamplingParams(n=2, max_tokens=20, stop=["STOP"]), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.text == "Paris. " and c.stop_reason == "STOP" for c in out.outputs)
    assert sorted(engine.aborted) == ["0_0", "1_0"]
    assert not engine.running


def test_chat(tokenizer: Any, fake_engine: Any) -> None:
    llm = make(tokenizer, fake_engine)
    convs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "hello"}]]
    outs = llm.chat(convs, SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(outs) == 2
    assert tokenizer.decode(fake_engine.added[1].prompt_token_ids).startswith(
        "<|im_start|>user\nhello<|im_end|>"
    )
    (single,) = llm.chat(convs[0], SamplingParams(max_tokens=2), use_tqdm=False)
    assert single.finished


def test_bad_prompt_in_batch_aborts_the_ones_added(tokenizer: Any, fake_engine: Any) -> None:
    llm = make(tokenizer, fake_engine)
    with pytest.raises(InvalidRequestError) as e:
        prompts: list[Any] = ["hello", [1, 10_000]]
        llm.generate(prompts, SamplingParams(max_tokens=3), use_tqdm=False)
    assert e.value.param == "prompt"
    assert fake_engine.aborted == ["0"] and not llm.output_processor.has_unfinished_requests()


def test_sampling_params_count_must_match(tokenizer: Any, fake_engine: Any) -> None:
    llm = make(tokenizer, fake_engine)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_extra_eos_ids_become_stop_tokens(tokenizer: Any, fake_engine: Any) -> None:
    llm = make(tokenizer, fake_engine, eos_token_ids=[2, 0])
    llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    req = fake_engine.added[0]
    assert req.eos_token_id == 2 and req.sampling_params.stop_token_ids == [0]


def test_context_manager_shuts_the_engine_down(tokenizer: Any, fake_engine: Any) -> None:
    with make(tokenizer, fake_engine) as llm:
        (out,) = llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
        assert out.finished
    assert fake_engine.shut_down


def test_stream_yields_deltas_and_aborts_when_closed(tokenizer: Any, fake_engine: Any) -> None:
    llm = make(tokenizer, fake_engine)
    deltas = [o.outputs[0].text for o in llm.stream("hello world", SamplingParams(max_tokens=4))]
    assert "".join(deltas) == _echo(tokenizer, "hello world", 4) and len(deltas) == 4
    it = llm.stream("hello world", SamplingParams(max_tokens=50))
    next(it)
    it.close()
    assert fake_engine.aborted == ["1"] and not fake_engine.running
