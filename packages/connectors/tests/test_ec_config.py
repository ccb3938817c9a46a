"""ECTransferConfig: vLLM's fields and spellings, role aliases, errors naming the field."""

from __future__ import annotations

import pytest

from paged.connectors.ec import (
    ECTransferConfig,
    ECTransferConfigError,
    ec_transfer_config_from_dict,
    parse_ec_transfer_config,
)


def test_vllm_json_parses_unchanged() -> None:
    config = parse_ec_transfer_config(
        '{"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer", "ec_port": 15000,'
        ' "ec_connector_extra_config": {"shared_storage_path": "/tmp/ec"}}'
    )
    assert config.ec_role == "ec_consumer"
    assert config.is_ec_consumer and not config.is_ec_producer
    assert not config.is_encode_only
    assert config.get_from_extra_config("shared_storage_path", None) == "/tmp/ec"
    assert config.ec_port == 15000
    assert config.ec_load_failure_policy == "recompute"
    assert config.engine_id  # a fresh uuid when not given
    # A round trip keeps everything (the server ships it to other processes as JSON).
    assert parse_ec_transfer_config(config.to_json()) == config


@pytest.mark.parametrize(
    ("role", "canonical", "producer", "consumer"),
    [
        ("producer", "ec_producer", True, False),
        ("consumer", "ec_consumer", False, True),
        ("both", "ec_both", True, True),
        ("ec_producer", "ec_producer", True, False),
        ("ec_both", "ec_both", True, True),
    ],
)
def test_role_aliases_are_stored_in_vllm_spelling(
    role: str, canonical: str, producer: bool, consumer: bool
) -> None:
    config = ec_transfer_config_from_dict({"ec_connector": "X", "ec_role": role})
    assert config.ec_role == canonical
    assert (config.is_ec_producer, config.is_ec_consumer) == (producer, consumer)
    assert config.is_encode_only == (producer and not consumer)


def test_no_connector_is_no_transfer_instance() -> None:
    config = ECTransferConfig()
    assert not config.is_ec_transfer_instance
    assert not config.is_ec_producer and not config.is_ec_consumer


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"ec_connector": "X"}, "ec_role"),
        ({"ec_connector": "X", "ec_role": "encoder"}, "ec_role"),
        ({"ec_connector": " ", "ec_role": "both"}, "ec_connector"),
        ({"ec_connector": "X", "ec_role": "both", "ec_port": 0}, "ec_port"),
        ({"ec_connector": "X", "ec_role": "both", "ec_parallel_size": 0}, "ec_parallel_size"),
        ({"ec_connector": "X", "ec_role": "both", "ec_conector_extra": {}}, "ec_conector_extra"),
        ({"ec_connector": "X", "ec_role": "both", "ec_port": "x"}, "ec_port"),
        (
            {"ec_connector": "X", "ec_role": "both", "ec_load_failure_policy": "retry"},
            "ec_load_failure_policy",
        ),
    ],
)
def test_bad_values_name_the_field(data: dict[str, object], field: str) -> None:
    with pytest.raises(ECTransferConfigError, match=field):
        ec_transfer_config_from_dict(data)


def test_bad_json_is_a_config_error() -> None:
    with pytest.raises(ECTransferConfigError, match="not valid JSON"):
        parse_ec_transfer_config("{ec_connector:")
    assert issubclass(ECTransferConfigError, ValueError)
