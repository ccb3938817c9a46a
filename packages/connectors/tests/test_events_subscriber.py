"""`KVEventSubscriber` hands out every batch once, in order, filling gaps by replay;
`CachedBlockIndex` rebuilds the cached blocks from events."""

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from paged.connectors.events import (
    CachedBlockIndex,
    KVEventDecodeError,
    KVEventsConfig,
    KVEventSubscriber,
    ZmqEventPublisher,
    make_batch,
)
from paged.kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

pytestmark = pytest.mark.timeout(60)


def _h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _stored(*hashes: int, group: int = 0, medium: str = "GPU") -> BlockStored:
    return BlockStored(
        block_hashes=[_h(i) for i in hashes],  # type: ignore[misc]
        parent_block_hash=None,
        token_ids=[0] * 4 * len(hashes),
        block_size=4,
        medium=medium,
        group_idx=group,
    )


def _removed(*hashes: int, group: int = 0) -> BlockRemoved:
    return BlockRemoved(block_hashes=[_h(i) for i in hashes], group_idx=group)  # type: ignore[misc]


def test_index_counts_copies_groups_and_clears() -> None:
    index = CachedBlockIndex()
    index.apply(make_batch([_stored(1, 2), _stored(2), _stored(2, group=1)], ts=0))
    assert index.hashes() == Counter({(0, 1): 1, (0, 2): 2, (1, 2): 1})
    index.apply(make_batch([_removed(2), _removed(1)], ts=0))
    assert index.hashes() == Counter({(0, 2): 1, (1, 2): 1})
    index.apply(make_batch([_removed(7)], ts=0))
    assert index.num_unknown_removals == 1
    index.apply(make_batch([_stored(9, medium="CPU")], ts=0))
    assert index.hashes("CPU") == Counter({(0, 9): 1})
    index.apply(make_batch([AllBlocksCleared(), _stored(3)], ts=0))
    # A device reset: the device's blocks go, the offload tier keeps its own.
    assert index.hashes() == Counter({(0, 3): 1})
    assert index.hashes("CPU") == Counter({(0, 9): 1})


@pytest.fixture
def publisher(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[ZmqEventPublisher, KVEventsConfig]]:
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        buffer_steps=50,
        wire_format=getattr(request, "param", "vllm"),
    )
    pub = ZmqEventPublisher(cfg)
    yield pub, cfg
    pub.shutdown()


def _batch(i: int) -> list[KVCacheEvent]:
    return [_stored(i)]


def _wait_replayable(pub: ZmqEventPublisher, cfg: KVEventsConfig, n: int) -> None:
    """Until the publisher thread has sent (and buffered) `n` batches."""
    assert cfg.replay_endpoint is not None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with KVEventSubscriber(
            cfg.endpoint, cfg.replay_endpoint, wire_format=cfg.wire_format
        ) as probe:
            if len(probe.catch_up()) >= n:
                return
        time.sleep(0.05)
    raise AssertionError("publisher did not send in time")


def test_late_joiner_gets_everything_in_order_through_replay(
    publisher: tuple[ZmqEventPublisher, KVEventsConfig],
) -> None:
    pub, cfg = publisher
    for i in range(5):
        pub.publish(_batch(i))
    _wait_replayable(pub, cfg, 5)
    index = CachedBlockIndex()
    seqs: list[int] = []
    with KVEventSubscriber(cfg.endpoint, cfg.replay_endpoint) as sub:
        # The live stream shows seq >= 5 first: the gap 0..4 comes by replay.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (not seqs or seqs[-1] < 5):
            pub.publish(_batch(pub.next_seq))
            for seq, batch in sub.poll(100):
                seqs.append(seq)
                index.apply(batch)
        assert seqs == list(range(len(seqs))) and len(seqs) >= 6
        assert sub.num_lost == 0
    assert index.hashes() == Counter({(0, external): 1 for external in range(len(seqs))})


@pytest.mark.parametrize("publisher", ["vllm", "map", "array"], indirect=True)
def test_catch_up_then_live_without_duplicates(
    publisher: tuple[ZmqEventPublisher, KVEventsConfig],
) -> None:
    pub, cfg = publisher
    for i in range(3):
        pub.publish(_batch(i))
    _wait_replayable(pub, cfg, 3)
    with KVEventSubscriber(cfg.endpoint, cfg.replay_endpoint, wire_format=cfg.wire_format) as sub:
        got = [seq for seq, _ in sub.catch_up()]
        assert got == [0, 1, 2] and sub.next_seq == 3
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sub.next_seq < 6:
            pub.publish(_batch(pub.next_seq))
            got += [seq for seq, _ in sub.poll(100)]
        assert got == list(range(len(got))) and len(got) >= 6


@pytest.mark.parametrize("publisher", ["map", "array"], indirect=True)
def test_subscriber_of_the_other_layout_says_so(
    publisher: tuple[ZmqEventPublisher, KVEventsConfig],
) -> None:
    pub, cfg = publisher
    pub.publish(_batch(0))
    _wait_replayable(pub, cfg, 1)
    with KVEventSubscriber(cfg.endpoint, cfg.replay_endpoint) as sub:  # "vllm"
        with pytest.raises(KVEventDecodeError, match="batch 0 is not a batch in the 'vllm'"):
            sub.catch_up()
        assert sub.next_seq == 0  # the batch was not handed out


def test_array_subscriber_rebuilds_the_same_index(
    publisher: tuple[ZmqEventPublisher, KVEventsConfig], tmp_path: Path
) -> None:
    """Same events through both layouts: the subscriber hands out equal batches."""
    map_pub, map_cfg = publisher
    array_cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/pub-array",
        replay_endpoint=f"ipc://{tmp_path}/replay-array",
        wire_format="array",
    )
    array_pub = ZmqEventPublisher(array_cfg)
    try:
        events: list[KVCacheEvent] = [
            _stored(1, 2),
            _removed(1),
            AllBlocksCleared(),
            _stored(3, group=1),
        ]
        for pub, cfg in ((map_pub, map_cfg), (array_pub, array_cfg)):
            pub.publish(events)
            _wait_replayable(pub, cfg, 1)
        got = []
        for cfg in (map_cfg, array_cfg):
            with KVEventSubscriber(
                cfg.endpoint, cfg.replay_endpoint, wire_format=cfg.wire_format
            ) as sub:
                ((_, batch),) = sub.catch_up()
                got.append(batch)
        assert got[0].events == got[1].events
        assert [type(e).__name__ for e in got[1].events] == [
            "BlockStored",
            "BlockRemoved",
            "AllBlocksCleared",
            "BlockStored",
        ]
    finally:
        array_pub.shutdown()


def test_batches_gone_from_the_ring_are_counted_lost(tmp_path: Path) -> None:
    cfg = KVEventsConfig(
        enable_kv_cache_events=True,
        endpoint=f"ipc://{tmp_path}/pub",
        replay_endpoint=f"ipc://{tmp_path}/replay",
        buffer_steps=2,
    )
    pub = ZmqEventPublisher(cfg)
    try:
        for i in range(6):
            pub.publish(_batch(i))
        # First wait until the publisher has sent all six (its thread sends them
        # asynchronously): a subscriber connected meanwhile would get some live.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with KVEventSubscriber(cfg.endpoint, cfg.replay_endpoint) as sub:
                got = sub.catch_up()
                if got and got[-1][0] == 5:
                    break
            time.sleep(0.05)
        else:
            raise AssertionError("never caught up")
        # A subscriber joining now gets only what the ring of 2 still holds.
        with KVEventSubscriber(cfg.endpoint, cfg.replay_endpoint) as sub:
            got = sub.catch_up()
            assert [s for s, _ in got] == [4, 5] and sub.num_lost == 4
    finally:
        pub.shutdown()


def test_no_publisher_means_empty_polls_not_a_hang(tmp_path: Path) -> None:
    with KVEventSubscriber(f"ipc://{tmp_path}/none", f"ipc://{tmp_path}/none-replay") as sub:
        start = time.monotonic()
        assert sub.poll(50) == [] and sub.catch_up(timeout_ms=200) == []
        assert time.monotonic() - start < 5
