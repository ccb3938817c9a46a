"""The LoRA adapter's path reaches the block hasher, and the wire stays backward-compatible."""

from __future__ import annotations

import msgspec

from paged.kvcache import KVCacheRequest
from paged.kvcache.hashing import get_request_block_hasher, init_none_hash, sha256
from paged.scheduler.boundary import EngineCoreRequest
from paged.scheduler.request import Request
from paged.scheduler.sampling_params import SamplingParams


def core_request(**kw: object) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id="r",
        prompt_token_ids=list(range(8)),
        sampling_params=SamplingParams(),
        eos_token_id=None,
        arrival_time=0.0,
        **kw,  # type: ignore[arg-type]
    )


def to_request(core: EngineCoreRequest) -> Request:
    hasher = get_request_block_hasher(4, sha256)
    return Request.from_engine_core_request(core, max_model_len=64, block_hasher=hasher)


def test_lora_path_enters_the_request_and_its_block_hashes() -> None:
    init_none_hash(sha256, seed=0)
    v1 = to_request(core_request(lora_request="ad", lora_path="/w/v1"))
    v2 = to_request(core_request(lora_request="ad", lora_path="/w/v2"))
    assert (v1.lora_name, v1.lora_path) == ("ad", "/w/v1")
    assert v1.block_hashes[0] != v2.block_hashes[0]
    # A path without an adapter is no adapter: nothing to key.
    assert to_request(core_request(lora_path="/w/v1")).lora_path is None
    view: KVCacheRequest = v1  # the scheduler's Request satisfies the protocol
    assert view.lora_path == "/w/v1"


def test_message_without_lora_path_still_decodes() -> None:
    """An array_like struct from a sender that predates the trailing field."""
    new = core_request(lora_request="ad", lora_path="/w", priority=1)
    fields = msgspec.msgpack.decode(msgspec.msgpack.encode(new))
    # lora_path, then ec_transfer_params and pooling_params (added after it)
    assert fields[-3:] == ["/w", None, None]
    old_wire = msgspec.msgpack.encode(fields[:-3])
    decoded = msgspec.msgpack.decode(old_wire, type=EngineCoreRequest)
    assert decoded.lora_request == "ad" and decoded.lora_path is None and decoded.priority == 1
    # A sender that predates ec_transfer_params only.
    before_ec = msgspec.msgpack.decode(msgspec.msgpack.encode(fields[:-2]), type=EngineCoreRequest)
    assert before_ec == new
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=EngineCoreRequest) == new
