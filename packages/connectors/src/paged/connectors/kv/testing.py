"""Test helpers: a tiny worker over real KV tensors that drives a connector like the runner.

Each computed token writes K/V that depend only on (layer, position, token id)
into its slot, so KV loaded from a connector can be compared with KV
computed from scratch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from paged.connectors.kv import KVConnectorBase
from paged.connectors.kv.blocks import slot_mapping
from paged.scheduler.boundary import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput

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
            self.reqs[new.req_id] = _Req(
                list(new.prompt_token_ids), list(new.block_ids[0]), new.num_computed_tokens
            )
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if ids is not None:
                self.reqs[rid].blocks.extend(ids[0])
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
        )
        self.connector.clear_connector_metadata()
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=out)

    def _forward(self, so: SchedulerOutput) -> tuple[list[str], list[list[int]]]:
        req_ids, sampled = [], []
        for layer, (name, cache) in enumerate(self.kv_caches.items()):
            self.connector.wait_for_layer_load(name)
            for rid, n in so.num_scheduled_tokens.items():
                req = self.reqs[rid]
                positions = range(req.num_computed, req.num_computed + n)
                slots = slot_mapping(req.blocks, self.block_size, req.num_computed + n, cache.device)
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
