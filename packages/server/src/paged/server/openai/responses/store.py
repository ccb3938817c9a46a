"""The in-memory response store, opt-in as in vLLM 0.33.

`VLLM_ENABLE_RESPONSES_API_STORE=1` (vllm/envs.py:1943) turns it on. Off (the
default), `store: true` is silently treated as false (responses/serving.py:
296-305), so nothing can be retrieved, cancelled or continued: GET,
/cancel and `previous_response_id` answer 404 "Response with id '...' not
found.", and `background: true` is a 400 (serving.py:240-252). On, every
stored response and its input conversation stay until the server stops
(vLLM warns of the same unbounded growth).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from paged.server.openai.responses.protocol import ResponsesResponse, StreamEvent

logger = logging.getLogger(__name__)

ENV_VAR = "VLLM_ENABLE_RESPONSES_API_STORE"


def store_enabled_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """vLLM reads the variable as `bool(int(value))`; a non-integer is a ValueError here."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "0")
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"{ENV_VAR} must be an integer (0 or 1), got {value!r}") from None


@dataclass
class EventLog:
    """A background stream's events, kept for replay (vLLM's event_store entry).

    Readers take `changed()` before reading, then wait on it: an append or a
    close after their read sets it, so no event is missed.
    """

    events: list[StreamEvent] = field(default_factory=list)
    closed: bool = False
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def changed(self) -> asyncio.Event:
        return self._changed

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def append(self, event: StreamEvent) -> None:
        self.events.append(event)
        self._notify()

    def close(self) -> None:
        self.closed = True
        self._notify()


@dataclass
class ResponseStore:
    """Responses by id, the conversation each was made from, and running background tasks."""

    enabled: bool = False
    responses: dict[str, ResponsesResponse] = field(default_factory=dict)
    messages: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    events: dict[str, EventLog] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        if self.enabled:
            logger.warning(
                "`%s` is enabled. Stored responses are never removed: memory grows "
                "with every stored response.",
                ENV_VAR,
            )

    async def get(self, response_id: str) -> ResponsesResponse | None:
        async with self.lock:
            return self.responses.get(response_id)

    async def put(self, response: ResponsesResponse) -> None:
        """Store a finished response unless it was cancelled meanwhile (vLLM: serving.py:927)."""
        async with self.lock:
            old = self.responses.get(response.id)
            if old is None or old.status != "cancelled":
                self.responses[response.id] = response
