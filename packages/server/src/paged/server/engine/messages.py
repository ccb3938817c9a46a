"""The wire protocol between an engine-core process and its client (structs only).

Every ZMQ message is multipart: ``[type, payload, *buffers]``. ``type`` is one
byte from `EngineCoreRequestType` (frontend -> engine, on the ROUTER/DEALER
input pair) or `EngineCoreOutputType` (engine -> frontend, on the PUSH/PULL
output pair). ``payload`` is msgpack (see `serial.py`); ``buffers`` are the
out-of-band frames of large arrays referenced from the payload.

    frontend (ROUTER, bind)                 engine (DEALER, connect)
      <- HANDSHAKE EngineHandshake            sent once, ready or failed
      -> ADD       AddRequestMessage          an EngineCoreRequest + its large tensors
      -> ABORT     list[str]                  request ids
      -> UTILITY   UtilityCall
      -> SHUTDOWN  (empty)
    frontend (PULL, bind)                   engine (PUSH, connect)
      <- OUTPUTS        EngineCoreOutputs
      <- UTILITY_RESULT UtilityResult
      <- ENGINE_ERROR   EngineErrorMessage   the engine is exiting
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from paged.scheduler.boundary import EngineCoreRequest, SchedulerStats


class EngineCoreRequestType(enum.Enum):
    """First frame of a message on the input socket."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"
    HANDSHAKE = b"\x04"  # the only message the engine sends on the input pair


class EngineCoreOutputType(enum.Enum):
    """First frame of a message on the output socket."""

    OUTPUTS = b"\x10"
    UTILITY_RESULT = b"\x11"
    ENGINE_ERROR = b"\x12"


class EngineCoreInfo(msgspec.Struct, array_like=True, frozen=True):
    """What the engine reports once it is ready (logged by the frontend at startup)."""

    num_gpu_blocks: int
    block_size: int
    max_model_len: int
    kv_cache_memory_bytes: int
    batch_queue_size: int = 1


class EngineHandshake(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """The engine's first message: ready (with `info`) or failed (with the error)."""

    ok: bool
    pid: int
    info: EngineCoreInfo | None = None
    error_type: str | None = None
    error_message: str | None = None
    traceback: str | None = None


class TensorDataRef(msgspec.Struct, array_like=True, frozen=True):
    """`request.mm_features[feature].data[key].data` travels as its own frame.

    The i-th ref of a message names its i-th trailing frame.
    """

    feature: int
    key: str


class AddRequestMessage(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """The ADD payload: the request, with large multimodal tensors sent out of band.

    Each `TensorDataRef` marks a `TensorData` whose `data` was emptied in
    `request` and sent as a separate frame without copying.
    """

    request: EngineCoreRequest
    tensor_refs: list[TensorDataRef] = msgspec.field(default_factory=list)


class UtilityCall(msgspec.Struct, array_like=True, frozen=True):
    """A call of one of `UTILITY_RESULT_TYPES`' methods on the engine core."""

    call_id: int
    method: str
    args: list[Any]


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """The answer to `UtilityCall` `call_id`; `error` is set when the call raised.

    `result` stays raw msgpack on the wire: the client decodes it with the
    result type the method declares in `UTILITY_RESULT_TYPES`.
    """

    call_id: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    error: str | None = None
    # The call raised ValueError (bad arguments, e.g. a LoRA adapter that does not
    # load): the client raises ValueError(error) so a frontend answers 400, not 500.
    value_error: bool = False


class EngineErrorMessage(msgspec.Struct, array_like=True, frozen=True):
    """Sent by the engine when its loop crashed, just before the process exits."""

    message: str
    traceback: str


class EngineCoreStats(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Engine-level counters plus a scheduler snapshot (the `get_stats` utility)."""

    num_steps: int
    num_model_steps: int  # steps that scheduled at least one token
    num_requests_added: int
    num_requests_aborted: int
    num_gpu_blocks: int
    scheduler: SchedulerStats | None = None


# Utility methods a client may call, with the type their result decodes to.
# An allowlist, so a frontend cannot invoke arbitrary engine methods by name.
UTILITY_RESULT_TYPES: dict[str, Any] = {
    "reset_prefix_cache": bool,
    "is_healthy": bool,
    "get_stats": EngineCoreStats,
    "get_num_unfinished_requests": int,
    "get_info": EngineCoreInfo,
    "add_lora": type(None),
    "remove_lora": bool,
    "list_loras": list[str],
}


# ---- data-parallel rendezvous (engines on other nodes; see `dp_remote.py`) -------------
# On the frontend's ROUTER at --data-parallel-address:--data-parallel-rpc-port:
#   <- [EngineRegistration]   a headless node offers DP rank `dp_rank`
#   -> [EngineAssignment]     the sockets (and identity) that rank's engine connects to
# The engine then sends its `EngineHandshake` on the assigned input socket, as a local one does.


class EngineRegistration(msgspec.Struct, array_like=True, frozen=True):
    """A headless node's offer of one DP rank."""

    dp_rank: int
    host: str
    pid: int


class EngineAssignment(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """The frontend's answer: where rank's engine connects; `error` set when refused."""

    input_address: str = ""
    output_address: str = ""
    identity: bytes = b""
    error: str | None = None
