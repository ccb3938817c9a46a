"""Shared fixtures for paged.server engine tests.

`FakeCore` is an `EngineCoreLike` with scripted behaviour (no model), used to
test the process loop and the clients. It lives here, at module level, so
that the `spawn`ed engine process can unpickle a factory that refers to it.
"""

from __future__ import annotations

import os
import time
import types
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from paged.kvcache import FullAttentionSpec, KVCacheConfig
from paged.scheduler.boundary import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from paged.scheduler.sampling_params import SamplingParams
from paged.scheduler.testing import FakeRunner
from paged.server.engine.messages import UTILITY_RESULT_TYPES, EngineCoreInfo, EngineCoreStats

if TYPE_CHECKING:
    from paged.runner.config import EngineConfig

# Keep this module light: spawned engine processes import it to unpickle
# `FakeCore`, and torch/transformers take many seconds to import on a busy
# machine. Heavy imports live inside the functions that need them.


class FakeCore:
    """Emits token `prompt[-1] + k` at its k-th step for each request, then finishes.

    A request with multimodal data starts from the CRC32 of its tensor bytes instead.

    `fail_on_init` raises at construction (as a bad model path would);
    `crash_after_steps` raises inside `run_step` after that many steps;
    `step_sleep_s` makes each step take that long, `init_sleep_s` construction;
    `unencodable_output` emits outputs msgpack cannot encode.
    """

    def __init__(
        self,
        fail_on_init: bool = False,
        crash_after_steps: int | None = None,
        step_sleep_s: float = 0.0,
        init_sleep_s: float = 0.0,
        unencodable_output: bool = False,
    ) -> None:
        time.sleep(init_sleep_s)
        if fail_on_init:
            raise FileNotFoundError("model path '/no/such/model' does not exist")
        self._crash_after = crash_after_steps
        self._unencodable = unencodable_output
        self._sleep = step_sleep_s
        self._requests: dict[str, tuple[EngineCoreRequest, int]] = {}
        self._aborted: list[str] = []
        self.mm_checksums: dict[str, int] = {}
        self.num_steps = 0
        self.added = 0
        self.aborted = 0

    @property
    def info(self) -> EngineCoreInfo:
        return EngineCoreInfo(
            num_gpu_blocks=7, block_size=16, max_model_len=128, kv_cache_memory_bytes=1 << 20
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        if not request.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        self._requests[request.request_id] = (request, 0)
        self.added += 1
        if request.mm_features:
            # Echo a checksum of the multimodal bytes so tests see they arrived intact.
            blob = b"".join(t.data for f in request.mm_features for t in (f.data or {}).values())
            self.mm_checksums[request.request_id] = zlib.crc32(blob)

    def abort_requests(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            if self._requests.pop(rid, None) is not None:
                self.aborted += 1

    def has_work(self) -> bool:
        return bool(self._requests)

    def run_step(self) -> dict[int, EngineCoreOutputs]:
        self.num_steps += 1
        if self._crash_after is not None and self.num_steps > self._crash_after:
            raise RuntimeError("simulated failure inside a step")
        if self._sleep:
            time.sleep(self._sleep)
        outs: list[EngineCoreOutput] = []
        for rid, (req, done) in list(self._requests.items()):
            token = self.mm_checksums.get(rid, req.prompt_token_ids[-1]) + done
            max_tokens = req.sampling_params.max_tokens or 1
            finished = done + 1 >= max_tokens
            reason = FinishReason.LENGTH if finished else None
            # Structs do not validate on construction: this only fails to encode.
            stop: Any = object() if self._unencodable else None
            outs.append(EngineCoreOutput(rid, [token], finish_reason=reason, stop_reason=stop))
            if finished:
                del self._requests[rid]
            else:
                self._requests[rid] = (req, done + 1)
        if not outs:
            return {}
        stats = SchedulerStats(num_running_reqs=len(self._requests))
        return {0: EngineCoreOutputs(outputs=outs, scheduler_stats=stats, timestamp=time.time())}

    def call_utility(self, method: str, args: Sequence[Any]) -> object:
        if method not in UTILITY_RESULT_TYPES:
            raise ValueError(f"unknown utility {method!r}")
        if method == "get_stats":
            return EngineCoreStats(
                num_steps=self.num_steps,
                num_model_steps=self.num_steps,
                num_requests_added=self.added,
                num_requests_aborted=self.aborted,
                num_gpu_blocks=7,
            )
        if method == "get_num_unfinished_requests":
            return len(self._requests)
        if method == "get_info":
            return object() if list(args) == ["unencodable"] else self.info
        if method == "is_healthy":
            return True
        if method == "reset_prefix_cache":
            if args and args[0] == "raise":
                raise RuntimeError("cannot reset while requests run")
            return True
        raise AssertionError(method)

    def shutdown(self) -> None:
        pass


def make_request(request_id: str, prompt: list[int], max_tokens: int = 3) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        eos_token_id=None,
        arrival_time=time.time(),
    )


def array_of(n: int) -> np.ndarray[Any, Any]:
    return np.arange(n, dtype=np.float32)


# ---- fixtures (test modules cannot import conftest under importlib mode) ----
import pytest  # noqa: E402


@pytest.fixture
def fake_core_cls() -> type[FakeCore]:
    return FakeCore


@pytest.fixture
def request_factory() -> Any:
    return make_request


def exit_before_handshake() -> FakeCore:
    """A core factory whose process dies without a word (like a segfault at load)."""
    os._exit(3)


@pytest.fixture
def exit_factory() -> Any:
    return exit_before_handshake


class FakeExecutor:
    """An executor over the scheduler's deterministic `FakeRunner` (no model).

    Two-phase like the real runner: `execute_model` returns None and
    `sample_tokens` hands out the result. `fail_health` makes `check_health`
    raise; `execute_sleep_s` slows each step (to observe overlap).
    """

    def __init__(self, engine_config: EngineConfig) -> None:
        self.block_size = engine_config.cache_config.block_size
        self.runner = FakeRunner(block_size=self.block_size)
        self.kv_cache_config: KVCacheConfig | None = None
        self.pending: ModelRunnerOutput | None = None
        self.grammar_seen: list[GrammarOutput | None] = []
        self.executed: list[SchedulerOutput] = []
        self.fail_health = False
        self.execute_sleep_s = 0.0
        self.is_shut_down = False

    def get_kv_cache_specs(self) -> dict[str, FullAttentionSpec]:
        spec = FullAttentionSpec(
            block_size=self.block_size, num_kv_heads=1, head_size=8, dtype="float32"
        )
        return {"layers.0.attn": spec}

    def determine_available_memory(self) -> int:
        return 1 << 16

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        assert self.pending is None, "execute_model twice without sample_tokens"
        if self.execute_sleep_s:
            time.sleep(self.execute_sleep_s)
        self.executed.append(scheduler_output)
        self.pending = self.runner.execute(scheduler_output)
        return None

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        assert self.pending is not None, "sample_tokens without execute_model"
        self.grammar_seen.append(grammar_output)
        out, self.pending = self.pending, None
        return out

    def check_health(self) -> None:
        if self.fail_health:
            raise RuntimeError("worker is gone")

    def shutdown(self) -> None:
        self.is_shut_down = True


def tiny_engine_config(
    *,
    max_model_len: int = 64,
    block_size: int = 4,
    kv_cache_memory_bytes: int | None = 1 << 14,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    vocab_size: int = 128,
) -> EngineConfig:
    """An EngineConfig for a model that exists only as a config (for fake executors).

    The HF config is a plain namespace with the fields EngineConfig checks, so
    that an engine process unpickling it need not import transformers.
    """
    import torch

    from paged.runner.config import CacheConfig, EngineConfig, ModelConfig, SchedulerLimits

    hf = types.SimpleNamespace(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=max_model_len,
    )
    model = ModelConfig(
        model="fake",
        hf_config=hf,
        architecture="LlamaForCausalLM",
        dtype=torch.float32,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        eos_token_ids=(),
        bos_token_id=None,
        tokenizer="fake",
        gguf_file=None,
        weights_format="safetensors",
    )
    return EngineConfig(
        model_config=model,
        cache_config=CacheConfig(
            block_size=block_size, kv_cache_memory_bytes=kv_cache_memory_bytes
        ),
        scheduler_limits=SchedulerLimits(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
        ),
    )


@pytest.fixture
def fake_executor_cls() -> type[FakeExecutor]:
    return FakeExecutor


@pytest.fixture
def engine_config_factory() -> Any:
    return tiny_engine_config
