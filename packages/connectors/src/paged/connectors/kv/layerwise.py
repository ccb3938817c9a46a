"""Layer-by-layer KV loads and saves (seed: KV Transfer, レイヤーバイレイヤー・パイプライニング).

    start_load_kv             LayerwiseLoad.start: a thread fetches every source, then
                              copies layer 0's blocks, signals layer 0, layer 1, ...
    forward, layer i:         wait_for_layer_load(i): LayerwiseLoad.wait(i) blocks only
                              until layer i is in the paged cache (deadline-bound)
                              ... layer i computes and writes its KV ...
                              save_kv_layer(i): LayerwiseSave.save_layer(i) copies
                              layer i's saved blocks out (CUDA: a side stream)
    wait_for_save             LayerwiseSave.finish (saves complete); LayerwiseLoad.finish
                              (the thread is done or cancelled: the blocks may be reused)

A load never hangs the step: each wait has a deadline from `start`; a wait that
misses it, a fetch that raises or a copy that raises puts the source's blocks
in `failed`, which the connector reports as load errors (the scheduler then
rewinds those requests and recomputes, or fails them under
kv_load_failure_policy="fail"). A cancelled thread stops before its next layer
copy (copies hold the job's lock, `cancel` takes it), so once `finish`
returns nothing writes into the cache, even if a fetch is stuck in I/O.

A source is a set of blocks and a fetch that returns, per layer, their rows
in the cache's layout `[2, n, block_size, heads, head_size]` (CPU): a view of
the offloading connector's cross-layer chunk, or of a layer's received bytes
(P/D). The fetch runs in the thread (tier look-up, disk read, checksum), so
it overlaps the layers that need nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


# Layer index -> that layer's rows of a source's blocks, `[2, n, B, H, D]`.
LayerRows = Callable[[int], torch.Tensor]


@dataclass(frozen=True)
class LayerSource:
    """Blocks to load and how to get their KV: `fetch()` -> the rows of each layer."""

    block_ids: list[int]
    fetch: Callable[[], LayerRows]
    label: str = ""  # for the log line of a failure


def cross_layer_rows(part: torch.Tensor) -> LayerRows:
    """The rows of each layer of a cross-layer part `[n, layers, 2, B, H, D]` (views)."""
    return lambda layer_idx: part[:, layer_idx].transpose(0, 1)


class LayerwiseLoad:
    """One step's per-layer load into `layers` (the paged caches in layer order)."""

    def __init__(
        self, layers: Sequence[torch.Tensor], sources: Sequence[LayerSource], timeout_s: float
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self._layers = list(layers)
        self._sources = list(sources)
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        self._ready = [threading.Event() for _ in self._layers]
        self._lock = threading.Lock()  # held by each layer copy; cancel takes it
        self._cancelled = False
        self._failed: set[int] = set()
        self._failed_ids: set[int] = set()  # id() of the sources that failed
        device = self._layers[0].device if self._layers else torch.device("cpu")
        self._cuda = device.type == "cuda"
        # CUDA: copies run on a side stream; layer i's event orders the compute stream after them.
        # (torch's Stream/Event constructors carry no annotations: hence the ignores.)
        self._stream = torch.cuda.Stream(device) if self._cuda else None  # type: ignore[no-untyped-call]
        self._events = [torch.cuda.Event() for _ in self._layers] if self._cuda else []  # type: ignore[no-untyped-call]
        if self._stream is not None:
            # The blocks may have been read by kernels still queued from the last step.
            self._stream.wait_stream(torch.cuda.current_stream())
        self._thread = threading.Thread(target=self._run, name="paged-kv-layer-load", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------- forward thread
    def wait(self, layer_idx: int) -> None:
        """Block until layer `layer_idx` is loaded, failed, or the deadline passed."""
        ready = self._ready[layer_idx]
        if not ready.wait(max(0.0, self._deadline - time.monotonic())):
            self.cancel(f"layer {layer_idx} not loaded within {self._timeout_s:.3g} s")
            return
        if self._cuda:
            torch.cuda.current_stream().wait_event(self._events[layer_idx])

    def cancel(self, reason: str) -> None:
        """Stop the thread before its next copy; every block not yet complete is failed."""
        with self._lock:
            if self._cancelled or self._ready[-1].is_set():
                return
            self._cancelled = True
            logger.warning("KV layer-wise load cancelled: %s", reason)
            for source in self._sources:
                self._failed.update(source.block_ids)
            for event in self._ready:
                event.set()  # later waits return at once

    def finish(self) -> set[int]:
        """End of step: wait for the thread (cancelling it at the deadline); the failed blocks."""
        self._thread.join(max(0.0, self._deadline - time.monotonic()))
        if self._thread.is_alive():
            self.cancel("the load thread passed its deadline")
        elif self._stream is not None:
            self._stream.synchronize()  # the sources' host memory may be dropped now
        with self._lock:
            return set(self._failed)

    # ------------------------------------------------------------- the thread
    def _run(self) -> None:
        try:
            with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
                parts = self._fetch_all()
                for layer_idx in range(len(self._layers)):
                    if not self._copy_layer(layer_idx, parts):
                        return
        except BaseException as exc:  # never leave a waiter without its event
            self.cancel(f"load thread failed: {exc}")

    def _fetch_all(self) -> list[tuple[LayerSource, torch.Tensor, LayerRows]]:
        parts = []
        device = self._layers[0].device
        for source in self._sources:
            if self._cancelled:
                break
            try:
                rows = source.fetch()
                ids = torch.tensor(source.block_ids, dtype=torch.int64, device=device)
                parts.append((source, ids, rows))
            except Exception as exc:  # a bad chunk fails its blocks only
                self._fail(source, exc)
        return parts

    def _copy_layer(
        self, layer_idx: int, parts: list[tuple[LayerSource, torch.Tensor, LayerRows]]
    ) -> bool:
        kv_layer = self._layers[layer_idx]
        with self._lock:
            if self._cancelled:
                return False
            for source, ids, layer_rows in parts:
                if id(source) in self._failed_ids:
                    continue  # an earlier layer failed it: already reported
                try:
                    rows = layer_rows(layer_idx)
                    want = (2, len(source.block_ids), *kv_layer.shape[2:])
                    if tuple(rows.shape) != want or rows.dtype != kv_layer.dtype:
                        raise ValueError(
                            f"layer {layer_idx}: rows {tuple(rows.shape)} {rows.dtype}, "
                            f"want {want} {kv_layer.dtype}"
                        )
                    rows = rows.to(kv_layer.device, non_blocking=self._cuda)
                    kv_layer.index_copy_(1, ids, rows)
                except Exception as exc:
                    self._fail(source, exc)
            if self._cuda:
                self._events[layer_idx].record()
            self._ready[layer_idx].set()
        return True

    def _fail(self, source: LayerSource, exc: BaseException) -> None:
        logger.warning("KV layer-wise load of %s failed: %s", source.label or "blocks", exc)
        self._failed.update(source.block_ids)
        self._failed_ids.add(id(source))

    @property
    def cancelled(self) -> bool:
        """True if a deadline or a thread failure cut the load short."""
        return self._cancelled

    @property
    def failed_sources(self) -> int:
        """Sources (chunks) whose fetch or copy raised (not counting a cancel)."""
        return len(self._failed_ids)


@dataclass
class SaveTarget:
    """Blocks to save and the buffer `[n, layers, 2, B, H, D]` (host) they are copied into."""

    block_ids: list[int]
    buffer: torch.Tensor
    ids: torch.Tensor  # block_ids on the cache's device


class LayerwiseSave:
    """One step's saves, each layer copied out by `save_layer` right after the forward wrote it.

    CPU: the copy runs inline (the layer's blocks are still hot in cache; a
    thread would compete with the forward's OpenMP threads for the same cores).
    CUDA: it is issued non_blocking on a side stream ordered after the compute
    stream's work so far, and `finish` synchronizes that stream.
    """

    def __init__(self, layers: Sequence[torch.Tensor], targets: Sequence[SaveTarget]) -> None:
        self._layers = list(layers)
        self.targets = list(targets)
        self._saved = [False] * len(self._layers)
        self._in_flight: list[torch.Tensor] = []
        device = self._layers[0].device if self._layers else torch.device("cpu")
        cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]

    def save_layer(self, layer_idx: int) -> None:
        if self._saved[layer_idx] or not self.targets:
            return
        self._saved[layer_idx] = True
        kv_layer = self._layers[layer_idx]
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                self._copy(layer_idx, kv_layer, non_blocking=True)
        else:
            self._copy(layer_idx, kv_layer, non_blocking=False)

    def _copy(self, layer_idx: int, kv_layer: torch.Tensor, non_blocking: bool) -> None:
        for target in self.targets:
            rows = kv_layer.index_select(1, target.ids).transpose(0, 1)
            target.buffer[:, layer_idx].copy_(rows, non_blocking=non_blocking)
            if non_blocking:
                self._in_flight.append(rows)  # alive until finish() synchronizes

    def finish(self) -> list[SaveTarget]:
        """Every layer copied (layers the forward did not reach are copied now); the targets."""
        for layer_idx in range(len(self._layers)):
            self.save_layer(layer_idx)
        if self._stream is not None:
            self._stream.synchronize()
        self._in_flight.clear()
        return self.targets
