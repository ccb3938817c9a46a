"""Encoder-input scheduling under budget, EC connector loads, speculative decoding, grammar hook."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from paged.scheduler.boundary import (
    ECConnectorMetadata,
    ECConnectorOutput,
    FinishReason,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)
from paged.scheduler.connectors import ECConnectorScheduler
from paged.scheduler.request import Request
from paged.scheduler.structured_output import StructuredOutputProvider
from paged.scheduler.testing import (
    FakeRunner,
    all_outputs,
    make_request,
    make_scheduler,
    run_to_completion,
)


def image(mm_hash: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec("image", mm_hash, PlaceholderRange(offset, length))


def distinct(base: int, n: int) -> list[int]:
    return [base * 1000 + i for i in range(n)]


def test_encoder_input_scheduled_once_and_shared() -> None:
    sched = make_scheduler(max_tokens_per_mm_item=4)
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 12), mm=[image("img", 2, 4)]))
    sched.add_request(make_request("b", distinct(2, 12), mm=[image("img", 5, 4)]))
    so = sched.schedule()
    # Same image in both prompts: its encoder runs once, for the first request.
    assert so.scheduled_encoder_inputs == {"a": [0]}
    assert so.num_scheduled_tokens == {"a": 12, "b": 12}
    # Both placeholders are computed this step: references dropped, the entry is
    # freeable (kept for later hits), not freed.
    assert sched.state.encoder_cache.cached["img"] == set()
    assert sched.state.encoder_cache.freeable == {"img": 4}
    assert so.free_encoder_mm_hashes == []
    sched.update_from_output(so, runner.execute(so))
    run_to_completion(sched, runner)
    sched.state.encoder_cache.check_integrity()


def test_encoder_budget_trims_chunk_before_second_item() -> None:
    # Budget and cache both 4 embeddings: one image per step.
    sched = make_scheduler(
        max_tokens_per_mm_item=4, max_num_encoder_input_tokens=4, encoder_cache_size=4
    )
    runner = FakeRunner()
    mm = [image("x", 2, 4), image("y", 10, 4)]
    sched.add_request(make_request("a", distinct(1, 20), mm=mm))
    so = sched.schedule()
    assert so.scheduled_encoder_inputs == {"a": [0]}
    assert so.num_scheduled_tokens == {"a": 10}  # stops right before image y
    sched.update_from_output(so, runner.execute(so))
    so = sched.schedule()
    assert so.scheduled_encoder_inputs == {"a": [1]}
    assert so.free_encoder_mm_hashes == ["x"]  # evicted to make room for y
    assert so.num_scheduled_tokens == {"a": 10}


def test_disable_chunked_mm_input_never_splits_an_item() -> None:
    sched = make_scheduler(
        max_tokens_per_mm_item=8, max_num_batched_tokens=8, disable_chunked_mm_input=True
    )
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 16), mm=[image("x", 4, 8)]))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4}  # would cut the image at 8: stop at 4
    assert so.scheduled_encoder_inputs == {}
    sched.update_from_output(so, runner.execute(so))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 8}  # the whole image in one step
    assert so.scheduled_encoder_inputs == {"a": [0]}
    sched2 = make_scheduler(max_tokens_per_mm_item=8, max_num_batched_tokens=8)
    sched2.add_request(make_request("a", distinct(1, 16), mm=[image("x", 4, 8)]))
    so2 = sched2.schedule()
    assert so2.num_scheduled_tokens == {"a": 8}  # chunking allowed: split the item
    assert so2.scheduled_encoder_inputs == {"a": [0]}
    # An item that may not be split must fit one step (vLLM refuses the config).
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_scheduler(
            max_tokens_per_mm_item=8, max_num_batched_tokens=6, disable_chunked_mm_input=True
        )


def test_item_larger_than_encoder_cache_is_ignored_with_abort() -> None:
    sched = make_scheduler(max_tokens_per_mm_item=4, encoder_cache_size=4)
    sched.add_request(make_request("a", distinct(1, 20), mm=[image("x", 2, 8)]))
    outs = run_to_completion(sched, FakeRunner())
    assert outs["a"][0].finish_reason is FinishReason.ABORT
    assert "encoder" in (outs["a"][0].finish_detail or "")


@dataclass
class FakeECConnector:
    available: set[str] = field(default_factory=set)
    loaded: list[tuple[str, int]] = field(default_factory=list)

    def has_cache_item(self, identifier: str, request: Request | None = None) -> bool:
        return identifier in self.available

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        self.loaded.append((request.request_id, index))

    def is_async_load(self, identifier: str) -> bool:
        return False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        return FakeECMetadata([f"{r}:{i}" for r, i in self.loaded])

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        return None

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        return False, None


class FakeECMetadata(ECConnectorMetadata, frozen=True):
    loads: list[str]


def test_ec_connector_loads_instead_of_computing() -> None:
    ec = FakeECConnector(available={"remote"})
    proto: ECConnectorScheduler = ec
    sched = make_scheduler(max_tokens_per_mm_item=4, ec_connector=proto)
    mm = [image("remote", 1, 4), image("local", 6, 4)]
    sched.add_request(make_request("a", distinct(1, 12), mm=mm))
    so = sched.schedule()
    assert so.scheduled_encoder_inputs == {"a": [1]}  # only the local item is computed
    assert ec.loaded == [("a", 0)]
    assert so.ec_connector_metadata is not None
    meta = msgspec.msgpack.decode(so.ec_connector_metadata, type=FakeECMetadata)
    assert meta.loads == ["a:0"]
    assert set(sched.state.encoder_cache.cached) == {"remote", "local"}


def test_spec_decode_drafts_scheduled_and_rejected_ones_rolled_back() -> None:
    sched = make_scheduler(num_lookahead_tokens=2)
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 5), max_tokens=20))
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    sched.update_draft_token_ids({"a": [7, 8], "unknown": [1]})
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 3}
    assert so.scheduled_spec_decode_tokens == {"a": [7, 8]}
    req = sched.state.requests["a"]
    assert req.num_computed_tokens == 8 and req.spec_token_ids == []
    # One draft accepted plus the bonus token: one draft rejected.
    mro = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7, 55]])
    (out,) = all_outputs(sched.update_from_output(so, mro))
    assert out.new_token_ids == [7, 55]
    assert req.num_computed_tokens == 7 and req.num_tokens == 8


def test_spec_decode_stop_inside_accepted_tokens_trims_the_rest() -> None:
    sched = make_scheduler()
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 5), max_tokens=20, stop_token_ids=[7]))
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    sched.update_draft_token_ids({"a": [7, 8]})
    so = sched.schedule()
    mro = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7, 8, 9]])
    (out,) = all_outputs(sched.update_from_output(so, mro))
    assert out.new_token_ids == [7] and out.finish_reason is FinishReason.STOP
    assert out.stop_reason == 7


@dataclass
class FakeGrammar:
    banned: int
    seen: list[tuple[str, list[int]]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def grammar_bitmask(
        self, requests: Sequence[Request], scheduler_output: SchedulerOutput
    ) -> GrammarOutput | None:
        ids = [r.request_id for r in requests]
        return GrammarOutput(structured_output_request_ids=ids, grammar_bitmask=[[-1]] * len(ids))

    def accept_tokens(self, request_id: str, token_ids: Sequence[int]) -> bool:
        self.seen.append((request_id, list(token_ids)))
        return self.banned not in token_ids

    def remove_request(self, request_id: str) -> None:
        self.removed.append(request_id)


def test_structured_output_hook_masks_and_rejects() -> None:
    grammar = FakeGrammar(banned=-1)
    provider: StructuredOutputProvider = grammar
    sched = make_scheduler(structured_output=provider)
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 4), max_tokens=3))
    so = sched.schedule()
    assert sched.get_grammar_bitmask(so) == GrammarOutput(["a"], [[-1]])
    mro = runner.execute(so)
    grammar.banned = mro.sampled_token_ids[0][0]
    (out,) = all_outputs(sched.update_from_output(so, mro))
    assert out.finish_reason is FinishReason.ERROR and "grammar" in (out.finish_detail or "")
    assert grammar.removed == ["a"]
    assert make_scheduler().get_grammar_bitmask(so) is None


def test_grammar_sees_a_stop_token_and_its_rejection_wins() -> None:
    # The tokens are appended before the grammar is asked, stop token included; a
    # rejected EOS turns the STOP finish into ERROR (update_requests' fast path kept this).
    grammar = FakeGrammar(banned=-1)
    sched = make_scheduler(structured_output=grammar)
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 4), max_tokens=5, eos=77))
    so = sched.schedule()
    mro = runner.execute(so)
    mro = ModelRunnerOutput(req_ids=mro.req_ids, sampled_token_ids=[[77]])
    grammar.banned = 77
    (out,) = all_outputs(sched.update_from_output(so, mro))
    assert grammar.seen == [("a", [77])]
    assert out.new_token_ids == [77] and out.finish_reason is FinishReason.ERROR


@dataclass
class GatedGrammar(FakeGrammar):
    """A provider whose grammars compile off the loop: not ready until `ready` holds the id."""

    ready: set[str] = field(default_factory=set)
    asked: list[str] = field(default_factory=list)

    def grammar_ready(self, request: Request) -> bool:
        self.asked.append(request.request_id)
        return request.request_id in self.ready


def test_request_waits_for_its_grammar_while_others_run() -> None:
    from paged.scheduler import StructuredOutputsParams

    grammar = GatedGrammar(banned=-1)
    sched = make_scheduler(structured_output=grammar)
    constrained = StructuredOutputsParams(regex="a+")
    sched.add_request(make_request("slow", distinct(1, 4), structured_outputs=constrained))
    sched.add_request(make_request("free", distinct(100, 4)))
    so = sched.schedule()
    assert set(so.num_scheduled_tokens) == {"free"}  # "slow" set aside, "free" admitted
    assert grammar.asked == ["slow"]  # unconstrained requests are never asked
    sched.update_from_output(so, FakeRunner().execute(so))
    sched.check_integrity()
    grammar.ready.add("slow")
    so = sched.schedule()
    assert "slow" in so.num_scheduled_tokens
