"""Noticing, from the engine process, that the frontend process died.

The engine must not outlive its frontend: nobody would read its outputs, and
it would keep generating and holding its memory. The busy loop cannot check
between steps on its own (a step may take long, and a busy engine used to
never check), so a daemon thread watches instead:

- `multiprocessing`'s parent sentinel, a pipe whose write end only the parent
  holds: it turns readable the moment the parent exits, however it died
  (SIGKILL included), on every platform `spawn` supports;
- a change of `os.getppid()`, polled, as the fallback for an engine started
  some other way or a sentinel whose write end a grandchild inherited.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

# How often the fallback looks at getppid(); the sentinel needs no polling.
_POLL_S = 0.25


class ParentDeathWatcher:
    """Calls `on_death()` once, from a daemon thread, when the parent process is gone."""

    def __init__(self, on_death: Callable[[], None], *, poll_s: float = _POLL_S) -> None:
        if poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self._on_death = on_death
        self._poll_s = poll_s
        self._ppid = os.getppid()
        parent = multiprocessing.parent_process()
        self._sentinel: int | None = parent.sentinel if parent is not None else None
        self._stop = threading.Event()
        self.died = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ParentWatch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def parent_gone(self) -> bool:
        if os.getppid() != self._ppid:
            return True
        if self._sentinel is None:
            return False
        return bool(multiprocessing.connection.wait([self._sentinel], timeout=0))

    def _watch(self) -> None:
        while not self._stop.is_set():
            if self._sentinel is not None:
                multiprocessing.connection.wait([self._sentinel], timeout=self._poll_s)
            else:
                self._stop.wait(self._poll_s)
            if self._stop.is_set():
                return
            if self.parent_gone():
                self.died.set()
                self._on_death()
                return
