"""EngineLoadBalancer: lightest live engine, round robin on ties, reports capped by held."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from paged.scheduler.boundary import SchedulerStats
from paged.server.engine.dp_balance import WAITING_WEIGHT, EngineLoadBalancer


def test_equal_loads_alternate() -> None:
    lb = EngineLoadBalancer(3)
    picks = [lb.choose() for _ in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]


def test_reports_weigh_waiting_four_times_running() -> None:
    lb = EngineLoadBalancer(2)
    for _ in range(5):
        lb.choose()  # 3 to engine 0, 2 to engine 1
    lb.report(0, SchedulerStats(num_running_reqs=3))
    lb.report(1, SchedulerStats(num_waiting_reqs=1, num_running_reqs=1))
    assert lb.loads[0].score == 3
    assert lb.loads[1].score == WAITING_WEIGHT * 1 + 1
    assert lb.choose() == 0


def test_stale_report_is_capped_by_released_requests() -> None:
    lb = EngineLoadBalancer(2)
    lb.choose(), lb.choose()
    lb.report(0, SchedulerStats(num_running_reqs=1))
    lb.release(0)  # aborted: the idle engine will not report again
    assert lb.loads[0].score == 0


def test_dead_engines_are_never_chosen() -> None:
    lb = EngineLoadBalancer(2)
    lb.mark_dead(1)
    assert [lb.choose() for _ in range(3)] == [0, 0, 0]
    lb.mark_dead(0)
    assert lb.choose() is None


ops = st.lists(
    st.one_of(
        st.tuples(st.just("choose"), st.integers(0, 3)),
        st.tuples(st.just("report"), st.integers(0, 3), st.integers(0, 9), st.integers(0, 9)),
        st.tuples(st.just("release"), st.integers(0, 3)),
        st.tuples(st.just("dead"), st.integers(0, 3)),
    ),
    max_size=60,
)


@given(ops)
def test_choice_is_always_a_lightest_live_engine(script: list[tuple[object, ...]]) -> None:
    lb = EngineLoadBalancer(4)
    for op in script:
        kind, index = op[0], op[1]
        assert isinstance(index, int)
        if kind == "choose":
            before = [(load.score, load.alive) for load in lb.loads]
            picked = lb.choose()
            live = [score for score, alive in before if alive]
            if not live:
                assert picked is None
            else:
                assert picked is not None and before[picked][1]
                assert before[picked][0] == min(live)
        elif kind == "report":
            waiting, running = op[2], op[3]
            assert isinstance(waiting, int) and isinstance(running, int)
            lb.report(index, SchedulerStats(num_waiting_reqs=waiting, num_running_reqs=running))
        elif kind == "release":
            lb.release(index)
        else:
            lb.mark_dead(index)
        for load in lb.loads:
            assert 0 <= load.score <= WAITING_WEIGHT * load.held
