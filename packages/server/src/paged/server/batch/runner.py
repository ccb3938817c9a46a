"""Run a batch file's lines through the endpoints; write one output line per input line.

Every line runs as its own task (at most `max_inflight` at once, as vLLM's
--max-inflight); outputs are written in input order as soon as every earlier
line is done (vLLM's dispatch_batch, launchers/run_batch.py:962-1050), so a
partial output file is always a prefix of the input.

A line that cannot run gets an error line and the file goes on. vLLM 0.33
refuses the whole file before loading the model when one line is not valid
JSON or its body does not validate (validate_batch, :417-428); paged, as the
OpenAI Batch API's error file does, reports such a line in place (its
`custom_id` when the line has one) and runs the others.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from paged.server.batch.endpoints import BatchEndpoint
from paged.server.batch.protocol import (
    BatchRequestInput,
    BatchRequestOutput,
    error_output,
    success_output,
)
from paged.server.errors import InvalidRequestError
from paged.server.openai.models import ModelNotFoundError

logger = logging.getLogger(__name__)

Write = Callable[[str], None]


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"]) or "line"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def _api_error(message: str, param: str | None, code: str | None, status: int) -> dict[str, Any]:
    """The API's error object, as the HTTP server would have answered."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    error = {"message": message, "type": kind, "param": param, "code": code}
    return {"error": error}


async def run_line(
    line: str, line_number: int, endpoints: Mapping[str, BatchEndpoint]
) -> BatchRequestOutput:
    """One input line -> its output line (never raises for a bad line)."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        return error_output(None, f"line {line_number}: not valid JSON: {e}")
    custom_id = raw.get("custom_id") if isinstance(raw, dict) else None
    custom_id = custom_id if isinstance(custom_id, str) else None
    try:
        request = BatchRequestInput.model_validate(raw)
    except ValidationError as e:
        return error_output(custom_id, f"line {line_number}: {_validation_message(e)}")
    if request.method.upper() != "POST":
        return error_output(custom_id, f"method {request.method!r} is not supported: use POST")
    endpoint = endpoints.get(request.url)
    if endpoint is None:
        supported = ", ".join(endpoints)
        return error_output(
            custom_id,
            f"URL {request.url} is not a supported endpoint. Supported endpoints: {supported}.",
        )
    try:
        body = endpoint.request_type.model_validate(request.body)
    except ValidationError as e:
        message = _validation_message(e)
        return error_output(custom_id, _api_error(message, None, None, 400))
    if getattr(body, "stream", False):
        return error_output(custom_id, "Request must not be sent in stream mode")  # vLLM's text
    try:
        response = await endpoint.handler(body)
    except ModelNotFoundError as e:
        return error_output(custom_id, _api_error(e.message, e.param, e.code, 404), 404)
    except InvalidRequestError as e:
        return error_output(custom_id, _api_error(e.message, e.param, e.code, 400))
    except Exception as e:  # the engine failed this request: the others go on
        logger.warning("batch line %d (%s) failed: %r", line_number, custom_id, e)
        message = str(e) or type(e).__name__
        return error_output(custom_id, _api_error(message, None, None, 500), 500)
    if isinstance(response, AsyncIterator):  # unreachable: stream is refused above
        return error_output(custom_id, "Request must not be sent in stream mode")
    return success_output(request.custom_id, response.model_dump())


async def run_batch_lines(
    lines: Iterable[str],
    endpoints: Mapping[str, BatchEndpoint],
    write: Write,
    *,
    max_inflight: int,
    on_done: Callable[[], None] = lambda: None,
) -> int:
    """Run every non-blank line; `write` each output JSON line in input order; the count.

    `on_done` is called once per written line (the progress bar).
    """
    if max_inflight < 1:
        raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
    slots = asyncio.Semaphore(max_inflight)
    finished: dict[int, str] = {}
    next_index = 0
    tasks: set[asyncio.Task[None]] = set()  # running ones only: a long file keeps few

    async def run(index: int, line: str, line_number: int) -> None:
        nonlocal next_index
        try:
            output = await run_line(line, line_number, endpoints)
        finally:
            slots.release()
        finished[index] = output.model_dump_json()
        while next_index in finished:
            write(finished.pop(next_index))
            next_index += 1
            on_done()

    try:
        index = 0
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            await slots.acquire()
            task = asyncio.create_task(run(index, line, line_number))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            index += 1
        while tasks:
            await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return index
