"""vLLM's scheduler flags: --scheduling-policy, --long-prefill-token-threshold(-adaptive).

vLLM 0.33.0: engine/arg_utils.py:1771-1783 (flags), config/scheduler.py:79-90,159
(fields). vLLM 0.33 has no --max-num-partial-prefills / --max-long-partial-prefills
(removed before 0.33), so paged has none either: argparse refuses them as unknown.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

from paged.runner.config import SchedulerLimits
from paged.scheduler.boundary import EngineCoreRequest
from paged.scheduler.sampling_params import SamplingParams
from paged.server.cli import build_parser, engine_args_from
from paged.server.engine.core import EngineCore, scheduler_config_from
from paged.server.engine_args import EngineArgs


def test_flags_reach_engine_args() -> None:
    ns = build_parser().parse_args(
        [
            "serve",
            "--scheduling-policy",
            "priority",
            "--long-prefill-token-threshold",
            "64",
            "--long-prefill-token-threshold-adaptive",
        ]
    )
    args = engine_args_from(ns)
    assert args.scheduling_policy == "priority"
    assert args.long_prefill_token_threshold == 64
    assert args.long_prefill_token_threshold_adaptive is True
    default = engine_args_from(build_parser().parse_args(["serve"]))
    assert (default.scheduling_policy, default.long_prefill_token_threshold) == ("fcfs", 0)
    assert default.long_prefill_token_threshold_adaptive is False


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--scheduling-policy", "lifo"], "invalid choice: 'lifo'"),
        (["--long-prefill-token-threshold", "-1"], "must be at least 0, got -1"),
        (["--long-prefill-token-threshold", "x"], "expected an integer, got 'x'"),
        (["--max-num-partial-prefills", "2"], "unrecognized arguments"),
    ],
)
def test_bad_values_exit_at_parse_time(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_limits_refuse_bad_values_naming_the_option() -> None:
    with pytest.raises(ValueError, match="scheduling_policy: must be 'fcfs' or 'priority'"):
        SchedulerLimits(policy="lifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="long_prefill_token_threshold: must be >= 0"):
        SchedulerLimits(long_prefill_token_threshold=-1)


def _request(rid: str, priority: int) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=rid,
        prompt_token_ids=[3, 4, 5],
        sampling_params=SamplingParams(max_tokens=2),
        eos_token_id=None,
        arrival_time=time.time(),
        priority=priority,
    )


def _finish_order(core: EngineCore) -> list[str]:
    order: list[str] = []
    while core.has_work():
        for outputs in core.run_step().values():
            order += [o.request_id for o in outputs.outputs if o.finish_reason is not None]
    return order


@pytest.mark.parametrize(
    ("policy", "order"),
    [("priority", ["high", "mid", "low"]), ("fcfs", ["low", "high", "mid"])],
)
def test_policy_reaches_the_engine_scheduler(
    policy: str, order: list[str], engine_config_factory: Any, fake_executor_cls: Any
) -> None:
    # One request at a time, so the finishing order is the admission order.
    config = engine_config_factory(max_num_seqs=1)
    limits = SchedulerLimits(max_num_seqs=1, max_num_batched_tokens=32, policy=policy)  # type: ignore[arg-type]
    core = EngineCore(dataclasses.replace(config, scheduler_limits=limits), fake_executor_cls)
    assert core.scheduler_config.policy == policy
    for rid, priority in (("low", 5), ("high", -1), ("mid", 2)):
        core.add_request(_request(rid, priority))
    assert _finish_order(core) == order
    core.shutdown()


def test_threshold_reaches_the_scheduler_config(engine_config_factory: Any) -> None:
    config = engine_config_factory()
    limits = SchedulerLimits(
        long_prefill_token_threshold=16, long_prefill_token_threshold_adaptive=True
    )
    sched = scheduler_config_from(dataclasses.replace(config, scheduler_limits=limits))
    assert sched.long_prefill_token_threshold == 16
    assert sched.long_prefill_token_threshold_adaptive is True
    too_big = SchedulerLimits(long_prefill_token_threshold=config.model_config.max_model_len + 1)
    with pytest.raises(ValueError, match="cannot be greater than the max_model_len"):
        scheduler_config_from(dataclasses.replace(config, scheduler_limits=too_big))


@pytest.mark.slow
def test_engine_args_carry_the_flags_into_the_engine_config() -> None:
    # The default model's config only (no weights are loaded by create_engine_config).
    args = EngineArgs(device="cpu", scheduling_policy="priority", long_prefill_token_threshold=32)
    sched = scheduler_config_from(args.create_engine_config())
    assert (sched.policy, sched.long_prefill_token_threshold) == ("priority", 32)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineArgs(device="cpu", scheduling_policy="lifo").create_engine_config()
