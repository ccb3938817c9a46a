"""The runner's multimodal half (seed: GPUModelRunner `_execute_mm_encoder`,
`_gather_mm_embeddings`, `embed_input_ids`), held by `ModelRunner` by composition.

Per step, in this order (`step` runs the first four):

    free(free_encoder_mm_hashes)      drop what the scheduler's EncoderCacheManager evicted
    EC connector, consumer            bind the step's metadata, start_load_caches: loaded
                                      embeddings are written straight into the cache
    execute(scheduled_encoder_inputs) run the encoder for the scheduled items, batched per
                                      modality; outputs -> encoder_cache rows [E, H];
                                      producer: save_caches(encoder_cache, mm_hash) each
    recompute failed loads            an item whose synchronous load failed (missing or
                                      corrupt file) is encoded here, same output
    EC connector report               get_finished + get_failed_loads -> ECConnectorOutput
    prepare(batch, inputs)            for every request's chunk [computed, computed + n):
                                      the slice of each overlapping item's output it needs
                                      (is_embed picks the embedded positions), in token order,
                                      the [T] is_mm_embed mask, and (Gemma3) each token's
                                      bidirectional span -> MultiModalStepInputs

A chunk that covers positions [c, c + n) of an item at [o, o + L) uses item
positions r in [max(c - o, 0), min(c + n - o, L)); with is_embed the output rows
are cumsum(is_embed) over that window:

    item      o ........................ o+L
    is_embed  0  1  1  1  1  1  1  1  1  0
    chunk          [c ......... c+n)
    rows           sum(is_embed[:c-o]) .. sum(is_embed[:c+n-o])

The cache is the worker's copy of the scheduler's: it holds an output from the
step its item was scheduled until the scheduler lists its hash as freed, so a
chunked prefill across a placeholder, and other requests with the same image,
read the same tensor without re-encoding. It is one preallocated buffer
(`PreallocatedEncoderCache`, sized like the scheduler's EncoderCacheManager),
handed to the EC connector once with `register_caches`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from paged.multimodal.encoder_cache import compute_mm_encoder_budget
from paged.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, TensorData
from paged.runner.ec_connector import ECConnectorWorker
from paged.runner.encoder_cache_buffer import PreallocatedEncoderCache
from paged.runner.input_batch import CachedRequestState, InputBatch
from paged.runner.input_prep import StepInputs
from paged.runner.models.interface import SupportsMultiModal
from paged.scheduler.boundary import ECConnectorOutput, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class MultiModalStepInputs:
    """This step's encoder outputs to merge, and the attention spans they need."""

    inputs_embeds: torch.Tensor  # [T, H] text embeddings with the image rows merged in
    # [T, 2] int32 per token: the bidirectional span it sits in (start == end: none);
    # None when no token of the step is in a span (plain causal attention).
    bidirectional_ranges: torch.Tensor | None


def tensor_from_data(data: TensorData) -> torch.Tensor:
    """A TensorData (raw row-major bytes) as a CPU tensor (copied: the bytes are read-only)."""
    array = np.frombuffer(data.data, dtype=np.dtype(data.dtype)).reshape(data.shape)
    return torch.from_numpy(array.copy())


def embed_runs(pos: PlaceholderRange) -> list[tuple[int, int]]:
    """Absolute [start, end) of each contiguous run of embedded positions of an item."""
    if pos.is_embed is None:
        return [(pos.offset, pos.end)]
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for j, embedded in enumerate([*pos.is_embed, False]):
        if embedded and start is None:
            start = j
        elif not embedded and start is not None:
            runs.append((pos.offset + start, pos.offset + j))
            start = None
    return runs


def encoder_cache_capacity(
    max_num_batched_tokens: int, max_tokens_per_mm_item: int, encoder_cache_size: int | None = None
) -> int:
    """Embeddings the worker's cache holds: the scheduler's EncoderCacheManager size.

    The same resolution as the scheduler's (`compute_mm_encoder_budget`, with
    `encoder_cache_size` None meaning max_num_batched_tokens), so every
    allocation the scheduler admits fits the buffer.
    """
    size = max_num_batched_tokens if encoder_cache_size is None else encoder_cache_size
    budget = compute_mm_encoder_budget(max_num_batched_tokens, size, max_tokens_per_mm_item)
    return max(budget.encoder_cache_size, 1)


class EncoderRunner:
    """Encoder cache keyed by mm_hash, the per-step gather, and the merge into embeddings.

    Holds the preallocated cache and, optionally, the worker side of an EC
    connector (composition: the runner calls it, never the other way round).
    """

    def __init__(
        self,
        model: SupportsMultiModal,
        device: torch.device,
        encoder_cache: PreallocatedEncoderCache,
        ec_connector: ECConnectorWorker | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.encoder_cache = encoder_cache
        self.ec_connector = ec_connector
        if ec_connector is not None:
            ec_connector.register_caches(encoder_cache)  # vLLM's gap 3
        # Counters for tests and metrics: encoder forward calls, items encoded,
        # items encoded because their connector load failed.
        self.num_encoder_calls = 0
        self.num_encoded_items = 0
        self.num_recomputed_loads = 0

    def free(self, mm_hashes: Iterable[str]) -> None:
        """Drop the outputs the scheduler evicted (a hash it never sent here is ignored)."""
        for mm_hash in mm_hashes:
            self.encoder_cache.free(mm_hash)

    def step(
        self, scheduler_output: SchedulerOutput, requests: Mapping[str, CachedRequestState]
    ) -> ECConnectorOutput | None:
        """Free, load, encode and report for one step (module docstring); before the forward."""
        so = scheduler_output
        self.free(so.free_encoder_mm_hashes)
        connector = self.ec_connector
        if connector is None:
            self.execute(so.scheduled_encoder_inputs, requests)
            return None
        bound = so.ec_connector_metadata is not None
        if so.ec_connector_metadata is not None:
            connector.bind_connector_metadata(so.ec_connector_metadata)
        try:
            failed: set[str] = set()
            if connector.is_consumer:
                connector.start_load_caches(self.encoder_cache)
                failed = connector.get_failed_loads()
            self.execute(so.scheduled_encoder_inputs, requests)
            if failed:
                self._recompute_failed_loads(failed, so.num_scheduled_tokens, requests)
        finally:
            if bound:
                connector.clear_connector_metadata()
        sending, recving = connector.get_finished(set(so.finished_req_ids))
        failed |= connector.get_failed_loads()
        return ECConnectorOutput(
            finished_sending=sorted(sending or ()),
            finished_recving=sorted(recving or ()),
            failed_recving=sorted(failed),
        )

    def _recompute_failed_loads(
        self,
        failed: set[str],
        num_scheduled_tokens: Mapping[str, int],
        requests: Mapping[str, CachedRequestState],
    ) -> None:
        """Encode the items this step needs whose load failed (their data came along)."""
        needed: dict[str, list[int]] = {}
        for req_id, n in num_scheduled_tokens.items():
            state = requests.get(req_id)
            if state is None or not state.mm_features:
                continue
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            for i, feature in enumerate(state.mm_features):
                pos = feature.mm_position
                if (
                    feature.identifier in failed
                    and feature.identifier not in self.encoder_cache
                    and pos.offset < end
                    and pos.end > start
                ):
                    needed.setdefault(req_id, []).append(i)
        if needed:
            before = self.num_encoded_items
            self.execute(needed, requests)
            self.num_recomputed_loads += self.num_encoded_items - before

    def execute(
        self,
        scheduled_encoder_inputs: Mapping[str, list[int]],
        requests: Mapping[str, CachedRequestState],
    ) -> None:
        """Encode the scheduled items not cached yet: one batched call per modality."""
        by_modality: dict[str, list[MultiModalFeatureSpec]] = {}
        chosen: set[str] = set()
        for req_id, indices in scheduled_encoder_inputs.items():
            state = requests.get(req_id)
            if state is None:
                raise ValueError(f"scheduled_encoder_inputs: unknown request {req_id!r}")
            features = state.mm_features or []
            for i in indices:
                if not 0 <= i < len(features):
                    raise ValueError(
                        f"scheduled_encoder_inputs[{req_id!r}]: item {i} out of range "
                        f"({len(features)} items)"
                    )
                feature = features[i]
                if feature.identifier in self.encoder_cache or feature.identifier in chosen:
                    continue  # the same image twice in one step is encoded once
                if feature.data is None:
                    raise ValueError(
                        f"request {req_id!r} item {i} (mm_hash {feature.identifier}) reached "
                        "the runner without data: the engine's processor-cache mirror "
                        "should have restored its tensors"
                    )
                chosen.add(feature.identifier)
                by_modality.setdefault(feature.modality, []).append(feature)
        for modality, items in by_modality.items():
            data = [
                {key: tensor_from_data(t).to(self.device) for key, t in (f.data or {}).items()}
                for f in items
            ]
            outputs = self.model.embed_multimodal(modality, data)
            self.num_encoder_calls += 1
            self.num_encoded_items += len(items)
            for feature, output in zip(items, outputs, strict=True):
                expected = feature.mm_position.get_num_embeds()
                if output.shape[0] != expected:
                    raise ValueError(
                        f"mm_hash {feature.identifier}: the encoder gave {output.shape[0]} "
                        f"embeddings for a placeholder with {expected} embedded positions"
                    )
                self.encoder_cache.store(feature.identifier, output)
                if self.ec_connector is not None and self.ec_connector.is_producer:
                    self._save(self.ec_connector, feature.identifier)

    def _save(self, connector: ECConnectorWorker, mm_hash: str) -> None:
        """A failed save (disk full, peer gone) costs a later recompute, never this step."""
        try:
            connector.save_caches(self.encoder_cache, mm_hash)
        except Exception:
            logger.warning("EC connector: saving mm_hash %s failed", mm_hash, exc_info=True)

    def prepare(
        self,
        batch: InputBatch,
        inputs: StepInputs,
        requests: Mapping[str, CachedRequestState],
    ) -> MultiModalStepInputs | None:
        """Gather this step's encoder rows and merge them into the token embeddings.

        None when no token of the step lies in an item (text and decode steps),
        so the plain forward, and CUDA graphs for decode, stay in use.
        """
        total = inputs.num_tokens
        is_mm = np.zeros(total, dtype=np.bool_)
        ranges: npt.NDArray[np.int32] | None = None
        pieces: list[torch.Tensor] = []
        bidirectional = self.model.bidirectional_mm_attention
        token_start = 0
        for row, req_id in enumerate(inputs.req_ids):
            n = int(inputs.num_scheduled[row])
            features = requests[req_id].mm_features
            if features:
                computed = int(batch.num_computed_tokens_cpu[row])
                for feature in features:
                    pos = feature.mm_position
                    if pos.offset >= computed + n:
                        break  # sorted by offset
                    if pos.end <= computed:
                        continue
                    pieces.extend(self._slice(feature, computed, n, token_start, is_mm))
                    if bidirectional:
                        ranges = _mark_spans(ranges, total, pos, computed, n, token_start, req_id)
            token_start += n
        ids = inputs.input_ids
        if not pieces and ranges is None:
            return None
        if not pieces:  # only special tokens of an item (boi / eoi) in this chunk
            return MultiModalStepInputs(self.model.embed_input_ids(ids), None)
        mask = torch.from_numpy(is_mm).to(self.device)
        embeds = self.model.embed_input_ids(ids, torch.cat(pieces), mask)
        ranges_t = None if ranges is None else torch.from_numpy(ranges).to(self.device)
        return MultiModalStepInputs(embeds, ranges_t)

    def _slice(
        self,
        feature: MultiModalFeatureSpec,
        computed: int,
        n: int,
        token_start: int,
        is_mm: npt.NDArray[np.bool_],
    ) -> list[torch.Tensor]:
        pos = feature.mm_position
        start_rel = max(computed - pos.offset, 0)
        end_rel = min(computed + n - pos.offset, pos.length)
        output = self.encoder_cache.get(feature.identifier)
        if output is None:
            raise ValueError(
                f"mm_hash {feature.identifier}: its encoder output is needed at positions "
                f"[{pos.offset + start_rel}, {pos.offset + end_rel}) but is not in the "
                "runner's encoder cache (never scheduled, or freed too early)"
            )
        first = token_start + pos.offset + start_rel - computed
        if pos.is_embed is None:
            is_mm[first : first + end_rel - start_rel] = True
            return [output[start_rel:end_rel]]
        window = np.asarray(pos.is_embed[start_rel:end_rel], dtype=np.bool_)
        if not window.any():
            return []
        lo = sum(pos.is_embed[:start_rel])
        is_mm[first : first + len(window)] = window
        return [output[lo : lo + int(window.sum())]]


def _mark_spans(
    ranges: npt.NDArray[np.int32] | None,
    total: int,
    pos: PlaceholderRange,
    computed: int,
    n: int,
    token_start: int,
    req_id: str,
) -> npt.NDArray[np.int32] | None:
    """Record, for this chunk's tokens inside an embedded run, the run as their span."""
    end = computed + n
    for run_start, run_end in embed_runs(pos):
        lo, hi = max(run_start, computed), min(run_end, end)
        if lo >= hi:
            continue
        if run_end > end:
            raise ValueError(
                f"request {req_id!r}: this step ends at position {end}, inside the image at "
                f"[{run_start}, {run_end}) whose tokens attend to each other both ways; "
                "the scheduler must not split it (disable_chunked_mm_input)"
            )
        if ranges is None:
            ranges = np.zeros((total, 2), dtype=np.int32)
        first = token_start + lo - computed
        ranges[first : first + hi - lo] = (run_start, run_end)
    return ranges
