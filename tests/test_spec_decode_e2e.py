"""Speculative decoding end to end (EngineCore + Scheduler + runner, fp32 on CPU).

Greedy tokens must equal the tokens without speculation, token for token, for
the n-gram proposer, a tiny random draft model and the target as its own
draft (then every draft is accepted), with a KV budget small enough to force
preemption and a token budget small enough to force chunked prefill. After
each workload no block is leaked (the KV cache manager's integrity check,
and every block free again).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from paged.runner.config import CacheConfig, EngineConfig, ModelConfig, SchedulerLimits
from paged.runner.spec_decode import SpeculativeConfig
from paged.scheduler.boundary import EngineCoreRequest, FinishReason, SpecDecodingStats
from paged.scheduler.sampling_params import SamplingParams
from paged.server.engine.core import EngineCore

VOCAB = 64
BLOCK = 4
MAX_LEN = 128


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _tiny_llama(path: Path, seed: int, layers: int) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_llama(tmp_path_factory.mktemp("target"), seed=0, layers=2)


@pytest.fixture(scope="module")
def draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_llama(tmp_path_factory.mktemp("draft"), seed=7, layers=1)


def engine_config(path: Path, spec: SpeculativeConfig | None, budget: int = 16) -> EngineConfig:
    model = ModelConfig.from_pretrained(str(path), dtype="float32", max_model_len=MAX_LEN)
    return EngineConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK, kv_cache_memory_bytes=1 << 20),
        scheduler_limits=SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=budget),
        speculative_config=spec,
    )


def spec_config(method: str, draft_path: Path | None = None, k: int = 3) -> SpeculativeConfig:
    if method == "ngram":
        return SpeculativeConfig("ngram", k, prompt_lookup_min=1, prompt_lookup_max=3)
    assert draft_path is not None
    draft_model = ModelConfig.from_pretrained(
        str(draft_path), dtype="float32", max_model_len=MAX_LEN
    )
    return SpeculativeConfig(
        "draft_model",
        k,
        model=str(draft_path),
        draft_model_config=draft_model,
        acceptance_rate_threshold=0.0,
    )


def prompts(seed: int) -> dict[str, list[int]]:
    """Repetitive prompts (n-gram material) of lengths past the 16-token step budget."""
    rng = random.Random(seed)
    out = {}
    for i, n in enumerate([23, 7, 30, 12, 18]):
        motif = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 6))]
        out[f"r{i}"] = (motif * 10)[:n]
    # Admitted last (max_num_seqs=4): starts from r2's cached prompt blocks.
    out["r5"] = out["r2"] + [9, 8]
    return out


@dataclasses.dataclass
class Run:
    tokens: dict[str, list[int]]
    finish: dict[str, FinishReason | None]
    spec: SpecDecodingStats
    preemptions: int
    cached_tokens: dict[str, int]


def run(
    config: EngineConfig,
    requests: dict[str, tuple[list[int], SamplingParams]],
    num_blocks: int,
) -> Run:
    core = EngineCore(config, num_gpu_blocks_override=num_blocks)
    try:
        for i, (rid, (prompt, params)) in enumerate(requests.items()):
            core.add_request(EngineCoreRequest(rid, prompt, params, 2, time.time() + i))
        tokens: dict[str, list[int]] = {rid: [] for rid in requests}
        finish: dict[str, FinishReason | None] = {}
        cached: dict[str, int] = {}
        drafts = draft_tokens = accepted = preemptions = 0
        per_pos: list[int] = []
        for _ in range(3000):
            if not core.has_work():
                break
            for outputs in core.run_step().values():
                for out in outputs.outputs:
                    tokens[out.request_id].extend(out.new_token_ids)
                    cached[out.request_id] = max(
                        cached.get(out.request_id, 0), out.num_cached_tokens
                    )
                    if out.finish_reason is not None:
                        finish[out.request_id] = out.finish_reason
                s = outputs.scheduler_stats
                if s is not None:
                    preemptions += s.num_preempted_reqs
                    if s.spec_decoding_stats is not None:
                        sd = s.spec_decoding_stats
                        drafts += sd.num_drafts
                        draft_tokens += sd.num_draft_tokens
                        accepted += sd.num_accepted_tokens
                        per_pos += [0] * (len(sd.num_accepted_tokens_per_pos) - len(per_pos))
                        for j, c in enumerate(sd.num_accepted_tokens_per_pos):
                            per_pos[j] += c
            core.scheduler.check_integrity()  # type: ignore[attr-defined]
        else:
            raise AssertionError("engine did not go idle")
        kv = core.scheduler.state.kv  # type: ignore[attr-defined]
        kv.check_integrity()
        pool = kv.block_pool
        # Every block but the null block is free again.
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 - pool.num_reserved_blocks
        stats = SpecDecodingStats(0, drafts, draft_tokens, accepted, per_pos)
        return Run(tokens, finish, stats, preemptions, cached)
    finally:
        core.shutdown()


def greedy_requests(seed: int, max_tokens: int = 30) -> dict[str, tuple[list[int], SamplingParams]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return {rid: (p, params) for rid, p in prompts(seed).items()}


@pytest.fixture(scope="module")
def baseline(target: Path) -> Run:
    return run(engine_config(target, None), greedy_requests(0), num_blocks=40)


@pytest.mark.parametrize("method", ["ngram", "draft_random", "draft_self"])
def test_greedy_identical_under_preemption_and_chunked_prefill(
    target: Path, draft: Path, baseline: Run, method: str
) -> None:
    spec = {
        "ngram": lambda: spec_config("ngram"),
        "draft_random": lambda: spec_config("draft_model", draft),
        "draft_self": lambda: spec_config("draft_model", target),
    }[method]()
    got = run(engine_config(target, spec), greedy_requests(0), num_blocks=40)
    assert got.preemptions > 0 and baseline.preemptions > 0, "the KV budget must force preemption"
    assert got.cached_tokens["r5"] >= 16, "r5 should start from r2's cached blocks"
    assert got.tokens == baseline.tokens
    assert got.spec.num_drafts > 0 and got.spec.num_draft_tokens > 0
    assert got.spec.num_accepted_tokens == sum(got.spec.num_accepted_tokens_per_pos)
    if method == "draft_self":
        assert got.spec.num_accepted_tokens == got.spec.num_draft_tokens
    else:
        assert 0 < got.spec.num_accepted_tokens <= got.spec.num_draft_tokens


def test_stop_token_and_max_tokens_inside_an_accepted_run(target: Path, baseline: Run) -> None:
    """The self-draft accepts everything, so stops land inside accepted runs and cut there."""
    tokens = baseline.tokens["r0"]
    stop_at = 9  # a token the baseline produces mid-stream
    stop_token = tokens[stop_at]
    first = tokens.index(stop_token)
    params = {
        "stop": SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_token]),
        "len": SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),
    }
    prompt = prompts(0)["r0"]
    requests = {rid: (prompt, p) for rid, p in params.items()}
    spec = spec_config("draft_model", target, k=4)
    got = run(engine_config(target, spec, budget=64), requests, num_blocks=60)
    assert got.tokens["stop"] == tokens[: first + 1]
    assert got.finish["stop"] is FinishReason.STOP
    assert got.tokens["len"] == tokens[:11]
    assert got.finish["len"] is FinishReason.LENGTH


def test_random_workload_leaks_no_block(target: Path, draft: Path) -> None:
    """Mixed greedy/seeded-random requests, n-gram drafts, a tight KV budget: blocks all return."""
    rng = random.Random(3)
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    for i in range(10):
        motif = [rng.randrange(3, VOCAB) for _ in range(3)]
        prompt = (motif * 12)[: rng.randrange(4, 40)]
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.8, 1.0]),
            max_tokens=rng.randrange(5, 40),
            seed=rng.randrange(1000) if rng.random() < 0.5 else None,
            stop_token_ids=[rng.randrange(3, VOCAB)] if rng.random() < 0.3 else [],
        )
        requests[f"w{i}"] = (prompt, params)
    got = run(engine_config(target, spec_config("ngram", k=4)), requests, num_blocks=36)
    assert set(got.finish) == set(requests)
    assert got.spec.num_draft_tokens > 0


def test_seeded_sampling_with_drafts_is_reproducible(target: Path) -> None:
    """Same seed, same tokens: run to run, and alone or beside other requests.

    (Beside others with a budget that never cuts a request's drafts short: a
    seeded request draws one uniform per draft it verifies, so its tokens
    depend on its own drafts only.)
    """
    # A low temperature: the tiny random model is near uniform, drafts would never pass.
    params = SamplingParams(temperature=0.03, max_tokens=25, seed=1234, ignore_eos=True)
    requests = {rid: (p, params) for rid, p in prompts(1).items()}
    spec = spec_config("draft_model", target, k=3)
    a = run(engine_config(target, spec), requests, num_blocks=60)
    b = run(engine_config(target, spec), requests, num_blocks=60)
    assert a.tokens == b.tokens
    assert a.spec.num_accepted_tokens > 0
    ngram = spec_config("ngram", k=3)
    together = run(engine_config(target, ngram, budget=256), requests, num_blocks=200)
    alone = run(engine_config(target, ngram, budget=256), {"r2": requests["r2"]}, num_blocks=200)
    assert alone.tokens["r2"] == together.tokens["r2"]
    assert together.spec.num_draft_tokens > 0


@pytest.mark.slow
def test_engine_process_with_a_draft_model(target: Path, draft: Path, baseline: Run) -> None:
    """The config, drafts and spec stats cross the process boundary (spawned engine core)."""
    from paged.server.engine.client import SyncMPClient
    from paged.server.engine.core import make_engine_core_factory

    config = engine_config(target, spec_config("draft_model", draft))
    client = SyncMPClient(make_engine_core_factory(config, num_gpu_blocks_override=40))
    try:
        requests = greedy_requests(0)
        for i, (rid, (prompt, params)) in enumerate(requests.items()):
            client.add_request(EngineCoreRequest(rid, prompt, params, 2, time.time() + i))
        tokens: dict[str, list[int]] = {rid: [] for rid in requests}
        done: set[str] = set()
        drafted = 0
        deadline = time.monotonic() + 300
        while done != set(requests):
            assert time.monotonic() < deadline, "the engine process did not finish"
            outputs = client.get_output()
            for out in outputs.outputs:
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finish_reason is not None:
                    done.add(out.request_id)
            stats = outputs.scheduler_stats
            if stats is not None and stats.spec_decoding_stats is not None:
                drafted += stats.spec_decoding_stats.num_draft_tokens
    finally:
        client.shutdown()
    assert tokens == baseline.tokens
    assert drafted > 0


def test_drafting_policies_keep_greedy_output(target: Path, baseline: Run) -> None:
    """The cost policy and `disable_by_batch_size` change how much is drafted, not the tokens."""
    base = spec_config("ngram", k=4)
    fixed = run(
        engine_config(target, dataclasses.replace(base, draft_policy="fixed")),
        greedy_requests(0),
        num_blocks=40,
    )
    cost = run(engine_config(target, base), greedy_requests(0), num_blocks=40)
    off = run(
        engine_config(target, dataclasses.replace(base, disable_by_batch_size=1)),
        greedy_requests(0),
        num_blocks=40,
    )
    assert fixed.tokens == cost.tokens == off.tokens == baseline.tokens
    assert fixed.spec.num_draft_tokens > 0 and cost.spec.num_draft_tokens > 0
    assert off.spec.num_draft_tokens == 0


def test_bf16_c_attention_greedy_identical_with_ngram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 on CPU: plain decode rows and verification rows go through one C attention
    call (cpu_step/attention.c, the same code for one row or several), so n-gram
    speculation gives the plain greedy tokens there too, not only in float32.

    Head size 64 (the kernel's vector path) and a 64-token step budget, so that
    verification steps, decode steps and short prefill chunks all take the C call
    and the 23-30-token prompts go through SDPA as whole prefills.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged.runner.attention import cpu_decode
    from paged.runner.cpu_step import attention_ops

    if not attention_ops.available():
        pytest.skip("no C compiler: the torch attention path")
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)

    def bf16_config(spec: SpeculativeConfig | None) -> EngineConfig:
        model = ModelConfig.from_pretrained(str(tmp_path), dtype="bfloat16", max_model_len=MAX_LEN)
        return EngineConfig(
            model_config=model,
            cache_config=CacheConfig(block_size=16, kv_cache_memory_bytes=1 << 22),
            scheduler_limits=SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64),
            speculative_config=spec,
        )

    calls: list[int] = []
    real = cpu_decode.decode_attention

    def counting(plan: cpu_decode.DecodePlan, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(plan.max_query_len)
        return real(plan, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_decode, "decode_attention", counting)
    plain = run(bf16_config(None), greedy_requests(1, max_tokens=40), num_blocks=64)
    plain_calls = len(calls)
    spec = run(
        bf16_config(SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3)),
        greedy_requests(1, max_tokens=40),
        num_blocks=64,
    )
    assert plain_calls > 0 and max(calls[plain_calls:]) > 1, "verification rows took the C call"
    assert spec.spec.num_accepted_tokens > 0
    assert spec.tokens == plain.tokens


def test_bf16_hybrid_sliding_window_spec_equals_plain_with_mixed_prefill_steps(
    tmp_path: Path,
) -> None:
    """A random bf16 Gemma 3 (sliding and full layers, head size 64): with n-gram drafts,
    greedy tokens equal plain greedy tokens although verification rows share steps with
    prefill chunks (64-token budget, prompts up to 50). Those steps are split: short runs
    through the C attention, chunks through SDPA. Before the split, a step with a chunk
    sent every row to SDPA, whose multi-row and one-row kernels round differently, and
    one of these four requests diverged."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from paged.runner.cpu_step import attention_ops
    from paged.server.llm import LLM

    if not attention_ops.available():
        pytest.skip("no C compiler: the torch attention path")
    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        rms_norm_eps=1e-6, query_pre_attn_scalar=24, sliding_window=20,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        bos_token_id=2, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(1)
    model: Any = Gemma3ForCausalLM(config)
    model = model.float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.randn_like(param) * 0.3)
    model.save_pretrained(str(tmp_path))
    prompts = [
        [2] + [(7 * i + j * 3) % 120 + 3 for j in range(n)] for i, n in enumerate([5, 30, 12, 50])
    ]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    tokens = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4,
                        "prompt_lookup_min": 1, "prompt_lookup_max": 3}):  # fmt: skip
        llm = LLM(
            str(tmp_path), dtype="bfloat16", max_model_len=256, max_num_batched_tokens=64,
            max_num_seqs=4, speculative_config=spec,
        )  # fmt: skip
        try:
            outs = llm.generate(prompts, params)
        finally:
            llm.shutdown()
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
    assert tokens[1] == tokens[0]
