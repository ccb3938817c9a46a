"""Follow a paged (or vLLM) engine's KV cache events and keep the set of cached blocks.

    paged serve --kv-events-config '{"enable_kv_cache_events": true,
        "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'
    python examples/kv_events_subscriber.py --topic kv-events \\
        --endpoint tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5558

`--wire-format` must match the publisher's: "vllm" (the default; paged's
default and vLLM 0.33.0's), or "map" / "array" for a publisher configured
with that `"wire_format"` ("array" also for a vLLM 0.2x engine).

It first asks the replay endpoint for everything it still holds (so it can
join late), then follows the live stream, filling gaps by replay. One line
per batch; with `--summary`, a JSON object of the cached blocks at exit:
{"next_seq": N, "lost": L, "blocks": [[medium, group_idx, hash, copies], ...]}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from paged.connectors.events import (
    WIRE_FORMATS,
    CachedBlockIndex,
    KVEventBatch,
    KVEventDecodeError,
    KVEventSubscriber,
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="the publisher's PUB address")
    p.add_argument("--replay-endpoint", default=None, help="its ROUTER replay address")
    p.add_argument("--topic", default="", help="the publisher's topic")
    p.add_argument(
        "--wire-format",
        choices=WIRE_FORMATS,
        default="vllm",
        help="the publisher's batch layout: vllm (vLLM 0.33.0, paged's default), "
        "map (paged's earlier default) or array (vLLM 0.2x)",
    )
    p.add_argument("--until-seq", type=int, default=None, help="stop once batch N-1 is in")
    p.add_argument("--timeout", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--quiet", action="store_true", help="no line per batch")
    p.add_argument("--summary", action="store_true", help="print the cached blocks as JSON")
    return p.parse_args(argv)


def describe(seq: int, batch: KVEventBatch, index: CachedBlockIndex) -> str:
    kinds = ", ".join(type(e).__name__ for e in batch.events)
    return f"seq {seq} ts {batch.ts:.3f}: {kinds} -> {sum(index.blocks.values())} blocks cached"


def follow(sub: KVEventSubscriber, ns: argparse.Namespace, index: CachedBlockIndex) -> None:
    """Apply batches until `--until-seq`, `--timeout` or Ctrl-C."""
    deadline = None if ns.timeout is None else time.monotonic() + ns.timeout
    batches = sub.catch_up() if ns.replay_endpoint else []
    try:
        while True:
            for seq, batch in batches:
                index.apply(batch)
                if not ns.quiet:
                    print(describe(seq, batch, index), flush=True)
            if ns.until_seq is not None and sub.next_seq >= ns.until_seq:
                return
            if deadline is not None and time.monotonic() >= deadline:
                return
            batches = sub.poll(200)
    except KeyboardInterrupt:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    index = CachedBlockIndex()
    with KVEventSubscriber(
        ns.endpoint, ns.replay_endpoint, topic=ns.topic, wire_format=ns.wire_format
    ) as sub:
        try:
            follow(sub, ns, index)
        except KVEventDecodeError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 1
        if ns.summary:
            blocks = [
                [m, g, h.hex() if isinstance(h, bytes) else h, n]
                for (m, g, h), n in sorted(index.blocks.items(), key=str)
            ]
            summary = {"next_seq": sub.next_seq, "lost": sub.num_lost, "blocks": blocks}
            print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
