"""ModelRunner with a worker-side KV connector held by composition (seed: KV Transfer).

The recording connector below implements the runner's own Protocol (the
runner never imports paged-connectors); the tests check the call order the
seed gives (bind -> start_load -> per layer wait/save -> wait_for_save ->
get_finished -> clear), that each layer's save sees the K/V the forward just
wrote, that results reach `ModelRunnerOutput.kv_connector_output`, and that a
step with nothing scheduled still drives the connector.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest
import torch

from paged.kvcache import get_kv_cache_config
from paged.runner.config import CacheConfig, ModelConfig, SchedulerLimits
from paged.runner.kv_connector import KVConnectorWorker
from paged.runner.model_runner import ModelRunner
from paged.scheduler.boundary import (
    KVConnectorOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from paged.scheduler.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 32


class RecordingConnector:
    """Logs every call; reports what the test scripts."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.saved_nonzero: dict[str, bool] = {}
        self.save_slots: list[int] = []
        self.finished_recving: set[str] = set()
        self.invalid: set[int] = set()
        self.layer_groups: list[list[str]] = []

    def register_kv_caches(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        layer_groups: Sequence[Sequence[str]] | None = None,
    ) -> None:
        self.calls.append(f"register:{len(kv_caches)}")
        self.kv_caches = dict(kv_caches)
        self.layer_groups = [list(g) for g in layer_groups or ()]

    def bind_connector_metadata(self, metadata: bytes) -> None:
        self.calls.append(f"bind:{metadata.decode()}")

    def clear_connector_metadata(self) -> None:
        self.calls.append("clear")

    def start_load_kv(self) -> None:
        self.calls.append("start_load")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(f"wait:{layer_name}")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        self.calls.append(f"save:{layer_name}")
        assert kv_layer is self.kv_caches[layer_name]  # the layer's own cache, not a copy
        flat = kv_layer.view(2, -1, *kv_layer.shape[3:])
        self.saved_nonzero[layer_name] = all(
            bool(flat[:, s].abs().sum() > 0) for s in self.save_slots
        )

    def wait_for_save(self) -> None:
        self.calls.append("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.calls.append(f"get_finished:{sorted(finished_req_ids)}")
        recving, self.finished_recving = self.finished_recving, set()
        return None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self.calls.append("errors")
        invalid, self.invalid = self.invalid, set()
        return invalid

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        self.calls.append(f"preempted:{sorted(preempted_req_ids)}")

    def get_kv_connector_stats(self) -> dict[str, float] | None:
        return None

    def shutdown(self) -> None:
        self.calls.append("shutdown")


# mypy proves the recording connector satisfies the runner's Protocol.
_PROTOCOL_CHECK: Callable[[], KVConnectorWorker] = RecordingConnector


def _runner(path: Path, connector: RecordingConnector | None) -> ModelRunner:
    config = ModelConfig.from_pretrained(str(path), max_model_len=64)
    runner = ModelRunner(
        config,
        CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=1 << 20),
        SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=32),
        "cpu",
        kv_connector=connector,
    )
    runner.load_model()
    specs = runner.get_kv_cache_spec()
    kv = get_kv_cache_config(
        specs, runner.determine_available_memory(), num_gpu_blocks_override=NUM_BLOCKS
    )
    runner.initialize_kv_cache(kv)
    return runner


def _step(runner: ModelRunner, so: SchedulerOutput) -> ModelRunnerOutput:
    out = runner.execute_model(so)
    return out if out is not None else runner.sample_tokens(None)


def test_a_hybrid_model_registers_each_groups_layers(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    # Full + sliding-window layers: a connector indexes each layer with its group's blocks.
    path = tiny_checkpoint(
        "qwen2", num_hidden_layers=2, use_sliding_window=True, sliding_window=8,
        max_window_layers=1,
    )  # fmt: skip
    conn = RecordingConnector()
    runner = _runner(path, conn)
    names = list(runner.get_kv_cache_spec())
    assert len(conn.layer_groups) == 2
    assert sorted(n for g in conn.layer_groups for n in g) == sorted(names)
    assert all(len(g) == 1 for g in conn.layer_groups)


def _new_request_step(meta: bytes | None) -> SchedulerOutput:
    new = NewRequestData(
        req_id="r",
        prompt_token_ids=[5, 6, 7, 8, 9, 10],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=4),
        block_ids=([3, 7],),
        num_computed_tokens=0,
    )
    return SchedulerOutput(
        scheduled_new_reqs=[new],
        num_scheduled_tokens={"r": 6},
        total_num_scheduled_tokens=6,
        kv_connector_metadata=meta,
    )


def test_step_calls_the_connector_in_the_seed_order(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    conn = RecordingConnector()
    runner = _runner(tiny_checkpoint("llama", num_hidden_layers=2), conn)
    names = list(runner.get_kv_cache_spec())
    assert conn.calls == ["register:2"] and list(conn.kv_caches) == names
    assert conn.layer_groups == [names]  # one group: every layer
    conn.calls.clear()
    conn.save_slots = [3 * BLOCK + i for i in range(4)] + [7 * BLOCK, 7 * BLOCK + 1]
    conn.finished_recving = {"x"}
    conn.invalid = {11, 4}
    out = _step(runner, _new_request_step(b"m1"))
    assert conn.calls == [
        "bind:m1",
        "start_load",
        f"wait:{names[0]}",
        f"save:{names[0]}",
        f"wait:{names[1]}",
        f"save:{names[1]}",
        "wait_for_save",
        "get_finished:[]",
        "errors",
        "clear",
    ]
    # Each layer's save ran after that layer wrote this step's six tokens.
    assert conn.saved_nonzero == dict.fromkeys(names, True)
    assert out.kv_connector_output == KVConnectorOutput(
        finished_recving=["x"], invalid_block_ids=[4, 11]
    )
    assert out.req_ids == ["r"] and len(out.sampled_token_ids[0]) == 1


def test_tokens_do_not_change_with_a_connector(tiny_checkpoint: Callable[..., Path]) -> None:
    path = tiny_checkpoint("llama", num_hidden_layers=2)
    plain = _step(_runner(path, None), _new_request_step(None))
    connected = _step(_runner(path, RecordingConnector()), _new_request_step(b"m"))
    assert plain.kv_connector_output is None
    assert connected.sampled_token_ids == plain.sampled_token_ids


def test_a_step_with_nothing_scheduled_still_drives_the_connector(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    conn = RecordingConnector()
    runner = _runner(tiny_checkpoint("llama", num_hidden_layers=1), conn)
    conn.calls.clear()
    conn.finished_recving = {"remote"}
    so = SchedulerOutput(
        finished_req_ids=["gone"], preempted_req_ids=["p"], kv_connector_metadata=b"idle"
    )
    out = runner.execute_model(so)
    assert out is not None
    assert conn.calls == [
        "preempted:['p']",
        "bind:idle",
        "start_load",
        "wait_for_save",
        "get_finished:['gone']",
        "errors",
        "clear",
    ]
    assert out.kv_connector_output == KVConnectorOutput(finished_recving=["remote"])


def test_without_metadata_nothing_is_bound(tiny_checkpoint: Callable[..., Path]) -> None:
    conn = RecordingConnector()
    runner = _runner(tiny_checkpoint("llama", num_hidden_layers=1), conn)
    conn.calls.clear()
    out = _step(runner, _new_request_step(None))
    # No metadata: no per-layer calls, but finished transfers are still collected.
    assert conn.calls == ["get_finished:[]", "errors"]
    assert out.kv_connector_output == KVConnectorOutput()


class FailingLoadConnector(RecordingConnector):
    def start_load_kv(self) -> None:
        super().start_load_kv()
        raise OSError("storage unreachable")


def test_a_raising_connector_leaves_no_metadata_bound(
    tiny_checkpoint: Callable[..., Path],
) -> None:
    conn = FailingLoadConnector()
    runner = _runner(tiny_checkpoint("llama", num_hidden_layers=1), conn)
    conn.calls.clear()
    with pytest.raises(OSError, match="storage unreachable"):
        runner.execute_model(_new_request_step(b"m"))
    assert conn.calls == ["bind:m", "start_load", "clear"]
