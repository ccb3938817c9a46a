"""`KVTransferConfig`: what `--kv-transfer-config` carries (vLLM's JSON, field for field).

    paged serve MODEL --kv-transfer-config \
        '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}'

The field names and defaults are vLLM's (vllm/config/kv_transfer.py), so a
config written for vLLM parses here unchanged. Unknown fields are rejected:
a misspelt key would otherwise silently turn a feature off.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal, get_args

import msgspec

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KVLoadFailurePolicy = Literal["recompute", "fail"]

KV_ROLES: tuple[str, ...] = get_args(KVRole)
KV_LOAD_FAILURE_POLICIES: tuple[str, ...] = get_args(KVLoadFailurePolicy)


class KVTransferConfigError(ValueError):
    """A `--kv-transfer-config` that cannot be used; the message names the field."""


class KVTransferConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Configuration of the KV connector (one per engine).

    kv_connector: the registered connector name (or a class name found in
        `kv_connector_module_path`); None disables KV transfer.
    kv_role: whether this instance produces KV (saves), consumes it (loads) or both.
    engine_id: this engine's identity towards peers; a fresh uuid when not given.
    kv_load_failure_policy: "recompute" (a failed load is recomputed) or "fail"
        (the request fails with an error).
    The kv_buffer_* / kv_ip / kv_port / kv_rank / kv_parallel_size fields are
    accepted for vLLM compatibility; the connectors built so far do not use them.
    """

    kv_connector: str | None = None
    engine_id: str = msgspec.field(default_factory=lambda: str(uuid.uuid4()))
    kv_buffer_device: str = "cuda"
    kv_buffer_size: float = 1e9
    kv_role: KVRole | None = None
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_connector_extra_config: dict[str, Any] = msgspec.field(default_factory=dict)
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool = False
    kv_load_failure_policy: KVLoadFailurePolicy = "recompute"

    def __post_init__(self) -> None:
        if self.kv_connector is not None and self.kv_role is None:
            raise KVTransferConfigError(
                f"kv_role is required when kv_connector is set (one of {', '.join(KV_ROLES)})"
            )
        if self.kv_connector is not None and not self.kv_connector.strip():
            raise KVTransferConfigError("kv_connector must not be empty")

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()


def parse_kv_transfer_config(text: str | bytes) -> KVTransferConfig:
    """Parse `--kv-transfer-config` JSON; `KVTransferConfigError` with one clear message."""
    try:
        return msgspec.json.decode(text, type=KVTransferConfig)
    except KVTransferConfigError:
        raise
    except msgspec.ValidationError as exc:
        raise KVTransferConfigError(f"kv_transfer_config: {exc}") from None
    except msgspec.DecodeError as exc:
        raise KVTransferConfigError(f"kv_transfer_config is not valid JSON: {exc}") from None


def kv_transfer_config_from_dict(data: dict[str, Any]) -> KVTransferConfig:
    """Build a config from a dict (the `LLM(kv_transfer_config={...})` form)."""
    return parse_kv_transfer_config(msgspec.json.encode(data))
