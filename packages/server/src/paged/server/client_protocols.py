"""The engine-client surface the frontend drives (implemented in `paged.server.engine`).

Structural Protocols, so `AsyncLLM` and `LLM` depend on behaviour, not on a
transport: the ZMQ clients, the in-process client and test fakes all fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from paged.scheduler import EngineCoreOutputs, EngineCoreRequest
from paged.server.engine.errors import EngineDeadError


class AsyncEngineClient(Protocol):
    """What `AsyncLLM` needs: non-blocking submit/abort and an output stream.

    `get_output_async()` waits for the next batch of outputs; it raises
    `EngineDeadError` once the engine is gone (and for every later call).
    """

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Set once the engine is gone (read by /health before any request notices)."""
        ...

    async def add_request_async(self, request: EngineCoreRequest) -> None: ...

    async def abort_requests_async(self, request_ids: Sequence[str]) -> None: ...

    async def get_output_async(self) -> EngineCoreOutputs: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class DegradableClient(Protocol):
    """A client over several engines that serves on while some are gone (data parallel).

    `degraded_error` is set once any engine is gone, `dead_error` only when all are.
    """

    @property
    def degraded_error(self) -> EngineDeadError | None: ...


@runtime_checkable
class RoutingClient(Protocol):
    """A client over several engines that knows which one holds a request (data parallel).

    `engine_of` answers the engine index, or None once the request finished or
    was never routed; `AsyncLLM` files its frontend aborts under that engine.
    """

    def engine_of(self, request_id: str) -> int | None: ...


@runtime_checkable
class AsyncUtilityClient(Protocol):
    """An async client that can also run engine utilities (`reset_prefix_cache`, ...)."""

    async def call_utility_async(self, method: str, *args: Any) -> Any: ...


@runtime_checkable
class SyncUtilityClient(Protocol):
    """A sync client that can also run engine utilities."""

    def call_utility(self, method: str, *args: Any) -> Any: ...


class NoEngineUtilities(NotImplementedError):
    """The engine client runs no utilities (`reset_prefix_cache`, LoRA loads).

    A test fake or a transport without them; raised by the `_utility_client()`
    accessor of `LLM` and `AsyncLLM`, the one path their utility calls take.
    """

    def __init__(self, client: object) -> None:
        super().__init__(f"{type(client).__name__} cannot run engine utilities")


class SyncEngineClient(Protocol):
    """What `LLM` needs: `get_output()` advances the engine and returns what it produced."""

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: Sequence[str]) -> None: ...

    def has_work(self) -> bool:
        """True while the engine holds unfinished requests."""
        ...

    def get_output(self) -> EngineCoreOutputs: ...

    def shutdown(self) -> None: ...
