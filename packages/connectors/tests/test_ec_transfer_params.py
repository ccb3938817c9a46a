"""`ec_transfer_params` (vLLM 0.33's shape): checking a client's, reading a producer's."""

from __future__ import annotations

import pytest

from paged.connectors.ec.transfer_params import (
    ECTransferParamsError,
    announced_endpoint,
    producer_entries,
    validate_ec_transfer_params,
)


def test_valid_params_are_kept_as_sent() -> None:
    params = {
        "h1": {
            "modality": "image",
            "item_indices": [0],
            "metadata": {},
            "peer_host": "enc",
            "peer_port": 5700,
            "size_bytes": 4096,
        },
        "h2": {"modality": "image", "metadata": {}},  # names no producer: encoded locally
        "ec_items": [{"mm_hash": "h1", "transfer_id": "t"}],  # vLLM's proxy adds this
    }
    assert validate_ec_transfer_params(params) == params
    assert validate_ec_transfer_params(None) is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([1, 2], "expected an object keyed by mm hash"),
        ("h1", "expected an object keyed by mm hash"),
        ({"h1": {"peer_host": "enc"}}, r"\['h1'\]\.peer_port is invalid"),
        ({"h1": {"peer_host": "enc", "peer_port": 0}}, r"\['h1'\]\.peer_port is invalid"),
        ({"h1": {"peer_host": "enc", "peer_port": "5700"}}, "peer_port is invalid"),
        ({"h1": {"peer_host": "enc", "peer_port": True}}, "peer_port is invalid"),
        ({"h1": {"peer_host": "", "peer_port": 5700}}, r"\['h1'\]\.peer_host is invalid"),
        ({"h1": {"peer_port": 5700}}, "peer_host is invalid"),
    ],
)
def test_malformed_params_name_the_key(raw: object, message: str) -> None:
    with pytest.raises(ECTransferParamsError, match=message):
        validate_ec_transfer_params(raw)


def test_announced_endpoint_reads_only_well_formed_entries() -> None:
    params = {
        "v4": {"peer_host": "10.0.0.1", "peer_port": 5700},
        "v6": {"peer_host": "fe80::1", "peer_port": 5701},
        "bad": {"peer_host": "x", "peer_port": 70000},
        "none": {"modality": "image"},
        "ec_items": [],
    }
    assert announced_endpoint(params, "v4") == "tcp://10.0.0.1:5700"
    assert announced_endpoint(params, "v6") == "tcp://[fe80::1]:5701"
    for key in ("bad", "none", "ec_items", "absent"):
        assert announced_endpoint(params, key) is None
    assert announced_endpoint(None, "v4") is None


def test_producer_entries_group_repeated_hashes() -> None:
    entries = producer_entries([("a", "image"), ("b", "image"), ("a", "image")], "enc", 5700)
    assert entries == {
        "a": {"modality": "image", "item_indices": [0, 2], "metadata": {},
              "peer_host": "enc", "peer_port": 5700},
        "b": {"modality": "image", "item_indices": [1], "metadata": {},
              "peer_host": "enc", "peer_port": 5700},
    }  # fmt: skip
    # What a producer answers, a consumer's check accepts and reads back.
    assert validate_ec_transfer_params(entries) == entries
    assert announced_endpoint(entries, "a") == "tcp://enc:5700"
