"""`paged proxy`: an OpenAI-compatible router for encoder/prefill/decode disaggregation.

    client --> proxy --0--> encode   (only requests with images: the request with
                                      max_tokens 1, stream false, n 1; the encoder-only
                                      instance runs the vision encoder, hands the
                                      embeddings to its EC connector and answers)
                   <------- {"ec_transfer_params": {mm_hash: {peer_host, peer_port, ...}}}
                                     (vLLM 0.33: where each item's output is held; merged
                                      into the bodies of stages 1 and 2, so the consumer
                                      fetches from that producer without being told of
                                      it at start-up)
                   --1--> prefill  (kv_transfer_params {"do_remote_decode": true},
                                      max_tokens 1, stream false, n 1)
                   <------- {"kv_transfer_params": {... remote_block_ids, host, port ...}}
                   --2--> decode     (the original request + those params; streamed back
                                      as it comes when the client asked for a stream)

Stage 0 runs with `--encode` (vLLM's disaggregated-encoder proxy), stage 1 with
`--prefill`; either may be left out (E + PD: `--encode E --decode PD`; P/D:
`--prefill P --decode D`), the decode stage is always there. The consumer of
the embeddings is the instance that computes the prompt (the prefill, else
the decode instance); it loads them by mm hash through its EC connector.

The protocol is vLLM's (its toy P/D proxy and NixlConnector), so the proxy
also routes vLLM instances, and a vLLM router routes paged instances.
Instances are picked round robin, prefill and decode independently. An
error from either side is passed through as sent (status and OpenAI error
body); an unreachable instance is a 502 in OpenAI's schema. `/health` is
200 only while every upstream answers its own `/health`.

A client that disconnects cancels the upstream call, which the paged server
answers by aborting the request (a prefill aborted before it finishes frees
its blocks at once; a finished prefill nobody pulls frees them after its
abort_request_timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from paged.server.openai.disconnect import run_until_disconnect

logger = logging.getLogger("paged.server.proxy")

# What the prefill request must carry, as vLLM's proxy sends it.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True)
class ProxyConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    timeout_s: float = 600.0
    health_timeout_s: float = 2.0
    encode_urls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.prefill_urls and not self.encode_urls:
            raise ValueError(
                "--prefill: at least one prefill instance URL is required "
                "(or --encode for encoder disaggregation)"
            )
        if not self.decode_urls:
            raise ValueError("--decode: at least one decode instance URL is required")
        for url in (*self.encode_urls, *self.prefill_urls, *self.decode_urls):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"instance URL {url!r} must start with http:// or https://")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The body sent to the prefill instance: one token, no stream, one choice."""
    req = copy.deepcopy(body)
    req["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    req["stream"] = False
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req.pop("stream_options", None)
    # The decoder samples every choice from the same pulled prompt KV.
    req["n"] = 1
    req.pop("best_of", None)
    return req


# Content parts that carry media for the encoder (vLLM's proxy looks for the same).
MM_CONTENT_TYPES = frozenset({"image_url", "input_image", "image", "audio_url", "input_audio"})


def has_mm_input(body: dict[str, Any]) -> bool:
    """Whether a chat request carries any image or audio part (text-only skips stage 0)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            isinstance(part, dict) and part.get("type") in MM_CONTENT_TYPES for part in content
        ):
            return True
    return False


def encode_request(body: dict[str, Any]) -> dict[str, Any]:
    """The body sent to an encoder instance: one token, no stream, one choice (as vLLM)."""
    req = copy.deepcopy(body)
    req["stream"] = False
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req.pop("stream_options", None)
    req.pop("kv_transfer_params", None)
    req.pop("ec_transfer_params", None)  # the producer is asked, it announces
    req["n"] = 1
    req.pop("best_of", None)
    return req


def with_ec_transfer_params(body: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """`body` with the encoder's `ec_transfer_params` merged over any the client sent.

    As vLLM 0.33's proxy (disagg_epd_proxy.py:1020): the encoder's entries are
    keyed by mm hash and win over the client's; an encoder that announced
    nothing (not an object) leaves the body as it was, and the consumer then
    encodes the items itself (or asks its static producer_endpoints).
    """
    announced = answer.get("ec_transfer_params")
    if not isinstance(announced, dict) or not announced:
        return body
    merged = dict(body)
    sent = body.get("ec_transfer_params")
    merged["ec_transfer_params"] = {**(sent if isinstance(sent, dict) else {}), **announced}
    return merged


class _UpstreamError(Exception):
    def __init__(self, response: Response) -> None:
        super().__init__("upstream error")
        self.response = response


class Router:
    """Round robin over the instances; one shared HTTP client."""

    def __init__(self, config: ProxyConfig, client: httpx.AsyncClient) -> None:
        self.config = config
        self.client = client
        self._encode = itertools.cycle(config.encode_urls)
        self._prefill = itertools.cycle(config.prefill_urls)
        self._decode = itertools.cycle(config.decode_urls)

    def next_encode(self) -> str:
        return next(self._encode)

    def next_prefill(self) -> str:
        return next(self._prefill)

    def next_decode(self) -> str:
        return next(self._decode)

    async def post_json(self, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST and return the JSON body; `_UpstreamError` carries a response to pass on."""
        try:
            resp = await self.client.post(url + path, json=body, headers=_forward_headers())
        except httpx.HTTPError as exc:
            raise _UpstreamError(_unreachable(url, exc)) from None
        if resp.status_code != 200:
            raise _UpstreamError(_passthrough(resp.status_code, resp.content, resp.headers))
        data = resp.json()
        if not isinstance(data, dict):
            raise _UpstreamError(error_response(502, f"{url}{path} answered with non-object JSON"))
        return data


def _forward_headers() -> dict[str, str]:
    return {"content-type": "application/json"}


def _unreachable(url: str, exc: Exception) -> JSONResponse:
    logger.warning("upstream %s failed: %s", url, exc)
    return error_response(502, f"instance {url} is unreachable: {type(exc).__name__}: {exc}")


def _passthrough(status: int, content: bytes, headers: httpx.Headers) -> Response:
    media = headers.get("content-type", "application/json")
    return Response(content=content, status_code=status, media_type=media)


async def _handle(router: Router, request: Request, path: str) -> Response:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error_response(400, "We could not parse the JSON body of your request.")
    if not isinstance(body, dict):
        return error_response(400, "The request body must be a JSON object.")
    stream = body.get("stream") is True

    async def prefill_then_decode_params() -> dict[str, Any]:
        consumer_body = body
        if router.config.encode_urls and has_mm_input(body):
            # Stage 0: the encoder holds the embeddings once it has answered, and
            # its answer says where (ec_transfer_params), for the consumer.
            encoded = await router.post_json(router.next_encode(), path, encode_request(body))
            consumer_body = with_ec_transfer_params(body, encoded)
        if not router.config.prefill_urls:
            # E + PD: the decode instance computes the prompt.
            return copy.deepcopy(consumer_body)
        prefill_url = router.next_prefill()
        answer = await router.post_json(prefill_url, path, prefill_request(consumer_body))
        params = answer.get("kv_transfer_params")
        decode_body = copy.deepcopy(consumer_body)
        if isinstance(params, dict):
            decode_body["kv_transfer_params"] = params
        else:
            # The prefill handed nothing over (its one token ended the request):
            # the decoder computes the prompt itself.
            decode_body.pop("kv_transfer_params", None)
        return decode_body

    try:
        decode_body = await run_until_disconnect(
            request, prefill_then_decode_params(), "upstream request cancelled"
        )
        if decode_body is None:
            return Response(status_code=499)
        decode_url = router.next_decode()
        if not stream:
            result = await run_until_disconnect(
                request,
                router.post_json(decode_url, path, decode_body),
                "upstream request cancelled",
            )
            return Response(status_code=499) if result is None else JSONResponse(result)
        return await _stream(router, decode_url, path, decode_body)
    except _UpstreamError as exc:
        return exc.response


async def _stream(router: Router, url: str, path: str, body: dict[str, Any]) -> Response:
    req = router.client.build_request("POST", url + path, json=body, headers=_forward_headers())
    try:
        upstream = await router.client.send(req, stream=True)
    except httpx.HTTPError as exc:
        return _unreachable(url, exc)
    if upstream.status_code != 200:
        content = await upstream.aread()
        await upstream.aclose()
        return _passthrough(upstream.status_code, content, upstream.headers)

    async def relay() -> AsyncIterator[bytes]:
        # Closing the upstream response (also when the client goes away and this
        # generator is closed) drops the decode connection: the decoder aborts.
        try:
            async for chunk in upstream.aiter_bytes():
                yield chunk
        finally:
            await upstream.aclose()

    return StreamingResponse(relay(), media_type="text/event-stream")


async def _health(router: Router) -> Response:
    urls = [*router.config.encode_urls, *router.config.prefill_urls, *router.config.decode_urls]

    async def one(url: str) -> str:
        try:
            resp = await router.client.get(url + "/health", timeout=router.config.health_timeout_s)
        except httpx.HTTPError as exc:
            return f"unreachable ({type(exc).__name__})"
        return "ok" if resp.status_code == 200 else f"status {resp.status_code}"

    states = await asyncio.gather(*(one(u) for u in urls))
    upstreams = dict(zip(urls, states, strict=True))
    healthy = all(s == "ok" for s in states)
    return JSONResponse(
        {"status": "ok" if healthy else "unhealthy", "upstreams": upstreams},
        status_code=200 if healthy else 503,
    )


def build_proxy_app(
    config: ProxyConfig, transport: httpx.AsyncBaseTransport | None = None
) -> FastAPI:
    """The proxy's FastAPI app; `transport` lets tests route to in-process apps."""
    timeout = httpx.Timeout(config.timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    holder: dict[str, Router] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as c:
            holder["router"] = Router(config, c)
            yield

    app = FastAPI(title="paged proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(holder["router"], request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _handle(holder["router"], request, "/v1/chat/completions")

    @app.get("/health")
    async def health() -> Response:
        return await _health(holder["router"])

    @app.get("/v1/models")
    async def models() -> Response:
        router = holder["router"]
        url = router.config.decode_urls[0]
        try:
            resp = await router.client.get(url + "/v1/models")
        except httpx.HTTPError as exc:
            return _unreachable(url, exc)
        return _passthrough(resp.status_code, resp.content, resp.headers)

    return app


def run_proxy(
    prefill: Sequence[str],
    decode: Sequence[str],
    *,
    host: str,
    port: int,
    log_level: str = "info",
    timeout_s: float = 600.0,
    encode: Sequence[str] = (),
) -> None:
    import uvicorn

    config = ProxyConfig(
        tuple(u.rstrip("/") for u in prefill),
        tuple(u.rstrip("/") for u in decode),
        timeout_s=timeout_s,
        encode_urls=tuple(u.rstrip("/") for u in encode),
    )
    logger.info(
        "proxy: encode %s, prefill %s, decode %s",
        config.encode_urls,
        config.prefill_urls,
        config.decode_urls,
    )
    uvicorn.run(build_proxy_app(config), host=host, port=port, log_level=log_level)
