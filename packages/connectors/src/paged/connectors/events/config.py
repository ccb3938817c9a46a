"""`KVEventsConfig`: vLLM's `--kv-events-config` JSON, field for field.

Fields, defaults and the publisher rule are vLLM's (`vllm/config/kv_events.py`):
`publisher` left out means "zmq" when events are enabled, else "null". The
JSON is checked where it enters: an unknown field, a wrong type or an
out-of-range number raises `KVEventsConfigError` naming the field, so a typo
stops start-up instead of silently publishing nothing.

One field is paged's own: `wire_format` ("vllm", the default, is vLLM
0.33.0's layout; "map" is paged's earlier default, the batch as a map;
"array" is the positional layout of vLLM 0.2x and before; see
`paged.connectors.events.codec`). vLLM does not know the field, so a config
meant for both leaves it out.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PublisherKind = Literal["null", "zmq"]
PUBLISHER_KINDS: tuple[PublisherKind, ...] = ("null", "zmq")

# "vllm": vLLM 0.33.0's structs (batch an array, events maps tagged by "type").
# "map": paged's earlier default (batch a map, events as in "vllm").
# "array": vLLM 0.2x's `array_like=True` structs (msgpack arrays, by position).
WireFormat = Literal["vllm", "map", "array"]
WIRE_FORMATS: tuple[WireFormat, ...] = ("vllm", "map", "array")


class KVEventsConfigError(ValueError):
    """The `--kv-events-config` JSON is malformed or names an impossible setting."""


class KVEventsConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Where and how KV cache events are published (vLLM's `KVEventsConfig`).

    `enable_kv_cache_events` makes the KV cache manager record events at all;
    `publisher` picks who sends them ("zmq": a PUB socket on `endpoint`, with
    a ROUTER on `replay_endpoint` answering replay requests from a ring of the
    last `buffer_steps` batches; "null": recorded and dropped). `hwm` is the
    PUB socket's high-water mark (messages queued per subscriber before ZMQ
    drops for that subscriber); `max_queue_size` bounds the batches waiting
    for the publisher thread. `topic` is the first frame of every message.
    `wire_format` (paged only, not a vLLM field) picks the msgpack layout of
    the batches: "vllm" (vLLM 0.33.0), "map" (paged's earlier default) or
    "array" (vLLM 0.2x and before).
    """

    enable_kv_cache_events: bool = False
    publisher: PublisherKind | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    wire_format: WireFormat = "vllm"

    def __post_init__(self) -> None:
        if self.publisher is None:
            # vLLM's rule; the struct is frozen, hence force_setattr.
            kind: PublisherKind = "zmq" if self.enable_kv_cache_events else "null"
            msgspec.structs.force_setattr(self, "publisher", kind)
        _check_range("buffer_steps", self.buffer_steps, 1)
        _check_range("hwm", self.hwm, 0)
        _check_range("max_queue_size", self.max_queue_size, 1)
        if self.wire_format not in WIRE_FORMATS:
            # The JSON path is caught by the Literal already; this is for code
            # building the struct directly, which msgspec does not validate.
            raise KVEventsConfigError(
                f"wire_format must be one of {', '.join(map(repr, WIRE_FORMATS))}, "
                f"got {self.wire_format!r}"
            )
        if self.publisher == "zmq":
            for name in ("endpoint", "replay_endpoint"):
                value = getattr(self, name)
                if value is not None and "://" not in value:
                    raise KVEventsConfigError(
                        f"{name} must be a ZMQ address like tcp://*:5557 or ipc:///tmp/kv, "
                        f"got {value!r}"
                    )

    @property
    def publishes(self) -> bool:
        """Whether events are recorded and sent anywhere (enabled and not "null")."""
        return self.enable_kv_cache_events and self.publisher != "null"


def _check_range(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise KVEventsConfigError(f"{name} must be >= {minimum}, got {value}")


def parse_kv_events_config(text: str | bytes) -> KVEventsConfig:
    """The config in `text` (a JSON object), or `KVEventsConfigError` saying what is wrong."""
    try:
        return msgspec.json.decode(text, type=KVEventsConfig)
    except msgspec.ValidationError as e:
        # msgspec names the field: "Expected `int`, got `str` - at `$.hwm`".
        raise KVEventsConfigError(f"invalid KV events config: {e}") from None
    except msgspec.DecodeError as e:
        raise KVEventsConfigError(f"KV events config is not valid JSON: {e}") from None
