"""AsyncLLM + OutputProcessor against a fake engine: kinds, n>1, stops, logprobs, aborts, death."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from typing import Any

import pytest
from prometheus_client import generate_latest

from paged.scheduler import RequestOutputKind, SamplingParams
from paged.server.async_llm import AsyncLLM
from paged.server.engine.errors import EngineDeadError
from paged.server.errors import InvalidRequestError
from paged.server.metrics import PrometheusStatLogger
from paged.server.outputs import RequestOutput

PROMPT = "hello world the quick brown fox"


def make_llm(tokenizer: Any, engine: Any, **kw: Any) -> AsyncLLM:
    return AsyncLLM(engine, tokenizer, max_model_len=64, **kw)


async def collect(
    llm: AsyncLLM, prompt: Any, params: SamplingParams, **kw: Any
) -> list[RequestOutput]:
    return [o async for o in llm.generate(prompt, params, **kw)]


def engine_id_of(external: str) -> re.Pattern[str]:
    """The engine's id for a caller's id: vLLM 0.33's `{id}-{8 random hex}`."""
    return re.compile(rf"{re.escape(external)}-[0-9a-f]{{8}}")


def _expected(tokenizer: Any, n: int) -> tuple[list[int], str]:
    ids = tokenizer.encode(PROMPT)
    out = [ids[i % len(ids)] for i in range(n)]
    return out, tokenizer.decode(out)


async def test_cumulative_outputs(tokenizer: Any, fake_engine: Any) -> None:
    llm = make_llm(tokenizer, fake_engine)
    outs = await collect(llm, PROMPT, SamplingParams(max_tokens=5))
    ids, text = _expected(tokenizer, 5)
    final = outs[-1]
    assert final.finished and final.outputs[0].text == text
    assert final.outputs[0].token_ids == ids
    assert final.outputs[0].finish_reason == "length"
    assert final.prompt == PROMPT and final.prompt_token_ids == tokenizer.encode(PROMPT)
    assert final.num_cached_tokens == 3
    # Each cumulative output extends the previous one.
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    llm.shutdown()


async def test_delta_outputs_concatenate(tokenizer: Any, fake_engine: Any) -> None:
    llm = make_llm(tokenizer, fake_engine)
    params = SamplingParams(max_tokens=7, output_kind=RequestOutputKind.DELTA)
    outs = await collect(llm, PROMPT, params)
    ids, text = _expected(tokenizer, 7)
    assert "".join(o.outputs[0].text for o in outs) == text
    assert [t for o in outs for t in o.outputs[0].token_ids] == ids
    llm.shutdown()


async def test_final_only_yields_once(tokenizer: Any, fake_engine: Any) -> None:
    llm = make_llm(tokenizer, fake_engine)
    params = SamplingParams(max_tokens=6, output_kind=RequestOutputKind.FINAL_ONLY)
    outs = await collect(llm, PROMPT, params)
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].text == _expected(tokenizer, 6)[1]
    llm.shutdown()


@pytest.mark.parametrize("kind", list(RequestOutputKind))
async def test_n_children_fanned_out_and_gathered(
    tokenizer: Any, fake_engine: Any, kind: RequestOutputKind
) -> None:
    llm = make_llm(tokenizer, fake_engine)
    params = SamplingParams(n=3, max_tokens=4, seed=7, output_kind=kind)
    outs = await collect(llm, PROMPT, params, request_id="req")
    engine_ids = sorted(r.request_id for r in fake_engine.added)
    assert [engine_ids[i][:6] for i in range(3)] == ["0_req-", "1_req-", "2_req-"]
    assert all(engine_id_of(f"{i}_req").fullmatch(rid) for i, rid in enumerate(engine_ids))
    assert len({rid[2:] for rid in engine_ids}) == 1  # one suffix: the parent's id
    assert sorted(r.sampling_params.seed or 0 for r in fake_engine.added) == [7, 8, 9]
    assert all(r.sampling_params.n == 1 for r in fake_engine.added)
    assert all(o.request_id == "req" for o in outs)
    assert outs[-1].finished and sum(o.finished for o in outs) == 1
    text = _expected(tokenizer, 4)[1]
    if kind == RequestOutputKind.DELTA:
        by_index: dict[int, str] = {}
        for o in outs:
            for c in o.outputs:
                by_index[c.index] = by_index.get(c.index, "") + c.text
        assert by_index == {0: text, 1: text, 2: text}
    else:
        assert [c.index for c in outs[-1].outputs] == [0, 1, 2]
        assert all(c.text == text for c in outs[-1].outputs)
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(outs) == 1
    llm.shutdown()


async def test_stop_string_truncates_and_aborts_in_engine(tokenizer: Any, engine_cls: Any) -> None:
    stop_text = tokenizer.encode("Paris. STOP here. stop there.")
    engine = engine_cls(script=lambda req: stop_text)
    llm = make_llm(tokenizer, engine)
    outs = await collect(llm, "hi", SamplingParams(max_tokens=20, stop=["STOP"]), request_id="s")
    final = outs[-1].outputs[0]
    assert final.text == "Paris. "
    assert final.finish_reason == "stop" and final.stop_reason == "STOP"
    assert [a for a in engine.aborted if engine_id_of("s").fullmatch(a)]  # the engine stops
    assert "STOP" not in "".join(o.outputs[0].text for o in outs)
    llm.shutdown()


async def test_stop_token_id_and_eos(tokenizer: Any, engine_cls: Any) -> None:
    ids = tokenizer.encode("hello world")
    eos = tokenizer.eos_token_id
    engine = engine_cls(script=lambda req: [*ids, eos, *ids])
    llm = make_llm(tokenizer, engine)
    out = (await collect(llm, "hi", SamplingParams(max_tokens=20)))[-1].outputs[0]
    assert out.text == "hello world" and out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == [*ids, eos]  # EOS kept in the token ids, not in the text
    out = (await collect(llm, "hi", SamplingParams(max_tokens=20, stop_token_ids=[ids[1]])))[
        -1
    ].outputs[0]
    assert out.stop_reason == ids[1] and out.token_ids == ids[:2]
    ignored = SamplingParams(max_tokens=len(ids) + 3, ignore_eos=True)
    out = (await collect(llm, "hi", ignored))[-1].outputs[0]
    assert out.finish_reason == "length"
    llm.shutdown()


async def test_logprobs(tokenizer: Any, fake_engine: Any) -> None:
    llm = make_llm(tokenizer, fake_engine)
    out = (await collect(llm, PROMPT, SamplingParams(max_tokens=3, logprobs=2)))[-1].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 3
    for tok, pos in zip(out.token_ids, out.logprobs, strict=True):
        first_id, first = next(iter(pos.items()))
        assert (
            first_id == tok and first.rank == 1 and first.decoded_token == tokenizer.decode([tok])
        )
        assert len(pos) == 2  # the chosen token is also the top-1: listed once
    assert out.cumulative_logprob == pytest.approx(3 * -0.6931471805599453)
    llm.shutdown()


async def test_closing_the_generator_aborts_the_request(tokenizer: Any, fake_engine: Any) -> None:
    llm = make_llm(tokenizer, fake_engine)
    gen = llm.generate(PROMPT, SamplingParams(max_tokens=50), request_id="c")
    await gen.__anext__()
    await gen.aclose()
    (engine_id,) = fake_engine.aborted
    assert engine_id_of("c").fullmatch(engine_id)
    assert not llm.output_processor.has_unfinished_requests()
    assert engine_id not in fake_engine.running
    llm.shutdown()


async def test_cancelling_a_consumer_task_aborts(tokenizer: Any, fake_engine: Any) -> None:
    llm = make_llm(tokenizer, fake_engine)
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in llm.generate(
            PROMPT, SamplingParams(max_tokens=10_000 // 200), request_id="t"
        ):
            started.set()
            await asyncio.sleep(0.01)

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The abandoned generator is closed by the event loop's async-generator
    # finalizer, which runs the abort.
    for _ in range(100):
        if fake_engine.aborted:
            break
        await asyncio.sleep(0.01)
    assert len(fake_engine.aborted) == 1 and engine_id_of("t").fullmatch(fake_engine.aborted[0])
    assert not llm.output_processor.has_unfinished_requests()
    llm.shutdown()


async def test_engine_death_fails_inflight_and_later_requests(
    tokenizer: Any, fake_engine: Any
) -> None:
    llm = make_llm(tokenizer, fake_engine)
    gen = llm.generate(PROMPT, SamplingParams(max_tokens=50))
    await gen.__anext__()
    fake_engine.kill()
    with pytest.raises(EngineDeadError):
        async for _ in gen:
            pass
    assert llm.errored
    with pytest.raises(EngineDeadError):
        await collect(llm, PROMPT, SamplingParams())
    with pytest.raises(EngineDeadError):
        await llm.check_health()
    llm.shutdown()


async def test_a_reused_request_id_runs_concurrently(tokenizer: Any, fake_engine: Any) -> None:
    """vLLM 0.33: the engine's id gets a random suffix, so a caller may reuse its id."""
    llm = make_llm(tokenizer, fake_engine)
    first = llm.generate(PROMPT, SamplingParams(max_tokens=50), request_id="dup")
    await first.__anext__()
    outs = await collect(llm, PROMPT, SamplingParams(max_tokens=5), request_id="dup")
    assert outs[-1].finished and outs[-1].request_id == "dup"  # the caller's id, as given
    a, b = (r.request_id for r in fake_engine.added)
    assert a != b and engine_id_of("dup").fullmatch(a) and engine_id_of("dup").fullmatch(b)
    assert fake_engine.aborted == []  # the second finished; the first runs on
    await first.aclose()
    assert fake_engine.aborted == [a]
    llm.shutdown()


async def test_abort_by_the_callers_id_aborts_every_request_under_it(
    tokenizer: Any, fake_engine: Any
) -> None:
    """vLLM's AsyncLLM.abort(external id): all requests in flight under that id."""
    llm = make_llm(tokenizer, fake_engine)
    gens = [
        llm.generate(PROMPT, SamplingParams(max_tokens=50), request_id=rid)
        for rid in ("same", "same", "other")
    ]
    for gen in gens:
        await gen.__anext__()
    await llm.abort("same")
    same = [r.request_id for r in fake_engine.added[:2]]
    assert sorted(fake_engine.aborted) == sorted(same)
    assert list(fake_engine.running) == [fake_engine.added[2].request_id]
    for gen in gens:
        await gen.aclose()
    llm.shutdown()


async def test_empty_request_id_rejected(tokenizer: Any, fake_engine: Any) -> None:
    llm = make_llm(tokenizer, fake_engine)
    with pytest.raises(InvalidRequestError) as e:
        await collect(llm, PROMPT, SamplingParams(), request_id="")
    assert e.value.param == "request_id"
    llm.shutdown()


async def test_concurrent_requests_and_metrics(tokenizer: Any, fake_engine: Any) -> None:
    stats = PrometheusStatLogger("tiny")
    llm = make_llm(tokenizer, fake_engine, stat_loggers=[stats])
    results = await asyncio.gather(
        *(collect(llm, PROMPT, SamplingParams(max_tokens=3 + i)) for i in range(8))
    )
    for i, outs in enumerate(results):
        assert outs[-1].outputs[0].text == _expected(tokenizer, 3 + i)[1]
    text = generate_latest(stats.registry).decode()
    assert 'paged:request_success_total{finished_reason="length",model_name="tiny"} 8.0' in text
    assert (
        f'paged:generation_tokens_total{{model_name="tiny"}} {sum(3 + i for i in range(8))}.0'
        in text
    )
    assert 'paged:time_to_first_token_seconds_count{model_name="tiny"} 8.0' in text
    assert 'paged:kv_cache_usage_perc{model_name="tiny"} 0.25' in text
    gen = llm.generate(PROMPT, SamplingParams(max_tokens=50))
    await gen.__anext__()
    await gen.aclose()
    text = generate_latest(stats.registry).decode()
    assert 'paged:request_success_total{finished_reason="abort",model_name="tiny"} 1.0' in text
    llm.shutdown()


async def test_large_output_batches_are_sliced(tokenizer: Any, fake_engine: Any) -> None:
    llm = make_llm(tokenizer, fake_engine)
    outs = await asyncio.gather(
        *(collect(llm, PROMPT, SamplingParams(max_tokens=2)) for _ in range(300))
    )
    assert all(o[-1].finished and len(o[-1].outputs[0].token_ids) == 2 for o in outs)
    llm.shutdown()


async def test_log_requests_logs_each_request(
    tokenizer: Any, fake_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """--enable-log-requests (vLLM): received with its parameters, added, aborted."""
    quiet = make_llm(tokenizer, fake_engine)
    with caplog.at_level(logging.DEBUG, logger="paged.server.async_llm"):
        await collect(quiet, PROMPT, SamplingParams(max_tokens=2), request_id="q")
    assert caplog.records == []  # off by default, as vLLM 0.33
    llm = make_llm(tokenizer, fake_engine, log_requests=True)
    with caplog.at_level(logging.DEBUG, logger="paged.server.async_llm"):
        gen = llm.generate(PROMPT, SamplingParams(max_tokens=50, seed=3), request_id="logged")
        await gen.__anext__()
        await llm.abort("logged")
        await gen.aclose()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    engine_id = fake_engine.added[-1].request_id
    assert (logging.DEBUG, f"Request logged details: prompt: {PROMPT!r}.") in lines
    received = [m for lvl, m in lines if lvl == logging.INFO and m.startswith("Received request")]
    assert len(received) == 1 and "seed=3" in received[0] and PROMPT not in received[0]
    assert (logging.INFO, f"Added request {engine_id}.") in lines
    assert (logging.INFO, "Aborted request(s) logged.") in lines
    quiet.shutdown()
    llm.shutdown()
