"""The OpenAI-compatible FastAPI app.

`build_app(llm, ...)` wires routes to an `AsyncLLM`; `paged serve` runs it
under uvicorn. Every error leaves as OpenAI's schema
`{"error": {"message", "type", "param", "code"}}`: 400 for bad input (wrong
types, out-of-range values, prompts that do not fit; unknown fields are
ignored with a warning, as vLLM does), 401 for
a missing or wrong API key, 404 for an unknown model or route, 500 when the
engine fails, and /health answers 503 once the engine is dead.
"""

from __future__ import annotations

import hmac
import importlib.metadata
import logging
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from paged.server.async_llm import AsyncLLM
from paged.server.engine.errors import EngineDeadError
from paged.server.errors import InvalidRequestError
from paged.server.lora import LoRAModulePath, runtime_lora_updating_allowed
from paged.server.metrics import PrometheusStatLogger
from paged.server.openai.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, BodySizeLimitMiddleware
from paged.server.openai.cache_routes import add_cache_routes
from paged.server.openai.cors import CorsConfig, install_cors
from paged.server.openai.disconnect import run_until_disconnect
from paged.server.openai.lifespan import engine_lifespan
from paged.server.openai.lora_routes import add_lora_routes
from paged.server.openai.models import LoRANotFoundError, ModelNotFoundError, ServedModels
from paged.server.openai.pooling_routes import add_pooling_routes
from paged.server.openai.pooling_tasks import ModelTasks
from paged.server.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from paged.server.openai.responses import (
    OpenAIServingResponses,
    ResponseStore,
    store_enabled_from_env,
)
from paged.server.openai.responses.routes import add_responses_routes
from paged.server.openai.responses.serving import ResponseNotFoundError
from paged.server.openai.serving import EngineRequestError, OpenAIServing
from paged.server.openai.serving_pooling import PoolingEngine, PoolingServing
from paged.server.openai.tools import ToolCallingConfig, resolve_for_tokenizer
from paged.server.reasoning import make_reasoning_parser

logger = logging.getLogger(__name__)
T = TypeVar("T")
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    413: {"model": ErrorResponse, "description": "Request body over the size limit"},
    500: {"model": ErrorResponse, "description": "Engine failure"},
}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if not errors:
        return error_response(400, "Invalid request body")
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # Union members add their type name to the location ("str", "list[int]").
    loc = [p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float")]
    param = ".".join(loc) or None
    kind = err.get("type")
    if kind == "json_invalid":
        return error_response(
            400, "We could not parse the JSON body of your request. Send valid JSON."
        )
    if kind in ("invalid_unicode", "int_out_of_range", "too_deep", "invalid_field"):
        ctx = err.get("ctx") or {}
        param = str(ctx.get("param") or "") or None
        return error_response(400, str(err.get("msg")), param)
    if kind == "missing" and param is None:
        return error_response(400, "The request body is missing. Send a JSON object.")
    if kind == "missing":
        return error_response(400, f"Missing required parameter: '{param}'.", param)
    if kind == "model_attributes_type" or param is None:
        return error_response(400, f"Invalid request body: {err.get('msg')}", param)
    return error_response(400, f"Invalid value for '{param}': {err.get('msg')}", param)


class ApiKeyAndMetricsMiddleware:
    """Checks `Authorization: Bearer <key>` on /v1 routes and counts responses.

    A plain ASGI middleware (not BaseHTTPMiddleware) so streaming responses
    and client-disconnect detection pass through untouched.
    """

    def __init__(
        self, app: ASGIApp, api_key: str | None, metrics: PrometheusStatLogger | None
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        status_holder = {"status": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_holder["status"] = int(message["status"])
            await send(message)

        try:
            if self.api_key is not None and path.startswith("/v1"):
                headers = dict(scope.get("headers") or [])
                auth = headers.get(b"authorization", b"").decode("latin-1")
                if not auth:
                    resp = error_response(
                        401,
                        "You didn't provide an API key. Pass it as 'Authorization: Bearer KEY'.",
                        code="invalid_api_key",
                    )
                    await resp(scope, receive, counting_send)
                    return
                if not _key_matches(auth, self.api_key):
                    resp = error_response(
                        401, "Incorrect API key provided.", code="invalid_api_key"
                    )
                    await resp(scope, receive, counting_send)
                    return
            await self.app(scope, receive, counting_send)
        finally:
            if self.metrics is not None:
                self.metrics.http_requests.labels(path, str(status_holder["status"])).inc()


def _key_matches(authorization: str, api_key: str) -> bool:
    """`Authorization: <scheme> <key>` carries `api_key` with the Bearer scheme.

    The scheme is case-insensitive (RFC 7235 section 2.1, as vLLM checks it):
    `bearer KEY` and `BEARER KEY` are accepted. The key is compared in
    constant time.
    """
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    # The header was decoded as latin-1, so this gives back its raw bytes.
    return hmac.compare_digest(token.strip(" ").encode("latin-1"), api_key.encode())


def build_app(
    llm: AsyncLLM,
    *,
    model_name: str,
    model_root: str | None = None,
    api_key: str | None = None,
    stat_logger: PrometheusStatLogger | None = None,
    cors: CorsConfig | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    tool_config: ToolCallingConfig | None = None,
    reasoning_parser: str | None = None,
    responses_store: ResponseStore | None = None,
    pooling_tasks: ModelTasks | None = None,
    pooling_engine: PoolingEngine | None = None,
    lora_modules: Sequence[LoRAModulePath] = (),
    allow_runtime_lora_updating: bool | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving `llm` under the name `model_name`.

    `pooling_tasks`: what the model serves (generation and/or pooling tasks,
    its labels); None = a generative model only. The pooling routes
    (/v1/embeddings, /pooling, /classify, /score, /rerank) and the generation
    routes answer a 400 naming the model's task when it cannot serve them.
    `pooling_engine`: where pooling requests go (default: `llm`).

    `cors`: cross-origin access for browsers; None or no origins = no CORS headers.
    Bodies over `max_request_body_bytes` are refused with a 413.
    `tool_config`: vLLM's tool-calling flags; ValueError when they do not fit together
    (or `--tool-call-parser auto` finds no format in the chat template).
    `reasoning_parser`: vLLM's --reasoning-parser name (ValueError if unknown).
    `responses_store`: /v1/responses' store; None: enabled by VLLM_ENABLE_RESPONSES_API_STORE.
    `lora_modules`: LoRA adapters loaded at start-up (--lora-modules; the server does
    not start if one fails); `allow_runtime_lora_updating`: serve /v1/load_lora_adapter
    and /v1/unload_lora_adapter (None: VLLM_ALLOW_RUNTIME_LORA_UPDATING decides).
    """
    tool_flags = resolve_for_tokenizer(tool_config or ToolCallingConfig(), llm.tokenizer)
    app = FastAPI(
        title="paged",
        version=_version(),
        description="OpenAI-compatible API of the paged inference engine",
        lifespan=engine_lifespan(llm, startup=lambda: served.load_static(lora_modules)),
    )
    served = ServedModels(llm, model_name, model_root)
    serving = OpenAIServing(
        llm, model_name, tool_flags, make_reasoning_parser(reasoning_parser), served
    )
    if responses_store is None:
        responses_store = ResponseStore(enabled=store_enabled_from_env())
    tasks = pooling_tasks if pooling_tasks is not None else ModelTasks()
    pooling = PoolingServing(
        pooling_engine if pooling_engine is not None else llm,
        model_name,
        tasks,
        metrics=None if stat_logger is None else stat_logger.pooling,
        adapters=llm.loras,
    )
    # Added first, so it runs inside the key check and the response counter.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes)
    app.add_middleware(ApiKeyAndMetricsMiddleware, api_key=api_key, metrics=stat_logger)
    _install_error_handlers(app)
    add_cache_routes(app, llm)
    if allow_runtime_lora_updating is None:
        allow_runtime_lora_updating = runtime_lora_updating_allowed()
    if allow_runtime_lora_updating:
        logger.warning(
            "LoRA dynamic loading & unloading is enabled in the API server. "
            "This should ONLY be used for local development!"
        )
        add_lora_routes(app, served)

    async def respond(request: Request, work: Awaitable[Any]) -> Response:
        result = await run_until_disconnect(request, _as_coroutine(work))
        if result is None:
            return Response(status_code=499)  # nobody is listening any more
        if isinstance(result, AsyncIterator):
            return StreamingResponse(result, media_type="text/event-stream")
        return JSONResponse(result.model_dump())

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}},
    )
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        tasks.require_generate("Chat Completions API")
        header_id = request.headers.get("X-Request-Id")
        return await respond(request, serving.create_chat_completion(body, header_id))

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}},
    )
    async def completions(body: CompletionRequest, request: Request) -> Response:
        tasks.require_generate("Completions API")
        header_id = request.headers.get("X-Request-Id")
        return await respond(request, serving.create_completion(body, header_id))

    add_responses_routes(app, OpenAIServingResponses(serving, responses_store), respond, _ERRORS)
    add_pooling_routes(app, pooling, respond, _ERRORS)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return served.model_list()

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await serving.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await serving.detokenize(body)

    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {"description": "The engine is running (empty body)"},
            503: {"model": ErrorResponse},
        },
    )
    async def health() -> Response:
        # Data parallel: 503 as soon as one engine is gone, though the others serve on.
        dead = llm.health_error
        if dead is not None:
            return error_response(503, f"The engine is not running: {dead}")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _version()}

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text"}},
    )
    async def metrics() -> Response:
        if stat_logger is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(stat_logger.registry), media_type=CONTENT_TYPE_LATEST)

    install_cors(app, cors)  # last: the outermost middleware
    return app


async def _as_coroutine(work: Awaitable[T]) -> T:
    return await work


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        not_found = ModelNotFoundError | LoRANotFoundError | ResponseNotFoundError
        status = 404 if isinstance(exc, not_found) else 400
        return error_response(status, exc.message, exc.param, exc.code)

    @app.exception_handler(EngineDeadError)
    async def on_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(500, f"The engine failed: {exc}", code="engine_dead")

    @app.exception_handler(EngineRequestError)
    async def on_request_failed(_: Request, exc: EngineRequestError) -> JSONResponse:
        return error_response(500, f"The engine failed this request: {exc}")

    @app.exception_handler(StarletteHTTPException)
    async def on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Keep the exception's headers: a 405 must say `Allow` (RFC 9110).
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)


def _version() -> str:
    try:
        return importlib.metadata.version("paged-server")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"
