"""The worker side of `OffloadingConnector`: cross-layer copies between the paged cache and tiers.

A chunk moves as one buffer holding its blocks across all layers of its KV
cache group, `[blocks, layers, 2, block_size, heads, head_size]` (see
chunks.py), so a tier sees one object per chunk whatever the number of
layers; a hybrid model has one chunk per group (`ChunkLoad.group`).

Per step, by default: `start_load_kv` loads synchronously (every layer,
before the forward); `wait_for_save` runs the step's evictions and copies the
saved blocks device->host, then hands them to the background `ChunkWriter`:
the step waits for that copy only, never for a disk write or a checksum.

With `use_layerwise` (see ../layerwise.py and docs/layerwise.md):
`start_layerwise` starts a thread that copies the step's loads layer by layer
while the forward runs (`wait_layer` blocks on one layer), `save_layer` copies
a layer's saved blocks out as soon as the forward wrote them, and
`finish_layerwise` (from `wait_for_save`) completes both before the writer
gets the chunks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from paged.connectors.kv.layerwise import (
    LayerRows,
    LayerSource,
    LayerwiseLoad,
    LayerwiseSave,
    SaveTarget,
    cross_layer_rows,
)
from paged.connectors.kv.offloading.chunks import ChunkError, ChunkKey, Fingerprint
from paged.connectors.kv.offloading.config import OffloadingConfig
from paged.connectors.kv.offloading.metadata import ChunkLoad, OffloadingMetadata, Tier
from paged.connectors.kv.offloading.redis_tier import (
    FaultCounters,
    RedisKeyspace,
    RedisRank,
    RedisStore,
    RedisWriter,
    redis_fingerprint,
)
from paged.connectors.kv.offloading.stats import OffloadingStats, TierStats
from paged.connectors.kv.offloading.storage import ChunkWriter, DiskStore, HostStore

logger = logging.getLogger(__name__)


def fingerprint_of(
    kv_caches: Mapping[str, torch.Tensor], rank: int, world_size: int
) -> Fingerprint:
    """The layout every stored chunk of this engine must match; `ValueError` if layers differ."""
    if not kv_caches:
        raise ValueError("OffloadingConnector: no KV cache layers registered")
    shapes = {(tuple(t.shape[2:]), t.dtype) for t in kv_caches.values()}
    if len(shapes) != 1 or any(t.dim() != 5 or t.shape[0] != 2 for t in kv_caches.values()):
        raise ValueError(
            "OffloadingConnector: every layer must be [2, num_blocks, block_size, heads, "
            f"head_size] with one shape and dtype, got {sorted(map(str, shapes))}"
        )
    (block_size, heads, head_size), dtype = next(iter(shapes))
    return Fingerprint(
        num_layers=len(kv_caches),
        block_size=int(block_size),
        num_kv_heads=int(heads),
        head_size=int(head_size),
        dtype=str(dtype).removeprefix("torch."),
        layer_names=tuple(kv_caches),
        rank=rank,
        world_size=world_size,
    )


class OffloadingWorker:
    """Worker-side logic (composed by `OffloadingConnector`)."""

    def __init__(
        self,
        config: OffloadingConfig,
        kv_caches: Mapping[str, torch.Tensor],
        blocks_per_chunk: int,
        rank: int,
        world_size: int,
        layer_groups: Sequence[Sequence[str]] | None = None,
        model_name: str = "",
    ) -> None:
        self.fingerprint = fingerprint_of(kv_caches, rank, world_size)
        self.layers = list(kv_caches.values())
        self.blocks_per_chunk = blocks_per_chunk
        first = self.layers[0]
        self.dtype = first.dtype
        # Each group's layers, in the scheduler's group order (the chunk's layer axis).
        groups = layer_groups if layer_groups is not None else [list(kv_caches)]
        self.group_layers = [[kv_caches[name] for name in names] for names in groups]
        self.chunk_shapes = [
            (blocks_per_chunk, len(layers), *first.shape[0:1], *first.shape[2:])
            for layers in self.group_layers
        ]
        self.chunk_shape = self.chunk_shapes[0]
        if config.use_layerwise and len(self.group_layers) > 1:
            # The layer-wise copies index one cross-layer chunk over every layer.
            raise ValueError(
                f"OffloadingConnector: use_layerwise needs a model with one KV cache group; "
                f"this one has {len(self.group_layers)} (sliding-window and full-attention "
                "layers): drop use_layerwise"
            )
        self.host = HostStore() if config.has_host else None
        disk_path = config.rank_disk_path(rank, world_size)
        self.disk = DiskStore(disk_path, self.fingerprint) if disk_path is not None else None
        self.writer = ChunkWriter(self.host, self.disk)
        self.redis: RedisStore | None = None
        self.redis_writer: RedisWriter | None = None
        self.redis_counters = FaultCounters()
        if config.redis is not None:
            keyspace = RedisKeyspace.of(
                config.redis,
                model_name,
                config.chunk_size // blocks_per_chunk,
                config.chunk_size,
                world_size,
            )
            rank_keys = RedisRank(keyspace, redis_fingerprint(self.fingerprint, model_name))
            self.redis = RedisStore(config.redis, rank_keys, self.redis_counters)
            self.redis_writer = RedisWriter(config.redis, rank_keys, self.redis_counters)
        self.stats = OffloadingStats()
        self._load_errors: set[int] = set()
        self.layerwise_timeout_s = config.layerwise_load_timeout_s
        self._layer_load: LayerwiseLoad | None = None
        self._layer_save: LayerwiseSave | None = None

    # ----------------------------------------------------------------- loads
    def load(self, meta: OffloadingMetadata) -> None:
        for load in meta.loads:
            try:
                self._load_one(load)
            except Exception as exc:  # ChunkError, but also torch errors on a bad buffer
                # Never a wrong token: the blocks are reported and recomputed.
                logger.warning("KV offload: load of chunk %s failed: %s", load.key[:16], exc)
                self._load_errors.update(load.block_ids)
                self.stats.load_errors += 1

    def _load_one(self, load: ChunkLoad) -> None:
        start = time.perf_counter()
        part, stats = self._fetch(load)
        device = self.layers[0].device
        ids = torch.tensor(load.block_ids, dtype=torch.int64, device=device)
        part_dev = part.to(device, non_blocking=False)
        for layer_idx, kv_layer in enumerate(self.group_layers[load.group]):
            # [n, 2, B, H, D] -> [2, n, B, H, D], written into the blocks' rows.
            kv_layer.index_copy_(1, ids, part_dev[:, layer_idx].transpose(0, 1))
        stats.seconds_loaded += time.perf_counter() - start

    def _fetch(self, load: ChunkLoad) -> tuple[torch.Tensor, TierStats]:
        """The load's blocks from its tier, `[n, layers, 2, B, H, D]` on CPU; the tier's
        counters (bytes counted here, seconds by the caller)."""
        key = ChunkKey(load.key)
        if not 0 <= load.group < len(self.group_layers):
            raise ChunkError(f"KV cache group {load.group} does not exist here")
        shape = self.chunk_shapes[load.group]
        self.writer.wait_for(key)  # a save of this chunk may still be queued
        stats: TierStats
        if load.source is Tier.HOST:
            if self.host is None:
                raise ChunkError("host tier is off")
            chunk, stats = self.host.get(key), self.stats.host
        elif load.source is Tier.REDIS:
            if self.redis is None:
                raise ChunkError("redis tier is off")
            chunk, stats = self.redis.get(key, shape, self.dtype), self.stats.redis
        else:
            if self.disk is None:
                raise ChunkError("disk tier is off")
            chunk, stats = self.disk.get(key, shape, self.dtype), self.stats.disk
        if tuple(chunk.shape) != shape:
            raise ChunkError(f"chunk shape {tuple(chunk.shape)}, want {shape}")
        n = len(load.block_ids)
        part = chunk[load.first_block : load.first_block + n]
        stats.bytes_loaded += part.numel() * part.element_size()
        if load.promote and self.host is not None:
            self.host.put(key, chunk.clone())
        return part, stats

    # ------------------------------------------------------- layer-wise
    def start_layerwise(self, meta: OffloadingMetadata) -> None:
        """Start the step's loads in a thread, layer by layer; prepare the saves' buffers."""
        self.finish_layerwise()  # a step that never reached wait_for_save
        if meta.loads:
            sources = [
                LayerSource(list(load.block_ids), self._timed_fetch(load), f"chunk {load.key[:16]}")
                for load in meta.loads
            ]
            self._layer_load = LayerwiseLoad(self.layers, sources, self.layerwise_timeout_s)
        if meta.saves:
            device = self.layers[0].device
            targets = [
                SaveTarget(
                    list(save.block_ids),
                    self._host_buffer(len(save.block_ids)),
                    torch.tensor(save.block_ids, dtype=torch.int64, device=device),
                )
                for save in meta.saves
            ]
            self._layer_save = LayerwiseSave(self.layers, targets)

    def _timed_fetch(self, load: ChunkLoad) -> Callable[[], LayerRows]:
        """`_fetch(load)` for the load thread; its seconds are the tier read only (the
        copies overlap the forward)."""

        def fetch() -> LayerRows:
            start = time.perf_counter()
            part, stats = self._fetch(load)
            stats.seconds_loaded += time.perf_counter() - start
            return cross_layer_rows(part)

        return fetch

    def wait_layer(self, layer_idx: int) -> None:
        if self._layer_load is not None:
            self._layer_load.wait(layer_idx)

    def save_layer(self, layer_idx: int) -> None:
        if self._layer_save is not None:
            self._layer_save.save_layer(layer_idx)

    def finish_layerwise(self, meta: OffloadingMetadata | None = None) -> None:
        """Complete the step's layer-wise loads (failures -> load errors) and, with `meta`,
        hand the saved chunks to the writer after the step's evictions."""
        load, self._layer_load = self._layer_load, None
        if load is not None:
            failed = load.finish()
            self._load_errors.update(failed)
            self.stats.load_errors += load.failed_sources + (1 if load.cancelled else 0)
        save, self._layer_save = self._layer_save, None
        if meta is None:
            return
        self._evict(meta)
        start = time.perf_counter()
        buffers = save.finish() if save is not None else []
        self.stats.host.seconds_saved += time.perf_counter() - start
        for spec, target in zip(meta.saves, buffers, strict=True):
            if spec.to_host or spec.to_disk:
                self.writer.put(
                    ChunkKey(spec.key), target.buffer, to_host=spec.to_host, to_disk=spec.to_disk
                )
            if spec.to_redis and self.redis_writer is not None:
                self.redis_writer.offer(ChunkKey(spec.key), target.buffer)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ----------------------------------------------------------------- saves
    def save(self, meta: OffloadingMetadata) -> None:
        self._evict(meta)
        for save in meta.saves:
            start = time.perf_counter()
            chunk = self._gather(save.block_ids, save.group)
            self.stats.host.seconds_saved += time.perf_counter() - start
            if save.to_host or save.to_disk:
                self.writer.put(
                    ChunkKey(save.key), chunk, to_host=save.to_host, to_disk=save.to_disk
                )
            if save.to_redis and self.redis_writer is not None:
                # Never waits: a full queue drops the chunk (counted as write_queue_full).
                self.redis_writer.offer(ChunkKey(save.key), chunk)

    def _evict(self, meta: OffloadingMetadata) -> None:
        # Before this step's saves: they may need the room.
        for key in meta.evict_host:
            self.writer.evict(ChunkKey(key), host=True, disk=False)
        for key in meta.evict_disk:
            self.writer.evict(ChunkKey(key), host=False, disk=True)

    def _host_buffer(self, num_blocks: int, group: int = 0) -> torch.Tensor:
        """An uninitialised host buffer for `num_blocks` blocks of `group` (cross-layer layout)."""
        return torch.empty(
            (num_blocks, *self.chunk_shapes[group][1:]),
            dtype=self.dtype,
            pin_memory=self.layers[0].device.type == "cuda",
        )

    def _gather(self, block_ids: list[int], group: int = 0) -> torch.Tensor:
        """The blocks across the group's layers, copied to host memory (cross-layer layout)."""
        device = self.layers[0].device
        ids = torch.tensor(block_ids, dtype=torch.int64, device=device)
        out = self._host_buffer(len(block_ids), group)
        for layer_idx, kv_layer in enumerate(self.group_layers[group]):
            out[:, layer_idx].copy_(kv_layer.index_select(1, ids).transpose(0, 1))
        return out

    def take_stats(self) -> dict[str, float]:
        host, disk = self.writer.take_counters()
        self.stats.host.bytes_saved += host.bytes_saved
        self.stats.disk.bytes_saved += disk.bytes_saved
        self.stats.disk.seconds_saved += disk.seconds_saved
        out = self.stats.to_dict()
        self.stats = OffloadingStats()
        for name, value in self.redis_counters.take().items():
            out[name] = out.get(name, 0.0) + value
        return out

    def close(self) -> None:
        self.finish_layerwise()
        self.writer.flush()
        self.writer.close()
        if self.redis_writer is not None:
            self.redis_writer.close()
        if self.redis is not None:
            self.redis.close()
