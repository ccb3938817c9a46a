"""AsyncLLM.encode and the pooling output path against a fake engine; pooling flags."""

from __future__ import annotations

import struct
from typing import Any

import pytest

from paged.scheduler import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    PoolingModelInfo,
    PoolingParams,
    SamplingParams,
)
from paged.scheduler.boundary import PoolerOutput
from paged.server.async_llm import AsyncLLM
from paged.server.cli import build_parser
from paged.server.engine_args import EngineArgs
from paged.server.errors import InvalidRequestError
from paged.server.pooling_frontend import PoolingFrontend
from paged.server.stats import IterationStats

PROMPT = "hello world the quick brown fox"
_INFO = PoolingModelInfo(served_model_name="m", embedding_size=3)


def _frontend(tasks: tuple[str, ...] = ("embed", "token_embed")) -> PoolingFrontend:
    return PoolingFrontend(
        supported_tasks=tasks,
        runner_type="pooling",
        pooling_task=tasks[0],
        model_info=_INFO,
        num_labels=0,
        is_cross_encoder=False,
    )


def _pooling_engine(engine_cls: type[Any]) -> Any:
    class PoolingFakeEngine(engine_cls):  # type: ignore[misc]
        """Pooling requests finish in one step with [len(prompt), first id, 0.5]."""

        def step(self) -> EngineCoreOutputs:
            pooled: list[EngineCoreOutput] = []
            for rid, r in list(self.running.items()):
                req = r.request
                if req.pooling_params is None:
                    continue
                del self.running[rid]
                values = [float(len(req.prompt_token_ids)), float(req.prompt_token_ids[0]), 0.5]
                out = PoolerOutput(data=struct.pack("<3f", *values), shape=[3])
                pooled.append(
                    EngineCoreOutput(
                        request_id=rid,
                        new_token_ids=[],
                        finish_reason=FinishReason.STOP,
                        num_cached_tokens=2,
                        pooling_output=out,
                    )
                )
            rest = super().step()
            return EngineCoreOutputs(outputs=pooled + rest.outputs, timestamp=0.0)

    return PoolingFakeEngine()


async def test_encode_yields_one_final_pooling_output(tokenizer: Any, engine_cls: Any) -> None:
    engine = _pooling_engine(engine_cls)
    llm = AsyncLLM(engine, tokenizer, max_model_len=64, pooling=_frontend())
    assert await llm.get_supported_tasks() == ("embed", "token_embed")
    outs = [o async for o in llm.encode(PROMPT, PoolingParams(task="embed"), request_id="r1")]
    ids = tokenizer.encode(PROMPT)
    assert len(outs) == 1
    out = outs[0]
    assert out.request_id == "r1" and out.finished and out.error is None
    assert out.prompt_token_ids == ids and out.num_cached_tokens == 2
    assert out.outputs.data.tolist() == [float(len(ids)), float(ids[0]), 0.5]
    sent = engine.added[-1]
    assert sent.pooling_params.task == "embed" and sent.pooling_params.use_activation is True
    llm.shutdown()


async def test_encode_defaults_task_and_truncates(tokenizer: Any, engine_cls: Any) -> None:
    engine = _pooling_engine(engine_cls)
    llm = AsyncLLM(engine, tokenizer, max_model_len=64, pooling=_frontend())
    outs = [o async for o in llm.encode(PROMPT, PoolingParams(), truncate_prompt_tokens=2)]
    assert len(outs[0].prompt_token_ids) == 2
    assert engine.added[-1].pooling_params.task == "embed"
    llm.shutdown()


async def test_bad_pooling_inputs_are_400s(tokenizer: Any, engine_cls: Any) -> None:
    engine = _pooling_engine(engine_cls)
    llm = AsyncLLM(engine, tokenizer, max_model_len=8, pooling=_frontend())
    long_prompt = " ".join(["hello"] * 20)
    with pytest.raises(InvalidRequestError, match="maximum context length is 8"):
        [o async for o in llm.encode(long_prompt, PoolingParams())]
    with pytest.raises(InvalidRequestError, match="does not support Matryoshka"):
        [o async for o in llm.encode(PROMPT, PoolingParams(dimensions=2))]
    with pytest.raises(InvalidRequestError, match="Classification API is not supported"):
        [o async for o in llm.encode(PROMPT, PoolingParams(task="classify"))]
    with pytest.raises(InvalidRequestError, match="only supported for generative models"):
        [o async for o in llm.generate(PROMPT, SamplingParams(max_tokens=2))]
    assert engine.added == []  # nothing reached the engine
    llm.shutdown()


async def test_generation_model_refuses_encode_and_counts_apart(
    tokenizer: Any, engine_cls: Any
) -> None:
    engine = _pooling_engine(engine_cls)
    plain = AsyncLLM(engine, tokenizer, max_model_len=64)
    assert plain.supported_tasks == ("generate",)
    with pytest.raises(InvalidRequestError, match="does not support pooling"):
        [o async for o in plain.encode(PROMPT, PoolingParams(task="embed"))]
    plain.shutdown()


def test_output_processor_counts_pooling_requests_apart(tokenizer: Any, engine_cls: Any) -> None:
    from paged.server.input_processor import InputProcessor
    from paged.server.output_processor import OutputProcessor
    from paged.server.pooling_frontend import build_pooling_request

    processor = OutputProcessor(tokenizer)
    inputs = InputProcessor(tokenizer, max_model_len=64)
    params = _frontend().resolve_params(None, "embed")
    request, _ = build_pooling_request(inputs, "p", PROMPT, params)
    processor.add_request(request, PROMPT)
    stats = IterationStats()
    pooled = PoolerOutput(data=struct.pack("<f", 1.0), shape=[1])
    done = processor.process_outputs(
        [EngineCoreOutput("p", [], finish_reason=FinishReason.STOP, pooling_output=pooled)],
        iteration_stats=stats,
    )
    assert [o.outputs.data.tolist() for o in done.pooling_outputs] == [[1.0]]
    assert done.request_outputs == []
    assert stats.num_pooling_requests == 1 and stats.num_generation_tokens == 0


def test_bad_pooler_config_fails_before_the_model_is_read() -> None:
    args = EngineArgs(model="/nonexistent/model", pooler_config='{"pooling_typ": "MEAN"}')
    with pytest.raises(ValueError, match="pooling_typ"):
        args.create_engine_config()
    with pytest.raises(ValueError, match="pooler_config: not valid JSON"):
        EngineArgs(model="/nonexistent/model", pooler_config="{").create_engine_config()


def test_cli_pooling_flags() -> None:
    parser = build_parser()
    ns = parser.parse_args(
        ["serve", "m", "--runner", "pooling", "--convert", "embed", "--pooler-config", "{}"]
    )
    assert (ns.runner, ns.convert, ns.pooler_config) == ("pooling", "embed", "{}")
    for bad in (["--runner", "bogus"], ["--convert", "reward"], ["--pooler-config", '{"x":1}']):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["serve", "m", *bad])
        assert exc.value.code == 2
