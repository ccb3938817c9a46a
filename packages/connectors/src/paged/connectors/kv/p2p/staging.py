"""Decode side with `use_layerwise`: pulled blocks copied layer by layer during a forward.

Without it, a finished pull is copied into the paged cache (every layer)
in `get_finished`, on the step's thread, before the request is reported in
`finished_recving`. With it:

    get_finished (step N)     the pull's bytes are checked (sizes) and staged; the
                              request is reported in finished_recving at once
    schedule (N+1)            the request (and any request hitting its blocks in the
                              prefix cache) may be scheduled
    start_load_kv (N+1)       staged pulls of requests finished meanwhile are dropped
                              (their blocks may be reused); the others start copying,
                              layer by layer, in a thread (../layerwise.py)
    wait_for_layer_load(i)    the forward waits for layer i only
    wait_for_save (N+1)       the copies are complete; a failed one is a load error

So the copy overlaps step N+1's forward instead of delaying step N's end.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from paged.connectors.kv.layerwise import LayerRows, LayerSource, LayerwiseLoad
from paged.connectors.kv.p2p.tensors import blocks_view


class StagedPulls:
    """Finished pulls awaiting their copy, and the current step's copy job."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], timeout_s: float) -> None:
        self._layers = list(kv_caches.values())
        self._timeout_s = timeout_s
        self._staged: dict[str, LayerSource] = {}
        self._job: LayerwiseLoad | None = None

    def stage(self, req_id: str, block_ids: list[int], frames: list[memoryview]) -> None:
        """Keep a finished pull for the next step's forward; `ValueError` on a short frame."""
        if len(frames) != len(self._layers):
            raise ValueError(f"{len(frames)} layers received, the cache has {len(self._layers)}")
        n = len(block_ids)
        views = [blocks_view(layer, n, f) for layer, f in zip(self._layers, frames, strict=True)]
        rows: LayerRows = views.__getitem__
        self._staged[req_id] = LayerSource(list(block_ids), lambda: rows, f"request {req_id}")

    def drop(self, req_ids: Iterable[str]) -> None:
        """These requests finished: their blocks are no longer theirs to write."""
        for req_id in req_ids:
            self._staged.pop(req_id, None)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._staged

    def start(self) -> set[int]:
        """Start copying every staged pull; returns the failed blocks of a previous job."""
        failed = self.finish()
        if self._staged:
            sources, self._staged = list(self._staged.values()), {}
            self._job = LayerwiseLoad(self._layers, sources, self._timeout_s)
        return failed

    def wait(self, layer_idx: int) -> None:
        if self._job is not None:
            self._job.wait(layer_idx)

    def finish(self) -> set[int]:
        """Complete the step's copies; the blocks whose copy failed (load errors)."""
        job, self._job = self._job, None
        return job.finish() if job is not None else set()
