"""Waiting queues: FCFS (a deque) and priority (a heap on (priority, arrival, id, seq)).

Both satisfy `RequestQueue`. `prepend_request` puts a request where it is
served next: the head of the deque for FCFS (a preempted request resumes
first); for the priority heap the order is fixed by the key, so it is a push.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Protocol

from paged.scheduler.config import SchedulingPolicy
from paged.scheduler.request import Request


class RequestQueue(Protocol):
    """The waiting queue's contract. `peek_request`/`pop_request` raise IndexError when empty."""

    def add_request(self, request: Request) -> None: ...
    def pop_request(self) -> Request: ...
    def peek_request(self) -> Request: ...
    def prepend_request(self, request: Request) -> None: ...
    def prepend_requests(self, requests: Iterable[Request]) -> None: ...
    def remove_request(self, request: Request) -> None: ...
    def remove_requests(self, requests: Iterable[Request]) -> None: ...
    def __bool__(self) -> bool: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...
    def __contains__(self, request: object) -> bool: ...


class FCFSRequestQueue:
    """First come, first served; O(1) at both ends."""

    def __init__(self) -> None:
        self._dq: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._dq.append(request)

    def pop_request(self) -> Request:
        return self._dq.popleft()

    def peek_request(self) -> Request:
        if not self._dq:
            raise IndexError("peek from an empty queue")
        return self._dq[0]

    def prepend_request(self, request: Request) -> None:
        self._dq.appendleft(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        """Put `requests` at the head, keeping their order."""
        self._dq.extendleft(reversed(list(requests)))

    def remove_request(self, request: Request) -> None:
        self._dq.remove(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        if gone:
            self._dq = deque(r for r in self._dq if id(r) not in gone)

    def __bool__(self) -> bool:
        return bool(self._dq)

    def __len__(self) -> int:
        return len(self._dq)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._dq)

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self._dq)


class PriorityRequestQueue:
    """Lowest `(priority, arrival_time, request_id)` first, as vLLM's `Request.__lt__`.

    Ties on all three (only possible for two live requests with one id) fall
    back to insertion order, where vLLM compares `id()`: deterministic here.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, str, int, Request]] = []
        self._seq = itertools.count()

    def add_request(self, request: Request) -> None:
        entry = (
            request.priority,
            request.arrival_time,
            request.request_id,
            next(self._seq),
            request,
        )
        heapq.heappush(self._heap, entry)

    def pop_request(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty queue")
        return heapq.heappop(self._heap)[4]

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][4]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.add_request(request)

    def remove_request(self, request: Request) -> None:
        self.remove_requests((request,))

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        if gone:
            self._heap = [e for e in self._heap if id(e[4]) not in gone]
            heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Requests in service order (sorts a copy; for inspection, not the hot path)."""
        return (e[4] for e in sorted(self._heap))

    def __contains__(self, request: object) -> bool:
        return any(e[4] is request for e in self._heap)


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
