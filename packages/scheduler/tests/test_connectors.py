"""KV and encoder-cache connector hooks, with fake connectors and the real KVCacheManager."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from paged.kvcache import KVCacheBlocks
from paged.kvcache.events import KVCacheEvent
from paged.scheduler.boundary import (
    BlockIdsPerGroup,
    EngineCoreOutput,
    FinishReason,
    KVConnectorOutput,
    KVTransferParams,
    ModelRunnerOutput,
    SchedulerOutput,
)
from paged.scheduler.connectors import KVConnectorScheduler
from paged.scheduler.request import Request, RequestStatus
from paged.scheduler.scheduler import Scheduler
from paged.scheduler.testing import (
    FakeRunner,
    all_outputs,
    free_blocks,
    make_request,
    make_scheduler,
    run_to_completion,
    tokens_of,
)


@dataclass
class FakeKVConnector:
    matches: dict[str, list[tuple[int | None, bool]]] = field(default_factory=dict)
    delay_free: set[str] = field(default_factory=set)
    allocs: list[tuple[str, tuple[list[int], ...], int]] = field(default_factory=list)
    finished: list[tuple[str, BlockIdsPerGroup]] = field(default_factory=list)
    outputs: list[KVConnectorOutput] = field(default_factory=list)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        answers = self.matches.get(request.request_id)
        if not answers:
            return 0, False
        return answers.pop(0)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.allocs.append((request.request_id, blocks.get_block_ids(), num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> bytes:
        return msgspec.json.encode(sorted(scheduler_output.num_scheduled_tokens))

    def request_finished(
        self, request: Request, block_ids: BlockIdsPerGroup
    ) -> tuple[bool, KVTransferParams | None]:
        self.finished.append((request.request_id, block_ids))
        if request.request_id in self.delay_free:
            return True, KVTransferParams(do_remote_decode=True, remote_block_ids=block_ids[0])
        return False, None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.outputs.append(connector_output)

    def take_events(self) -> Sequence[KVCacheEvent]:
        return []

    def get_kv_connector_stats(self) -> dict[str, float] | None:
        return None


def distinct(base: int, n: int) -> list[int]:
    return [base * 1000 + i for i in range(n)]


def with_kv(mro: ModelRunnerOutput, **kwargs: list[str] | list[int]) -> ModelRunnerOutput:
    return msgspec.structs.replace(mro, kv_connector_output=KVConnectorOutput(**kwargs))  # type: ignore[arg-type]


def protocol_mismatches(protocol: type, obj: object) -> list[str]:
    """Methods of `protocol` that `obj` lacks or takes with other parameter names or kinds.

    The runtime half of the conformance check; the types are mypy's half (below).
    """
    problems: list[str] = []
    for name, member in vars(protocol).items():
        if name.startswith("_") or not callable(member):
            continue
        impl = getattr(obj, name, None)
        if not callable(impl):
            problems.append(f"{name}: missing")
            continue
        want = [(p.name, p.kind) for p in inspect.signature(member).parameters.values()][1:]
        got = [(p.name, p.kind) for p in inspect.signature(impl).parameters.values()]
        if want != got:
            problems.append(f"{name}: {got} != {want}")
    return problems


def test_fake_satisfies_protocol() -> None:
    # Static half: mypy --strict rejects this assignment if a method's types drift.
    conn: KVConnectorScheduler = FakeKVConnector()
    assert protocol_mismatches(KVConnectorScheduler, conn) == []


def test_protocol_check_catches_missing_and_renamed_methods() -> None:
    class Drifted(FakeKVConnector):
        take_events = None  # type: ignore[assignment]

        def update_connector_output(self, output: KVConnectorOutput) -> None:
            pass

    assert protocol_mismatches(KVConnectorScheduler, Drifted()) == [
        "update_connector_output: [('output', <_ParameterKind.POSITIONAL_OR_KEYWORD: 1>)] != "
        "[('connector_output', <_ParameterKind.POSITIONAL_OR_KEYWORD: 1>)]",
        "take_events: missing",
    ]


def test_sync_external_hit_skips_tokens_and_builds_metadata() -> None:
    conn = FakeKVConnector(matches={"a": [(8, False)]})
    sched = make_scheduler(kv_connector=conn)
    sched.add_request(make_request("a", distinct(1, 12), max_tokens=2))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    assert conn.allocs == [("a", ([1, 2, 3],), 8)]
    assert msgspec.json.decode(so.kv_connector_metadata or b"") == ["a"]
    runner = FakeRunner()
    out = all_outputs(sched.update_from_output(so, runner.execute(so)))
    assert out[0].num_cached_tokens == 8
    run_to_completion(sched, runner)
    assert conn.finished == [("a", ([1, 2, 3, 4],))]  # 13 tokens by the end


def test_undecided_connector_skips_request_and_asks_again() -> None:
    conn = FakeKVConnector(matches={"a": [(None, False), (0, False)]})
    sched = make_scheduler(kv_connector=conn)
    sched.add_request(make_request("a", distinct(1, 6)))
    sched.add_request(make_request("b", distinct(2, 6)))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"b": 6}
    assert [r.request_id for r in sched.state.waiting] == ["a"]
    sched.update_from_output(so, FakeRunner().execute(so))
    so2 = sched.schedule()
    assert "a" in so2.num_scheduled_tokens


def test_async_load_waits_for_remote_kvs_then_runs() -> None:
    conn = FakeKVConnector(matches={"a": [(8, True)]})
    sched = make_scheduler(kv_connector=conn)
    runner = FakeRunner()
    prompt = distinct(1, 12)
    sched.add_request(make_request("a", prompt, max_tokens=2))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {}
    req = sched.state.requests["a"]
    assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert free_blocks(sched) == 61  # blocks for the 8 loaded tokens are held
    sched.update_from_output(so, runner.execute(so))
    so = sched.schedule()  # load not finished: still waiting
    assert so.num_scheduled_tokens == {}
    sched.update_from_output(so, with_kv(runner.execute(so), finished_recving=["a"]))
    sched.check_integrity()
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    sched.update_from_output(so, runner.execute(so))
    # The loaded blocks were registered in the prefix cache once the load finished.
    sched.add_request(make_request("b", prompt, max_tokens=1))
    so = sched.schedule()
    # Hits stop at num_tokens - 1 on a block boundary: both loaded blocks hit.
    assert so.num_scheduled_tokens["b"] == 4
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8


def test_async_load_error_falls_back_to_recompute() -> None:
    conn = FakeKVConnector(matches={"a": [(8, True)]})
    sched = make_scheduler(kv_connector=conn)
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 12), max_tokens=2))
    so = sched.schedule()
    second_block = sched.state.kv.get_block_ids("a")[0][1]
    sched.update_from_output(
        so, with_kv(runner.execute(so), finished_recving=["a"], invalid_block_ids=[second_block])
    )
    so = sched.schedule()
    # Only the first block (4 tokens) loaded correctly: recompute the other 8.
    assert so.num_scheduled_tokens == {"a": 8}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4
    sched.update_from_output(so, runner.execute(so))
    outs = run_to_completion(sched, runner)
    assert outs["a"][-1].finish_reason is FinishReason.LENGTH


def test_a_load_error_after_the_load_was_reported_rewinds_a_request_not_admitted_yet() -> None:
    # A layer-wise connector reports an async load finished and copies its blocks
    # during a later forward; the copy may fail while the request, back to WAITING,
    # could not be admitted yet (no free block). It must then recompute, not run on.
    conn = FakeKVConnector(matches={"a": [(8, True)]})
    sched = make_scheduler(16, kv_connector=conn)
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 12), max_tokens=1))
    so = sched.schedule()  # a: WAITING_FOR_REMOTE_KVS with 2 blocks
    sched.update_from_output(so, runner.execute(so))
    # b takes every free block and runs one decode step more.
    sched.add_request(make_request("b", distinct(2, 4 * free_blocks(sched) - 1), max_tokens=2))
    so = sched.schedule()
    assert set(so.num_scheduled_tokens) == {"b"} and free_blocks(sched) == 0
    sched.update_from_output(so, with_kv(runner.execute(so), finished_recving=["a"]))
    so = sched.schedule()  # a's load is done, but its third block does not fit
    a = sched.state.requests["a"]
    assert set(so.num_scheduled_tokens) == {"b"}
    assert a.status is RequestStatus.WAITING and a.num_computed_tokens == 8
    bad = sched.state.kv.get_block_ids("a")[0][1]
    sched.update_from_output(so, with_kv(runner.execute(so), invalid_block_ids=[bad]))
    assert a.num_computed_tokens == 4  # only the first block's tokens are valid
    so = sched.schedule()  # b finished: a is admitted and recomputes from token 4
    assert so.num_scheduled_tokens == {"a": 8}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4
    sched.update_from_output(so, runner.execute(so))
    sched.check_integrity()


def test_sync_load_error_discards_step_and_recomputes() -> None:
    conn = FakeKVConnector(matches={"a": [(8, False)]})
    sched = make_scheduler(kv_connector=conn)
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 12), max_tokens=2))
    so = sched.schedule()
    bad = sched.state.kv.get_block_ids("a")[0][1]
    mro = with_kv(runner.execute(so), invalid_block_ids=[bad])
    assert all_outputs(sched.update_from_output(so, mro)) == []
    assert sched.state.requests["a"].num_computed_tokens == 4
    runner.reqs["a"].num_computed = 4  # the runner learns it from the next step
    runner.reqs["a"].tokens = runner.reqs["a"].tokens[:12]
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 8}


def test_delayed_free_keeps_blocks_until_sent() -> None:
    conn = FakeKVConnector(delay_free={"a"})
    sched = make_scheduler(kv_connector=conn)
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 10), max_tokens=1))
    so = sched.schedule()
    (out,) = all_outputs(sched.update_from_output(so, runner.execute(so)))
    assert out.finish_reason is FinishReason.LENGTH
    assert out.kv_transfer_params == KVTransferParams(
        do_remote_decode=True, remote_block_ids=[1, 2, 3]
    )
    assert free_blocks(sched) == 60 and sched.has_requests()
    so = sched.schedule()
    sched.update_from_output(so, with_kv(runner.execute(so), finished_sending=["a"]))
    assert free_blocks(sched) == 63
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    assert not sched.has_requests()
    assert conn.outputs[-1].finished_sending == ["a"]


def test_abort_during_async_load_frees_after_worker_reports() -> None:
    conn = FakeKVConnector(matches={"a": [(8, True)]})
    sched = make_scheduler(kv_connector=conn)
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 12)))
    so = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert free_blocks(sched) == 61  # the worker may still write into them
    sched.update_from_output(so, with_kv(runner.execute(so), finished_recving=["a"]))
    assert free_blocks(sched) == 63
    sched.check_integrity()


def _step(sched: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    return so


def test_take_kv_cache_events_merges_manager_and_connector() -> None:
    conn = FakeKVConnector()
    sched = make_scheduler(kv_connector=conn, enable_kv_cache_events=True)
    sched.add_request(make_request("a", distinct(1, 8), max_tokens=1))
    _step(sched, FakeRunner())
    events = sched.take_kv_cache_events()
    assert events and sched.take_kv_cache_events() == []
    assert tokens_of([]) == []


# ---- kv_load_failure_policy -------------------------------------------------------


def _sync_load_error_step(
    policy: str,
) -> tuple[Scheduler, FakeRunner, list[EngineCoreOutput]]:
    """`a` loads 8 tokens synchronously and its second block fails; `b` loads nothing."""
    conn = FakeKVConnector(matches={"a": [(8, False)]})
    sched = make_scheduler(kv_connector=conn, kv_load_failure_policy=policy)
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 12), max_tokens=2))
    sched.add_request(make_request("b", distinct(2, 8), max_tokens=3))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"a": 4, "b": 8}
    a_blocks = sched.state.kv.get_block_ids("a")[0]
    assert a_blocks == [1, 2, 3]
    mro = with_kv(runner.execute(so), invalid_block_ids=[a_blocks[1]])
    outs = all_outputs(sched.update_from_output(so, mro))
    sched.check_integrity()
    return sched, runner, outs


def test_recompute_policy_rewinds_a_failed_sync_load() -> None:
    sched, _, outs = _sync_load_error_step("recompute")
    assert [o.request_id for o in outs] == ["b"]  # a's step output is discarded
    a = sched.state.requests["a"]
    assert a.status is RequestStatus.RUNNING and a.num_computed_tokens == 4
    assert free_blocks(sched) == 63 - 3 - 2  # a keeps its blocks, b holds 2


def test_fail_policy_finishes_a_failed_sync_load_with_error_and_frees_it() -> None:
    sched, runner, first = _sync_load_error_step("fail")
    (a_out,) = [o for o in first if o.request_id == "a"]
    assert a_out.finish_reason is FinishReason.ERROR and a_out.new_token_ids == []
    assert a_out.finish_detail is not None and "kv_load_failure_policy" in a_out.finish_detail
    assert "a" not in sched.state.requests and "a" in sched.state.finished_req_ids
    assert free_blocks(sched) == 63 - 2  # only b's blocks are held
    b = sched.state.requests["b"]
    assert b.status is RequestStatus.RUNNING and sched.state.running == [b]
    # The bad block and the one computed after it left the prefix cache; the
    # first (valid) block still hits.
    sched.add_request(make_request("c", distinct(1, 12), max_tokens=1))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].req_id == "c"
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4
    second = all_outputs(sched.update_from_output(so, runner.execute(so)))
    outs = run_to_completion(sched, runner)
    assert outs["b"][-1].finish_reason is FinishReason.LENGTH
    b_outs = [o for o in first + second if o.request_id == "b"] + outs["b"]
    assert len(tokens_of(b_outs)) == 3  # b ran to max_tokens, untouched by a's failure
    assert free_blocks(sched) == 63


def test_fail_policy_finishes_a_failed_async_load_once_the_worker_is_done() -> None:
    conn = FakeKVConnector(matches={"a": [(8, True)]})
    sched = make_scheduler(kv_connector=conn, kv_load_failure_policy="fail")
    runner = FakeRunner()
    sched.add_request(make_request("a", distinct(1, 12), max_tokens=2))
    so = sched.schedule()
    bad = sched.state.kv.get_block_ids("a")[0][1]
    # The error comes before the worker finished writing: blocks are held until then.
    mro = with_kv(runner.execute(so), invalid_block_ids=[bad])
    outs = all_outputs(sched.update_from_output(so, mro))
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", FinishReason.ERROR)]
    assert free_blocks(sched) == 61 and sched.has_requests()
    so = sched.schedule()
    assert so.num_scheduled_tokens == {}
    sched.update_from_output(so, with_kv(runner.execute(so), finished_recving=["a"]))
    sched.check_integrity()
    assert free_blocks(sched) == 63 and not sched.has_requests()
