"""The `ECZmqConnector`'s `ec_connector_extra_config` keys.

Producer (ec_producer / ec_both):
    listen_host          address its worker serves outputs on ("127.0.0.1")
    listen_port          port of that ROUTER socket (5700)
    advertise_host       the host a consumer should dial, announced in the response's
                         ec_transfer_params as peer_host (default: listen_host; the
                         machine's host name when listen_host is a wildcard)
    hold_timeout         seconds an output nobody fetched is kept before it is freed (120)

Consumer (ec_consumer / ec_both):
    producer_endpoints   optional: "host:port" (or "tcp://host:port") producers asked for
                         an item the request's ec_transfer_params name no producer for.
                         Without it (vLLM 0.33's way) a consumer fetches only from the
                         producer each request announces and encodes the other items
    transfer_timeout     seconds to wait for a producer's reply before it counts as dead (5)

What a consumer does with an item no producer delivered is the transfer
config's `ec_load_failure_policy` ("recompute": encode it locally, the same
output; "fail": finish its requests with an error). Unknown keys are an error
naming the key.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_KNOWN = frozenset(
    {
        "listen_host",
        "listen_port",
        "advertise_host",
        "hold_timeout",
        "producer_endpoints",
        "transfer_timeout",
    }
)


# Bind-all addresses: no consumer can dial them, so another host is announced.
_WILDCARDS = frozenset({"0.0.0.0", "*", "::", "[::]", ""})


def _endpoint(raw: str) -> str:
    text = raw.strip()
    if text.startswith(("tcp://", "ipc://", "inproc://")):
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"ec_connector_extra_config.producer_endpoints: {raw!r} is not host:port "
            "or a tcp:// address"
        )
    return f"tcp://{host}:{port}"


@dataclass(frozen=True)
class ECZmqConfig:
    listen_host: str = "127.0.0.1"
    listen_port: int = 5700
    hold_timeout: float = 120.0
    producer_endpoints: tuple[str, ...] = ()
    transfer_timeout: float = 5.0
    advertise_host: str | None = None

    def __post_init__(self) -> None:
        # Frozen: normalise "host:port" to a ZMQ address once, here.
        object.__setattr__(
            self, "producer_endpoints", tuple(_endpoint(e) for e in self.producer_endpoints)
        )
        if not 0 < self.listen_port < 65536:
            raise ValueError(
                f"ec_connector_extra_config.listen_port must be in 1..65535, got {self.listen_port}"
            )
        for name in ("hold_timeout", "transfer_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"ec_connector_extra_config.{name} must be positive seconds, "
                    f"got {getattr(self, name)}"
                )

    @property
    def peer_host(self) -> str:
        """The host this producer announces as `peer_host` (see `advertise_host`)."""
        if self.advertise_host:
            return self.advertise_host
        if self.listen_host in _WILDCARDS:
            return socket.gethostname()
        return self.listen_host

    @property
    def listen_endpoint(self) -> str:
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        return f"tcp://{host}:{self.listen_port}"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> ECZmqConfig:
        """Parse the extra config; `ValueError` naming the key on a bad or unknown one."""
        unknown = sorted(k for k in extra if k not in _KNOWN)
        if unknown:
            raise ValueError(
                f"ec_connector_extra_config: unknown key {unknown[0]!r} for ECZmqConnector "
                f"(known: {', '.join(sorted(_KNOWN))})"
            )
        defaults = cls()

        def pick(key: str, kind: type) -> Any:
            raw = extra.get(key)
            if raw is None:
                return getattr(defaults, key)
            if kind in (int, float) and isinstance(raw, bool):
                raise ValueError(f"ec_connector_extra_config.{key}: expected a number, got {raw!r}")
            try:
                return kind(raw)
            except (TypeError, ValueError):
                raise ValueError(
                    f"ec_connector_extra_config.{key}: expected {kind.__name__}, got {raw!r}"
                ) from None

        endpoints_raw = extra.get("producer_endpoints", ())
        if isinstance(endpoints_raw, str):
            endpoints_raw = [endpoints_raw]
        if not isinstance(endpoints_raw, Sequence) or not all(
            isinstance(e, str) for e in endpoints_raw
        ):
            raise ValueError(
                "ec_connector_extra_config.producer_endpoints: expected a list of "
                f"'host:port' strings, got {endpoints_raw!r}"
            )
        return cls(
            listen_host=pick("listen_host", str),
            listen_port=pick("listen_port", int),
            hold_timeout=pick("hold_timeout", float),
            producer_endpoints=tuple(endpoints_raw),
            transfer_timeout=pick("transfer_timeout", float),
            advertise_host=pick("advertise_host", str),
        )
