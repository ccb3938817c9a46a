"""What the engine-core process loop and the clients need from an engine core.

`EngineCore` satisfies `EngineCoreLike`; the process loop (`EngineCoreProc`)
and `InprocClient` only talk to this Protocol, so the IPC layer can be tested
and reused independently of the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from paged.scheduler.boundary import EngineCoreOutputs, EngineCoreRequest
from paged.server.engine.messages import EngineCoreInfo


class EngineCoreLike(Protocol):
    """The engine core seen from its driver (a process loop or an in-process client).

    Calls come from one thread. `add_request` raises `ValueError` for a
    request that can never be served (the driver turns that into an error
    output or an exception for the caller); everything else the engine
    rejects later reaches the frontend as a finished `EngineCoreOutput`.
    """

    @property
    def info(self) -> EngineCoreInfo: ...

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Finish these requests as aborted; unknown or finished ids are ignored."""
        ...

    def has_work(self) -> bool:
        """True while requests are unfinished or batches are still in flight."""
        ...

    def run_step(self) -> dict[int, EngineCoreOutputs]:
        """One iteration of the busy loop; outputs keyed by client index (may be empty)."""
        ...

    def call_utility(self, method: str, args: Sequence[Any]) -> object:
        """Run one allowlisted utility method (see `messages.UTILITY_RESULT_TYPES`)."""
        ...

    def shutdown(self) -> None: ...


# Builds the engine core inside the engine process. Must be picklable (the
# process is started with `spawn`): a module-level function, a class, or a
# `functools.partial` of those with picklable arguments.
EngineCoreFactory = Callable[[], EngineCoreLike]
