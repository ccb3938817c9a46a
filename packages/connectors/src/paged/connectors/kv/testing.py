"""Test helpers: a tiny worker over real KV tensors that drives a connector like the runner.

Each computed token writes K/V that depend only on (layer, position, token id)
into its slot, so KV loaded from a connector can be compared with KV
computed from scratch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import torch

from paged.connectors.kv.base import KVConnectorBase, KVConnectorContext, KVConnectorRole
from paged.connectors.kv.blocks import slot_mapping
from paged.connectors.kv.config import KVTransferConfig
from paged.connectors.kv.groups import GroupLayout, window_start_block
from paged.kvcache import (
    FullAttentionSpec,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from paged.scheduler.boundary import (
    BlockIdsPerGroup,
    KVConnectorOutput,
    KVTransferParams,
    ModelRunnerOutput,
    SchedulerOutput,
)
from paged.scheduler.request import Request

NUM_LAYERS = 2
NUM_HEADS = 2
HEAD_SIZE = 4


def token_kv(layer: int, position: int, token: int) -> torch.Tensor:
    """[2, H, D] K/V of one token (K and V differ)."""
    base = torch.arange(NUM_HEADS * HEAD_SIZE, dtype=torch.float32).view(NUM_HEADS, HEAD_SIZE)
    k = base + 1000 * layer + 10 * position + 0.5 * token
    return torch.stack([k, -k])


def make_kv_caches(num_blocks: int, block_size: int) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(
            2, num_blocks, block_size, NUM_HEADS, HEAD_SIZE
        )
        for i in range(NUM_LAYERS)
    }


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.attn"


def hybrid_kv_config(num_blocks: int, block_size: int, sliding_window: int) -> KVCacheConfig:
    """A Gemma-3-like hybrid over `make_kv_caches`'s two layers: layer 0 full, layer 1 sliding."""
    dims = {"block_size": block_size, "num_kv_heads": NUM_HEADS, "head_size": HEAD_SIZE}
    full = FullAttentionSpec(dtype="float32", **dims)
    sliding = SlidingWindowSpec(dtype="float32", sliding_window=sliding_window, **dims)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=[layer_name(0)], kv_cache_spec=full),
            KVCacheGroupSpec(layer_names=[layer_name(1)], kv_cache_spec=sliding),
        ],
    )


def hybrid_context(block_size: int, sliding_window: int, **kwargs: object) -> KVConnectorContext:
    """The context an engine gives a connector for `hybrid_kv_config`."""
    block_bytes = 2 * block_size * NUM_HEADS * HEAD_SIZE * 4
    groups = (
        GroupLayout((layer_name(0),), None, block_bytes),
        GroupLayout((layer_name(1),), sliding_window, block_bytes),
    )
    return KVConnectorContext(
        block_size=block_size,
        num_kv_cache_groups=2,
        kv_bytes_per_block=2 * block_bytes,
        kv_cache_groups=groups,
        **kwargs,  # type: ignore[arg-type]
    )


HYBRID_LAYER_GROUPS = [[layer_name(0)], [layer_name(1)]]


@dataclass
class _Req:
    tokens: list[int]
    blocks: list[list[int]]  # per KV cache group
    num_computed: int
    # Tokens sampled so far; a step whose load failed has its sample discarded by the
    # scheduler, so a rewind drops the samples made past the rewind point.
    sampled_at: list[int] = field(default_factory=list)


@dataclass
class KVWorkerSim:
    """Mirrors requests from SchedulerOutput diffs and calls the connector in the runner's order."""

    connector: KVConnectorBase
    kv_caches: dict[str, torch.Tensor]
    block_size: int
    reqs: dict[str, _Req] = field(default_factory=dict)
    computed_positions: dict[str, list[int]] = field(default_factory=dict)
    # Layer names per KV cache group (None: one group of every layer).
    layer_groups: Sequence[Sequence[str]] | None = None

    def __post_init__(self) -> None:
        self.connector.register_kv_caches(self.kv_caches, self.layer_groups)
        groups = self.layer_groups or [list(self.kv_caches)]
        self._group_of = {name: g for g, names in enumerate(groups) for name in names}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self.reqs[new.req_id] = _Req(
                list(new.prompt_token_ids),
                [list(ids) for ids in new.block_ids],
                new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if ids is not None:
                if cached.resumed_from_preemption[i]:
                    self.reqs[rid].blocks = [list(g) for g in ids]
                else:
                    for have, new_ids in zip(self.reqs[rid].blocks, ids, strict=True):
                        have.extend(new_ids)
            # After a load error the scheduler rewinds to the first bad block and
            # drops what that step sampled.
            req = self.reqs[rid]
            req.num_computed = cached.num_computed_tokens[i]
            while req.sampled_at and req.sampled_at[-1] > req.num_computed:
                req.sampled_at.pop()
                req.tokens.pop()
        if so.kv_connector_metadata is not None:
            self.connector.bind_connector_metadata(so.kv_connector_metadata)
            self.connector.start_load_kv()
        req_ids, sampled = self._forward(so)
        if so.kv_connector_metadata is not None:
            self.connector.wait_for_save()
        sending, recving = self.connector.get_finished(set(so.finished_req_ids))
        out = KVConnectorOutput(
            finished_sending=sorted(sending or ()),
            finished_recving=sorted(recving or ()),
            invalid_block_ids=sorted(self.connector.get_block_ids_with_load_errors()),
            kv_connector_stats=self.connector.get_kv_connector_stats() or {},
        )
        self.connector.clear_connector_metadata()
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=out
        )

    def _forward(self, so: SchedulerOutput) -> tuple[list[str], list[list[int]]]:
        req_ids, sampled = [], []
        for layer, (name, cache) in enumerate(self.kv_caches.items()):
            self.connector.wait_for_layer_load(name)
            for rid, n in so.num_scheduled_tokens.items():
                req = self.reqs[rid]
                positions = range(req.num_computed, req.num_computed + n)
                slots = slot_mapping(
                    req.blocks[self._group_of[name]],
                    self.block_size,
                    req.num_computed + n,
                    cache.device,
                )
                flat = cache.view(2, -1, NUM_HEADS, HEAD_SIZE)
                for p in positions:
                    flat[:, int(slots[p])] = token_kv(layer, p, req.tokens[p])
            self.connector.save_kv_layer(name, cache)
        for rid, n in so.num_scheduled_tokens.items():
            req = self.reqs[rid]
            self.computed_positions.setdefault(rid, []).extend(
                range(req.num_computed, req.num_computed + n)
            )
            req.num_computed += n
            req_ids.append(rid)
            if req.num_computed >= len(req.tokens):
                token = (sum(req.tokens[-3:]) % 50) + 1
                req.tokens.append(token)
                req.sampled_at.append(req.num_computed)
                sampled.append([token])
            else:
                sampled.append([])
        return req_ids, sampled

    def kv_of(self, rid: str, num_tokens: int) -> dict[str, torch.Tensor]:
        """The KV currently in the cache for the first `num_tokens` tokens of `rid`."""
        req = self.reqs[rid]
        out: dict[str, torch.Tensor] = {}
        for name, cache in self.kv_caches.items():
            blocks = req.blocks[self._group_of[name]]
            slots = slot_mapping(blocks, self.block_size, num_tokens, torch.device("cpu"))
            out[name] = cache.view(2, -1, NUM_HEADS, HEAD_SIZE)[:, slots].clone()
        return out

    def window_kv_of(
        self, rid: str, num_tokens: int, windows: Sequence[int | None]
    ) -> dict[str, torch.Tensor]:
        """Like `kv_of`, but each layer from its group's window start (`windows` per group).

        A sliding-window group's blocks before the window are null blocks: only
        the window is comparable.
        """
        req = self.reqs[rid]
        out: dict[str, torch.Tensor] = {}
        for name, cache in self.kv_caches.items():
            g = self._group_of[name]
            first = window_start_block(windows[g], num_tokens, self.block_size)
            slots = slot_mapping(req.blocks[g], self.block_size, num_tokens, torch.device("cpu"))
            start = first * self.block_size
            out[name] = cache.view(2, -1, NUM_HEADS, HEAD_SIZE)[:, slots[start:]].clone()
        return out


def expected_kv(
    tokens: list[int], num_tokens: int, first_tokens: Sequence[int] = ()
) -> dict[str, torch.Tensor]:
    """KV of the first `num_tokens`, layer l from token `first_tokens[l]` on (default 0)."""
    firsts = list(first_tokens) or [0] * NUM_LAYERS
    return {
        layer_name(layer): torch.stack(
            [token_kv(layer, p, tokens[p]) for p in range(firsts[layer], num_tokens)], dim=1
        )
        for layer in range(NUM_LAYERS)
    }


class ScriptedConnector(KVConnectorBase):
    """A connector whose answers come from `kv_connector_extra_config` (MultiConnector tests).

    extra config: "matched" (int or None, the external tokens offered),
    "load_async" (bool), "delay_free" (bool), "name" (str).
    Scheduler side records `update_state_after_alloc` calls; its metadata is
    the list of request ids scheduled this step. Worker side reports every
    request named in `sending_done` (set by the test) as finished sending.
    """

    def __init__(
        self, config: KVTransferConfig, role: KVConnectorRole, context: KVConnectorContext
    ) -> None:
        super().__init__(config, role, context)
        extra = config.kv_connector_extra_config
        self.name = str(extra.get("name", ""))
        self.matched: int | None = extra.get("matched", 0)
        self.load_async = bool(extra.get("load_async", False))
        self.delay_free = bool(extra.get("delay_free", False))
        self.allocs: list[tuple[str, int]] = []
        self.bound: list[list[str]] = []
        self.sending_done: set[str] = set()
        self.saved_layers: list[str] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.matched, self.load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.allocs.append((request.request_id, num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> bytes:
        return msgspec.msgpack.encode(sorted(scheduler_output.num_scheduled_tokens))

    def request_finished(
        self, request: Request, block_ids: BlockIdsPerGroup
    ) -> tuple[bool, KVTransferParams | None]:
        return self.delay_free, None

    def bind_connector_metadata(self, metadata: bytes) -> None:
        super().bind_connector_metadata(metadata)
        self.bound.append(msgspec.msgpack.decode(metadata, type=list[str]))

    def start_load_kv(self) -> None:
        self._get_connector_metadata_bytes()

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        self.saved_layers.append(layer_name)

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self.sending_done = self.sending_done, set()
        return (done or None), None
