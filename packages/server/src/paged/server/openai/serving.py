"""The handlers behind /v1/completions and /v1/chat/completions.

Every prompt is submitted (validated, tokenized) before a response starts,
so bad input is always a plain 400, never a broken stream. Streams are
async generators of SSE lines ending in `data: [DONE]`; closing one (the
client went away) closes the underlying `AsyncLLM` streams, which abort
their requests in the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from paged.scheduler import SamplingParams
from paged.scheduler.boundary import KVTransferParams
from paged.server.async_llm import AsyncLLM
from paged.server.chat_utils import (
    FALLBACK_CHAT_TEMPLATE,
    apply_chat_template,
    collect_image_urls,
    normalize_messages,
)
from paged.server.collector import RequestOutputCollector
from paged.server.ec_transfer import parse_request_ec_transfer_params
from paged.server.errors import InvalidRequestError
from paged.server.input_processor import PromptType, TextPrompt
from paged.server.kv_transfer import parse_request_kv_transfer_params
from paged.server.lora import LoRARequest
from paged.server.offload import messages_size
from paged.server.openai import formatting as fmt
from paged.server.openai import tools
from paged.server.openai.generic_tools import ToolTemplateProbe, generic_messages
from paged.server.openai.models import ServedModels
from paged.server.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
)
from paged.server.openai.sampling import chat_sampling_params, completion_sampling_params
from paged.server.openai.tool_types import ToolRequest
from paged.server.openai.tools import ResolvedToolConfig
from paged.server.outputs import CompletionOutput, RequestOutput
from paged.server.reasoning import (
    ReasoningEndDetector,
    ReasoningParser,
    ReasoningStream,
    thinking_enabled,
)
from paged.server.tokenizer import TokenizerLike
from paged.server.tool_parsers import ToolStreamer
from paged.server.utils import merge_async_iterators

if TYPE_CHECKING:
    from paged.server.mm_frontend import MultiModalFrontend

logger = logging.getLogger(__name__)


class EngineRequestError(RuntimeError):
    """The engine failed one request (e.g. NaN logits); it keeps serving the others."""


def check_failed(out: RequestOutput, prompt_param: str) -> None:
    """Raise for a request the engine failed or refused (finished with no tokens and a reason)."""
    if any(c.finish_reason == "error" for c in out.outputs):
        raise EngineRequestError(out.error or out.finish_detail or "the engine failed the request")
    if out.finished and out.finish_detail and not any(c.token_ids for c in out.outputs):
        length = any(c.finish_reason == "length" for c in out.outputs)
        code = "context_length_exceeded" if length else None
        raise InvalidRequestError(prompt_param, out.finish_detail, code=code)


async def _peeked(
    first: RequestOutput, rest: AsyncGenerator[RequestOutput, None]
) -> AsyncGenerator[RequestOutput, None]:
    try:
        yield first
        async for out in rest:
            yield out
    finally:
        await rest.aclose()


async def peek_streams(
    streams: list[AsyncGenerator[RequestOutput, None]], prompt_param: str
) -> list[AsyncGenerator[RequestOutput, None]]:
    """Wait for each stream's first output so a refused request is a 400, not a broken stream."""
    peeked: list[AsyncGenerator[RequestOutput, None]] = []
    try:
        for stream in streams:
            first = await anext(stream)
            check_failed(first, prompt_param)
            peeked.append(_peeked(first, stream))
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    return peeked


@dataclass
class _Totals:
    """Usage accumulated over a request's prompts and choices."""

    prompt: int = 0
    completion: int = 0
    cached: int = 0
    seen_prompts: set[int] = field(default_factory=set)
    kv_transfer_params: dict[str, Any] | None = None  # from the connector, once finished
    ec_transfer_params: dict[str, Any] | None = None  # from the EC connector, once finished

    def add(self, prompt_idx: int, out: RequestOutput) -> None:
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        if out.ec_transfer_params is not None:
            self.ec_transfer_params = out.ec_transfer_params
        if prompt_idx not in self.seen_prompts:
            self.seen_prompts.add(prompt_idx)
            self.prompt += len(out.prompt_token_ids)
            self.cached += out.num_cached_tokens
        self.completion += sum(len(c.token_ids) for c in out.outputs)


class OpenAIServing:
    def __init__(
        self,
        llm: AsyncLLM,
        model_name: str,
        tool_config: ResolvedToolConfig | None = None,
        reasoning: ReasoningParser | None = None,
        models: ServedModels | None = None,
    ) -> None:
        """`reasoning`: the --reasoning-parser; chat answers then carry `reasoning`.

        `models`: what `model` may name (the served name and the LoRA adapters).
        """
        self.llm = llm
        self.model_name = model_name
        self.models = models if models is not None else ServedModels(llm, model_name)
        self.tool_config = tool_config or ResolvedToolConfig()
        self.reasoning = reasoning
        # Reads the prompt's tags, so the split starts where the engine's grammar does.
        self._reasoning_end = (
            ReasoningEndDetector(reasoning.spec, llm.tokenizer) if reasoning is not None else None
        )
        self.tool_probe = ToolTemplateProbe(llm.tokenizer)

    def request_tool_config(
        self, chat_template: str | None, has_tools: bool = True
    ) -> ResolvedToolConfig:
        """The tool config for a request rendered with `chat_template` (or the server's).

        Only a request with tools probes the template: the probe renders it twice.
        """
        if not self.tool_config.generic_when_ignored or not has_tools:
            return self.tool_config
        template = (
            chat_template
            or getattr(self.llm.tokenizer, "chat_template", None)
            or FALLBACK_CHAT_TEMPLATE
        )
        return self.tool_config.for_template(self.tool_probe.ignores_tools(template))

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); 404 for an unknown name."""
        return self.models.resolve(model)

    async def _submit(
        self,
        base_id: str,
        prompts: Sequence[PromptType],
        params: SamplingParams,
        req_priority: int,
        cache_salt: str | None,
        kv_transfer_params: KVTransferParams | None = None,
        ec_transfer_params: dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        submitted: list[RequestOutputCollector] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                # The engine makes its own id unique: a client may reuse `rid`.
                queue = await self.llm.add_request(
                    rid,
                    prompt,
                    params,
                    priority=req_priority,
                    cache_salt=cache_salt,
                    kv_transfer_params=kv_transfer_params,
                    ec_transfer_params=ec_transfer_params,
                    lora_request=lora_request,
                )
                submitted.append(queue)
        except BaseException:
            await self.llm.abort([q.request_id for q in submitted], internal=True)
            raise
        return [self.llm.stream_outputs(q) for q in submitted]

    # -- tokenizer endpoints ---------------------------------------------------------------
    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt or messages")
        if body.tools is not None and body.messages is None:
            raise InvalidRequestError("tools", "tools go with messages (the chat form)")
        messages = [m.model_dump(exclude_none=True) for m in body.messages or []]
        # Checked as a chat request's tools; the template gets them the same way.
        tool_dicts = [t.template_dict() for t in tools.parse_tools(body.tools or [])]
        if collect_image_urls(messages) and self.llm.input_processor.mm_frontend is not None:
            raise InvalidRequestError(
                "messages", "/tokenize does not process images; send the messages without them"
            )
        size = messages_size(messages) + len(body.prompt or "")
        ids, strs = await self.llm.offload.run(
            size, _tokenize, self.llm.tokenizer, body, messages, tool_dicts
        )
        return TokenizeResponse(
            count=len(ids), max_model_len=self.llm.max_model_len, tokens=ids, token_strs=strs
        )

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        size = len(body.tokens)
        check = self.llm.input_processor.check_token_ids
        ids = await self.llm.offload.run(size, check, body.tokens, "tokens")
        text = await self.llm.offload.run(size, self.llm.tokenizer.decode, ids)
        return DetokenizeResponse(prompt=text)

    # -- completions -------------------------------------------------------------------
    async def create_completion(
        self, req: CompletionRequest, header_request_id: str | None = None
    ) -> CompletionResponse | AsyncIterator[str]:
        """`header_request_id`: the X-Request-Id header, which names the request first."""
        lora = self.check_model(req.model)
        params = completion_sampling_params(req, self.llm.generation_defaults.sampling)
        kv_params = parse_request_kv_transfer_params(req.kv_transfer_params)
        ec_params = parse_request_ec_transfer_params(req.ec_transfer_params)
        prompts = _completion_prompts(req)
        base_id = response_id("cmpl", header_request_id, req.request_id)
        streams = await self._submit(
            base_id, prompts, params, req.priority, req.cache_salt, kv_params, ec_params, lora
        )
        texts = [p.get("prompt") if isinstance(p, dict) else None for p in prompts]
        if req.stream:
            streams = await peek_streams(streams, "prompt")
            return self._completion_stream(req, base_id, streams, texts)
        totals = _Totals()
        choices: list[CompletionResponseChoice] = []
        async for i, out in merge_async_iterators(streams):
            check_failed(out, "prompt")
            totals.add(i, out)
            for c in out.outputs:
                echo = (texts[i] or "") if req.echo else ""
                choices.append(
                    CompletionResponseChoice(
                        index=i * params.n + c.index,
                        text=echo + c.text,
                        logprobs=fmt.completion_logprobs(c.logprobs, req.logprobs or 0, 0),
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=base_id,
            model=self.models.response_name(req.model),
            choices=choices,
            usage=fmt.usage(totals.prompt, totals.completion, totals.cached),
            kv_transfer_params=totals.kv_transfer_params,
            ec_transfer_params=totals.ec_transfer_params,
        )

    async def _completion_stream(
        self,
        req: CompletionRequest,
        base_id: str,
        streams: list[AsyncGenerator[RequestOutput, None]],
        texts: list[str | None],
    ) -> AsyncIterator[str]:
        n = req.n
        totals = _Totals()
        offsets: dict[int, int] = {}
        merged = merge_async_iterators(streams)
        try:
            if req.echo:
                for i, text in enumerate(texts):
                    for j in range(n):
                        offsets[i * n + j] = len(text or "")
                        yield fmt.sse(
                            self._completion_chunk(base_id, i * n + j, text or "", req.model)
                        )
            async for i, out in merged:
                totals.add(i, out)
                if any(c.finish_reason == "error" for c in out.outputs):
                    check_failed(out, "prompt")
                for c in out.outputs:
                    index = i * n + c.index
                    start = offsets.get(index, 0)
                    offsets[index] = start + len(c.text)
                    if not c.text and not c.finished() and not c.token_ids:
                        continue
                    chunk = self._completion_chunk(base_id, index, c.text, req.model)
                    choice = chunk.choices[0]
                    choice.logprobs = fmt.completion_logprobs(c.logprobs, req.logprobs or 0, start)
                    choice.finish_reason = c.finish_reason
                    choice.stop_reason = c.stop_reason
                    chunk.usage = _running_usage(req, totals)
                    yield fmt.sse(chunk)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield fmt.sse(
                    CompletionStreamResponse(
                        id=base_id,
                        model=self.models.response_name(req.model),
                        choices=[],
                        usage=fmt.usage(totals.prompt, totals.completion, totals.cached),
                    )
                )
        except Exception as e:  # the response has started: report in-band
            yield stream_error(e)
        finally:
            await merged.aclose()
        yield fmt.SSE_DONE

    def _completion_chunk(
        self, base_id: str, index: int, text: str, model: str | None
    ) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            id=base_id,
            model=self.models.response_name(model),
            choices=[CompletionResponseChoice(index=index, text=text)],
        )

    # -- chat ----------------------------------------------------------------------------
    async def create_chat_completion(
        self, req: ChatCompletionRequest, header_request_id: str | None = None
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """`header_request_id`: the X-Request-Id header, which names the request first."""
        lora = self.check_model(req.model)
        tool_config = self.request_tool_config(req.chat_template, bool(req.tools))
        tool_req = tools.parse_tool_request(
            req.tools, req.tool_choice, req.parallel_tool_calls, tool_config
        )
        params = chat_sampling_params(
            req, tools.structured_json(tool_req, tool_config), self.llm.generation_defaults.sampling
        )
        thinking = self.thinking(req.chat_template_kwargs)
        params = self.gate_structured_output(params, req.include_reasoning and thinking)
        kv_params = parse_request_kv_transfer_params(req.kv_transfer_params)
        ec_params = parse_request_ec_transfer_params(req.ec_transfer_params)
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        mm = self.llm.input_processor.mm_frontend
        image_urls = collect_image_urls(messages)
        if image_urls and mm is None:
            raise InvalidRequestError(
                "messages",
                f"model {self.model_name!r} is text-only: it does not accept image inputs",
            )
        if mm is not None:
            mm.check_counts({"image": len(image_urls)}, "messages")
        size = messages_size(messages) + len(req.chat_template or "")
        if tool_config.generic:
            # The template knows no tools: the conversation carries them as text.
            messages = await self.llm.offload.run(
                size, generic_messages, messages, tool_req, allow_images=mm is not None
            )
        prompt_text = await self.llm.offload.run(
            size,
            apply_chat_template,
            self.llm.tokenizer,
            messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
            tools=tools.template_tools(tool_req, tool_config),
            allow_images=mm is not None,
        )
        # The template already holds the special tokens (BOS etc.).
        prompt: TextPrompt = {"prompt": prompt_text, "add_special_tokens": False}
        if image_urls and mm is not None:
            prompt["multi_modal_data"] = {"image": await _load_images(mm, image_urls)}
        base_id = response_id("chatcmpl", header_request_id, req.request_id)
        (stream,) = await self._submit(
            base_id, [prompt], params, req.priority, req.cache_salt, kv_params, ec_params, lora
        )
        echo = ""
        if req.echo and messages and messages[-1].get("role") == "assistant":
            # The text the template saw: content parts joined, not the list's repr.
            echo = normalize_messages(messages)[-1]["content"]
        top_k = req.top_logprobs or 0
        if req.stream:
            (stream,) = await peek_streams([stream], "messages")
            return self._chat_stream(
                req, base_id, stream, echo, top_k, tool_req, thinking, params, tool_config
            )
        totals = _Totals()
        choices: list[ChatCompletionResponseChoice] = []
        async for out in stream:
            check_failed(out, "messages")
            totals.add(0, out)
            open_ = self.prompt_open(params, out.prompt_token_ids)
            for c in out.outputs:
                reasoning, answer = None, c.text
                if self.reasoning is not None:
                    reasoning, content = self.reasoning.extract(c.text, thinking, open_)
                    answer = content or ""
                message = ChatMessage(role="assistant", content=echo + answer)
                if self.reasoning is not None and not echo and not answer:
                    message.content = None  # vLLM: null content after the thinking
                finish = c.finish_reason
                if tool_req is not None and tool_req.mode != "none":
                    # Tool calls are read from the answer only.
                    message, finish = tools.chat_message(
                        tool_req, tool_config, answer, c.finish_reason
                    )
                    if echo:
                        message.content = echo + (message.content or "")
                message.reasoning = reasoning if req.include_reasoning else None
                choices.append(
                    ChatCompletionResponseChoice(
                        index=c.index,
                        message=message,
                        logprobs=fmt.chat_logprobs(c.logprobs, top_k),
                        finish_reason=finish,
                        stop_reason=c.stop_reason,
                    )
                )
        choices.sort(key=lambda c: c.index)
        return ChatCompletionResponse(
            id=base_id,
            model=self.models.response_name(req.model),
            choices=choices,
            usage=fmt.usage(totals.prompt, totals.completion, totals.cached),
            kv_transfer_params=totals.kv_transfer_params,
            ec_transfer_params=totals.ec_transfer_params,
        )

    async def _chat_stream(
        self,
        req: ChatCompletionRequest,
        base_id: str,
        stream: AsyncGenerator[RequestOutput, None],
        echo: str,
        top_k: int,
        tool_req: ToolRequest | None = None,
        thinking: bool = True,
        params: SamplingParams | None = None,
        tool_config: ResolvedToolConfig | None = None,
    ) -> AsyncIterator[str]:
        totals = _Totals()
        config = tool_config or self.tool_config
        streamers: dict[int, ToolStreamer] = {}
        splits: dict[int, ReasoningStream] = {}
        try:
            for j in range(req.n):
                yield fmt.sse(
                    self._chat_chunk(
                        base_id, j, DeltaMessage(role="assistant", content=""), req.model
                    )
                )
                if echo:
                    yield fmt.sse(
                        self._chat_chunk(base_id, j, DeltaMessage(content=echo), req.model)
                    )
            async for out in stream:
                totals.add(0, out)
                if any(c.finish_reason == "error" for c in out.outputs):
                    check_failed(out, "messages")
                for c in out.outputs:
                    if self.reasoning is not None:
                        split = splits.get(c.index)
                        if split is None:
                            open_ = self.prompt_open(params, out.prompt_token_ids)
                            split = self.reasoning.stream(thinking, open_)
                            splits[c.index] = split
                        chunk, c = self._reasoning_chunk(req, base_id, c, split, top_k)
                        if chunk is not None:
                            chunk.usage = _running_usage(req, totals)
                            yield fmt.sse(chunk)
                        if not c.text and not c.finished():
                            continue  # all of this delta was thinking (or a held tag)
                    st = streamers.get(c.index) or tools.streamer(tool_req, config)
                    if st is not None:
                        streamers[c.index] = st
                        for tool_chunk in self._tool_chunks(req, base_id, c, st, tool_req, top_k):
                            tool_chunk.usage = _running_usage(req, totals)
                            yield fmt.sse(tool_chunk)
                        continue
                    if not c.text and not c.finished() and not c.token_ids:
                        continue
                    chunk = self._chat_chunk(
                        base_id, c.index, DeltaMessage(content=c.text), req.model
                    )
                    choice = chunk.choices[0]
                    if c.finished():
                        if not c.text:
                            choice.delta = DeltaMessage()
                        choice.finish_reason = c.finish_reason
                        choice.stop_reason = c.stop_reason
                    choice.logprobs = fmt.chat_logprobs(c.logprobs, top_k) if req.logprobs else None
                    chunk.usage = _running_usage(req, totals)
                    yield fmt.sse(chunk)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield fmt.sse(
                    ChatCompletionStreamResponse(
                        id=base_id,
                        model=self.models.response_name(req.model),
                        choices=[],
                        usage=fmt.usage(totals.prompt, totals.completion, totals.cached),
                    )
                )
        except Exception as e:
            yield stream_error(e)
        finally:
            await stream.aclose()
        yield fmt.SSE_DONE

    # The reasoning split, shared with /v1/responses (responses/serving.py).
    def thinking(self, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether the model thinks in this request (qwen3 reads `enable_thinking`)."""
        if self.reasoning is None:
            return False
        return thinking_enabled(self.reasoning.spec, chat_template_kwargs)

    def prompt_open(
        self, params: SamplingParams | None, prompt_token_ids: list[int]
    ) -> bool | None:
        """Whether the output starts inside the thinking, as the engine's gate decides:
        False when the grammar was told to start at once or the prompt's last tag closed
        the thinking, True when it opened it, None (the parser's own start) with no tag.
        vLLM's parse_delta checks the prompt the same way (abstract_parser.py:869-882)."""
        so = params.structured_outputs if params is not None else None
        if so is not None and so.reasoning_ended:
            return False
        if self._reasoning_end is None:
            return None
        tag = self._reasoning_end.prompt_tag(prompt_token_ids)
        return None if tag is None else not tag

    def gate_structured_output(self, params: SamplingParams, thinks: bool) -> SamplingParams:
        """vLLM's `resolve_reasoning_ended` (chat_completion/protocol.py:626-641): when
        the model does not think here (`thinks` false: chat's `include_reasoning` false, or
        thinking off) the grammar constrains from the first token; otherwise the engine
        reads the prompt's tags."""
        so = params.structured_outputs
        if self.reasoning is None or so is None:
            return params
        if thinks:
            return params
        return msgspec.structs.replace(
            params, structured_outputs=msgspec.structs.replace(so, reasoning_ended=True)
        )

    def _reasoning_chunk(
        self,
        req: ChatCompletionRequest,
        base_id: str,
        c: CompletionOutput,
        split: ReasoningStream,
        top_k: int,
    ) -> tuple[ChatCompletionStreamResponse | None, CompletionOutput]:
        """Split one output delta: a `delta.reasoning` chunk (or None) and the answer's delta.

        The tokens' logprobs go with the reasoning chunk when there is one, so they
        are sent once; a delta that is all held-back tag text sends none.
        """
        part = split.feed(c.text, c.finished())
        answer = dataclasses.replace(c, text=part.content)
        if not part.reasoning or not req.include_reasoning:
            return None, answer
        chunk = self._chat_chunk(
            base_id, c.index, DeltaMessage(reasoning=part.reasoning), req.model
        )
        if req.logprobs:
            chunk.choices[0].logprobs = fmt.chat_logprobs(c.logprobs, top_k)
            answer.logprobs = None
        return chunk, answer

    def _tool_chunks(
        self,
        req: ChatCompletionRequest,
        base_id: str,
        c: CompletionOutput,
        st: ToolStreamer,
        tool_req: ToolRequest | None,
        top_k: int,
    ) -> list[ChatCompletionStreamResponse]:
        """One output delta of a choice whose text goes through a tool streamer."""
        chunks: list[ChatCompletionStreamResponse] = []
        deltas = tools.delta_messages(tool_req, st.feed(c.text, c.finished()))
        logprobs = fmt.chat_logprobs(c.logprobs, top_k) if req.logprobs else None
        if not deltas and logprobs is not None:
            deltas = [DeltaMessage()]  # the tokens' logprobs still go out
        for i, delta in enumerate(deltas):
            chunk = self._chat_chunk(base_id, c.index, delta, req.model)
            chunk.choices[0].logprobs = logprobs if i == 0 else None
            chunks.append(chunk)
        if c.finished():
            # The finish reason in a chunk of its own, after every call's deltas.
            end = self._chat_chunk(base_id, c.index, DeltaMessage(), req.model)
            end.choices[0].finish_reason = tools.finish_reason(
                tool_req, st.tools_called, c.finish_reason
            )
            end.choices[0].stop_reason = c.stop_reason
            chunks.append(end)
        return chunks

    def _chat_chunk(
        self, base_id: str, index: int, delta: DeltaMessage, model: str | None = None
    ) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            id=base_id,
            model=self.models.response_name(model),
            choices=[ChatCompletionStreamChoice(index=index, delta=delta)],
        )


def response_id(prefix: str, header_id: str | None, body_id: str | None) -> str:
    """The response's `id`, as vLLM 0.33: the prefix, then X-Request-Id, else the body's
    `request_id`, else 16 random hex digits (vLLM's random_uuid)."""
    chosen = header_id if header_id is not None else body_id
    return f"{prefix}-{chosen if chosen is not None else uuid.uuid4().hex[:16]}"


def _running_usage(req: SamplingFields, totals: _Totals) -> UsageInfo | None:
    """Usage so far on every chunk, when `stream_options.continuous_usage_stats` asks (vLLM)."""
    opts = req.stream_options
    if opts is None or not opts.continuous_usage_stats:
        return None
    return fmt.usage(totals.prompt, totals.completion, totals.cached)


def _completion_prompts(req: CompletionRequest) -> list[PromptType]:
    p = req.prompt
    if isinstance(p, str):
        return [{"prompt": p, "add_special_tokens": req.add_special_tokens}]
    if not p:
        raise InvalidRequestError("prompt", "prompt must not be empty")
    if all(isinstance(x, int) for x in p):
        return [[int(x) for x in p if isinstance(x, int)]]
    out: list[PromptType] = []
    for x in p:
        if isinstance(x, str):
            out.append({"prompt": x, "add_special_tokens": req.add_special_tokens})
        elif isinstance(x, list):
            out.append(list(x))
    return out


def _tokenize(
    tok: TokenizerLike,
    body: TokenizeRequest,
    messages: list[dict[str, Any]],
    tool_dicts: list[dict[str, Any]],
) -> tuple[list[int], list[str] | None]:
    """/tokenize's blocking part: template (for messages, with tools), encode, token strings."""
    if body.messages is not None:
        text = apply_chat_template(
            tok,
            messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=tool_dicts or None,
        )
        add_special = bool(body.add_special_tokens)
    else:
        text = body.prompt or ""
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
    ids = tok.encode(text, add_special_tokens=add_special)
    strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return ids, strs


async def _load_images(mm: MultiModalFrontend, urls: list[str]) -> list[Any]:
    """Fetch and decode off the event loop (http fetches block up to their timeout)."""
    try:
        return await asyncio.to_thread(mm.load_images, urls)
    except ValueError as e:  # MediaError: names the URL and the problem
        raise InvalidRequestError("messages", str(e)) from e


def stream_error(e: Exception) -> str:
    """An error that happened after a stream started, as one SSE event."""
    if isinstance(e, InvalidRequestError):
        info = ErrorInfo(
            message=e.message, type="invalid_request_error", param=e.param, code=e.code
        )
    else:
        logger.error("stream failed: %r", e)
        info = ErrorInfo(message=str(e) or type(e).__name__, type="server_error")
    return fmt.sse(ErrorResponse(error=info))
