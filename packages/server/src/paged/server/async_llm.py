"""AsyncLLM: the asynchronous entry point the API server uses (seed: AsyncLLM).

    generate() -> add_request() -> InputProcessor -> OutputProcessor.add_request
                                -> engine client add_request_async (ZMQ)
    output handler task: get_output_async() -> OutputProcessor.process_outputs
                         -> per-request RequestOutputCollector -> generate() yields

Cancelling or closing a `generate()` generator aborts its request in the
engine. When the engine dies, every in-flight and later request fails with
`EngineDeadError` and `errored` turns true (the API's /health then says 503).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from paged.scheduler import PoolingParams, SamplingParams, SchedulerStats
from paged.scheduler.boundary import KVTransferParams
from paged.server.client_protocols import (
    AsyncEngineClient,
    AsyncUtilityClient,
    DegradableClient,
    NoEngineUtilities,
    RoutingClient,
)
from paged.server.collector import RequestOutputCollector
from paged.server.engine.errors import EngineDeadError
from paged.server.errors import InvalidRequestError
from paged.server.generation_defaults import GenerationDefaults
from paged.server.input_processor import InputProcessor, PromptType
from paged.server.lora import LoRARegistry, LoRARequest
from paged.server.metrics import PerEngineStatLogger, StatLogger
from paged.server.offload import BlockingWork, prompt_size
from paged.server.output_processor import OutputProcessor
from paged.server.outputs import RequestOutput
from paged.server.parent import fan_out
from paged.server.pooling_frontend import (
    PoolingFrontend,
    build_pooling_request,
    generate_unsupported_message,
)
from paged.server.pooling_outputs import PoolingOutput, PoolingOutputCollector, PoolingRequestOutput
from paged.server.stats import IterationStats
from paged.server.structured_output.compiler import GrammarCompiler
from paged.server.structured_output.validate import check_compiles_async
from paged.server.tokenizer import TokenizerLike

if TYPE_CHECKING:
    from paged.server.mm_frontend import MultiModalFrontend

logger = logging.getLogger(__name__)
_OUTPUT_CHUNK = 256


class AsyncLLM:
    """Streams `RequestOutput`s for concurrent requests sharing one engine."""

    def __init__(
        self,
        engine_client: AsyncEngineClient,
        tokenizer: TokenizerLike,
        *,
        max_model_len: int,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] = (),
        max_logprobs: int = 20,
        stat_loggers: Sequence[StatLogger] = (),
        grammar_compiler: GrammarCompiler | None = None,
        mm_frontend: MultiModalFrontend | None = None,
        generation_defaults: GenerationDefaults | None = None,
        log_requests: bool = False,
        pooling: PoolingFrontend | None = None,
    ) -> None:
        self.engine_client = engine_client
        # What the model pools (None: a generative model without a pooler).
        self.pooling = pooling
        # --generation-config: the API's defaults for fields a request leaves out.
        self.generation_defaults = generation_defaults or GenerationDefaults()
        self.log_requests = log_requests  # --enable-log-requests
        # Compiles (and caches) output constraints to refuse bad ones up front;
        # None: this engine has no grammar backend, constrained requests are refused.
        self.grammar_compiler = grammar_compiler
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.input_processor = InputProcessor(
            tokenizer,
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            eos_token_ids=eos_token_ids,
            max_logprobs=max_logprobs,
            mm_frontend=mm_frontend,
            default_max_tokens=self.generation_defaults.default_max_tokens,
            max_tokens_cap=self.generation_defaults.max_tokens_cap,
        )
        self.output_processor = OutputProcessor(tokenizer)
        # Tokenization and chat templates of large inputs run here, off the loop.
        self.offload = BlockingWork()
        self.stat_loggers = list(stat_loggers)
        self._output_handler: asyncio.Task[None] | None = None
        self._dead: EngineDeadError | None = None
        # LoRA adapters this frontend loaded on the engine (names -> requests).
        self.loras = LoRARegistry()

    # -- health ----------------------------------------------------------------------
    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine is unusable, or None while it serves."""
        return self._dead or self.engine_client.dead_error

    @property
    def health_error(self) -> EngineDeadError | None:
        """What /health reports: `dead_error`, or a data-parallel engine that is gone
        while the others still serve (`DegradableClient.degraded_error`)."""
        dead = self.dead_error
        if dead is None and isinstance(self.engine_client, DegradableClient):
            return self.engine_client.degraded_error
        return dead

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def is_running(self) -> bool:
        return not self.errored

    async def check_health(self) -> None:
        dead = self.dead_error
        if dead is not None:
            raise dead

    # -- requests --------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: KVTransferParams | None = None,
        ec_transfer_params: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestOutputCollector:
        """Validate, register and submit one request; return its output collector.

        `lora_request`: the adapter to run with, loaded on the engine first if
        this frontend has not loaded it (InvalidRequestError when it cannot be).

        `request_id` is the caller's id and may be reused, even by requests in
        flight together: as vLLM 0.33 (InputProcessor.assign_request_id), the
        engine gets `"{request_id}-{8 random hex}"`, which the collector's
        `request_id` holds, while outputs carry `request_id` as given.
        """
        if not request_id:
            raise InvalidRequestError("request_id", "request_id must not be empty")
        if "generate" not in self.supported_tasks:
            raise InvalidRequestError(None, generate_unsupported_message("generate"))
        self._check_alive()
        internal_id = self._internal_request_id(request_id)
        if self.log_requests:
            self._log_received(request_id, prompt, params)
        if params.structured_outputs is not None:
            await check_compiles_async(self.grammar_compiler, params)
        if lora_request is not None:
            await self.loras.ensure_loaded(lora_request, self._add_lora_for_request)
        try:
            request, prompt_text = await self.offload.run(
                prompt_size(prompt),
                self.input_processor.process_inputs,
                internal_id,
                prompt,
                params,
                priority=priority,
                cache_salt=cache_salt,
                kv_transfer_params=kv_transfer_params,
                ec_transfer_params=ec_transfer_params,
                commit_mm=False,
            )
            # Checked again: the engine may have died while a large prompt was
            # tokenized on the worker thread.
            self._check_alive()
            if internal_id in self.output_processor.request_states:  # 1 in 4e9: try again
                raise InvalidRequestError("request_id", "request id collision; please retry")
            if lora_request is not None:
                request = msgspec.structs.replace(
                    request,
                    lora_request=lora_request.lora_name,
                    lora_path=lora_request.lora_path,
                )
        except BaseException:
            self.input_processor.discard_mm(internal_id)  # cancelled or refused: not sent
            raise
        # No await from here to the send: the processor cache is updated in
        # send order, which is what keeps the engine's mirror in step.
        request = self.input_processor.commit_mm(request)
        self._ensure_output_handler()
        queue = RequestOutputCollector(params.output_kind, internal_id)
        parent, requests = fan_out(request)
        for i, req in enumerate(requests):
            self.output_processor.add_request(req, prompt_text, parent, i, queue, request_id)
        for req in requests:
            await self.engine_client.add_request_async(req)
            if self.log_requests:
                logger.info("Added request %s.", req.request_id)
        return queue

    # -- pooling ---------------------------------------------------------------------
    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """vLLM's supported tasks ("generate", or the pooler's: embed, classify, ...)."""
        return ("generate",) if self.pooling is None else self.pooling.supported_tasks

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's `AsyncLLM.get_supported_tasks` (async there too)."""
        return self.supported_tasks

    async def add_pooling_request(
        self,
        request_id: str,
        prompt: PromptType,
        pooling_params: PoolingParams,
        *,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
    ) -> PoolingOutputCollector:
        """Validate and submit one pooling request; its collector (one final output).

        `pooling_params.task` None takes the model's pooling task; the params
        are verified against the model (InvalidRequestError naming the field).
        """
        pooling = self.pooling
        if pooling is None or not pooling.can_pool:
            raise InvalidRequestError(
                None,
                "This model does not support pooling; its tasks are "
                f"{self.supported_tasks}. Try passing `--runner pooling`.",
            )
        task = pooling_params.task or pooling.pooling_task
        try:
            task = pooling.check_task(task)
        except ValueError as exc:
            raise InvalidRequestError("task", str(exc)) from exc
        params = pooling.resolve_params(pooling_params, task)
        if not request_id:
            raise InvalidRequestError("request_id", "request_id must not be empty")
        self._check_alive()
        internal_id = self._internal_request_id(request_id)
        request, prompt_text = await self.offload.run(
            prompt_size(prompt),
            build_pooling_request,
            self.input_processor,
            internal_id,
            prompt,
            params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            priority=priority,
        )
        self._check_alive()
        self._ensure_output_handler()
        queue = PoolingOutputCollector(internal_id)
        self.output_processor.add_request(
            request, prompt_text, external_req_id=request_id, pooling_queue=queue
        )
        await self.engine_client.add_request_async(request)
        if self.log_requests:
            logger.info("Added pooling request %s.", internal_id)
        return queue

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput[PoolingOutput], None]:
        """vLLM's `AsyncLLM.encode`: yields the request's one, final PoolingRequestOutput.

        Closing the generator before it yields aborts the request.
        """
        rid = request_id if request_id is not None else uuid.uuid4().hex
        queue = await self.add_pooling_request(
            rid,
            prompt,
            pooling_params,
            priority=priority,
            truncate_prompt_tokens=truncate_prompt_tokens,
        )
        finished = False
        try:
            out = queue.get_nowait() or await queue.get()
            finished = True
            yield out
        finally:
            if not finished:
                await self.abort(queue.request_id, internal=True)

    def _internal_request_id(self, request_id: str) -> str:
        states, parents = (
            self.output_processor.request_states,
            self.output_processor.parent_requests,
        )
        while True:
            internal_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
            if internal_id not in states and internal_id not in parents:
                return internal_id

    def _log_received(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        # vLLM's RequestLogger: parameters at INFO, the prompt only at DEBUG.
        logger.debug("Request %s details: prompt: %r.", request_id, prompt)
        logger.info("Received request %s: params: %s.", request_id, params)

    def _check_alive(self) -> None:
        dead = self.dead_error
        if dead is not None:
            raise dead

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield outputs until the request finishes; closing the generator aborts it."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        rid = request_id if request_id is not None else uuid.uuid4().hex
        queue = await self.add_request(
            rid,
            prompt,
            params,
            priority=priority,
            cache_salt=cache_salt,
            lora_request=lora_request,
        )
        stream = self.stream_outputs(queue)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()  # now, not when the loop finalizes it: aborts at once

    async def stream_outputs(
        self, queue: RequestOutputCollector
    ) -> AsyncGenerator[RequestOutput, None]:
        """Like `generate()`, for a request already submitted with `add_request()`.

        The API server submits every prompt first (so bad input is a 400
        before any response starts), then streams them.
        """
        finished = False
        try:
            while not finished:
                out = queue.get_nowait() or await queue.get()
                finished = out.finished
                yield out
        finally:
            # Cancelled, closed early (client disconnect) or failed: free this
            # request's engine resources, and no other's that shares its id.
            if not finished:
                await self.abort(queue.request_id, internal=True)

    async def abort(self, request_id: str | Sequence[str], *, internal: bool = False) -> None:
        """Abort requests; unknown ids are ignored.

        By default the ids are the callers' (`add_request`/`generate`'s), and every
        request in flight under one is aborted, as vLLM's `AsyncLLM.abort`;
        `internal=True` names engine ids (a collector's `request_id`) instead.
        """
        named = [request_id] if isinstance(request_id, str) else list(request_id)
        ids = named if internal else self.output_processor.ids_of_external(named)
        engine_ids: list[str] = []
        # Counted under the engine that held each request (data parallelism),
        # asked before the engine client forgets who held it.
        for index, held in self._group_by_engine(self.output_processor.engine_ids_of(ids)):
            stats = IterationStats()
            engine_ids += self.output_processor.abort_requests(held, stats)
            self._record_stats(index, None, stats)
        if engine_ids and self.log_requests:
            logger.info("Aborted request(s) %s.", ",".join(named))
        if engine_ids and self._dead is None:
            # A dead engine holds nothing any more; the handler reports the death.
            with contextlib.suppress(EngineDeadError):
                await self.engine_client.abort_requests_async(engine_ids)

    # -- LoRA adapters (vLLM's AsyncLLM.add_lora / remove_lora / list_loras) -----------
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter on the engine; ValueError with the cause if it does not load.

        True when loaded now, False when this frontend had loaded it already.
        """
        return await self.loras.ensure_loaded(lora_request, self._engine_add_lora)

    async def remove_lora(self, lora_name: str) -> bool:
        """Forget an adapter; requests already running with it finish with it first.

        False if the engine did not know the name.
        """
        self.loras.forget(lora_name)
        return bool(await self._utility_client().call_utility_async("remove_lora", lora_name))

    async def list_loras(self) -> list[str]:
        """The adapter names the engine has loaded."""
        return list(await self._utility_client().call_utility_async("list_loras"))

    async def _engine_add_lora(self, lora_request: LoRARequest) -> None:
        await self._utility_client().call_utility_async(
            "add_lora", lora_request.lora_name, lora_request.lora_path, lora_request.lora_int_id
        )

    async def _add_lora_for_request(self, lora_request: LoRARequest) -> None:
        try:
            await self._engine_add_lora(lora_request)
        except ValueError as exc:
            raise InvalidRequestError("lora_request", str(exc)) from exc

    def _utility_client(self) -> AsyncUtilityClient:
        client = self.engine_client
        if not isinstance(client, AsyncUtilityClient):
            raise NoEngineUtilities(client)
        return client

    async def reset_prefix_cache(self) -> bool:
        """Drop the engine's cached prefix blocks; False while running requests hold blocks."""
        return bool(await self._utility_client().call_utility_async("reset_prefix_cache"))

    # -- the output handler ----------------------------------------------------------
    def _ensure_output_handler(self) -> None:
        if self._output_handler is None or self._output_handler.done():
            self._output_handler = asyncio.get_running_loop().create_task(
                self._run_output_handler(), name="paged-output-handler"
            )

    async def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_client.get_output_async()
                stats = IterationStats()
                # Large batches are processed in slices, yielding to the event
                # loop in between so the API keeps answering (as vLLM does).
                for start in range(0, len(outputs.outputs), _OUTPUT_CHUNK):
                    if start:
                        await asyncio.sleep(0)
                    processed = self.output_processor.process_outputs(
                        outputs.outputs[start : start + _OUTPUT_CHUNK], outputs.timestamp, stats
                    )
                    if processed.reqs_to_abort:
                        await self.engine_client.abort_requests_async(processed.reqs_to_abort)
                # Data parallelism: each batch comes from one engine.
                self._record_stats(outputs.engine_index, outputs.scheduler_stats, stats)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._fail(e)
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("the output handler failed")
            self._fail(EngineDeadError(f"the engine output handler failed: {e!r}"))

    def _record_stats(
        self,
        engine_index: int,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats,
    ) -> None:
        for stat_logger in self.stat_loggers:
            if isinstance(stat_logger, PerEngineStatLogger):
                stat_logger.record_engine(engine_index, scheduler_stats, iteration_stats)
            else:
                stat_logger.record(scheduler_stats, iteration_stats)

    def _group_by_engine(self, engine_ids: list[str]) -> list[tuple[int, list[str]]]:
        """`engine_ids` by the engine that holds them, in first-seen order (0 if unknown)."""
        client = self.engine_client
        groups: dict[int, list[str]] = {}
        for rid in engine_ids:
            index = client.engine_of(rid) if isinstance(client, RoutingClient) else None
            groups.setdefault(index or 0, []).append(rid)
        return list(groups.items())

    def _fail(self, error: EngineDeadError) -> None:
        logger.error("engine is dead: %s", error)
        self._dead = error
        stats = IterationStats()
        self.output_processor.propagate_error(error, stats)
        # A dead engine runs, queues and caches nothing: zero its gauges, which
        # would otherwise keep its last report (the in-flight requests) forever.
        for stat_logger in self.stat_loggers:
            stat_logger.record(SchedulerStats(), stats)

    def shutdown(self) -> None:
        if self._output_handler is not None:
            self._output_handler.cancel()
        self.offload.shutdown()
        self.engine_client.shutdown()
        if self.input_processor.mm_frontend is not None:
            self.input_processor.mm_frontend.close()  # shm segments
