"""The persistent batch (seed: InputBatch: 永続バッチと状態管理).

`CachedRequestState` is one request's logical state; it lives in
`ModelRunner.requests` from its first schedule until it finishes, and
survives preemption. `InputBatch` holds the requests scheduled in the
current step as rows of preallocated host arrays (token ids, counts,
sampling parameters, block table). Between steps only the deltas are
written, so a decode step touches a few bytes per request.

Row layout: live rows are `req_ids[i] is not None`. `remove_request`
leaves a hole; `condense` moves the last live rows into the holes so that
rows `[0, num_reqs)` are exactly the live ones again:

    [A, _, B, _, C]  --condense-->  [A, C, B]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from paged.multimodal.inputs import MultiModalFeatureSpec
from paged.runner.block_table import MultiGroupBlockTable
from paged.runner.buffers import CpuGpuBuffer
from paged.scheduler.sampling_params import SamplingParams

_GREEDY_EPS = 1e-5
_V = TypeVar("_V")


def _move_key(d: dict[int, _V], src: int, dst: int) -> None:
    if src in d:
        d[dst] = d.pop(src)


def _swap_keys(d: dict[int, _V], a: int, b: int) -> None:
    va, vb = d.pop(a, None), d.pop(b, None)
    if va is not None:
        d[b] = va
    if vb is not None:
        d[a] = vb


@dataclass
class CachedRequestState:
    """One request as the runner knows it (persists across steps and preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    mm_features: list[MultiModalFeatureSpec] | None = None
    lora_request: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_token_id(self, idx: int) -> int:
        if idx < self.num_prompt_tokens:
            return self.prompt_token_ids[idx]
        return self.output_token_ids[idx - self.num_prompt_tokens]


class InputBatch:
    """Preallocated rows for up to `max_num_reqs` requests (see module docstring)."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device | str,
        vocab_size: int,
        block_sizes: Sequence[int],
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        if max_num_reqs <= 0 or max_model_len <= 0 or vocab_size <= 0:
            raise ValueError(
                "max_num_reqs, max_model_len and vocab_size must be positive, got "
                f"{max_num_reqs}, {max_model_len}, {vocab_size}"
            )
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)

        self._req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}

        self.token_ids_cpu_tensor = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int32)
        self.token_ids_cpu: npt.NDArray[np.int32] = self.token_ids_cpu_tensor.numpy()
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        self.is_greedy = np.zeros(max_num_reqs, dtype=np.bool_)

        self.block_table = MultiGroupBlockTable(
            max_num_reqs,
            max_model_len,
            max_num_batched_tokens,
            device,
            block_sizes,
        )

        def buf(dtype: torch.dtype) -> CpuGpuBuffer:
            return CpuGpuBuffer(max_num_reqs, dtype=dtype, device=device)

        self.temperature = buf(torch.float32)
        self.top_p = buf(torch.float32)
        self.top_k = buf(torch.int32)
        self.min_p = buf(torch.float32)
        self.presence_penalties = buf(torch.float32)
        self.frequency_penalties = buf(torch.float32)
        self.repetition_penalties = buf(torch.float32)

        # Sparse per-row state, keyed by row (moved by condense/swap).
        self.generators: dict[int, torch.Generator] = {}
        self.min_tokens: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.logit_bias: dict[int, tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]] = {}
        # Keyed by request id (do not move with rows).
        self.num_logprobs: dict[str, int] = {}
        self.num_prompt_logprobs: dict[str, int] = {}

    # ------------------------------------------------------------------ rows

    @property
    def req_ids(self) -> list[str]:
        """Live request ids in row order (valid after `condense`)."""
        return [r for r in self._req_ids if r is not None]

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, request: CachedRequestState) -> int:
        """Place `request` in the lowest free row and return that row."""
        if request.req_id in self.req_id_to_index:
            raise ValueError(f"request {request.req_id!r} is already in the batch")
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.req_id!r} has {request.num_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        row = next((i for i, r in enumerate(self._req_ids) if r is None), len(self._req_ids))
        if row >= self.max_num_reqs:
            raise ValueError(f"the batch is full (max_num_reqs={self.max_num_reqs})")
        if row == len(self._req_ids):
            self._req_ids.append(request.req_id)
        else:
            self._req_ids[row] = request.req_id
        self.req_id_to_index[request.req_id] = row

        n_prompt = request.num_prompt_tokens
        self.token_ids_cpu[row, :n_prompt] = request.prompt_token_ids
        self.token_ids_cpu[row, n_prompt : request.num_tokens] = request.output_token_ids
        self.num_tokens[row] = request.num_tokens
        self.num_prompt_tokens[row] = n_prompt
        self.num_computed_tokens_cpu[row] = request.num_computed_tokens
        self.block_table.add_row(request.block_ids, row)
        self._set_sampling_params(row, request)
        return row

    def _set_sampling_params(self, row: int, request: CachedRequestState) -> None:
        sp = request.sampling_params
        greedy = sp.temperature < _GREEDY_EPS
        self.is_greedy[row] = greedy
        self.temperature.np[row] = 1.0 if greedy else sp.temperature
        self.top_p.np[row] = sp.top_p
        top_k = sp.effective_top_k
        self.top_k.np[row] = self.vocab_size if top_k == 0 else min(top_k, self.vocab_size)
        self.min_p.np[row] = sp.min_p
        self.presence_penalties.np[row] = sp.presence_penalty
        self.frequency_penalties.np[row] = sp.frequency_penalty
        self.repetition_penalties.np[row] = sp.repetition_penalty
        if request.generator is not None:
            self.generators[row] = request.generator
        if sp.min_tokens > 0:
            stop_ids = list(sp.stop_token_ids)
            if not sp.ignore_eos:
                stop_ids.extend(self.eos_token_ids)
            stop = tuple(t for t in dict.fromkeys(stop_ids) if t < self.vocab_size)
            if stop:
                self.min_tokens[row] = (sp.min_tokens, stop)
        if sp.logit_bias:
            tokens = np.fromiter(sp.logit_bias.keys(), dtype=np.int64)
            if (tokens < 0).any() or (tokens >= self.vocab_size).any():
                raise ValueError(
                    f"logit_bias has token ids outside the vocabulary [0, {self.vocab_size})"
                )
            values = np.fromiter(sp.logit_bias.values(), dtype=np.float32)
            self.logit_bias[row] = (tokens, values)
        if sp.logprobs is not None:
            self.num_logprobs[request.req_id] = sp.logprobs
        if sp.prompt_logprobs is not None:
            self.num_prompt_logprobs[request.req_id] = sp.prompt_logprobs

    def remove_request(self, req_id: str) -> int | None:
        """Drop `req_id` from the batch, leaving a hole; return its row (None if absent)."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        self._req_ids[row] = None
        self.generators.pop(row, None)
        self.min_tokens.pop(row, None)
        self.logit_bias.pop(row, None)
        self.num_logprobs.pop(req_id, None)
        self.num_prompt_logprobs.pop(req_id, None)
        self.block_table.clear_row(row)
        return row

    def _move_row(self, src: int, dst: int) -> None:
        req_id = self._req_ids[src]
        assert req_id is not None and self._req_ids[dst] is None
        n = int(self.num_tokens[src])
        self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
        for arr in self._row_arrays():
            arr[dst] = arr[src]
        for b in self._param_buffers():
            b.np[dst] = b.np[src]
        self.block_table.move_row(src, dst)
        _move_key(self.generators, src, dst)
        _move_key(self.min_tokens, src, dst)
        _move_key(self.logit_bias, src, dst)
        self._req_ids[dst] = req_id
        self._req_ids[src] = None
        self.req_id_to_index[req_id] = dst

    def _row_arrays(self) -> tuple[npt.NDArray[Any], ...]:
        return (
            self.num_tokens,
            self.num_prompt_tokens,
            self.num_computed_tokens_cpu,
            self.is_greedy,
        )

    def _param_buffers(self) -> tuple[CpuGpuBuffer, ...]:
        return (
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.presence_penalties,
            self.frequency_penalties,
            self.repetition_penalties,
        )

    def condense(self) -> None:
        """Fill holes with the last live rows so rows `[0, num_reqs)` are all live."""
        holes = [i for i, r in enumerate(self._req_ids) if r is None]
        last = len(self._req_ids) - 1
        for hole in holes:
            while last > hole and self._req_ids[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move_row(last, hole)
            last -= 1
        del self._req_ids[self.num_reqs :]

    def swap_states(self, i1: int, i2: int) -> None:
        """Exchange two live rows (used to reorder the batch)."""
        id1, id2 = self._req_ids[i1], self._req_ids[i2]
        if id1 is None or id2 is None:
            raise ValueError(f"swap_states needs two live rows, got {i1} and {i2}")
        n = int(max(self.num_tokens[i1], self.num_tokens[i2]))
        self.token_ids_cpu[[i1, i2], :n] = self.token_ids_cpu[[i2, i1], :n]
        for arr in self._row_arrays():
            arr[[i1, i2]] = arr[[i2, i1]]
        for b in self._param_buffers():
            b.np[[i1, i2]] = b.np[[i2, i1]]
        self.block_table.swap_row(i1, i2)
        _swap_keys(self.generators, i1, i2)
        _swap_keys(self.min_tokens, i1, i2)
        _swap_keys(self.logit_bias, i1, i2)
        self._req_ids[i1], self._req_ids[i2] = id2, id1
        self.req_id_to_index[id1], self.req_id_to_index[id2] = i2, i1

    # ---------------------------------------------------------------- tokens

    def append_token_ids(self, row: int, token_ids: Sequence[int]) -> None:
        """Append tokens (sampled or sent by the scheduler) to a live row."""
        start = int(self.num_tokens[row])
        end = start + len(token_ids)
        if end > self.max_model_len:
            raise ValueError(
                f"row {row} would hold {end} tokens, more than max_model_len={self.max_model_len}"
            )
        self.token_ids_cpu[row, start:end] = token_ids
        self.num_tokens[row] = end

    def check_integrity(self) -> None:
        """Raise AssertionError if the row bookkeeping is inconsistent."""
        live = {r: i for i, r in enumerate(self._req_ids) if r is not None}
        assert live == self.req_id_to_index, (live, self.req_id_to_index)
        for sparse in (self.generators, self.min_tokens, self.logit_bias):
            for row in sparse:
                assert row < len(self._req_ids) and self._req_ids[row] is not None, row
        for row in live.values():
            assert self.num_prompt_tokens[row] <= self.num_tokens[row] <= self.max_model_len
