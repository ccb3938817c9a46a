"""The scheduler side of `OffloadingConnector`: lookups, save decisions, tier indexes.

Lookup (a request that missed the device prefix cache beyond `num_local`):

    chunk i          0        1        2        3
    device hit   [======]==                          num_local (block aligned)
    tiers          host     host     disk     miss
    loaded               [==|=================]      from num_local to the last
                                                     consecutive hit (capped so one
                                                     prompt token is left to compute)

Loads are synchronous: `(N, False)`, done in the worker's `start_load_kv`
of the step that schedules the request. Saves: every full prompt chunk (and decode chunk
with offload_prompt_only false; once offered store_threshold times), in
the step whose forward computes its last token, to every configured tier
that does not hold it yet (write-through: host and disk).

Every insert into a tier index, eviction and drop is also a KV cache event
(`events.TierEvents`, taken by the engine through `take_events()`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from paged.connectors.kv.offloading.admission import StoreAdmission
from paged.connectors.kv.offloading.arc import ArcTierIndex
from paged.connectors.kv.offloading.chunks import ChunkKey, chunk_keys
from paged.connectors.kv.offloading.config import OffloadingConfig
from paged.connectors.kv.offloading.events import TierEvents
from paged.connectors.kv.offloading.index import TierIndex
from paged.connectors.kv.offloading.metadata import (
    ChunkLoad,
    ChunkSave,
    OffloadingMetadata,
    Tier,
)
from paged.connectors.kv.offloading.redis_tier import RedisKeyspace, RemoteLookup
from paged.connectors.kv.offloading.stats import OffloadingStats
from paged.connectors.kv.offloading.storage import scan_disk
from paged.kvcache import BlockHash, KVCacheEvent
from paged.scheduler.boundary import BlockIdsPerGroup, KVConnectorOutput, SchedulerOutput
from paged.scheduler.request import Request

# Steps whose load block ids are remembered to map a load error back to its chunk.
_LOAD_HISTORY_STEPS = 8


@dataclass
class _LoadPlan:
    num_local: int  # tokens already in the device cache (block aligned)
    end: int  # tokens computed once the load is done
    first_chunk: int
    sources: list[tuple[ChunkKey, Tier]]


@dataclass
class _RequestState:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    next_save_chunk: int = 0
    load: _LoadPlan | None = None


class OffloadingScheduler:
    """Scheduler-side logic (composed by `OffloadingConnector`)."""

    def __init__(
        self,
        config: OffloadingConfig,
        block_size: int,
        block_bytes: int,
        *,
        can_load: bool,
        can_save: bool,
        world_size: int = 1,
        model_name: str = "",
    ) -> None:
        if block_bytes <= 0:
            raise ValueError(
                "OffloadingConnector needs the bytes of one KV block across layers "
                "(KVConnectorContext.kv_bytes_per_block) to enforce its byte budgets"
            )
        self.config = config
        self.block_size = block_size
        self.blocks_per_chunk = config.chunk_size // block_size
        self.chunk_bytes = block_bytes * self.blocks_per_chunk
        self.can_load = can_load
        self.can_save = can_save
        host_index = ArcTierIndex if config.eviction_policy == "arc" else TierIndex
        self.host = host_index("host", config.host_bytes) if config.has_host else None
        self.disk: TierIndex | None = None
        self._evict_host: list[ChunkKey] = []
        self._evict_disk: list[ChunkKey] = []
        quiet = frozenset() if config.disk_events else frozenset({Tier.DISK})
        # The shared tier: not indexed here (other engines write it, Redis evicts on
        # its own), asked at lookup time; see redis_tier.py.
        self.redis: RemoteLookup | None = None
        if config.redis is not None:
            keyspace = RedisKeyspace.of(
                config.redis, model_name, block_size, config.chunk_size, world_size
            )
            self.redis = RemoteLookup(config.redis, keyspace)
            if not config.redis.enable_kv_events:
                quiet = quiet | {Tier.REDIS}
        self.events = TierEvents(block_size, self.blocks_per_chunk, quiet)
        disk_path = config.rank_disk_path(0, world_size)  # rank 0 speaks for all ranks
        if disk_path is not None:
            self.disk = TierIndex("disk", config.disk_bytes)
            # A restarted engine finds its chunks again (contents checked on load).
            self._evict_disk.extend(self.disk.rebuild(scan_disk(disk_path)))
            # Trimmed files were never announced; the rest are, so a subscriber that
            # joins later learns them through replay.
            self.events.stored_by_key(Tier.DISK, self.disk.keys_lru_first())
        self.stats = OffloadingStats()
        self.admission = StoreAdmission(config.store_threshold, config.max_tracker_size)
        self._reported_evictions = [0, 0]  # host, disk: evictions already in a report
        self._requests: dict[str, _RequestState] = {}
        self._plans: dict[str, _LoadPlan] = {}
        # Per step: block id -> (chunk key, request id) of each block a load wrote.
        self._load_history: deque[dict[int, tuple[ChunkKey, str]]] = deque(
            maxlen=_LOAD_HISTORY_STEPS
        )

    # ----------------------------------------------------------------- lookups
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._plans.pop(request.request_id, None)
        if not self.can_load:
            return 0, False
        keys = chunk_keys(request.block_hashes, self.blocks_per_chunk)
        chunk = self.config.chunk_size
        first = num_computed_tokens // chunk
        sources: list[tuple[ChunkKey, Tier]] = []
        for key in keys[first:]:
            tier = self._find(key)
            if tier is None:
                break
            sources.append((key, tier))
        # One token must be left to compute (the logits of the last prompt token).
        cap = (request.num_tokens - 1) // self.block_size * self.block_size
        if self.redis is not None:
            # Below host and disk: the chunks after the local hits, up to the cap.
            start = first + len(sources)
            wanted = keys[start : max(-(-cap // chunk), start)]
            found = self.redis.present_prefix(wanted)
            sources.extend((key, Tier.REDIS) for key in wanted[:found])
        end = min((first + len(sources)) * chunk, cap)
        self._count_lookup(len(keys) * chunk - num_computed_tokens, sources, first, end)
        if end <= num_computed_tokens:
            return 0, False
        used = -(-(end - first * chunk) // chunk)  # chunks the capped range touches
        self._plans[request.request_id] = _LoadPlan(num_computed_tokens, end, first, sources[:used])
        return end - num_computed_tokens, False

    def _find(self, key: ChunkKey) -> Tier | None:
        if self.host is not None and key in self.host:
            self.host.touch(key)
            return Tier.HOST
        if self.disk is not None and key in self.disk:
            self.disk.touch(key)
            return Tier.DISK
        return None

    def _count_lookup(
        self, queried: int, sources: list[tuple[ChunkKey, Tier]], first: int, end: int
    ) -> None:
        if queried <= 0:
            return
        chunk = self.config.chunk_size
        host_hits = disk_hits = redis_hits = 0
        for i, (_, tier) in enumerate(sources):
            start = (first + i) * chunk
            tokens = max(min(start + chunk, end) - start, 0)
            if tier is Tier.HOST:
                host_hits += tokens
            elif tier is Tier.DISK:
                disk_hits += tokens
            else:
                redis_hits += tokens
        if self.host is not None:
            self.stats.host.queries += queried
            self.stats.host.hits += host_hits
        if self.disk is not None:
            self.stats.disk.queries += queried - host_hits
            self.stats.disk.hits += disk_hits
        if self.redis is not None:
            self.stats.redis.queries += queried - host_hits - disk_hits
            self.stats.redis.hits += redis_hits

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        plan = self._plans.pop(request.request_id, None)
        state = _RequestState(request)
        if num_external_tokens > 0 and plan is not None:
            state.load = plan
        self._requests[request.request_id] = state

    # ------------------------------------------------------------- per step
    def build_connector_meta(self, so: SchedulerOutput) -> bytes:
        for req_id in so.preempted_req_ids:
            self._requests.pop(req_id, None)  # re-admitted through update_state_after_alloc
        loads: list[ChunkLoad] = []
        saves: list[ChunkSave] = []
        self._load_history.append({})
        scheduled = so.num_scheduled_tokens
        for new in so.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
                end = new.num_computed_tokens + scheduled.get(new.req_id, 0)
                self._step(state, end, loads, saves)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            self._extend_blocks(state, cached.new_block_ids[i], cached.resumed_from_preemption[i])
            end = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            self._step(state, end, loads, saves)
        meta = OffloadingMetadata(
            loads=loads,
            saves=self._still_indexed(saves),
            evict_host=list(self._evict_host),
            evict_disk=list(self._evict_disk),
        )
        self._evict_host.clear()
        self._evict_disk.clear()
        return msgspec.msgpack.encode(meta)

    @staticmethod
    def _extend_blocks(state: _RequestState, new: BlockIdsPerGroup | None, replace: bool) -> None:
        blocks = list(new[0]) if new else []
        if replace:
            state.block_ids = blocks
        else:
            state.block_ids.extend(blocks)

    def _step(
        self,
        state: _RequestState,
        computed_end: int,
        loads: list[ChunkLoad],
        saves: list[ChunkSave],
    ) -> None:
        if state.load is not None:
            emitted = self._emit_load(state, state.load)
            loads.extend(emitted)
            step = self._load_history[-1]
            for load in emitted:
                step.update(
                    (b, (ChunkKey(load.key), state.request.request_id)) for b in load.block_ids
                )
            state.load = None
        if self.can_save:
            self._emit_saves(state, computed_end, saves)

    def _emit_load(self, state: _RequestState, plan: _LoadPlan) -> list[ChunkLoad]:
        bpc = self.blocks_per_chunk
        local_blocks = plan.num_local // self.block_size
        end_blocks = plan.end // self.block_size
        out: list[ChunkLoad] = []
        for j, (key, tier) in enumerate(plan.sources):
            base = (plan.first_chunk + j) * bpc
            first = max(local_blocks - base, 0)
            last = min(end_blocks - base, bpc)
            promote = False
            if tier is not Tier.HOST and self.host is not None:
                promote = self._insert(Tier.HOST, key, state.request, plan.first_chunk + j)
            if tier is Tier.REDIS:
                # Which tier served it: a reuse report of the Redis tier (medium STORAGE,
                # locality REMOTE, ownership "redis").
                self.events.stored(Tier.REDIS, key, state.request, plan.first_chunk + j)
            ids = state.block_ids[base + first : base + last]
            out.append(ChunkLoad(key, tier, ids, first, promote))
        return out

    def _emit_saves(self, state: _RequestState, computed_end: int, saves: list[ChunkSave]) -> None:
        request = state.request
        chunk = self.config.chunk_size
        # Full chunks only; by default prompt chunks only (vLLM 0.33's offload_prompt_only,
        # LMCache's default): decode KV is saved only when that is false.
        saved_end = computed_end
        if self.config.offload_prompt_only:
            saved_end = min(computed_end, request.num_prompt_tokens)
        limit = saved_end // chunk
        if state.next_save_chunk >= limit:
            return
        keys = chunk_keys(request.block_hashes, self.blocks_per_chunk)
        bpc = self.blocks_per_chunk
        offered = range(state.next_save_chunk, min(limit, len(keys)))
        self.admission.record([keys[i] for i in offered])
        for i in offered:
            key = keys[i]
            if not self._held(key) and not self.admission.admit(key):
                continue  # store_threshold: not offered often enough yet
            to_host = self._insert(Tier.HOST, key, request, i, touch=True)
            to_disk = self._insert(Tier.DISK, key, request, i, touch=True)
            to_redis = self.redis is not None and self.redis.should_write(key)
            if to_redis:
                self.events.stored(Tier.REDIS, key, request, i)
            if to_host or to_disk or to_redis:
                blocks = state.block_ids[i * bpc : (i + 1) * bpc]
                saves.append(ChunkSave(key, blocks, to_host, to_disk, to_redis))
        state.next_save_chunk = max(state.next_save_chunk, min(limit, len(keys)))

    def _insert(
        self, tier: Tier, key: ChunkKey, request: Request, chunk_idx: int, *, touch: bool = False
    ) -> bool:
        """True if chunk `chunk_idx` of `request` must be written to `tier` (absent, fits).

        A chunk already there is touched; a save then skips it (`touch`), while a
        promotion still writes it (the same bytes; another save of this step may
        have just indexed it). Only a real insert is announced.
        """
        index, evictions = self._tier(tier)
        if index is None:
            return False
        if key in index:
            index.touch(key)
            return not touch
        result = index.insert(key, self.chunk_bytes)
        evictions.extend(result.evicted)
        self.events.removed(tier, result.evicted)
        if result.inserted:
            self.events.stored(tier, key, request, chunk_idx)
        return result.inserted

    def _held(self, key: ChunkKey) -> bool:
        return (self.host is not None and key in self.host) or (
            self.disk is not None and key in self.disk
        )

    def _tier(self, tier: Tier) -> tuple[TierIndex | None, list[ChunkKey]]:
        if tier is Tier.HOST:
            return self.host, self._evict_host
        return self.disk, self._evict_disk

    def _still_indexed(self, saves: list[ChunkSave]) -> list[ChunkSave]:
        # A chunk saved early in the step may be evicted by a later save of the same
        # step; the worker runs evictions before saves, so drop such a write.
        kept: list[ChunkSave] = []
        for save in saves:
            key = ChunkKey(save.key)
            to_host = save.to_host and self.host is not None and key in self.host
            to_disk = save.to_disk and self.disk is not None and key in self.disk
            if to_host or to_disk or save.to_redis:
                kept.append(ChunkSave(save.key, save.block_ids, to_host, to_disk, save.to_redis))
        return kept

    # ------------------------------------------------------------ feedback
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        bad: set[ChunkKey] = set()
        for block in output.invalid_block_ids:
            # Block ids are reused: the newest load that wrote this block is the one.
            for step in reversed(self._load_history):
                if block in step:
                    key, req_id = step[block]
                    bad.add(key)
                    state = self._requests.get(req_id)
                    if state is not None:
                        # It recomputes from the first bad block: save its chunks again
                        # as they are recomputed (chunks still stored are only touched).
                        state.next_save_chunk = 0
                    break
        for key in bad:
            # Corrupt, truncated, foreign or vanished: forget it and delete its file,
            # so the recomputed KV is saved again.
            if self.host is not None and self.host.remove(key):
                self._evict_host.append(key)
                self.events.removed(Tier.HOST, [key])
            if self.disk is not None and self.disk.remove(key):
                self._evict_disk.append(key)
                self.events.removed(Tier.DISK, [key])
            if self.redis is not None:
                self.redis.forget(key)  # the recomputed chunk overwrites a bad value

    def take_stats(self) -> dict[str, float]:
        """Lookup, eviction and load-error counters since the last call (flat deltas)."""
        stats, self.stats = self.stats, OffloadingStats()
        if self.host is not None:
            stats.host.evictions = self.host.num_evictions - self._reported_evictions[0]
            self._reported_evictions[0] = self.host.num_evictions
        if self.disk is not None:
            stats.disk.evictions = self.disk.num_evictions - self._reported_evictions[1]
            self._reported_evictions[1] = self.disk.num_evictions
        out = stats.to_dict()
        if self.redis is not None:
            out.update(self.redis.counters.take())
        return out

    def take_events(self) -> Sequence[KVCacheEvent]:
        """`BlockStored` / `BlockRemoved` of the tiers since the last call (CPU / STORAGE)."""
        return self.events.take()

    def tier_block_hashes(self, tier: Tier) -> dict[ChunkKey, list[BlockHash]]:
        """What `tier` holds, LRU first, with the hashes its `BlockStored` announced.

        `KeyError` if the index holds a chunk that was never announced (an event
        path was missed); a chunk announced but gone unannounced is absent here
        and shows up as a mismatch against a subscriber's index.
        """
        index, _ = self._tier(tier)
        announced = self.events.announced(tier)
        keys = index.keys_lru_first() if index is not None else []
        if len(announced) != len(keys):
            raise AssertionError(
                f"{tier.name}: {len(announced)} chunks announced, {len(keys)} held"
            )
        return {key: announced[key] for key in keys}

    def request_finished(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)
        self._plans.pop(request.request_id, None)

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
