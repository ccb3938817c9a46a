"""dp_launch: which GPUs each local DP rank sees, and the env its engine process gets.

vLLM's assignment: local DP rank r of engines that use W devices each (TP x PP)
sees devices r*W .. r*W+W-1 of those the server sees. Checked without GPUs:
`CUDA_VISIBLE_DEVICES` stands in for the device list.
"""

from __future__ import annotations

import os
from typing import cast

import pytest

from paged.server.engine.dp_launch import (
    DP_RANK_ENV,
    DPRankFactory,
    rank_devices,
    rank_factories,
    visible_cuda_devices,
)
from paged.server.engine.interfaces import EngineCoreLike

CORE = cast(EngineCoreLike, object())  # what the wrapped factory builds


def _core() -> EngineCoreLike:
    return CORE


def test_each_rank_gets_its_own_contiguous_devices() -> None:
    visible = ["0", "1", "2", "3", "4", "5"]
    assert [rank_devices(r, 2, visible) for r in range(3)] == [("0", "1"), ("2", "3"), ("4", "5")]
    assert rank_devices(1, 1, ["7", "3"]) == ("3",)  # entries as listed, not renumbered
    with pytest.raises(
        ValueError, match=r"data_parallel_size_local: local DP rank 2 needs GPUs 4\.\.5"
    ):
        rank_devices(2, 2, visible[:5])


def test_factories_on_cuda_follow_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4, 5,6,7")
    assert visible_cuda_devices() == ["4", "5", "6", "7"]
    # A headless node holding DP ranks 2 and 3, TP=2 each: local ranks 0 and 1.
    factories = rank_factories(_core, start_rank=2, num_local=2, world_size=2, device="cuda")
    assert [(f.dp_rank, f.visible_devices) for f in factories] == [(2, ("4", "5")), (3, ("6", "7"))]
    with pytest.raises(ValueError, match="only 4 are visible"):
        rank_factories(_core, start_rank=0, num_local=3, world_size=2, device="cuda:0")


def test_factories_on_cpu_leave_devices_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    factories = rank_factories(_core, start_rank=0, num_local=3, world_size=4, device="cpu")
    assert [(f.dp_rank, f.visible_devices) for f in factories] == [(0, None), (1, None), (2, None)]


def test_the_factory_sets_the_env_before_building_the_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.delenv(DP_RANK_ENV, raising=False)
    seen: list[tuple[str | None, str | None]] = []

    def core() -> EngineCoreLike:
        seen.append((os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get(DP_RANK_ENV)))
        return CORE

    assert DPRankFactory(core, 1, ("2", "3"))() is CORE
    DPRankFactory(core, 0)()  # CPU: CUDA_VISIBLE_DEVICES untouched
    assert seen == [("2,3", "1"), ("2,3", "0")]
