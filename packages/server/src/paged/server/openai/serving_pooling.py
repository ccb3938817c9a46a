"""The handlers behind /v1/embeddings, /pooling, /classify, /score and /rerank.

Each handler: checks the model serves the task (a 400 naming the model's
task otherwise), renders the inputs to token ids off the event loop
(truncation and the max_model_len check happen here, with vLLM 0.33's
messages), submits one engine request per prompt through `encode`, waits for
all of them (closing the merged stream aborts the rest when one fails or the
client leaves), and builds vLLM 0.33's response. Engine request ids are
"{response id}-{i}" as in vLLM (pooling/base/serving.py:161-166).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Container, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import torch

from paged.scheduler import PoolingParams
from paged.server.errors import InvalidRequestError
from paged.server.input_processor import PromptType
from paged.server.offload import BlockingWork
from paged.server.openai import pooling_inputs as inputs
from paged.server.openai.models import ModelNotFoundError
from paged.server.openai.pooling_encoding import encode_tensor
from paged.server.openai.pooling_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    PoolingRequest,
    PoolingResponse,
    PoolingResponseData,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
    ScoringFields,
    TextInputFields,
)
from paged.server.openai.pooling_tasks import ModelTasks
from paged.server.openai.protocol import UsageInfo
from paged.server.openai.serving import response_id
from paged.server.pooling_metrics import PoolingMetrics
from paged.server.tokenizer import TokenizerLike
from paged.server.utils import merge_async_iterators


class PooledOutput(Protocol):
    """vLLM's PoolingOutput: the pooler's tensor for one request."""

    @property
    def data(self) -> torch.Tensor: ...


class PooledRequestOutput(Protocol):
    """What the API layer reads of vLLM's PoolingRequestOutput."""

    @property
    def outputs(self) -> PooledOutput: ...

    @property
    def prompt_token_ids(self) -> list[int]: ...


class TokenIdChecker(Protocol):
    def check_token_ids(self, ids: object, param: str) -> list[int]: ...


class PoolingEngine(Protocol):
    """The engine side the pooling handlers need (satisfied by `AsyncLLM`).

    `encode` yields the request's outputs (one, final, for pooling); it may
    raise `ValueError` for parameters the model refuses (e.g. a `dimensions`
    the model does not support), which becomes a 400 naming the field.
    """

    @property
    def tokenizer(self) -> TokenizerLike: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def offload(self) -> BlockingWork: ...

    @property
    def input_processor(self) -> TokenIdChecker: ...

    def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams,
        request_id: str | None = None,
        *,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
    ) -> AsyncGenerator[PooledRequestOutput, None]: ...


@dataclass(frozen=True)
class _Submitted:
    """One engine request: its token ids and its params."""

    token_ids: list[int]
    params: PoolingParams


class PoolingServing:
    """The pooling endpoints of one served model."""

    def __init__(
        self,
        engine: PoolingEngine,
        model_name: str,
        tasks: ModelTasks,
        metrics: PoolingMetrics | None = None,
        adapters: Container[str] = (),
    ) -> None:
        """`adapters`: the LoRA adapter names loaded (pooling refuses them with a 400)."""
        self.engine = engine
        self.model_name = model_name
        self.adapters = adapters
        self.tasks = tasks
        self.metrics = metrics

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            if model in self.adapters:
                raise InvalidRequestError(
                    "model", f"`{model}` is a LoRA adapter; the pooling endpoints serve none"
                )
            raise ModelNotFoundError(model, self.model_name)

    def _limits(self, req: TextInputFields | ScoringFields) -> inputs.TokenLimits:
        return inputs.TokenLimits(
            self.engine.max_model_len, req.truncate_prompt_tokens, req.truncation_side
        )

    # -- endpoints -----------------------------------------------------------------------
    async def create_embedding(
        self, req: EmbeddingRequest, header_id: str | None = None
    ) -> EmbeddingResponse:
        self._check_model(req.model)
        self.tasks.require_pooling("Embeddings API", "embed")
        params = PoolingParams(
            task="embed", dimensions=req.dimensions, use_activation=req.use_activation
        )
        base_id = response_id("embd", header_id, req.request_id)
        ids = await self._render(req)
        outs = await self._run(base_id, [_Submitted(i, params) for i in ids], req.priority)
        data = [
            EmbeddingResponseData(
                index=i,
                embedding=encode_tensor(
                    o.outputs.data, req.encoding_format, req.embed_dtype, req.endianness
                ),
            )
            for i, o in enumerate(outs)
        ]
        return EmbeddingResponse(id=base_id, model=self.model_name, data=data, usage=_usage(ids))

    async def create_pooling(
        self, req: PoolingRequest, header_id: str | None = None
    ) -> PoolingResponse:
        self._check_model(req.model)
        if req.dimensions is not None:
            # vllm/entrypoints/pooling/pooling/serving.py:61-64
            raise InvalidRequestError("dimensions", "dimensions is currently not supported")
        default = self.tasks.pooling_task
        task = req.task or default or "embed"  # "embed" only to word a generative model's 400
        if default is not None and task not in self.tasks.supported_tasks:
            # vllm/entrypoints/pooling/pooling/serving.py:73-80
            raise InvalidRequestError(
                "task", f"Unsupported task: {task!r} Supported tasks: {self.tasks.supported_tasks}"
            )
        self.tasks.require_pooling("Pooling API", task)
        if task != default:
            # vllm/entrypoints/pooling/pooling/serving.py:76-88
            raise InvalidRequestError(
                "task", f"Try switching the model's pooling_task via --pooler-config.task {task}."
            )
        params = PoolingParams(task=task, use_activation=req.use_activation)
        base_id = response_id("pooling", header_id, req.request_id)
        ids = await self._render(req)
        outs = await self._run(base_id, [_Submitted(i, params) for i in ids], req.priority)
        data = [
            PoolingResponseData(
                index=i,
                data=encode_tensor(
                    o.outputs.data, req.encoding_format, req.embed_dtype, req.endianness
                ),
            )
            for i, o in enumerate(outs)
        ]
        return PoolingResponse(id=base_id, model=self.model_name, data=data, usage=_usage(ids))

    async def create_classify(
        self, req: ClassificationRequest, header_id: str | None = None
    ) -> ClassificationResponse:
        self._check_model(req.model)
        self.tasks.require_pooling("Classification API", "classify")
        params = PoolingParams(task="classify", use_activation=req.use_activation)
        base_id = response_id("classify", header_id, req.request_id)
        ids = await self._render(req)
        outs = await self._run(base_id, [_Submitted(i, params) for i in ids], req.priority)
        data: list[ClassificationData] = []
        for i, o in enumerate(outs):
            probs = [float(x) for x in o.outputs.data.to(torch.float32).flatten().tolist()]
            best = max(range(len(probs)), key=probs.__getitem__) if probs else None
            label = self.tasks.id2label.get(best) if best is not None else None
            data.append(
                ClassificationData(index=i, label=label, probs=probs, num_classes=len(probs))
            )
        return ClassificationResponse(
            id=base_id, model=self.model_name, data=data, usage=_usage(ids)
        )

    async def create_score(self, req: ScoreRequest, header_id: str | None = None) -> ScoreResponse:
        self._check_model(req.model)
        left, right = req.pair()
        base_id = response_id("score", header_id, req.request_id)
        scores, tokens = await self._scores("Score API", req, left, right, base_id)
        data = [ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
        usage = UsageInfo(prompt_tokens=tokens, total_tokens=tokens)
        return ScoreResponse(id=base_id, model=self.model_name, data=data, usage=usage)

    async def create_rerank(
        self, req: RerankRequest, header_id: str | None = None
    ) -> RerankResponse:
        self._check_model(req.model)
        docs = [req.documents] if isinstance(req.documents, str) else list(req.documents)
        base_id = response_id("score", header_id, req.request_id)
        scores, tokens = await self._scores("Rerank API", req, [req.query], docs, base_id)
        results = [
            RerankResult(
                index=i,
                document=RerankDocument(text=doc) if req.return_documents else None,
                relevance_score=s,
            )
            for i, (doc, s) in enumerate(zip(docs, scores, strict=True))
        ]
        # Most relevant first, then the top_n (0: all), as vLLM (scoring/serving.py:174-177).
        results.sort(key=lambda r: r.relevance_score, reverse=True)
        if 0 < req.top_n < len(results):
            results = results[: req.top_n]
        usage = RerankUsage(prompt_tokens=tokens, total_tokens=tokens)
        return RerankResponse(id=base_id, model=self.model_name, usage=usage, results=results)

    # -- scoring -------------------------------------------------------------------------
    async def _scores(
        self, api: str, req: ScoringFields, left: list[str], right: list[str], base_id: str
    ) -> tuple[list[float], int]:
        """One score per pair (1:1, 1:N or N:N) and the prompt tokens pooled."""
        task = self.tasks.score_task(api)
        _check_pair_counts(left, right)
        max_len = self.engine.max_model_len
        for name in ("max_tokens_per_query", "max_tokens_per_doc"):
            if getattr(req, name) != 0:
                inputs.check_token_limit(getattr(req, name), name, max_len)
        tok = self.engine.tokenizer
        limits = self._limits(req)
        size = sum(len(t) for t in left + right)
        if task == "embed":
            return await self._bi_encoder(req, left, right, base_id, limits, size)
        pairs = left * len(right) if len(left) == 1 else left
        template = inputs.ScoreTemplate(
            self.tasks.use_sep_token, *self.tasks.score_template_for(req.chat_template_kwargs)
        )
        pair_tokens = await self.engine.offload.run(
            size, _encode_pairs, tok, pairs, right, req, template, limits
        )
        params = PoolingParams(task="classify", use_activation=req.use_activation)
        submitted = [
            _Submitted(
                p.token_ids,
                params
                if p.token_type_range is None
                else _with_extra(params, {"compressed_token_type_ids": p.token_type_range}),
            )
            for p in pair_tokens
        ]
        outs = await self._run(base_id, submitted, req.priority)
        scores = [float(o.outputs.data.to(torch.float32).flatten()[0]) for o in outs]
        return scores, sum(len(p.token_ids) for p in pair_tokens)

    async def _bi_encoder(
        self,
        req: ScoringFields,
        left: list[str],
        right: list[str],
        base_id: str,
        limits: inputs.TokenLimits,
        size: int,
    ) -> tuple[list[float], int]:
        """Embed each text once; a pair's score is the cosine of its two embeddings."""
        tok = self.engine.tokenizer
        q = [inputs.truncate_text(tok, t, req.max_tokens_per_query) for t in left]
        d = [inputs.truncate_text(tok, t, req.max_tokens_per_doc) for t in right]
        check = self.engine.input_processor.check_token_ids
        ids = await self.engine.offload.run(
            size, inputs.render_prompts, tok, [*q, *d], True, limits, check
        )
        params = PoolingParams(task="embed", use_activation=req.use_activation)
        outs = await self._run(base_id, [_Submitted(i, params) for i in ids], req.priority)
        queries, docs = outs[: len(q)], outs[len(q) :]
        if len(queries) == 1:
            queries = queries * len(docs)
        scores = [
            float(
                torch.nn.functional.cosine_similarity(
                    a.outputs.data.to(torch.float32), b.outputs.data.to(torch.float32), dim=0
                )
            )
            for a, b in zip(queries, docs, strict=True)
        ]
        return scores, sum(len(i) for i in ids)

    # -- shared steps --------------------------------------------------------------------
    async def _render(self, req: TextInputFields) -> list[list[int]]:
        """The request's prompts as token ids (chat template for `messages`)."""
        tok = self.engine.tokenizer
        limits = self._limits(req)
        if req.messages is not None:
            convs = req.messages if isinstance(req.messages[0], list) else [req.messages]
            dumped = [[m.model_dump(exclude_none=True) for m in conv] for conv in convs]
            options = inputs.ChatOptions(
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template,
                req.chat_template_kwargs,
            )
            add_special = bool(req.add_special_tokens)  # chat: False unless asked
            size = sum(len(str(c)) for c in dumped)
            return await self.engine.offload.run(
                size, inputs.render_conversations, tok, dumped, options, add_special, limits
            )
        assert req.input is not None
        prompts = inputs.completion_prompts(req.input)
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        check = self.engine.input_processor.check_token_ids
        size = sum(len(p) for p in prompts)
        return await self.engine.offload.run(
            size, inputs.render_prompts, tok, prompts, add_special, limits, check
        )

    async def _run(
        self, base_id: str, submitted: Sequence[_Submitted], priority: int
    ) -> list[PooledRequestOutput]:
        """Each request's final output, in order; the first failure aborts the rest."""
        streams = [
            self.engine.encode(
                {"prompt_token_ids": s.token_ids},
                s.params,
                f"{base_id}-{i}",
                priority=priority,
            )
            for i, s in enumerate(submitted)
        ]
        finals: list[PooledRequestOutput | None] = [None] * len(streams)
        merged = merge_async_iterators(streams)
        try:
            async for i, out in merged:
                finals[i] = out
        except ValueError as e:  # the engine refused a parameter: the client's fault
            raise _refused(e) from e
        finally:
            await merged.aclose()  # aborts whatever is still running
        done = [o for o in finals if o is not None]
        if len(done) != len(finals):
            raise RuntimeError("the engine finished a pooling request without an output")
        if self.metrics is not None and submitted:
            task = submitted[0].params.task or "embed"
            self.metrics.record(task, len(done), sum(len(s.token_ids) for s in submitted))
        return done


def _refused(e: ValueError) -> InvalidRequestError:
    """A parameter the engine refused, as a 400 naming the field its message names."""
    if isinstance(e, InvalidRequestError):
        return e
    message = str(e)
    param = next((f for f in _PARAMS if f in message), None)
    return InvalidRequestError(param, message)


# Request fields an engine refusal may be about (PoolingParams.verify's subjects).
_PARAMS = ("dimensions", "use_activation", "step_tag_id", "returned_token_ids", "task")


def _check_pair_counts(left: list[str], right: list[str]) -> None:
    """vLLM 0.33's rules and messages (scoring/utils.py:111-123)."""
    if len(left) > 1 and len(left) != len(right):
        raise InvalidRequestError("documents", "Input lengths must be either 1:1, 1:N or N:N")
    if not left:
        raise InvalidRequestError("queries", "At least one text element must be given")
    if not right:
        raise InvalidRequestError("documents", "At least one text_pair element must be given")


def _encode_pairs(
    tok: TokenizerLike,
    queries: list[str],
    docs: list[str],
    req: ScoringFields,
    template: inputs.ScoreTemplate,
    limits: inputs.TokenLimits,
) -> list[inputs.PairTokens]:
    return [
        inputs.encode_pair(
            tok,
            inputs.truncate_text(tok, q, req.max_tokens_per_query),
            inputs.truncate_text(tok, d, req.max_tokens_per_doc),
            template,
            limits,
        )
        for q, d in zip(queries, docs, strict=True)
    ]


def _with_extra(params: PoolingParams, extra: dict[str, Any]) -> PoolingParams:
    """`params` with `extra` added to its extra_kwargs (vLLM's channel for token types)."""
    return msgspec.structs.replace(params, extra_kwargs={**(params.extra_kwargs or {}), **extra})


def _usage(ids: Sequence[Sequence[int]]) -> UsageInfo:
    n = sum(len(i) for i in ids)
    return UsageInfo(prompt_tokens=n, total_tokens=n)
