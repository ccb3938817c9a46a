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

Hybrid models (full-attention and sliding-window KV cache groups): each group
has its own chunks (`chunks.group_chunk_key`). A hit must hold, for every
full-attention group, every chunk from the local hit to its end, and for
every sliding-window group only the chunks of the window before its end
(`groups.window_start_block`); the longest end that all groups agree on is
loaded (vLLM 0.33 likewise looks full groups up as a prefix and sliding
groups as a run of window length: offloading/scheduler.py:805-1011). A
sliding-window group saves only the chunks a resume near the prompt's end
can need (the window plus one chunk before the last token), and only while
their blocks are still in the window (older ones are already freed):

    prompt 0 .. 39, chunk 8, W = 6   full group saves chunks 0..4
                                     sliding group saves chunks 2..4 only
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from paged.connectors.kv.groups import GroupLayout, window_start_block
from paged.connectors.kv.offloading.admission import StoreAdmission
from paged.connectors.kv.offloading.arc import ArcTierIndex
from paged.connectors.kv.offloading.chunks import ChunkKey, chunk_keys, group_chunk_key
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


@dataclass(frozen=True)
class _Source:
    group: int
    chunk_idx: int
    key: ChunkKey  # the group's key
    tier: Tier


@dataclass
class _LoadPlan:
    num_local: int  # tokens already in the device cache (block aligned)
    end: int  # tokens computed once the load is done
    sources: list[_Source]


@dataclass
class _RequestState:
    request: Request
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
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
        groups: tuple[GroupLayout, ...] = (),
    ) -> None:
        self.groups = groups or (GroupLayout(layer_names=(), block_bytes=block_bytes),)
        if any(g.block_bytes <= 0 for g in self.groups):
            raise ValueError(
                "OffloadingConnector needs the bytes of one KV block across layers "
                "(KVConnectorContext.kv_bytes_per_block) to enforce its byte budgets"
            )
        self.config = config
        self.block_size = block_size
        self.blocks_per_chunk = config.chunk_size // block_size
        # Bytes of one chunk of each group (a group's chunk holds its layers only).
        self.group_chunk_bytes = [g.block_bytes * self.blocks_per_chunk for g in self.groups]
        self.chunk_bytes = sum(self.group_chunk_bytes)
        self._full_groups = [i for i, g in enumerate(self.groups) if g.sliding_window is None]
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
        found: dict[tuple[int, int], Tier | None] = {}

        # One token must be left to compute (the logits of the last prompt token).
        cap = (request.num_tokens - 1) // self.block_size * self.block_size
        in_redis_of: dict[int, list[bool]] = {}

        def in_redis(group: int, idx: int) -> bool:
            # Below host and disk, asked only after a local miss: one pipelined query
            # per group for its chunks from `first` up to the cap (a sliding group may
            # hold only the later ones).
            if self.redis is None:
                return False
            if group not in in_redis_of:
                wanted = [
                    group_chunk_key(keys[i], group)
                    for i in range(first, min(len(keys), -(-cap // chunk)))
                ]
                in_redis_of[group] = self.redis.present(wanted)
            found = in_redis_of[group]
            return 0 <= idx - first < len(found) and found[idx - first]

        def tier_of(group: int, idx: int) -> Tier | None:
            if (group, idx) not in found:
                tier = self._find(group_chunk_key(keys[idx], group))
                if tier is None and in_redis(group, idx):
                    tier = Tier.REDIS
                found[(group, idx)] = tier
            return found[(group, idx)]

        # Full-attention groups: the run of consecutive chunks every one of them holds.
        run = len(keys) - first
        for g in self._full_groups:
            k = 0
            while k < run and tier_of(g, first + k) is not None:
                k += 1
            run = k
        end = 0
        sources: list[_Source] = []
        # The longest end whose chunks every group holds (sliding windows may miss).
        for k in range(run, 0, -1):
            candidate = min((first + k) * chunk, cap)
            if candidate <= num_computed_tokens:
                break
            found_sources = self._sources(num_computed_tokens, candidate, keys, tier_of)
            if found_sources is not None:
                end, sources = candidate, found_sources
                break
        stat_group = self._full_groups[0] if self._full_groups else 0
        self._count_lookup(
            len(keys) * chunk - num_computed_tokens,
            [s for s in sources if s.group == stat_group],
            end,
        )
        if end <= num_computed_tokens:
            return 0, False
        self._plans[request.request_id] = _LoadPlan(num_computed_tokens, end, sources)
        return end - num_computed_tokens, False

    def _needed_blocks(self, group: int, num_local: int, end: int) -> range:
        """Blocks of `group` a load from `num_local` to `end` tokens writes."""
        bs = self.block_size
        window = self.groups[group].sliding_window
        return range(max(num_local // bs, window_start_block(window, end, bs)), end // bs)

    def _sources(
        self,
        num_local: int,
        end: int,
        keys: list[ChunkKey],
        tier_of: Callable[[int, int], Tier | None],
    ) -> list[_Source] | None:
        """Every group's chunks a load up to `end` reads, or None if one is missing."""
        bpc = self.blocks_per_chunk
        out: list[_Source] = []
        for g in range(len(self.groups)):
            blocks = self._needed_blocks(g, num_local, end)
            if not blocks:
                continue
            for idx in range(blocks[0] // bpc, (blocks[-1]) // bpc + 1):
                tier = tier_of(g, idx)
                if tier is None:
                    return None
                out.append(_Source(g, idx, group_chunk_key(keys[idx], g), tier))
        return out

    def _find(self, key: ChunkKey) -> Tier | None:
        if self.host is not None and key in self.host:
            self.host.touch(key)
            return Tier.HOST
        if self.disk is not None and key in self.disk:
            self.disk.touch(key)
            return Tier.DISK
        return None

    def _count_lookup(self, queried: int, sources: list[_Source], end: int) -> None:
        """Hit tokens per tier, counted on one group (the first full-attention one)."""
        if queried <= 0:
            return
        chunk = self.config.chunk_size
        host_hits = disk_hits = redis_hits = 0
        for source in sources:
            start = source.chunk_idx * chunk
            tokens = max(min(start + chunk, end) - start, 0)
            if source.tier is Tier.HOST:
                host_hits += tokens
            elif source.tier is Tier.DISK:
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
                state.block_ids = [list(ids) for ids in new.block_ids]
                start = new.num_computed_tokens
                self._step(state, start, start + scheduled.get(new.req_id, 0), loads, saves)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            self._extend_blocks(state, cached.new_block_ids[i], cached.resumed_from_preemption[i])
            start = cached.num_computed_tokens[i]
            self._step(state, start, start + scheduled.get(req_id, 0), loads, saves)
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
        blocks = [list(ids) for ids in new] if new else []
        if replace or not state.block_ids:
            state.block_ids = blocks
        elif blocks:
            for have, added in zip(state.block_ids, blocks, strict=True):
                have.extend(added)

    def _step(
        self,
        state: _RequestState,
        computed_start: int,
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
            self._emit_saves(state, computed_start, computed_end, saves)

    def _emit_load(self, state: _RequestState, plan: _LoadPlan) -> list[ChunkLoad]:
        bpc = self.blocks_per_chunk
        out: list[ChunkLoad] = []
        for source in plan.sources:
            blocks = self._needed_blocks(source.group, plan.num_local, plan.end)
            base = source.chunk_idx * bpc
            first = max(blocks.start - base, 0)
            last = min(blocks.stop - base, bpc)
            promote = False
            if source.tier is not Tier.HOST and self.host is not None:
                promote = self._insert(
                    Tier.HOST, source.key, state.request, source.chunk_idx, source.group
                )
            if source.tier is Tier.REDIS:
                # Which tier served it: a reuse report of the Redis tier (medium STORAGE,
                # locality REMOTE, ownership "redis").
                self.events.stored(
                    Tier.REDIS, source.key, state.request, source.chunk_idx, source.group
                )
            ids = state.block_ids[source.group][base + first : base + last]
            out.append(ChunkLoad(source.key, source.tier, ids, first, promote, source.group))
        return out

    def _emit_saves(
        self, state: _RequestState, computed_start: int, computed_end: int, saves: list[ChunkSave]
    ) -> None:
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
            groups = [
                g for g in range(len(self.groups)) if self._saves(g, i, state, computed_start)
            ]
            group_keys = [(g, group_chunk_key(keys[i], g)) for g in groups]
            held = any(self._held(key) for _, key in group_keys)
            if not held and not self.admission.admit(keys[i]):
                continue  # store_threshold: not offered often enough yet
            for g, key in group_keys:
                to_host = self._insert(Tier.HOST, key, request, i, g, touch=True)
                to_disk = self._insert(Tier.DISK, key, request, i, g, touch=True)
                to_redis = self.redis is not None and self.redis.should_write(key)
                if to_redis:
                    self.events.stored(Tier.REDIS, key, request, i, g)
                if to_host or to_disk or to_redis:
                    ids = state.block_ids[g][i * bpc : (i + 1) * bpc]
                    saves.append(ChunkSave(key, ids, to_host, to_disk, to_redis=to_redis, group=g))
        state.next_save_chunk = max(state.next_save_chunk, min(limit, len(keys)))

    def _saves(self, group: int, chunk_idx: int, state: _RequestState, computed_start: int) -> bool:
        """Whether `group` stores chunk `chunk_idx` (always, unless it is a sliding window).

        A sliding-window group stores the chunks a resume within one chunk of the
        prompt's last token needs (the window before it), and only if their blocks
        were not freed when this step was allocated (blocks before the window of
        `computed_start` are null blocks by now, or reused).
        """
        window = self.groups[group].sliding_window
        if window is None:
            return True
        chunk, bs = self.config.chunk_size, self.block_size
        lowest = max(0, state.request.num_prompt_tokens - window - chunk - bs)
        if (chunk_idx + 1) * chunk <= lowest:
            return False
        return chunk_idx * self.blocks_per_chunk >= window_start_block(window, computed_start, bs)

    def _insert(
        self,
        tier: Tier,
        key: ChunkKey,
        request: Request,
        chunk_idx: int,
        group: int = 0,
        *,
        touch: bool = False,
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
        result = index.insert(key, self.group_chunk_bytes[group])
        evictions.extend(result.evicted)
        self.events.removed(tier, result.evicted)
        if result.inserted:
            self.events.stored(tier, key, request, chunk_idx, group)
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
                kept.append(
                    ChunkSave(save.key, save.block_ids, to_host, to_disk, save.to_redis, save.group)
                )
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
