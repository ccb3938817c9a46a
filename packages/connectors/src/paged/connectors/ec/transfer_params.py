"""`ec_transfer_params`: where an EPD producer holds each item's encoder output (vLLM 0.33).

The JSON is vLLM 0.33.0's, an object keyed by mm hash (the item's identifier):

    response of the encoder (producer):
        "ec_transfer_params": {"<mm_hash>": {"modality": "image", "item_indices": [0],
                                             "metadata": {}, "peer_host": "10.0.0.5",
                                             "peer_port": 5700}, ...}
    request to the consumer (the proxy copies the encoder's entries in):
        "ec_transfer_params": {"<mm_hash>": {... "peer_host": ..., "peer_port": ...}}

(vllm/distributed/ec_transfer/ec_connector/utils.py:56 builds the per-item
entries, cpu/scheduler/__init__.py:601 adds peer_host/peer_port for the items it
holds, examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py:1000
merges them into the consumer's body.) An entry without `peer_host` names no
producer: the consumer encodes that item itself. Values that are not objects
are other keys a router may add (vLLM's proxy adds `ec_items`, a list) and are
kept as sent. The consumer never trusts an address it cannot reach: a fetch
that fails falls back to local encoding (`ec_load_failure_policy`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class ECTransferParamsError(ValueError):
    """A request's `ec_transfer_params` that cannot be used; the message names the key."""


def validate_ec_transfer_params(raw: object) -> dict[str, Any] | None:
    """A client's `ec_transfer_params`, checked; `ECTransferParamsError` if malformed.

    Only what the consumer would act on is checked strictly: an entry that
    names a producer must give a non-empty `peer_host` string and a
    `peer_port` integer in 1..65535. Every other key and value is kept as sent
    (the dict is open, as vLLM's).
    """
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ECTransferParamsError(
            "ec_transfer_params is invalid: expected an object keyed by mm hash"
        )
    for key, entry in raw.items():
        if not isinstance(entry, dict) or ("peer_host" not in entry and "peer_port" not in entry):
            continue
        host = entry.get("peer_host")
        port = entry.get("peer_port")
        if not isinstance(host, str) or not host.strip():
            raise ECTransferParamsError(
                f"ec_transfer_params[{key!r}].peer_host is invalid: expected a non-empty "
                f"string, got {host!r}"
            )
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise ECTransferParamsError(
                f"ec_transfer_params[{key!r}].peer_port is invalid: expected an integer "
                f"in 1..65535, got {port!r}"
            )
    return dict(raw)


def zmq_address(host: str, port: int) -> str:
    """The ZMQ tcp:// address of `host:port` (an IPv6 host in brackets)."""
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{shown}:{port}"


def announced_endpoint(params: Mapping[str, Any] | None, mm_hash: str) -> str | None:
    """The producer address `params` give for `mm_hash`, or None if they name none.

    Tolerant on purpose (this runs in the scheduler on whatever reached it):
    an entry that is not well formed names no producer.
    """
    entry = (params or {}).get(mm_hash)
    if not isinstance(entry, dict):
        return None
    host = entry.get("peer_host")
    port = entry.get("peer_port")
    if not isinstance(host, str) or not host or isinstance(port, bool):
        return None
    if not isinstance(port, int) or not 0 < port < 65536:
        return None
    return zmq_address(host, port)


def producer_entries(
    features: Sequence[tuple[str, str]], host: str, port: int
) -> dict[str, dict[str, Any]]:
    """A producer's response params for its items, given as (mm hash, modality) in order.

    One entry per distinct hash (vLLM's shape: `item_indices` lists every
    position the hash occurs at; `metadata` is empty: the consumer runs its
    own processor on the media, which the request still carries).
    """
    entries: dict[str, dict[str, Any]] = {}
    for index, (mm_hash, modality) in enumerate(features):
        entry = entries.get(mm_hash)
        if entry is None:
            entry = {
                "modality": modality,
                "item_indices": [],
                "metadata": {},
                "peer_host": host,
                "peer_port": port,
            }
            entries[mm_hash] = entry
        entry["item_indices"].append(index)
    return entries
