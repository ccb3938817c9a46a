"""`paged serve --ec-role ...` shorthands and the encode-only producer's engine settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paged.server.cli import build_parser
from paged.server.ec_cli import ec_transfer_config_from, ec_transfer_config_json
from paged.server.ec_transfer import ECConnectorBuilder
from paged.server.encode_only import is_encode_only
from paged.server.engine.core import scheduler_config_from
from paged.server.engine_args import EngineArgs
from paged.server.mm_testing import save_tiny_gemma3_model


def parse(*args: str) -> str | None:
    return ec_transfer_config_json(build_parser().parse_args(["serve", "m", *args]))


def test_shorthands_compose_vllms_json() -> None:
    text = parse("--ec-role", "producer", "--ec-connector-extra-config", '{"listen_port": 7}')
    assert text is not None
    assert json.loads(text) == {
        "ec_connector": "ECZmqConnector",
        "ec_role": "producer",
        "ec_connector_extra_config": {"listen_port": 7},
    }
    text = parse("--ec-role", "ec_consumer", "--ec-connector", "ECExampleConnector")
    assert text is not None and json.loads(text)["ec_connector"] == "ECExampleConnector"
    full = '{"ec_connector": "ECExampleConnector", "ec_role": "ec_both"}'
    assert parse("--ec-transfer-config", full) == full
    assert parse() is None


def test_bad_combinations_are_named() -> None:
    with pytest.raises(ValueError, match="are exclusive"):
        parse("--ec-transfer-config", "{}", "--ec-role", "producer")
    with pytest.raises(ValueError, match="--ec-role is required"):
        parse("--ec-connector", "ECZmqConnector")
    with pytest.raises(ValueError, match="not valid JSON"):
        parse("--ec-role", "producer", "--ec-connector-extra-config", "{nope")
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse("--ec-role", "producer", "--ec-connector-extra-config", "[1]")
    ns = build_parser().parse_args(["serve", "m", "--ec-connector", "X"])
    with pytest.raises(SystemExit) as exc:
        ec_transfer_config_from(ns)
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--ec-role", "encoder"])


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_gemma3_model(tmp_path_factory.mktemp("tiny-gemma3-flags"))


def test_a_producer_gets_encode_only_settings(gemma3: Path) -> None:
    config = EngineArgs(
        model=str(gemma3),
        max_model_len=256,
        ec_transfer_config=json.dumps({"ec_connector": "ECZmqConnector", "ec_role": "producer"}),
    ).create_engine_config()
    assert is_encode_only(config)
    assert config.cache_config.enable_prefix_caching is False
    assert config.cache_config.kv_cache_memory_bytes is None
    assert scheduler_config_from(config).encode_only is True
    consumer = EngineArgs(
        model=str(gemma3),
        max_model_len=256,
        ec_transfer_config=json.dumps(
            {
                "ec_connector": "ECZmqConnector",
                "ec_role": "consumer",
                "ec_connector_extra_config": {"producer_endpoints": ["127.0.0.1:1"]},
            }
        ),
    ).create_engine_config()
    assert not is_encode_only(consumer) and not scheduler_config_from(consumer).encode_only
    assert consumer.cache_config.enable_prefix_caching is True


def test_a_consumer_starts_without_producer_endpoints(gemma3: Path) -> None:
    # vLLM 0.33: requests name their producers (ec_transfer_params), so
    # `paged serve --ec-role consumer` needs no producer list.
    parsed = build_parser().parse_args(["serve", str(gemma3), "--ec-role", "consumer"])
    config = EngineArgs(
        model=str(gemma3), max_model_len=256, ec_transfer_config=ec_transfer_config_json(parsed)
    ).create_engine_config()
    builder = config.ec_connector_factory
    assert isinstance(builder, ECConnectorBuilder)
    scheduler_side = builder.make_scheduler_ec_connector(1)
    worker_side = builder.make_worker_ec_connector(0, 1)
    try:
        assert scheduler_side.is_consumer and not scheduler_side.has_cache_item("h")
    finally:
        scheduler_side.shutdown()
        worker_side.shutdown()


def test_a_producer_refuses_a_kv_connector(gemma3: Path) -> None:
    with pytest.raises(ValueError, match=r"an encode-only producer .* has no KV cache"):
        EngineArgs(
            model=str(gemma3),
            max_model_len=256,
            ec_transfer_config=json.dumps(
                {"ec_connector": "ECZmqConnector", "ec_role": "producer"}
            ),
            kv_transfer_config=json.dumps(
                {"kv_connector": "PagedZmqConnector", "kv_role": "kv_producer"}
            ),
        ).create_engine_config()
