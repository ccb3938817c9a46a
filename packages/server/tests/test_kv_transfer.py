"""KV transfer wiring in the server: config validation, request params, engine and workers."""

from __future__ import annotations

import pickle
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest
import torch

from paged.connectors.kv import KVConnectorRole
from paged.connectors.kv.shared_storage import SharedStorageConnector, prefix_key
from paged.runner.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerLimits,
)
from paged.scheduler.boundary import EngineCoreOutput, EngineCoreRequest, KVTransferParams
from paged.scheduler.sampling_params import SamplingParams
from paged.server.cli import main
from paged.server.engine.core import EngineCore
from paged.server.errors import InvalidRequestError
from paged.server.kv_transfer import (
    KVConnectorBuilder,
    kv_connector_builder,
    kv_load_failure_policy,
    kv_transfer_params_to_dict,
    make_scheduler_connector,
    parse_request_kv_transfer_params,
)

STORAGE = '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both", '


def test_request_params_parse_into_the_typed_struct() -> None:
    raw = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [3, 4]}
    assert parse_request_kv_transfer_params(raw) == KVTransferParams(
        do_remote_prefill=True, remote_engine_id="p0", remote_block_ids=[3, 4]
    )
    assert parse_request_kv_transfer_params(None) is None
    assert parse_request_kv_transfer_params({}) == KVTransferParams()


def test_keys_outside_the_typed_set_are_kept_not_refused() -> None:
    # vLLM's kv_transfer_params is an open dict: a P/D router (NIXL) sends e.g. tp_size;
    # a connector of one's own reads its keys from `extra`, and they come back in responses.
    raw = {"do_remote_prefill": True, "tp_size": 2, "my_connector": {"k": [1]}}
    params = parse_request_kv_transfer_params(raw)
    assert params == KVTransferParams(
        do_remote_prefill=True, extra={"tp_size": 2, "my_connector": {"k": [1]}}
    )
    assert kv_transfer_params_to_dict(params) == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "tp_size": 2,
        "my_connector": {"k": [1]},
    }
    # They cross the engine's msgpack boundary intact.
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=KVTransferParams) == params


def test_per_group_remote_block_ids_of_a_hybrid_prefill_round_trip() -> None:
    # A hybrid model's prefill answers one list per KV cache group (vLLM's form); the
    # decoder's request carries it back unchanged.
    raw = {"do_remote_prefill": True, "remote_block_ids": [[1, 2, 3], [0, 5, 6]]}
    params = parse_request_kv_transfer_params(raw)
    assert params == KVTransferParams(
        do_remote_prefill=True, extra={"remote_block_ids": [[1, 2, 3], [0, 5, 6]]}
    )
    assert kv_transfer_params_to_dict(params) == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_block_ids": [[1, 2, 3], [0, 5, 6]],
    }
    with pytest.raises(InvalidRequestError, match="remote_block_ids"):
        parse_request_kv_transfer_params({"remote_block_ids": [[1], ["x"]]})
    with pytest.raises(InvalidRequestError, match="remote_block_ids"):
        parse_request_kv_transfer_params({"remote_block_ids": [[1], 2]})


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"remote_port": "80"}, "remote_port"),
        ({"do_remote_decode": 1}, "do_remote_decode"),
        ([1, 2], "object"),
    ],
)
def test_bad_request_params_are_a_400_naming_the_field(raw: object, fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment) as info:
        parse_request_kv_transfer_params(raw)
    assert info.value.param == "kv_transfer_params"


def test_response_params_leave_unset_fields_out() -> None:
    params = KVTransferParams(do_remote_decode=True, remote_port=5)
    assert kv_transfer_params_to_dict(params) == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_port": 5,
    }
    assert kv_transfer_params_to_dict(None) is None


def test_builder_validates_at_start_up_and_pickles(tmp_path: Path) -> None:
    assert kv_connector_builder(None, 16) is None
    assert kv_connector_builder('{"kv_role": "kv_both"}', 16) is None  # no connector named
    text = STORAGE + f'"kv_connector_extra_config": {{"shared_storage_path": "{tmp_path}"}}}}'
    builder = kv_connector_builder(text, 16)
    assert builder is not None
    # It travels to engine and worker processes inside EngineConfig.
    clone = pickle.loads(pickle.dumps(builder))
    worker = clone.make_worker_connector(1, 2)
    assert isinstance(worker, SharedStorageConnector) and worker.role is KVConnectorRole.WORKER
    assert worker.context.rank == 1 and worker.context.world_size == 2
    sched = clone.make_scheduler_connector(2, 1)
    assert sched.role is KVConnectorRole.SCHEDULER and sched.context.block_size == 16
    assert sched.kv_transfer_config.engine_id == builder.config().engine_id  # fixed once


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ("{", "not valid JSON"),
        ('{"kv_connector": "Nope", "kv_role": "kv_both"}', "unknown KV connector 'Nope'"),
        (
            '{"kv_connector": "X", "kv_role": "kv_both", "kv_connector_module_path": "no_mod"}',
            "cannot import module 'no_mod'",
        ),
        ('{"kv_connector": "SharedStorageConnector"}', "kv_role is required"),
        (STORAGE + '"kv_load_failure_policy": "retry"}', "kv_load_failure_policy"),
    ],
)
def test_cli_stops_with_one_message_on_a_bad_config(
    config: str, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "/nonexistent-model", "--kv-transfer-config", config]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paged serve: error: ") and fragment in err
    assert "Traceback" not in err


def test_scheduler_side_needs_the_servers_builder() -> None:
    class Other:
        def make_worker_connector(self, rank: int, world_size: int) -> SharedStorageConnector:
            raise AssertionError

    config = _engine_config_stub(Other())
    with pytest.raises(TypeError, match="KVConnectorBuilder"):
        make_scheduler_connector(config, 1)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_the_load_failure_policy_is_read_off_the_transfer_config(
    policy: str, tmp_path: Path
) -> None:
    config = {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    builder = kv_connector_builder(config, block_size=16)  # "fail" is no longer refused
    assert kv_load_failure_policy(_engine_config_stub(builder)) == policy
    assert kv_load_failure_policy(_engine_config_stub(None)) == "recompute"


def _engine_config_stub(factory: object) -> EngineConfig:
    # Only kv_connector_factory and parallel_config are read.
    stub = object.__new__(EngineConfig)
    object.__setattr__(stub, "kv_connector_factory", factory)
    object.__setattr__(stub, "parallel_config", ParallelConfig())
    return stub


# ---- the real engine, with its worker in another process -----------------------------

PLUGIN = textwrap.dedent(
    """
    from paged.connectors.kv.shared_storage import SharedStorageConnector
    from paged.scheduler.boundary import KVTransferParams

    class EchoParamsConnector(SharedStorageConnector):
        '''Answers every finished request with params naming it (a P/D producer would).'''

        def request_finished(self, request, block_ids):
            super().request_finished(request, block_ids)
            return False, KVTransferParams(remote_request_id=request.request_id)
    """
)


@pytest.fixture
def tiny_llama(tmp_path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
    )
    path = tmp_path / "tiny-llama"
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def _run(core: EngineCore) -> dict[str, list[EngineCoreOutput]]:
    got: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(500):
        if not core.has_work():
            return got
        for outputs in core.run_step().values():
            for out in outputs.outputs:
                got.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not go idle")


@pytest.mark.slow
def test_multiprocess_workers_build_their_connector_and_params_reach_the_output(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kv_echo_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers inherit sys.path
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delitem(sys.modules, "kv_echo_plugin", raising=False)
    storage = tmp_path / "kv"
    builder = kv_connector_builder(
        {
            "kv_connector": "EchoParamsConnector",
            "kv_connector_module_path": "kv_echo_plugin",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        },
        4,
    )
    assert isinstance(builder, KVConnectorBuilder)
    config = EngineConfig(
        model_config=ModelConfig.from_pretrained(str(tiny_llama), max_model_len=96),
        cache_config=CacheConfig(block_size=4, kv_cache_memory_bytes=1 << 16),
        parallel_config=ParallelConfig(distributed_executor_backend="mp"),
        scheduler_limits=SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=16),
        kv_connector_factory=builder,
    )
    core = EngineCore(config)
    try:
        prompt = list(range(3, 16))  # 13 tokens: a 12-token prefix
        core.add_request(
            EngineCoreRequest(
                "r0",
                prompt,
                SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                eos_token_id=2,
                arrival_time=time.time(),
                kv_transfer_params=KVTransferParams(do_remote_decode=True),
            )
        )
        outs = _run(core)["r0"]
    finally:
        core.shutdown()
    assert outs[-1].finished
    assert outs[-1].kv_transfer_params == KVTransferParams(remote_request_id="r0")
    # The worker process saved the prefix: its connector was built there.
    assert (storage / prefix_key(prompt[:12], []) / "rank0" / "COMPLETE").is_file()
