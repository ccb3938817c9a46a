"""The handler behind /v1/responses (create, retrieve, cancel), vLLM 0.33's behaviour.

vLLM: responses/serving.py (create 262-609, full response 765-945, streaming
1309-1457, retrieve/cancel 1131-1190) and api_router.py. The prompt goes
through the chat endpoint's path (chat template with the request's tools,
`paged.server.openai.tools` for forced choices and parsing), so whatever the
chat endpoint learns about tools, this endpoint gets too. With a
--reasoning-parser the output is split as the chat endpoint splits it
(`OpenAIServing.thinking`, `prompt_open`, `gate_structured_output`): the
thinking becomes a `reasoning` item (vLLM: _make_response_output_items,
serving.py:1048-1065; streamed, _process_simple_streaming_events,
serving.py:1217-1289), and tools and `text.format` apply to the answer only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from paged.scheduler import SamplingParams
from paged.server.chat_utils import apply_chat_template
from paged.server.errors import InvalidRequestError
from paged.server.input_processor import TextPrompt
from paged.server.lora import LoRARequest
from paged.server.offload import messages_size
from paged.server.openai import formatting as fmt
from paged.server.openai import tools as chat_tools
from paged.server.openai.generic_tools import generic_messages
from paged.server.openai.responses.inputs import (
    input_messages,
    stored_conversation,
    template_kwargs,
)
from paged.server.openai.responses.output import StreamItems, build_output_items, item_status
from paged.server.openai.responses.protocol import (
    ErrorEvent,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputTokensDetails,
    ResponseLifecycleEvent,
    ResponsesRequest,
    ResponsesResponse,
    ResponseStatus,
    ResponseUsage,
    StreamEvent,
    random_uuid,
)
from paged.server.openai.responses.sampling import responses_sampling_params
from paged.server.openai.responses.store import EventLog, ResponseStore
from paged.server.openai.responses.tooling import ResponsesTools, resolve_tools
from paged.server.openai.serving import OpenAIServing, check_failed, peek_streams
from paged.server.openai.tools import ResolvedToolConfig
from paged.server.outputs import CompletionOutput, RequestOutput
from paged.server.reasoning import ReasoningStream
from paged.server.tool_parsers import ToolStreamer

logger = logging.getLogger(__name__)


class ResponseNotFoundError(InvalidRequestError):
    """404 (vLLM's _make_not_found_error, serving.py:1183-1189)."""

    def __init__(self, response_id: str) -> None:
        super().__init__("response_id", f"Response with id '{response_id}' not found.")


STORE_NEEDED = (
    "This vLLM engine does not support `store=True` and therefore does not support the "
    "background mode. To enable these features, set the environment variable "
    "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server."
)


@dataclass
class _Job:
    """One accepted request: everything needed to run it and describe it."""

    req: ResponsesRequest
    response_id: str
    params: SamplingParams
    tools: ResponsesTools
    messages: list[dict[str, Any]]
    store: bool
    created_at: int
    template_kwargs: dict[str, Any] | None  # the request's, with reasoning.effort applied
    thinking: bool  # a reasoning parser is on and the model thinks in this request
    tool_config: ResolvedToolConfig  # the server's, or the generic format for this template
    lora: LoRARequest | None = None  # the adapter `model` names (None: the base model)


@dataclass
class _Tally:
    prompt: int = 0
    cached: int = 0
    completion: int = 0
    max_tokens: int | None = None
    finish_reason: str | None = None
    # Whether the output starts inside the thinking (OpenAIServing.prompt_open).
    prompt_open: bool | None = None

    def usage(self) -> ResponseUsage:
        return ResponseUsage(
            input_tokens=self.prompt,
            input_tokens_details=InputTokensDetails(cached_tokens=self.cached),
            output_tokens=self.completion,
            output_tokens_details=OutputTokensDetails(),
            total_tokens=self.prompt + self.completion,
        )


def sse_event(event: StreamEvent) -> str:
    """vLLM's SSE framing (api_router.py:34-45): an `event:` line, then the JSON."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


class OpenAIServingResponses:
    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store

    # -- create ------------------------------------------------------------------------

    async def create(self, req: ResponsesRequest) -> ResponsesResponse | AsyncIterator[str]:
        job = await self._accept(req)
        # Submitted (prompt rendered, checked) first: bad input is a 400, background or not.
        stream = await self._submit(job)
        if req.background:
            return await self._start_background(job, stream)
        if req.stream:
            (stream,) = await peek_streams([stream], "input")
            return self._stream(job, stream)
        return await self._full(job, stream)

    async def _accept(self, req: ResponsesRequest) -> _Job:
        """Every check of the request, in vLLM's order, before anything is generated."""
        if req.prompt is not None:
            raise InvalidRequestError("prompt", "prompt template is not supported")
        if req.background and req.store is False:
            raise InvalidRequestError(
                "background", "background can only be used when `store` is true"
            )
        lora = self.serving.check_model(req.model)
        if req.background and not self.store.enabled:
            raise InvalidRequestError("background", STORE_NEEDED)
        llm = self.serving.llm
        # The chat endpoint's choice: the generic format when the template ignores tools.
        tool_config = self.serving.request_tool_config(None, bool(req.tools))
        # The field defaults to true here (OpenAI's Responses default); the generic tool
        # format allows several calls only when a client asked for them in so many words.
        asked = req.parallel_tool_calls if "parallel_tool_calls" in req.model_fields_set else None
        tools = resolve_tools(req.tools, req.tool_choice, asked, tool_config)
        params = responses_sampling_params(
            req,
            chat_tools.structured_json(tools.request, tool_config),
            llm.generation_defaults.sampling,
        )
        kwargs = template_kwargs(req)
        thinking = self.serving.thinking(kwargs)
        # Unlike chat, include_reasoning=false does not stop the thinking: vLLM's
        # Responses hides it after generation (reasoning_ended None, serving.py:532).
        params = self.serving.gate_structured_output(params, thinking)
        prev_messages: list[dict[str, Any]] | None = None
        prev_output: list[OutputItem] | None = None
        if req.previous_response_id is not None:
            prev = await self.store.get(req.previous_response_id)
            if prev is None:
                raise ResponseNotFoundError(req.previous_response_id)
            prev_messages = self.store.messages.get(prev.id)
            prev_output = list(prev.output)
        messages = input_messages(req.instructions, req.input, prev_messages, prev_output)
        return _Job(
            req=req,
            response_id=req.request_id or f"resp_{random_uuid()}",
            params=params,
            tools=tools,
            messages=messages,
            # vLLM silently drops `store` when the store is off (serving.py:296-305).
            store=bool(req.store) and self.store.enabled,
            created_at=int(time.time()),
            template_kwargs=kwargs,
            thinking=thinking,
            tool_config=tool_config,
            lora=lora,
        )

    async def _submit(self, job: _Job) -> AsyncGenerator[RequestOutput, None]:
        llm = self.serving.llm
        messages = job.messages
        if job.tool_config.generic:
            # The template knows no tools: the conversation carries them as text.
            messages = await llm.offload.run(
                messages_size(messages), generic_messages, messages, job.tools.request
            )
        prompt_text = await llm.offload.run(
            messages_size(messages),
            apply_chat_template,
            llm.tokenizer,
            messages,
            add_generation_prompt=True,
            continue_final_message=False,
            chat_template=None,
            chat_template_kwargs=job.template_kwargs,
            tools=job.tools.template_tools,
            allow_images=False,
        )
        prompt: TextPrompt = {"prompt": prompt_text, "add_special_tokens": False}
        try:
            (stream,) = await self.serving._submit(
                job.response_id,
                [prompt],
                job.params,
                job.req.priority,
                job.req.cache_salt,
                lora_request=job.lora,
            )
        except InvalidRequestError as e:
            if e.param != "prompt":
                raise
            # The prompt is made from `input` here (vLLM names it too: serving.py:225).
            raise InvalidRequestError("input", e.message, e.code) from None
        if job.store:
            self.store.messages[job.response_id] = stored_conversation(job.messages)
        return stream

    # -- non-streaming -------------------------------------------------------------------

    async def _full(
        self, job: _Job, stream: AsyncGenerator[RequestOutput, None]
    ) -> ResponsesResponse:
        tally = _Tally()
        text = ""
        logprobs: list[dict[str, Any]] = []
        try:
            async for out in stream:
                check_failed(out, "input")
                self._count(job, tally, out)
                for c in out.outputs:
                    text += c.text
                    logprobs += self._logprobs(job, c)
        finally:
            await stream.aclose()
        output = self._items(job, text, tally, logprobs or None)
        status: ResponseStatus = "incomplete" if tally.finish_reason == "length" else "completed"
        response = self._response(job, status, output, tally)
        if job.store:
            await self.store.put(response)
        return response

    def _items(
        self,
        job: _Job,
        text: str,
        tally: _Tally,
        logprobs: list[dict[str, Any]] | None,
    ) -> list[OutputItem]:
        """The output items of a whole generation: the thinking, the answer, its calls."""
        finish_reason = tally.finish_reason
        reasoning: str | None = None
        parser = self.serving.reasoning
        if parser is not None:
            reasoning, content = parser.extract(text, job.thinking, tally.prompt_open)
            text = content or ""
            if not job.req.include_reasoning:
                reasoning, logprobs = None, None  # vLLM: serving.py:1056-1058
        tool_req = job.tools.request
        if tool_req is None or tool_req.mode == "none":
            return build_output_items(reasoning, text, [], finish_reason, logprobs)
        # Tool calls are read from the answer only, as the chat endpoint does.
        result = chat_tools.extract(tool_req, job.tool_config, text)
        return build_output_items(reasoning, result.content, result.calls, finish_reason)

    def _logprobs(self, job: _Job, c: CompletionOutput) -> list[dict[str, Any]]:
        """`include: ["message.output_text.logprobs"]`: the tokens' logprobs, OpenAI's shape."""
        if job.params.logprobs is None:
            return []
        found = fmt.chat_logprobs(c.logprobs, job.params.logprobs)
        return [lp.model_dump() for lp in (found.content or [])] if found else []

    def _count(self, job: _Job, tally: _Tally, out: RequestOutput) -> None:
        if tally.max_tokens is None:
            tally.prompt = len(out.prompt_token_ids)
            tally.cached = out.num_cached_tokens
            llm = self.serving.llm
            resolved = llm.input_processor.resolve_max_tokens(job.params, tally.prompt)
            tally.max_tokens = resolved.max_tokens
            tally.prompt_open = self.serving.prompt_open(job.params, out.prompt_token_ids)
        for c in out.outputs:
            tally.completion += len(c.token_ids)
            if c.finish_reason is not None:
                tally.finish_reason = c.finish_reason

    def _response(
        self,
        job: _Job,
        status: ResponseStatus,
        output: list[OutputItem],
        tally: _Tally | None,
    ) -> ResponsesResponse:
        """vLLM's ResponsesResponse.from_request (protocol.py:966-1031)."""
        req, params = job.req, job.params
        return ResponsesResponse(
            id=job.response_id,
            created_at=job.created_at,
            status=status,
            incomplete_details=(
                IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
            ),
            instructions=req.instructions,
            metadata=req.metadata,
            model=self.serving.models.response_name(req.model),
            output=output,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=params.temperature,
            tool_choice=req.tool_choice if req.tools else "none",
            tools=req.tools,
            top_p=params.top_p,
            background=bool(req.background),
            max_output_tokens=tally.max_tokens if tally is not None else params.max_tokens,
            max_tool_calls=req.max_tool_calls,
            previous_response_id=req.previous_response_id,
            reasoning=req.reasoning,
            service_tier=req.service_tier,
            text=req.text,
            top_logprobs=params.logprobs,
            truncation=req.truncation or "disabled",
            usage=tally.usage() if tally is not None and status != "queued" else None,
            user=req.user,
            prompt_cache_key=req.prompt_cache_key,
            safety_identifier=req.safety_identifier,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
        )

    # -- streaming ---------------------------------------------------------------------

    async def _stream(
        self, job: _Job, stream: AsyncGenerator[RequestOutput, None]
    ) -> AsyncIterator[str]:
        events = self._stream_events(job, stream)
        try:
            async for event in events:
                yield sse_event(event)
        finally:
            await events.aclose()

    async def _stream_events(
        self, job: _Job, stream: AsyncGenerator[RequestOutput, None]
    ) -> AsyncGenerator[StreamEvent, None]:
        """created, in_progress, the items' events, then completed / incomplete."""
        seq = 0

        def numbered(event: StreamEvent) -> StreamEvent:
            nonlocal seq
            event.sequence_number = seq
            seq += 1
            return event

        tally = _Tally()
        items = StreamItems()
        tool_req = job.tools.request
        streamer = None
        parallel = tool_req is None or tool_req.parallel_tool_calls
        if tool_req is not None and tool_req.mode != "none":
            streamer = chat_tools.streamer(tool_req, job.tool_config)
        parser = self.serving.reasoning
        split: ReasoningStream | None = None
        # vLLM's hide_stream_metadata (serving.py:1230-1240): no thinking, no logprobs.
        hidden = parser is not None and not job.req.include_reasoning
        try:
            first = True
            async for out in stream:
                self._count(job, tally, out)
                if first:
                    start = self._response(job, "in_progress", [], None)
                    start.max_output_tokens = tally.max_tokens
                    for kind in ("response.created", "response.in_progress"):
                        yield numbered(ResponseLifecycleEvent(type=kind, response=start))
                    first = False
                check_failed(out, "input")
                for c in out.outputs:
                    text = c.text
                    pieces: list[StreamEvent] = []
                    if parser is not None:
                        if split is None:
                            split = parser.stream(job.thinking, tally.prompt_open)
                        part = split.feed(c.text, c.finished())
                        text = part.content
                        if not hidden:
                            pieces += items.reasoning(part.reasoning)
                    if streamer is None:
                        logprobs = [] if hidden else self._logprobs(job, c)
                        pieces += items.content(text, logprobs)
                    else:
                        pieces += _piece_events(items, streamer, parallel, text, c.finished())
                    for event in pieces:
                        yield numbered(event)
            for event in items.close(item_status(tally.finish_reason)):
                yield numbered(event)
            status: ResponseStatus = (
                "incomplete" if tally.finish_reason == "length" else "completed"
            )
            final = self._response(job, status, items.items, tally)
            if job.store:
                await self.store.put(final)
            yield numbered(ResponseLifecycleEvent(type=f"response.{status}", response=final))
        except Exception as e:  # the stream has started: report in-band
            logger.error("responses stream failed: %r", e)
            param = e.param if isinstance(e, InvalidRequestError) else None
            message = str(e) or type(e).__name__
            yield numbered(ErrorEvent(type="error", message=message, param=param))
        finally:
            await stream.aclose()

    # -- background, retrieve, cancel -----------------------------------------------------

    async def _start_background(
        self, job: _Job, stream: AsyncGenerator[RequestOutput, None]
    ) -> ResponsesResponse | AsyncIterator[str]:
        """Queue the response and run it in a task; a stream replays the task's events."""
        queued = self._response(job, "queued", [], None)
        async with self.store.lock:
            self.store.responses[job.response_id] = queued.model_copy(deep=True)
        if job.req.stream:
            self.store.events[job.response_id] = EventLog()
        task = asyncio.create_task(
            self._run_background(job, stream), name=f"create_{job.response_id}"
        )
        self.store.tasks[job.response_id] = task
        task.add_done_callback(lambda _: self.store.tasks.pop(job.response_id, None))
        if job.req.stream:
            return self._replay(job.response_id, None)
        return queued

    async def _record(
        self, job: _Job, stream: AsyncGenerator[RequestOutput, None], log: EventLog
    ) -> None:
        events = self._stream_events(job, stream)
        try:
            async for event in events:
                log.append(event)
        finally:
            await events.aclose()

    async def _replay(self, response_id: str, starting_after: int | None) -> AsyncIterator[str]:
        """vLLM's responses_background_stream_generator (serving.py:1121-1150)."""
        log = self.store.events[response_id]
        index = 0 if starting_after is None else starting_after + 1
        while True:
            changed = log.changed()
            while index < len(log.events):
                event = log.events[index]
                yield sse_event(event)
                if event.type in ("response.completed", "response.incomplete", "error"):
                    return
                index += 1
            if log.closed:
                return
            await changed.wait()

    async def _run_background(self, job: _Job, stream: AsyncGenerator[RequestOutput, None]) -> None:
        # vLLM shows "queued" until the response is done (serving.py:1103-1119).
        log = self.store.events.get(job.response_id)
        try:
            if log is not None:
                await self._record(job, stream, log)
            else:
                await self._full(job, stream)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.error("background response %s failed: %r", job.response_id, e)
            async with self.store.lock:
                current = self.store.responses.get(job.response_id)
                if current is not None and current.status not in ("completed", "cancelled"):
                    current.status = "failed"
                    current.error = {"code": "server_error", "message": str(e)}
        finally:
            if log is not None:
                log.close()

    async def retrieve(
        self, response_id: str, stream: bool, starting_after: int | None
    ) -> ResponsesResponse | AsyncIterator[str]:
        """The stored response, or (`stream`) a background stream's events replayed."""
        response = await self.store.get(response_id)
        if response is None:
            raise ResponseNotFoundError(response_id)
        if not stream:
            return response
        if response_id not in self.store.events:
            # vLLM: serving.py:1128-1133 (only background streams keep their events).
            raise InvalidRequestError("response_id", f"Unknown response_id: {response_id}")
        return self._replay(response_id, starting_after)

    async def cancel(self, response_id: str) -> ResponsesResponse:
        async with self.store.lock:
            response = self.store.responses.get(response_id)
            if response is None:
                raise ResponseNotFoundError(response_id)
            if response.status not in ("queued", "in_progress"):
                raise InvalidRequestError("response_id", "Cannot cancel a synchronous response.")
            response.status = "cancelled"
        task = self.store.tasks.get(response_id)
        if task is not None:
            task.cancel()  # closing its stream aborts the request in the engine
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return response


def _piece_events(
    items: StreamItems,
    streamer: ToolStreamer,
    parallel: bool,
    text: str,
    final: bool,
) -> list[StreamEvent]:
    """One output delta as events: its content and calls via the tool streamer."""
    update = streamer.feed(text, final)
    events = items.content(update.content)
    for d in update.tool_calls:
        if not parallel and d.index != 0:
            continue  # parallel_tool_calls: false keeps the first call (vLLM)
        events += items.tool_call(d.index, d.arguments, d.id, d.name)
    return events
