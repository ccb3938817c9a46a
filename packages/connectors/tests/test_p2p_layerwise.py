"""PagedZmqConnector with `use_layerwise` on the decoder: pulled blocks copied during a forward.

Two schedulers with real KV tensors over loopback ZMQ (test_p2p.py's
harness). The decoder reports a finished pull at once and copies its blocks
layer by layer in the next step's forward; the KV must equal what the
prefill computed, an abort in between must leave the freed blocks alone, and
a failed copy must be recomputed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from packages.connectors.tests.test_p2p import (
    PROMPT,
    Engine,
    decode_request,
    free_port,
    make_engine,
    prefill,
    run_until,
)
from paged.connectors.kv.layerwise import LayerRows
from paged.connectors.kv.p2p import ZmqConnectorConfig
from paged.connectors.kv.p2p.staging import StagedPulls
from paged.connectors.kv.testing import expected_kv
from paged.scheduler.request import RequestStatus
from paged.scheduler.testing import BLOCK_SIZE

N = len(PROMPT)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.worker_side.shutdown()


def _step_until_reported(p: Engine, d: Engine, rid: str) -> None:
    """Step both engines until the decoder's worker has reported `rid`'s pull."""
    for _ in range(2000):
        p.step()
        d.step()
        if rid in d.sched.state.finished_recving_kv_req_ids:
            return
    raise AssertionError("the pull was never reported")


def _blocks(d: Engine, rid: str) -> list[int]:
    return list(d.sched.state.kv.get_block_ids(rid)[0][: (N - 1) // BLOCK_SIZE])


def test_a_pull_is_reported_first_and_copied_during_the_next_forward(
    engines: list[Engine],
) -> None:
    p = make_engine("kv_producer", free_port())
    d = make_engine("kv_consumer", free_port(), use_layerwise=True)
    engines += [p, d]
    params = prefill(p)
    d.sched.add_request(decode_request("d1", params))
    _step_until_reported(p, d, "d1")
    # Reported, not yet copied: without use_layerwise the copy comes before the report.
    for cache in d.sim.kv_caches.values():
        assert bool((cache[:, _blocks(d, "d1")] == 0).all())
    run_until([p, d], lambda: d.finished("d1") is not None and p.usage == 0.0)
    assert d.sim.computed_positions["d1"] == list(range(N - 1, N + 3))
    got, want = d.sim.kv_of("d1", N - 1), expected_kv(PROMPT, N - 1)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    assert d.stats.get("p2p.recv_failures", 0) == 0
    d.sched.check_integrity()


def test_an_abort_after_the_report_drops_the_staged_copy(engines: list[Engine]) -> None:
    p = make_engine("kv_producer", free_port())
    d = make_engine("kv_consumer", free_port(), use_layerwise=True)
    engines += [p, d]
    params = prefill(p)
    d.sched.add_request(decode_request("d1", params))
    _step_until_reported(p, d, "d1")
    blocks = _blocks(d, "d1")
    staging = d.worker_side._staging
    assert staging is not None and "d1" in staging
    d.sched.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    run_until([p, d], lambda: d.usage == 0.0 and p.usage == 0.0, timeout=3.0)
    assert "d1" not in staging
    for cache in d.sim.kv_caches.values():  # freed blocks: never written by the late copy
        assert bool((cache[:, blocks] == 0).all())
    d.sched.check_integrity()


def test_a_failed_layer_copy_is_recomputed(
    engines: list[Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_stage = StagedPulls.stage

    def stage_broken(
        self: StagedPulls, req_id: str, block_ids: list[int], frames: list[memoryview]
    ) -> None:
        real_stage(self, req_id, block_ids, frames)
        source = self._staged[req_id]
        rows = source.fetch()

        def broken(layer_idx: int) -> torch.Tensor:
            if layer_idx == 1:
                raise RuntimeError("device copy failed")
            return rows(layer_idx)

        good: LayerRows = broken
        self._staged[req_id] = type(source)(source.block_ids, lambda: good, source.label)

    monkeypatch.setattr(StagedPulls, "stage", stage_broken)
    p = make_engine("kv_producer", free_port())
    d = make_engine("kv_consumer", free_port(), use_layerwise=True)
    engines += [p, d]
    params = prefill(p)
    d.sched.add_request(decode_request("d1", params))
    run_until([p, d], lambda: d.finished("d1") is not None and p.usage == 0.0)
    # Layer 1 of every pulled block failed: the prompt was recomputed from token 0.
    assert 0 in d.sim.computed_positions["d1"]
    got, want = d.sim.kv_of("d1", N), expected_kv(PROMPT, N)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    assert len(d.tokens("d1")) == 4
    d.sched.check_integrity()


def test_use_layerwise_is_a_known_key() -> None:
    assert ZmqConnectorConfig.from_extra_config({"use_layerwise": True}).use_layerwise
    assert not ZmqConnectorConfig.from_extra_config({}).use_layerwise
