"""vLLM's --kv-offloading-size / --kv-offloading-backend, --block-hash-seed, connector metrics."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from paged.connectors.kv import parse_kv_transfer_config
from paged.scheduler import SchedulerStats
from paged.server.cli import build_parser, engine_args_from, main
from paged.server.engine_args import EngineArgs
from paged.server.kv_transfer import offloading_kv_transfer_config
from paged.server.metrics import PrometheusStatLogger


def test_offloading_size_maps_onto_the_offloading_connector_as_vllm_does() -> None:
    cfg = offloading_kv_transfer_config(8.0, "native", 2)
    assert cfg["kv_connector"] == "OffloadingConnector" and cfg["kv_role"] == "kv_both"
    # vLLM 0.33 config/vllm.py:1174: cpu_bytes_to_use, all ranks together.
    assert cfg["kv_connector_extra_config"] == {"cpu_bytes_to_use": 8.0 * (1 << 30)}
    with pytest.raises(ValueError, match="'lmcache' is not supported"):
        offloading_kv_transfer_config(1.0, "lmcache", 1)
    with pytest.raises(ValueError, match="must be positive"):
        offloading_kv_transfer_config(0.0, "native", 1)


def test_cli_flags_reach_the_engine_args() -> None:
    ns = build_parser().parse_args(
        ["serve", "m", "--kv-offloading-size", "1.5", "--block-hash-seed", "7"]
    )
    args = engine_args_from(ns)
    assert args.kv_offloading_size == 1.5 and args.kv_offloading_backend == "native"
    assert args.block_hash_seed == 7
    config = args._kv_transfer_config()
    assert isinstance(config, dict)
    parsed = parse_kv_transfer_config(json.dumps(config))
    assert parsed.kv_connector == "OffloadingConnector"
    assert parsed.kv_connector_extra_config["cpu_bytes_to_use"] == 1.5 * (1 << 30)
    with pytest.raises(SystemExit):  # lmcache is not offered (docs/lmcache.md)
        build_parser().parse_args(["serve", "m", "--kv-offloading-backend", "lmcache"])
    default = engine_args_from(build_parser().parse_args(["serve", "m"]))
    assert default.block_hash_seed is None and default.prefix_caching_hash_algo == "sha256"
    algo = build_parser().parse_args(["serve", "m", "--prefix-caching-hash-algo", "xxhash_cbor"])
    assert engine_args_from(algo).prefix_caching_hash_algo == "xxhash_cbor"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--prefix-caching-hash-algo", "md5"])


def test_offloading_size_and_a_transfer_config_are_exclusive() -> None:
    args = EngineArgs(kv_offloading_size=1.0, kv_transfer_config='{"kv_connector":"X"}')
    with pytest.raises(ValueError, match="exclusive"):
        args._kv_transfer_config()


def test_block_hashes_agree_across_processes_whatever_pythonhashseed() -> None:
    # What a disk tier relies on after a restart: the same tokens hash alike in a
    # new process, even with a different (or random) PYTHONHASHSEED, once
    # --block-hash-seed fixes the seed.
    code = (
        "from paged.kvcache import init_none_hash, sha256, hash_block_tokens\n"
        "init_none_hash(sha256, 0)\n"
        "print(hash_block_tokens(sha256, None, [1, 2, 3, 4]).hex())\n"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2", "random")
    }
    assert len(outs) == 1 and len(next(iter(outs))) == 64


def test_connector_stats_become_per_tier_prometheus_counters() -> None:
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry, kv_connector_metrics=True)
    stats = {"host.hits": 32.0, "disk.bytes_loaded": 4096.0, "load_errors": 1.0, "x.y": 5.0}
    logger.record(SchedulerStats(kv_connector_stats=stats), None)
    logger.record(SchedulerStats(kv_connector_stats={"host.hits": 16.0}), None)
    text = generate_latest(registry).decode()
    assert 'paged:kv_offload_hits_tokens_total{model_name="m",tier="host"} 48.0' in text
    assert 'paged:kv_offload_hits_tokens_total{model_name="m",tier="disk"} 0.0' in text
    assert 'paged:kv_offload_loaded_bytes_total{model_name="m",tier="disk"} 4096.0' in text
    assert 'paged:kv_offload_load_errors_total{model_name="m"} 1.0' in text
    assert 'tier="x"' not in text


def test_redis_tier_traffic_and_faults_become_counters() -> None:
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry, kv_connector_metrics=True)
    stats = {"redis.hits": 256.0, "redis.write_oom": 2.0, "redis.lookup_timeout": 1.0}
    logger.record(SchedulerStats(kv_connector_stats=stats), None)
    logger.record(SchedulerStats(kv_connector_stats={"redis.write_oom": 1.0}), None)
    text = generate_latest(registry).decode()
    assert 'paged:kv_offload_hits_tokens_total{model_name="m",tier="redis"} 256.0' in text
    fault = 'paged:kv_offload_remote_faults_total{model_name="m",op="%s",reason="%s",tier="redis"}'
    assert f"{fault % ('write', 'oom')} 3.0" in text
    assert f"{fault % ('lookup', 'timeout')} 1.0" in text


def test_no_connector_counters_without_a_connector() -> None:
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry)
    logger.record(SchedulerStats(kv_connector_stats={"host.hits": 32.0}), None)
    assert "kv_offload" not in generate_latest(registry).decode()


def _serve_exit(extra: dict[str, object], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    config["kv_connector_extra_config"] = extra  # type: ignore[assignment]
    # A model path that does not exist: a refusal naming the key, not the model, shows the
    # config was checked before any model loads.
    code = main(["serve", "/nonexistent/model", "--kv-transfer-config", json.dumps(config)])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"num_cpu_blocks": 1000}, "num_cpu_blocks is not supported"),
        ({"cpu_bytes_to_use": 1e9, "eviction_policy": "lfu"}, "eviction_policy 'lfu'"),
        (
            {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": 1e9,
                "secondary_tiers": [{"type": "obj", "bucket": "kv"}],
            },
            "secondary tier type 'obj'",
        ),
    ],
)
def test_a_refused_offloading_key_exits_2_before_the_model_loads(
    extra: dict[str, object], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = _serve_exit(extra, capsys)
    assert code == 2 and message in err and "/nonexistent/model" not in err


def test_vllm_keys_pass_argument_parsing_and_lmcache_is_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, err = _serve_exit({"cpu_bytes_to_use": 1e9, "block_size": 64}, capsys)
    assert code == 2 and "'/nonexistent/model' does not exist" in err  # past the config
    config = json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})
    assert main(["serve", "/nonexistent/model", "--kv-transfer-config", config]) == 2
    err = capsys.readouterr().err
    assert "'LMCacheConnectorV1' is not available" in err and "OffloadingConnector" in err


def test_an_offloading_child_of_a_multi_connector_is_checked_too(
    capsys: pytest.CaptureFixture[str],
) -> None:
    child = {
        "kv_connector": "OffloadingConnector",
        "kv_connector_extra_config": {"num_cpu_blocks": 8},
    }
    config = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [child]},
    }
    assert main(["serve", "/nonexistent/model", "--kv-transfer-config", json.dumps(config)]) == 2
    assert "num_cpu_blocks is not supported" in capsys.readouterr().err
