"""The `PagedZmqConnector`'s `kv_connector_extra_config` keys.

    side_channel_host        where the prefill engine's workers listen, and what it
                             tells decoders (vLLM: VLLM_NIXL_SIDE_CHANNEL_HOST, "localhost")
    side_channel_port        base port; TP rank r listens on port + r
                             (vLLM: VLLM_NIXL_SIDE_CHANNEL_PORT, 5600)
    abort_request_timeout    seconds a prefill keeps a finished request's blocks for a
                             decoder that never pulls them (vLLM:
                             VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480)
    transfer_timeout         seconds a decoder waits for any reply from a prefill
                             (handshake or blocks) before the load fails (5)
    use_ipc                  also listen on an IPC socket, which decoders on the same
                             host use instead of TCP (true)
    ipc_dir                  directory of the IPC sockets (the system temp dir)
    use_layerwise            decoder: copy pulled blocks into the cache layer by layer
                             during the next forward instead of all at once between
                             steps (false; LMCache's name; docs/layerwise.md)

A key missing from the extra config falls back to vLLM's environment
variable of the same meaning, then to vLLM's default, so a deployment
written for NixlConnector keeps its ports.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_KNOWN = frozenset(
    {
        "side_channel_host",
        "side_channel_port",
        "abort_request_timeout",
        "transfer_timeout",
        "use_ipc",
        "ipc_dir",
        "use_layerwise",
    }
)


@dataclass(frozen=True)
class ZmqConnectorConfig:
    side_channel_host: str = "localhost"
    side_channel_port: int = 5600
    abort_request_timeout: float = 480.0
    transfer_timeout: float = 5.0
    use_ipc: bool = True
    ipc_dir: str = tempfile.gettempdir()
    use_layerwise: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.side_channel_port < 65536:
            raise ValueError(
                f"kv_connector_extra_config.side_channel_port must be in 1..65535, "
                f"got {self.side_channel_port}"
            )
        for name in ("abort_request_timeout", "transfer_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"kv_connector_extra_config.{name} must be positive seconds, "
                    f"got {getattr(self, name)}"
                )

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> ZmqConnectorConfig:
        """Parse the extra config; `ValueError` naming the key on a bad or unknown one."""
        env = os.environ if environ is None else environ
        # Keys of other connectors may share the dict (MultiConnector passes its own).
        unknown = sorted(k for k in extra if k.startswith("side_channel_") and k not in _KNOWN)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key {unknown[0]!r}")

        def pick(key: str, env_key: str | None, default: Any, kind: type) -> Any:
            raw = extra.get(key)
            if raw is None and env_key is not None:
                raw = env.get(env_key)
            if raw is None:
                return default
            try:
                if kind is bool and isinstance(raw, str):
                    return raw.strip().lower() in ("1", "true", "yes")
                return kind(raw)
            except (TypeError, ValueError):
                raise ValueError(
                    f"kv_connector_extra_config.{key}: expected {kind.__name__}, got {raw!r}"
                ) from None

        defaults = cls()
        return cls(
            side_channel_host=pick(
                "side_channel_host", "VLLM_NIXL_SIDE_CHANNEL_HOST", defaults.side_channel_host, str
            ),
            side_channel_port=pick(
                "side_channel_port", "VLLM_NIXL_SIDE_CHANNEL_PORT", defaults.side_channel_port, int
            ),
            abort_request_timeout=pick(
                "abort_request_timeout",
                "VLLM_NIXL_ABORT_REQUEST_TIMEOUT",
                defaults.abort_request_timeout,
                float,
            ),
            transfer_timeout=pick("transfer_timeout", None, defaults.transfer_timeout, float),
            use_ipc=pick("use_ipc", None, defaults.use_ipc, bool),
            ipc_dir=pick("ipc_dir", None, defaults.ipc_dir, str),
            use_layerwise=pick("use_layerwise", None, defaults.use_layerwise, bool),
        )

    def tcp_endpoint(self, host: str, port: int, rank: int) -> str:
        return f"tcp://{_bracket(host)}:{port + rank}"

    def ipc_endpoint(self, port: int, rank: int) -> str:
        return f"ipc://{os.path.join(self.ipc_dir, f'paged-kv-{port + rank}.sock')}"

    def ipc_path(self, port: int, rank: int) -> str:
        return self.ipc_endpoint(port, rank)[len("ipc://") :]


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0"})
