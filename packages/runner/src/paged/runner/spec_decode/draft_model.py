"""Draft-model proposer: a small model of the target's tokenizer, run by the same worker.

KV cache design: the draft keeps its *own cache tensors* (one per draft
layer, the draft's own head count and size) but addresses them with the
*target's block table*: the same block ids and slots, in the target's single
KV cache group. Why:

- the draft sees exactly the target's positions, so a request's blocks hold
  both models' KV for the same tokens; no second allocator, no second prefix
  cache that could disagree with the scheduler's, and preemption, freeing
  and prefix-cache hits need nothing extra;
- a separate KV cache group would make every model hybrid to the scheduler
  (and change its capacity planning) for what is an implementation detail of
  the worker.

The cost: the draft's tensors (num_blocks of the target, the draft's layer
sizes) sit beside the target's and are not taken out of the KV cache budget.

Each step the draft first runs over the very tokens the target computed (so
its KV follows the target's, including prefill chunks and recomputation
after preemption), then drafts greedily: k one-token forwards for the
requests that sampled, the first fed the token just sampled. Its drafts are
deterministic (q one-hot), which the rejection sampler accounts for. Drafted
positions write KV into slots the scheduler reserved as lookahead
(num_lookahead_tokens = k); a request gets only as many drafts as its
allocated blocks can hold, so a draft never writes outside its own blocks.
A prefix hit whose draft KV was never written (e.g. loaded by a KV
connector) only lowers acceptance: verification keeps the output exact.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from paged.kvcache import KVCacheConfig, get_kv_cache_config
from paged.runner.attention.backends import AttentionMetadataBuilder
from paged.runner.attention.metadata import ForwardContext
from paged.runner.buffers import CpuGpuBuffer
from paged.runner.config import ModelConfig
from paged.runner.input_batch import InputBatch
from paged.runner.input_prep import StepInputs
from paged.runner.kv_cache_setup import allocate_kv_caches
from paged.runner.models.interface import CausalLM


class DraftModelProposer:
    """Owns the draft model and its KV cache tensors (see the module docstring)."""

    def __init__(
        self,
        model_config: ModelConfig,
        device: torch.device,
        builder: AttentionMetadataBuilder,
        num_speculative_tokens: int,
        max_num_reqs: int,
    ) -> None:
        self.model_config = model_config
        # Built here, outside inference mode: the model's rotary cache keys on
        # the positions tensor's version counter, which inference tensors lack.
        self._positions = CpuGpuBuffer(max_num_reqs, dtype=torch.int64, device=device)
        self.device = device
        self.builder = builder
        self.k = num_speculative_tokens
        self.model: CausalLM | None = None
        self.kv_caches: list[torch.Tensor] = []

    def load_model(self, model: CausalLM | None = None) -> None:
        if model is None:
            from paged.runner.loader import load_model

            model = load_model(self.model_config, self.device, 0, 1)
        self.model = model

    def _require_model(self) -> CausalLM:
        if self.model is None:
            raise RuntimeError("the draft model is not loaded (call load_model first)")
        return self.model

    def initialize_kv_cache(self, target_config: KVCacheConfig, block_size: int) -> None:
        """Allocate the draft's cache with the target's number of blocks and block size."""
        if len(target_config.kv_cache_groups) != 1:
            raise ValueError(
                "speculative_config.model: a draft model needs a target with one KV cache "
                f"group, this one has {len(target_config.kv_cache_groups)} (hybrid attention)"
            )
        specs = self._require_model().kv_cache_specs(block_size)
        page = sum(s.page_size_bytes for s in specs.values())
        config = get_kv_cache_config(
            specs, page * target_config.num_blocks, num_gpu_blocks_override=target_config.num_blocks
        )
        self.kv_caches = allocate_kv_caches(config, specs, self.device)

    def follow_target(self, inputs: StepInputs) -> None:
        """Run the draft over this step's tokens, writing its KV where the target wrote its own."""
        model = self._require_model()
        ctx = ForwardContext(inputs.attn_metadata, self.kv_caches)
        model.forward(inputs.input_ids, inputs.positions, ctx)

    def propose(
        self, batch: InputBatch, rows: npt.NDArray[np.int64], max_drafts: npt.NDArray[np.int64]
    ) -> list[list[int]]:
        """Greedy drafts for batch `rows` (their last token is the one just sampled)."""
        model = self._require_model()
        table = batch.block_table[0]
        block_size = table.block_size
        last_pos = batch.num_tokens[rows].astype(np.int64) - 1
        # Draft i writes KV at last_pos + i: it must stay inside the row's blocks.
        room = table.num_blocks_per_row[rows].astype(np.int64) * block_size - last_pos
        budget = np.minimum(np.minimum(max_drafts, room), self.k).clip(min=0)
        drafts: list[list[int]] = [[] for _ in rows]
        active = np.flatnonzero(budget > 0)
        if len(active) == 0:
            return drafts
        # The token each row feeds next: the one just sampled, then its own drafts.
        feed = batch.token_ids_cpu[rows, last_pos].astype(np.int64)
        block_rows = table.block_table.np
        for step in range(int(budget.max())):
            active = active[budget[active] > step]
            batch_rows = rows[active]
            positions = last_pos[active] + step
            blocks = block_rows[batch_rows, positions // block_size].astype(np.int64)
            slots = blocks * block_size + positions % block_size
            n = len(active)
            meta = self.builder.build(
                num_reqs=n,
                num_actual_tokens=n,
                query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=self.device),
                seq_lens=torch.from_numpy((positions + 1).astype(np.int32)).to(self.device),
                block_table=torch.from_numpy(block_rows[batch_rows]).to(self.device),
                slot_mapping=torch.from_numpy(slots).to(self.device),
                max_query_len=1,
                max_seq_len=int(positions.max()) + 1,
            )
            self._positions.np[:n] = positions
            input_ids = torch.from_numpy(feed[active]).to(self.device)
            hidden = model.forward(
                input_ids, self._positions.copy_to_gpu(n), ForwardContext(meta, self.kv_caches)
            )
            tokens = model.compute_logits(hidden).argmax(dim=-1).cpu().numpy()
            feed[active] = tokens
            for i, token in zip(active.tolist(), tokens.tolist(), strict=True):
                drafts[i].append(token)
        return drafts
