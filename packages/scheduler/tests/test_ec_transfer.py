"""The scheduler with an encoder-cache connector: vLLM's gaps 1 (async loads), 2 (request_finished).

A scripted scheduler-side connector says which items it has and which load
asynchronously; the fake runner reports finished or failed loads through
`ECConnectorOutput` when the test says so. Every test ends with nothing
leaked: all KV blocks free, no encoder-cache entry referenced, no pending
transfer, `check_integrity` clean.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from paged.scheduler.boundary import (
    ECConnectorMetadata,
    ECConnectorOutput,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
)
from paged.scheduler.connectors import ECConnectorScheduler
from paged.scheduler.request import Request, RequestStatus
from paged.scheduler.scheduler import Scheduler
from paged.scheduler.testing import FakeRunner, free_blocks, make_request, make_scheduler

EMBEDS = 4


class FakeECMetadata(ECConnectorMetadata, frozen=True):
    loads: list[str] = msgspec.field(default_factory=list)


@dataclass
class ScriptedECConnector:
    """Scheduler side: has `available`, loads `async_hashes` asynchronously."""

    available: set[str] = field(default_factory=set)
    async_hashes: set[str] = field(default_factory=set)
    delay_free: bool = False
    pending: list[str] = field(default_factory=list)
    started: list[tuple[str, str]] = field(default_factory=list)  # (request id, mm hash)
    outputs: list[ECConnectorOutput] = field(default_factory=list)
    finished: list[tuple[str, RequestStatus]] = field(default_factory=list)
    # Answered by request_finished (the response's ec_transfer_params).
    finished_params: dict[str, Any] | None = None
    # Also loadable: items the asking request's ec_transfer_params announce.
    follow_announcements: bool = False

    def has_cache_item(self, identifier: str, request: Request | None = None) -> bool:
        if self.follow_announcements and request is not None:
            return identifier in (request.ec_transfer_params or {})
        return identifier in self.available

    def is_async_load(self, identifier: str) -> bool:
        return identifier in self.async_hashes

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        self.started.append((request.request_id, mm_hash))
        self.pending.append(mm_hash)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta, self.pending = FakeECMetadata(self.pending), []
        return meta

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        self.outputs.append(connector_output)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self.finished.append((request.request_id, request.status))
        return self.delay_free, self.finished_params


_PROTOCOL_CHECK: type[ECConnectorScheduler] = ScriptedECConnector


def image(mm_hash: str, offset: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec("image", mm_hash, PlaceholderRange(offset, EMBEDS))


def prompt(base: int, n: int) -> list[int]:
    return [base * 100 + i for i in range(n)]


def make(ec: ScriptedECConnector, **kwargs: Any) -> Scheduler:
    kwargs.setdefault("max_tokens_per_mm_item", EMBEDS)
    return make_scheduler(ec_connector=ec, **kwargs)


class Loop:
    """Steps scheduler + fake runner; `report` is attached to the next step's output."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.runner = FakeRunner()
        self.report: ECConnectorOutput | None = None
        self.outputs: dict[str, list[EngineCoreOutput]] = {}
        self.initial_free = free_blocks(sched)

    def step(self) -> SchedulerOutput:
        so = self.sched.schedule()
        mro: ModelRunnerOutput = self.runner.execute(so)
        if self.report is not None:
            mro = msgspec.structs.replace(mro, ec_connector_output=self.report)
            self.report = None
        for eco in self.sched.update_from_output(so, mro).values():
            for out in eco.outputs:
                self.outputs.setdefault(out.request_id, []).append(out)
        self.sched.check_integrity()
        return so

    def finish_reason(self, rid: str) -> FinishReason | None:
        return self.outputs[rid][-1].finish_reason

    def run(self, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if not self.sched.has_requests():
                return
            self.step()
        raise AssertionError("scheduler did not go idle")

    def assert_nothing_leaked(self) -> None:
        state = self.sched.state
        assert free_blocks(self.sched) == self.initial_free
        assert all(not refs for refs in state.encoder_cache.cached.values())
        assert not state.ec_transfer.loads and not state.ec_transfer.delayed
        assert not self.sched.has_requests()
        state.encoder_cache.check_integrity()


def test_sync_load_skips_the_encoder_and_its_budget() -> None:
    ec = ScriptedECConnector(available={"remote"})
    # Budget for one item's encoding: the loaded one must not consume it.
    sched = make(ec, max_num_encoder_input_tokens=EMBEDS)
    sched.add_request(make_request("a", prompt(1, 14), mm=[image("remote", 1), image("local", 7)]))
    loop = Loop(sched)
    so = loop.step()
    assert so.scheduled_encoder_inputs == {"a": [1]}  # only "local" is encoded
    assert so.num_scheduled_tokens == {"a": 14}  # the loaded item's tokens run this step
    assert so.ec_connector_metadata is not None
    meta = msgspec.msgpack.decode(so.ec_connector_metadata, type=FakeECMetadata)
    assert meta.loads == ["remote"] and ec.started == [("a", "remote")]
    loop.run()
    assert loop.finish_reason("a") is FinishReason.LENGTH
    assert ec.finished == [("a", RequestStatus.FINISHED_LENGTH_CAPPED)]
    loop.assert_nothing_leaked()


def test_async_load_holds_back_only_the_waiting_request() -> None:
    ec = ScriptedECConnector(available={"img"}, async_hashes={"img"})
    sched = make(ec)
    sched.add_request(make_request("a", prompt(1, 12), mm=[image("img", 3)]))
    sched.add_request(make_request("b", prompt(2, 6)))  # text only, behind "a"
    loop = Loop(sched)
    so = loop.step()
    # "a" runs its text before the image, the load starts, "b" is admitted too.
    assert so.num_scheduled_tokens == {"a": 3, "b": 6}
    assert ec.started == [("a", "img")]
    assert so.scheduled_encoder_inputs == {}
    pins = sched.state.encoder_cache.cached["img"]
    assert len(pins) == 1 and "a" not in pins  # held by the load's pin
    for _ in range(3):  # the load has not landed: "a" waits, "b" decodes
        so = loop.step()
        assert "a" not in so.num_scheduled_tokens and "b" in so.num_scheduled_tokens
        assert sched.has_requests()
    loop.report = ECConnectorOutput(finished_recving=["img"])
    loop.step()  # the report arrives with this step's output
    so = loop.step()
    assert so.num_scheduled_tokens["a"] == 9  # the image and the rest of the prompt
    assert so.scheduled_encoder_inputs == {}  # never encoded here
    # "a" took the reference over from the pin, then consumed the item: freeable.
    assert "img" not in sched.state.ec_transfer.loads
    assert sched.state.encoder_cache.cached["img"] == set()
    loop.run()
    assert loop.finish_reason("a") is FinishReason.LENGTH
    assert ec.started == [("a", "img")]  # loaded once
    loop.assert_nothing_leaked()


def test_request_waiting_at_the_head_does_not_block_the_queue() -> None:
    ec = ScriptedECConnector(available={"img"}, async_hashes={"img"})
    sched = make(ec)
    sched.add_request(make_request("a", prompt(1, 8), mm=[image("img", 0)]))  # image first
    sched.add_request(make_request("b", prompt(2, 6)))
    loop = Loop(sched)
    so = loop.step()
    assert so.num_scheduled_tokens == {"b": 6}  # "a" has nothing to run: set aside
    assert ec.started == [("a", "img")]
    assert [r.request_id for r in sched.waiting] == ["a"]
    loop.step()
    loop.report = ECConnectorOutput(finished_recving=["img"])
    loop.step()
    so = loop.step()
    assert so.num_scheduled_tokens.get("a") == 8
    loop.run()
    loop.assert_nothing_leaked()


def test_same_image_in_two_requests_is_loaded_once() -> None:
    ec = ScriptedECConnector(available={"img"}, async_hashes={"img"})
    sched = make(ec)
    sched.add_request(make_request("a", prompt(1, 10), mm=[image("img", 2)]))
    sched.add_request(make_request("b", prompt(2, 10), mm=[image("img", 5)]))
    loop = Loop(sched)
    so = loop.step()
    assert so.num_scheduled_tokens == {"a": 2, "b": 5}
    assert ec.started == [("a", "img")]
    waiting_for = sched.state.ec_transfer.loads["img"].waiters
    assert waiting_for == {"a", "b"}
    loop.report = ECConnectorOutput(finished_recving=["img"])
    loop.step()
    so = loop.step()
    assert so.num_scheduled_tokens == {"a": 8, "b": 5}
    assert so.scheduled_encoder_inputs == {}
    loop.run()
    assert ec.started == [("a", "img")]
    loop.assert_nothing_leaked()


def test_failed_async_load_is_encoded_locally_under_recompute() -> None:
    ec = ScriptedECConnector(available={"img"}, async_hashes={"img"})
    sched = make(ec)
    sched.add_request(make_request("a", prompt(1, 10), mm=[image("img", 2)]))
    loop = Loop(sched)
    loop.step()
    loop.report = ECConnectorOutput(failed_recving=["img"])
    so = loop.step()  # scheduled before the report was folded in: still waiting
    assert "a" not in so.num_scheduled_tokens
    assert "img" not in sched.state.encoder_cache.cached  # evicted: nothing arrived
    assert "img" in sched.state.ec_transfer.failed
    so = loop.step()
    assert so.scheduled_encoder_inputs == {"a": [0]}  # encoded here, not loaded again
    assert so.num_scheduled_tokens["a"] == 8
    assert ec.started == [("a", "img")]
    loop.run()
    assert loop.finish_reason("a") is FinishReason.LENGTH
    assert not sched.state.ec_transfer.failed  # cleared once encoded
    loop.assert_nothing_leaked()


def test_failed_async_load_fails_the_request_under_fail_policy() -> None:
    ec = ScriptedECConnector(available={"img"}, async_hashes={"img"})
    sched = make(ec, ec_load_failure_policy="fail")
    sched.add_request(make_request("a", prompt(1, 10), mm=[image("img", 2)]))
    sched.add_request(make_request("b", prompt(2, 6)))
    loop = Loop(sched)
    loop.step()
    loop.report = ECConnectorOutput(failed_recving=["img"])
    loop.step()
    assert loop.finish_reason("a") is FinishReason.ERROR
    assert "encoder cache load failed" in (loop.outputs["a"][-1].finish_detail or "")
    assert ("a", RequestStatus.FINISHED_ERROR) in ec.finished
    loop.run()
    assert loop.finish_reason("b") is FinishReason.LENGTH  # the others are served
    loop.assert_nothing_leaked()


def test_bad_failure_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="ec_load_failure_policy"):
        make(ScriptedECConnector(), ec_load_failure_policy="retry")


def test_items_announced_by_the_request_are_loaded_others_encoded() -> None:
    # vLLM 0.33: the request's ec_transfer_params name the producer of each item;
    # the connector decides per request, so the same hash is loaded for one
    # request and encoded for another that announces nothing.
    ec = ScriptedECConnector(follow_announcements=True)
    sched = make(ec)
    announced = {"img": {"peer_host": "10.0.0.1", "peer_port": 5700}}
    request = make_request("a", prompt(1, 8), mm=[image("img", 1)])
    sched.add_request(msgspec.structs.replace(request, ec_transfer_params=announced))
    loop = Loop(sched)
    so = loop.step()
    assert so.scheduled_encoder_inputs == {}
    assert ec.started == [("a", "img")]
    loop.run()
    sched.add_request(make_request("b", prompt(2, 8), mm=[image("other", 1)]))
    so = loop.step()
    assert so.scheduled_encoder_inputs == {"b": [0]}
    assert ec.started == [("a", "img")]
    loop.run()
    loop.assert_nothing_leaked()


def test_request_finished_params_reach_the_last_output() -> None:
    params = {"img": {"modality": "image", "peer_host": "127.0.0.1", "peer_port": 5700}}
    ec = ScriptedECConnector(finished_params=params)
    sched = make(ec)
    sched.add_request(make_request("a", prompt(1, 6), mm=[image("img", 1)], max_tokens=2))
    loop = Loop(sched)
    loop.run()
    outs = loop.outputs["a"]
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].ec_transfer_params == params
    assert all(o.ec_transfer_params is None for o in outs[:-1])
    # The boundary struct carries it across processes (msgpack, array_like).
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(outs[-1]), type=EngineCoreOutput)
    assert wire.ec_transfer_params == params


def test_request_finished_on_every_end_path() -> None:
    ec = ScriptedECConnector(available={"slow"}, async_hashes={"slow"})
    sched = make(ec, max_model_len=64)
    sched.add_request(make_request("done", prompt(1, 6), mm=[image("x", 1)], max_tokens=2))
    sched.add_request(make_request("aborted-running", prompt(2, 8), max_tokens=50))
    sched.add_request(make_request("aborted-loading", prompt(3, 8), mm=[image("slow", 2)]))
    sched.add_request(make_request("nan", prompt(4, 6), max_tokens=50))
    loop = Loop(sched)
    loop.step()
    loop.step()
    sched.finish_requests(["aborted-running", "aborted-loading"], RequestStatus.FINISHED_ABORTED)
    # The aborted request's load is still in flight: its entry stays pinned.
    assert "slow" in sched.state.ec_transfer.loads
    loop.runner.extra = {"num_nans_in_logits": {"nan": 1}}
    loop.step()
    loop.runner.extra = {}
    loop.report = ECConnectorOutput(finished_recving=["slow"])  # lands after the abort
    loop.run()
    ends = dict(ec.finished)
    assert ends == {
        "done": RequestStatus.FINISHED_LENGTH_CAPPED,
        "aborted-running": RequestStatus.FINISHED_ABORTED,
        "aborted-loading": RequestStatus.FINISHED_ABORTED,
        "nan": RequestStatus.FINISHED_ERROR,
    }
    assert len(ec.finished) == 4  # once each
    loop.assert_nothing_leaked()


def test_delayed_free_keeps_entries_until_finished_sending() -> None:
    ec = ScriptedECConnector(delay_free=True)  # a producer still sending its outputs
    sched = make(ec)
    sched.add_request(make_request("a", prompt(1, 10), mm=[image("x", 1), image("y", 6)]))
    loop = Loop(sched)
    for _ in range(20):
        loop.step()
        if loop.outputs.get("a") and loop.finish_reason("a") is not None:
            break
    assert loop.finish_reason("a") is FinishReason.LENGTH
    cache = sched.state.encoder_cache
    # Finished, but the connector still sends: both entries stay referenced.
    assert cache.cached["x"] == {"a"} and cache.cached["y"] == {"a"}
    assert sched.has_requests()  # the engine keeps stepping for the transfer
    loop.report = ECConnectorOutput(finished_sending=["x"])
    loop.step()
    assert cache.cached["y"] == {"a"}  # one of two sent
    loop.report = ECConnectorOutput(finished_sending=["y"])
    loop.step()
    assert cache.cached["x"] == set() and cache.cached["y"] == set()
    loop.assert_nothing_leaked()
