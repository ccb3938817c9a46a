"""Errors the engine core and its clients raise to the frontend."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine core is gone: its process died, crashed in a step, or was shut down.

    Raised to every waiter (pending `get_output*`, utility calls) and to every
    later call on the client. It is final: a dead client never recovers; the
    frontend must fail its in-flight requests and report itself unhealthy.
    """


class EngineStartupError(RuntimeError):
    """The engine core could not start (bad model path, out of memory, ...).

    `engine_traceback` holds the formatted traceback from the engine process
    when the failure happened there, so that logs show where it broke.
    """

    def __init__(self, message: str, engine_traceback: str | None = None) -> None:
        super().__init__(message)
        self.engine_traceback = engine_traceback
