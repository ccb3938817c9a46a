"""MessageQueue: ordered broadcast over shared memory, ZMQ overflow, back-pressure.

Spawned readers import this module: keep its top-level imports light (no torch).
"""

from __future__ import annotations

import multiprocessing
import os

import pytest

from paged.runner.shm_broadcast import MessageQueue, QueueHandle
from paged.scheduler.boundary import SchedulerOutput


def _reader(handle: QueueHandle, rank: int, out: QueueHandle, count: int) -> None:
    queue = MessageQueue.attach(handle, writer=False, reader_rank=rank)
    back = MessageQueue.attach(out, writer=True)
    for _ in range(count):
        data = queue.dequeue(timeout=60)
        back.enqueue(len(data).to_bytes(8, "little") + data[:16] + data[-16:], timeout=60)
    queue.close()
    back.close()


def test_in_process_order_overflow_and_backpressure() -> None:
    handle = MessageQueue.make_handle(n_readers=2, n_chunks=2, chunk_bytes=64)
    writer = MessageQueue.create_writer(handle)
    readers = [MessageQueue.attach(handle, writer=False, reader_rank=r) for r in range(2)]
    try:
        writer.enqueue(b"a")
        writer.enqueue(b"b" * 200)  # larger than a chunk: goes over ZMQ
        with pytest.raises(TimeoutError):
            writer.enqueue(b"c", timeout=0.05)  # both chunks unread
        assert readers[0].dequeue(timeout=1) == b"a"
        with pytest.raises(TimeoutError):
            writer.enqueue(b"c", timeout=0.05)  # reader 1 has not read chunk 0 yet
        assert readers[1].dequeue(timeout=1) == b"a"
        writer.enqueue(b"c", timeout=1)
        for r in readers:
            assert r.dequeue(timeout=1) == b"b" * 200
            assert r.dequeue(timeout=1) == b"c"
            with pytest.raises(TimeoutError):
                r.dequeue(timeout=0.01)
        with pytest.raises(RuntimeError):
            writer.dequeue()
    finally:
        for r in readers:
            r.close()
        writer.close()
    assert not os.path.exists(f"/dev/shm/{handle.shm_name}")


def test_cross_process_many_messages() -> None:
    handle = MessageQueue.make_handle(n_readers=2, n_chunks=3, chunk_bytes=256)
    out_handles = [MessageQueue.make_handle(1, 64, 256) for _ in range(2)]  # holds every reply
    writer = MessageQueue.create_writer(handle)
    outs = [MessageQueue.create_reader(h, 0) for h in out_handles]
    ctx = multiprocessing.get_context("spawn")
    n = 40
    procs = [ctx.Process(target=_reader, args=(handle, r, out_handles[r], n)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        sent = [bytes([i % 251]) * (1 + (i * 37) % 700) for i in range(n)]
        for msg in sent:
            writer.enqueue(msg, timeout=60)
        for out in outs:
            for msg in sent:
                got = out.dequeue(timeout=60)
                assert got == len(msg).to_bytes(8, "little") + msg[:16] + msg[-16:]
    finally:
        for p in procs:
            p.join(timeout=30)
        writer.close()
        for out in outs:
            out.close()
    assert all(p.exitcode == 0 for p in procs)


def test_messages_round_trip() -> None:
    from paged.kvcache import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )
    from paged.runner.executor.messages import (
        ExecuteModel,
        GetKVCacheSpec,
        decode_call,
        decode_result,
        encode,
        encode_result,
        kv_config_from_wire,
        kv_config_to_wire,
    )

    so = SchedulerOutput(num_scheduled_tokens={"a": 3}, total_num_scheduled_tokens=3)
    call = decode_call(encode(ExecuteModel(so)))
    assert call == ExecuteModel(so)
    specs = {
        "l0": FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype="float32"),
        "m": MambaSpec(block_size=4, shapes=((2, 3),), dtypes=("float32",)),
    }
    assert decode_result(GetKVCacheSpec(), encode_result(GetKVCacheSpec(), specs)) == specs
    config = KVCacheConfig(
        num_blocks=7,
        kv_cache_tensors=[KVCacheTensor(size=10, shared_by=["l0"])],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["l0"], kv_cache_spec=specs["l0"])],
    )
    assert kv_config_from_wire(kv_config_to_wire(config)) == config
