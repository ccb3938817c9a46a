"""KVTransferConfig: vLLM's JSON parses as is; bad values stop with a message naming the field."""

from __future__ import annotations

import uuid

import pytest

from paged.connectors.kv import (
    KVTransferConfig,
    KVTransferConfigError,
    kv_transfer_config_from_dict,
    parse_kv_transfer_config,
)

# As written in vLLM's docs and examples (every field vLLM defines).
VLLM_JSON = """{
  "kv_connector": "SharedStorageConnector",
  "kv_role": "kv_both",
  "engine_id": "engine-7",
  "kv_buffer_device": "cuda",
  "kv_buffer_size": 1e9,
  "kv_rank": 0,
  "kv_parallel_size": 2,
  "kv_ip": "10.0.0.1",
  "kv_port": 14579,
  "kv_connector_extra_config": {"shared_storage_path": "local_storage"},
  "kv_connector_module_path": null,
  "enable_permute_local_kv": false,
  "kv_load_failure_policy": "fail"
}"""


def test_vllm_json_is_accepted_field_for_field() -> None:
    cfg = parse_kv_transfer_config(VLLM_JSON)
    assert cfg.kv_connector == "SharedStorageConnector"
    assert cfg.kv_role == "kv_both"
    assert cfg.engine_id == "engine-7"
    assert cfg.kv_parallel_size == 2 and cfg.kv_ip == "10.0.0.1"
    assert cfg.get_from_extra_config("shared_storage_path", "/tmp") == "local_storage"
    assert cfg.get_from_extra_config("missing", 3) == 3
    assert cfg.kv_load_failure_policy == "fail"
    assert cfg.is_kv_producer and cfg.is_kv_consumer


def test_defaults_follow_vllm() -> None:
    cfg = parse_kv_transfer_config(
        '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer"}'
    )
    assert cfg.kv_load_failure_policy == "recompute"
    assert cfg.kv_connector_extra_config == {}
    assert cfg.kv_port == 14579
    uuid.UUID(cfg.engine_id)  # a fresh uuid
    assert cfg.is_kv_consumer and not cfg.is_kv_producer
    assert parse_kv_transfer_config(cfg.to_json()).engine_id == cfg.engine_id


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"kv_connector": "X"}', "kv_role is required"),
        ('{"kv_connector": "X", "kv_role": "kv_sender"}', r"\$\.kv_role"),
        ('{"kv_connector": "X", "kv_role": "kv_both", "kv_port": "80"}', r"\$\.kv_port"),
        ('{"kv_connector": "X", "kv_role": "kv_both", "kv_conector": 1}', "kv_conector"),
        (
            '{"kv_connector": "X", "kv_role": "kv_both", "kv_load_failure_policy": "retry"}',
            "kv_load_failure_policy",
        ),
        ('{"kv_connector": "", "kv_role": "kv_both"}', "kv_connector must not be empty"),
        ('{"kv_connector": "X", ', "not valid JSON"),
        ("[1, 2]", "kv_transfer_config"),
    ],
)
def test_bad_values_are_rejected_with_the_field_named(text: str, message: str) -> None:
    with pytest.raises(KVTransferConfigError, match=message):
        parse_kv_transfer_config(text)


def test_config_errors_are_value_errors() -> None:
    # The CLI reports ValueErrors as one line instead of a traceback.
    assert issubclass(KVTransferConfigError, ValueError)


def test_from_dict_validates_like_json() -> None:
    cfg = kv_transfer_config_from_dict({"kv_connector": "MultiConnector", "kv_role": "kv_both"})
    assert isinstance(cfg, KVTransferConfig)
    with pytest.raises(KVTransferConfigError, match="kv_role"):
        kv_transfer_config_from_dict({"kv_connector": "MultiConnector"})
