"""--speculative-config from the CLI down to the engine, through `LLM` (tiny random model).

Greedy outputs (tokens and logprobs of the accepted tokens) equal those
without speculation; n > 1 and stop strings inside accepted runs work; bad
configs fail before the model loads, naming the key; a draft with another
tokenizer is refused at start-up; vLLM's spec_decode_* counters reach the
Prometheus registry.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import generate_latest

from paged.scheduler import SamplingParams
from paged.server.cli import build_parser, engine_args_from
from paged.server.engine_args import EngineArgs
from paged.server.llm import LLM
from paged.server.metrics import PrometheusStatLogger
from paged.server.metrics_names import VLLM_NAMING

# Repetitive prompts: the n-gram proposer finds material in them.
PROMPTS = ["abc abc abc abc abc abc", "the cat the cat the cat the", "1 2 3 1 2 3 1 2 3"]
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _tiny(path: Path, tokenizer: Any, vocab: int | None = None) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab or len(tokenizer),
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
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    return _tiny(tmp_path_factory.mktemp("spec-target"), tokenizer)


def cli(model: Path, *flags: str) -> EngineArgs:
    return engine_args_from(
        build_parser().parse_args(
            ["generate", str(model), "-p", "unused", "--device", "cpu", "--max-model-len", "96",
             "--block-size", "4", "--kv-cache-memory", "64KiB", "--max-num-batched-tokens", "16",
             "--max-num-seqs", "4", *flags]
        )
    )  # fmt: skip


def run(llm: LLM, params: SamplingParams) -> list[Any]:
    return [o.outputs for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_greedy_tokens_and_logprobs_equal_without_speculation(tiny_model: Path) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    with LLM(**vars(cli(tiny_model))) as plain:
        expected = run(plain, params)
    draft = json.dumps(
        {"method": "draft_model", "model": str(tiny_model), "num_speculative_tokens": 3}
    )
    for config in (NGRAM, draft):
        with LLM(**vars(cli(tiny_model, "--speculative-config", config))) as spec:
            got = run(spec, params)
        for want_outs, got_outs in zip(expected, got, strict=True):
            want, have = want_outs[0], got_outs[0]
            assert have.token_ids == want.token_ids
            assert have.logprobs is not None and want.logprobs is not None
            assert len(have.logprobs) == len(want.logprobs) == 24
            for a, b in zip(have.logprobs, want.logprobs, strict=True):
                assert a.keys() == b.keys()
                for t in a:
                    assert math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-4)


def test_n_greater_than_one_and_stop_strings(tiny_model: Path) -> None:
    with LLM(**vars(cli(tiny_model))) as plain:
        greedy = run(plain, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    text = greedy[0][0].text
    stop = text[8:11]
    assert stop.strip(), text
    with LLM(**vars(cli(tiny_model, "--speculative-config", NGRAM))) as spec:
        sampled = run(
            spec, SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
        )
        stopped = run(
            spec, SamplingParams(max_tokens=20, temperature=0.0, stop=[stop], ignore_eos=True)
        )
    assert all(len(outs) == 3 and all(len(o.token_ids) == 12 for o in outs) for outs in sampled)
    assert stopped[0][0].text == text[: text.index(stop)]
    assert stopped[0][0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ('{"method": "ngram"}', "speculative_config.num_speculative_tokens"),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "speculative_config.method"),
        (
            '{"method": "draft_model", "model": "/nonexistent", "num_speculative_tokens": 2}',
            "speculative_config.model",
        ),
    ],
)
def test_bad_configs_name_the_key(tiny_model: Path, config: str, key: str) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        cli(tiny_model, "--speculative-config", config).create_engine_config()


def test_async_scheduling_is_refused(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="speculative_config"):
        cli(tiny_model, "--speculative-config", NGRAM, "--async-scheduling").create_engine_config()


def test_draft_with_another_vocabulary_is_refused(
    tiny_model: Path, tmp_path: Path, tokenizer: Any
) -> None:
    other = _tiny(tmp_path / "other", tokenizer, vocab=len(tokenizer) + 8)
    config = json.dumps({"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config\.model: .*vocabulary size"):
        cli(tiny_model, "--speculative-config", config).create_engine_config()


def test_spec_decode_counters_reach_prometheus(tiny_model: Path) -> None:
    logger = PrometheusStatLogger("tiny", naming=VLLM_NAMING, num_speculative_tokens=3)
    with LLM(**vars(cli(tiny_model, "--speculative-config", NGRAM))) as llm:
        original = llm.engine_client.get_output

        def recording() -> Any:
            outputs = original()
            if outputs.scheduler_stats is not None:
                logger.record(outputs.scheduler_stats, None)
            return outputs

        llm.engine_client.get_output = recording  # type: ignore[method-assign]
        run(llm, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    text = generate_latest(logger.registry).decode()

    def value(name: str, extra: str = "") -> float:
        for line in text.splitlines():
            if line.startswith(f"vllm:{name}{{") and extra in line:
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"{name} missing:\n{text}")

    drafts = value("spec_decode_num_drafts_total")
    drafted = value("spec_decode_num_draft_tokens_total")
    accepted = value("spec_decode_num_accepted_tokens_total")
    per_pos = [
        value("spec_decode_num_accepted_tokens_per_pos_total", f'position="{p}"') for p in range(3)
    ]
    assert drafts > 0 and drafted >= drafts and 0 <= accepted <= drafted
    assert sum(per_pos) == accepted
    assert per_pos[0] >= per_pos[1] >= per_pos[2]
