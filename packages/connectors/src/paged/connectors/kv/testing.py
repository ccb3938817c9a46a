"""Test helpers: a tiny worker over real KV tensors that drives a connector like the runner.

Each computed token writes K/V that depend only on (layer, position, token id)
into its slot, so KV loaded from a connector can be compared with KV
computed from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from paged.connectors.kv.base import KVConnectorBase, KVConnectorContext, KVConnectorRole
from paged.connectors.kv.blocks import slot_mapping
from paged.connectors.kv.config import KVTransferConfig
from paged.kvcache import KVCacheBlocks
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


@dataclass
class _Req:
    tokens: list[int]
    blocks: list[int]
    num_computed: int
    num_prompt: int = 0


@dataclass
class KVWorkerSim:
    """Mirrors requests from SchedulerOutput diffs and calls the connector in the runner's order."""

    connector: KVConnectorBase
    kv_caches: dict[str, torch.Tensor]
    block_size: int
    reqs: dict[str, _Req] = field(default_factory=dict)
    computed_positions: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.connector.register_kv_caches(self.kv_caches)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            prompt = list(new.prompt_token_ids)
            self.reqs[new.req_id] = _Req(
                prompt, list(new.block_ids[0]), new.num_computed_tokens, len(prompt)
            )
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if ids is not None:
                self.reqs[rid].blocks.extend(ids[0])
            # After a load error the scheduler rewinds to the first bad block.
            self.reqs[rid].num_computed = cached.num_computed_tokens[i]
            if i < len(cached.num_output_tokens):
                # ... and drops the token sampled in the failed step (as the runner does).
                req = self.reqs[rid]
                del req.tokens[req.num_prompt + cached.num_output_tokens[i] :]
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
                    req.blocks, self.block_size, req.num_computed + n, cache.device
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
                sampled.append([token])
            else:
                sampled.append([])
        return req_ids, sampled

    def kv_of(self, rid: str, num_tokens: int) -> dict[str, torch.Tensor]:
        """The KV currently in the cache for the first `num_tokens` tokens of `rid`."""
        req = self.reqs[rid]
        slots = slot_mapping(req.blocks, self.block_size, num_tokens, torch.device("cpu"))
        return {
            name: cache.view(2, -1, NUM_HEADS, HEAD_SIZE)[:, slots].clone()
            for name, cache in self.kv_caches.items()
        }


def expected_kv(tokens: list[int], num_tokens: int) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{layer}.self_attn.attn": torch.stack(
            [token_kv(layer, p, tokens[p]) for p in range(num_tokens)], dim=1
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
