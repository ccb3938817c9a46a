"""`ECTransferConfig`: what `--ec-transfer-config` carries (vLLM's JSON, field for field).

    paged serve MODEL --ec-transfer-config \
        '{"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
          "ec_connector_extra_config": {"shared_storage_path": "/tmp/ec"}}'

Field names and defaults are vLLM's (vllm/config/ec_transfer.py), so a config
written for vLLM parses here unchanged. `ec_role` also accepts the short
spellings `producer` / `consumer` / `both` (as `paged serve --ec-role` does)
and stores vLLM's. Unknown fields are rejected: a misspelt key would otherwise
silently turn a feature off.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal, get_args

import msgspec

ECRole = Literal["ec_producer", "ec_consumer", "ec_both"]
EC_ROLES: tuple[str, ...] = get_args(ECRole)
# Short spellings accepted on input; always stored as vLLM's.
EC_ROLE_ALIASES: dict[str, str] = {
    "producer": "ec_producer",
    "consumer": "ec_consumer",
    "both": "ec_both",
}
ECLoadFailurePolicy = Literal["recompute", "fail"]
EC_LOAD_FAILURE_POLICIES: tuple[str, ...] = get_args(ECLoadFailurePolicy)


class ECTransferConfigError(ValueError):
    """An `--ec-transfer-config` that cannot be used; the message names the field."""


def normalize_ec_role(role: str) -> str:
    """vLLM's spelling of `role` (`producer` -> `ec_producer`); `ECTransferConfigError` else."""
    canonical = EC_ROLE_ALIASES.get(role, role)
    if canonical not in EC_ROLES:
        accepted = ", ".join([*EC_ROLES, *EC_ROLE_ALIASES])
        raise ECTransferConfigError(f"ec_role: unsupported value {role!r} (one of {accepted})")
    return canonical


class ECTransferConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Configuration of the encoder-cache connector (one per engine).

    ec_connector: a registered connector name (or a class name found in
        `ec_connector_module_path`); None disables encoder-cache transfer.
    ec_role: `ec_producer` (saves encoder outputs), `ec_consumer` (loads them)
        or `ec_both`; required when `ec_connector` is set.
    engine_id: this engine's identity towards peers; a fresh uuid when not given.
    ec_connector_extra_config: connector-specific keys (e.g. `shared_storage_path`).
    ec_connector_module_path: module to import `ec_connector` from (dynamic loading).
    ec_load_failure_policy: paged's addition: "recompute" (a failed load is
        encoded locally, same output) or "fail" (the request fails with an error).
    The ec_buffer_* / ec_rank / ec_parallel_size / ec_ip / ec_port fields are
    accepted for vLLM compatibility; connectors read them if they need them.
    """

    ec_connector: str | None = None
    engine_id: str = msgspec.field(default_factory=lambda: str(uuid.uuid4()))
    ec_buffer_device: str | None = "cuda"
    ec_buffer_size: float = 1e9
    ec_role: str | None = None
    ec_rank: int | None = None
    ec_parallel_size: int = 1
    ec_ip: str = "127.0.0.1"
    ec_port: int = 14579
    ec_connector_extra_config: dict[str, Any] = msgspec.field(default_factory=dict)
    ec_connector_module_path: str | None = None
    ec_load_failure_policy: ECLoadFailurePolicy = "recompute"

    def __post_init__(self) -> None:
        if self.ec_role is not None:
            # Frozen struct: store the alias under vLLM's spelling once, at construction.
            msgspec.structs.force_setattr(self, "ec_role", normalize_ec_role(self.ec_role))
        if self.ec_connector is not None:
            if not self.ec_connector.strip():
                raise ECTransferConfigError("ec_connector must not be empty")
            if self.ec_role is None:
                raise ECTransferConfigError(
                    f"ec_role is required when ec_connector is set (one of {', '.join(EC_ROLES)})"
                )
        if self.ec_parallel_size < 1:
            raise ECTransferConfigError(
                f"ec_parallel_size must be >= 1, got {self.ec_parallel_size}"
            )
        if not 0 < self.ec_port < 65536:
            raise ECTransferConfigError(f"ec_port must be in 1..65535, got {self.ec_port}")

    @property
    def is_ec_transfer_instance(self) -> bool:
        return self.ec_connector is not None and self.ec_role in EC_ROLES

    @property
    def is_ec_producer(self) -> bool:
        return self.ec_connector is not None and self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_ec_consumer(self) -> bool:
        return self.ec_connector is not None and self.ec_role in ("ec_consumer", "ec_both")

    @property
    def is_encode_only(self) -> bool:
        """Encodes but runs no language model (no KV cache): a producer that is not a consumer."""
        return self.is_ec_producer and not self.is_ec_consumer

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.ec_connector_extra_config.get(key, default)

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()


def parse_ec_transfer_config(text: str | bytes) -> ECTransferConfig:
    """Parse `--ec-transfer-config` JSON; `ECTransferConfigError` with one clear message."""
    try:
        return msgspec.json.decode(text, type=ECTransferConfig)
    except ECTransferConfigError:
        raise
    except msgspec.ValidationError as exc:
        raise ECTransferConfigError(f"ec_transfer_config: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ECTransferConfigError(f"ec_transfer_config is not valid JSON: {exc}") from None


def ec_transfer_config_from_dict(data: dict[str, Any]) -> ECTransferConfig:
    """Build a config from a dict (the `LLM(ec_transfer_config={...})` form)."""
    return parse_ec_transfer_config(msgspec.json.encode(data))
