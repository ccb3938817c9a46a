"""FCFS and priority waiting queues."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paged.scheduler.queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    RequestQueue,
    create_request_queue,
)
from paged.scheduler.request import Request
from paged.scheduler.sampling_params import SamplingParams


def req(rid: str, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(
        rid,
        [1, 2],
        SamplingParams(),
        None,
        max_model_len=64,
        priority=priority,
        arrival_time=arrival,
    )


def test_fcfs_order_and_prepend() -> None:
    q = FCFSRequestQueue()
    a, b, c, d = req("a"), req("b"), req("c"), req("d")
    q.add_request(a)
    q.add_request(b)
    q.prepend_request(c)
    assert [r.request_id for r in q] == ["c", "a", "b"]
    q.prepend_requests([d])
    assert [r.request_id for r in q] == ["d", "c", "a", "b"]
    assert q.peek_request() is d
    assert q.pop_request() is d


def test_fcfs_prepend_requests_keeps_their_order() -> None:
    q = FCFSRequestQueue()
    q.add_request(req("z"))
    q.prepend_requests([req("a"), req("b")])
    assert [r.request_id for r in q] == ["a", "b", "z"]


def test_priority_order_then_arrival() -> None:
    q = PriorityRequestQueue()
    for rid, prio, arr in [
        ("late-hi", 0, 5.0),
        ("lo", 3, 0.0),
        ("early-hi", 0, 1.0),
        ("mid", 1, 0.5),
    ]:
        q.add_request(req(rid, prio, arr))
    assert [q.pop_request().request_id for _ in range(4)] == ["early-hi", "late-hi", "mid", "lo"]


def test_priority_ties_broken_by_request_id_as_vllm() -> None:
    # vLLM's Request.__lt__: (priority, arrival_time, request_id); string order, so "r10" < "r9".
    q = PriorityRequestQueue()
    for rid in ("r9", "b", "r10", "a"):
        q.add_request(req(rid, 1, 2.0))
    q.add_request(req("z", 0, 2.0))
    assert [q.pop_request().request_id for _ in range(5)] == ["z", "a", "b", "r10", "r9"]


def test_priority_same_id_falls_back_to_insertion_order() -> None:
    q = PriorityRequestQueue()
    first, second = req("x", 0, 1.0), req("x", 0, 1.0)
    q.add_request(first)
    q.add_request(second)
    assert q.pop_request() is first and q.pop_request() is second


def test_remove_and_empty_errors() -> None:
    for q in (FCFSRequestQueue(), PriorityRequestQueue()):
        a, b = req("a"), req("b")
        q.add_request(a)
        q.add_request(b)
        q.remove_request(a)
        assert a not in q and b in q and len(q) == 1
        q.remove_requests([b])
        assert not q
        with pytest.raises(IndexError):
            q.peek_request()
        with pytest.raises(IndexError):
            q.pop_request()


def test_create_rejects_unknown_policy() -> None:
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)
    with pytest.raises(ValueError, match="policy"):
        create_request_queue("lifo")  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 3), st.floats(0, 10)), max_size=30), st.data())
def test_priority_queue_pops_sorted_after_removals(
    items: list[tuple[int, float]], data: st.DataObject
) -> None:
    q: RequestQueue = PriorityRequestQueue()
    reqs = [req(f"r{i}", p, a) for i, (p, a) in enumerate(items)]
    for r in reqs:
        q.add_request(r)
    gone = data.draw(st.sets(st.sampled_from(range(len(reqs))))) if reqs else set()
    q.remove_requests([reqs[i] for i in gone])
    popped = [q.pop_request() for _ in range(len(q))]
    keys = [(r.priority, r.arrival_time, r.request_id) for r in popped]
    assert keys == sorted(keys)
    assert {r.request_id for r in popped} == {f"r{i}" for i in range(len(reqs)) if i not in gone}
