"""--async-scheduling and --kv-cache-metrics reach the real engine, from the CLI down.

A tiny random Llama checkpoint with the frontend tests' BPE tokenizer is built
in a temporary directory (no download), so `LLM(**vars(engine_args_from(argv)))`
runs the same path as `paged generate`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from prometheus_client import generate_latest

from paged.scheduler import SamplingParams, SchedulerStats
from paged.server.cli import build_parser, engine_args_from
from paged.server.engine.client import InprocClient
from paged.server.engine_args import EngineArgs
from paged.server.llm import LLM
from paged.server.metrics import PrometheusStatLogger

PROMPTS = ["hello world the quick", "café naïve résumé", "0123456789 + - * /", "The capital"]
RESIDENCY = (
    "kv_block_lifetime_seconds",
    "kv_block_idle_before_evict_seconds",
    "kv_block_reuse_gap_seconds",
)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-llama-bpe")
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def args_from(argv: list[str]) -> EngineArgs:
    return engine_args_from(build_parser().parse_args(argv))


def cli(model: Path, *flags: str) -> EngineArgs:
    # A small step budget splits the prompts into chunks, so batches overlap.
    return args_from(
        ["generate", str(model), "-p", "unused", "--device", "cpu", "--max-model-len", "96",
         "--block-size", "4", "--kv-cache-memory", "64KiB", "--max-num-batched-tokens", "8",
         "--max-num-seqs", "4",
         *flags]
    )  # fmt: skip


def greedy_ids(llm: LLM, prompts: list[str] = PROMPTS) -> list[list[int]]:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def batch_queue_size(llm: LLM) -> int:
    return cast(InprocClient, llm.engine_client).info.batch_queue_size


def test_async_scheduling_flag_parses_like_vllm() -> None:
    assert args_from(["serve"]).async_scheduling is False
    assert args_from(["serve", "--async-scheduling"]).async_scheduling is True
    assert args_from(["serve", "--no-async-scheduling"]).async_scheduling is False
    assert args_from(["serve", "--async-scheduling"]).engine_core_options()["batch_queue_size"] == 2


def test_async_scheduling_reaches_the_engine_and_keeps_greedy_outputs(tiny_model: Path) -> None:
    with LLM(**vars(cli(tiny_model))) as default:
        assert batch_queue_size(default) == 1
        expected = greedy_ids(default)
    with LLM(**vars(cli(tiny_model, "--async-scheduling"))) as overlapped:
        assert batch_queue_size(overlapped) == 2
        got = greedy_ids(overlapped)
    assert got == expected
    assert all(len(ids) == 10 for ids in got)


def test_kv_cache_metrics_sample_is_validated_before_loading() -> None:
    with pytest.raises(SystemExit):
        args_from(["serve", "--kv-cache-metrics-sample", "0"])
    with pytest.raises(ValueError, match="kv_cache_metrics_sample"):
        LLM(model="/nonexistent", kv_cache_metrics=True, kv_cache_metrics_sample=1.5)


def _run_and_record(llm: LLM, logger: PrometheusStatLogger) -> list[SchedulerStats]:
    """Drive the engine directly so every step's scheduler stats reach the logger."""
    seen: list[SchedulerStats] = []
    original = llm.engine_client.get_output

    def recording() -> Any:
        outputs = original()
        if outputs.scheduler_stats is not None:
            seen.append(outputs.scheduler_stats)
            logger.record(outputs.scheduler_stats, None)
        return outputs

    llm.engine_client.get_output = recording  # type: ignore[method-assign]
    # Each round needs ~20 of the 64 blocks: the second round hits (touches)
    # the first one's prompt blocks, the later rounds cycle the whole pool and
    # so reallocate (evict) them.
    greedy_ids(llm)
    greedy_ids(llm)
    for n in range(1, 5):
        greedy_ids(llm, [p[n:] + p[:n] for p in PROMPTS])
    return seen


def _count(text: str, name: str) -> float:
    match = re.search(rf"^paged:{name}_count\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} missing from /metrics"
    return float(match.group(1))


def test_kv_cache_metrics_fill_the_residency_histograms(tiny_model: Path) -> None:
    args = cli(tiny_model, "--kv-cache-metrics", "--kv-cache-metrics-sample", "1")
    logger = PrometheusStatLogger("tiny", kv_cache_metrics=args.kv_cache_metrics)
    with LLM(**vars(args)) as llm:
        seen = _run_and_record(llm, logger)
    events = [e for s in seen for e in s.kv_cache_eviction_events]
    assert events, "no sampled block was evicted"
    assert all(e.lifetime_seconds >= e.idle_seconds >= 0 for e in events)
    text = generate_latest(logger.registry).decode()
    assert _count(text, "kv_block_lifetime_seconds") == len(events)
    assert _count(text, "kv_block_idle_before_evict_seconds") == len(events)
    gaps = sum(len(e.reuse_gaps_seconds) for e in events)
    assert gaps > 0  # the second round hits the first round's cached prompt blocks
    assert _count(text, "kv_block_reuse_gap_seconds") == gaps


def test_without_kv_cache_metrics_there_are_no_events_nor_series(tiny_model: Path) -> None:
    logger = PrometheusStatLogger("tiny")
    with LLM(**vars(cli(tiny_model))) as llm:
        seen = _run_and_record(llm, logger)
    assert seen and not any(s.kv_cache_eviction_events for s in seen)
    text = generate_latest(logger.registry).decode()
    assert not any(name in text for name in RESIDENCY)
