"""EncoderPoolingRunner's step: one packed forward, then the pooler on one torch thread."""

from __future__ import annotations

import struct

import pytest
import torch

from paged.runner.config import CacheConfig, SchedulerLimits
from paged.runner.encoder_pooling_runner import EncoderPoolingRunner
from paged.runner.model_config import ModelConfig
from paged.runner.pooling import PoolerConfig, build_pooler, load_pooler_config
from paged.scheduler.boundary import NewRequestData, SchedulerOutput
from paged.scheduler.pooling_params import PoolingParams
from paged.scheduler.sampling_params import SamplingParams

H = 8
_HF = {"architectures": ["BertModel"], "model_type": "bert"}


class _Encoder:
    """Hidden state of a token = its id in every column (packed rows in, rows out)."""

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int],
        token_type_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        assert sum(seq_lens) == input_ids.shape[0]
        return input_ids.float()[:, None].expand(-1, H).contiguous()


def _runner() -> EncoderPoolingRunner:
    model_config = ModelConfig(
        model="unused",
        hf_config=_HF,
        architecture="BertModel",
        dtype=torch.float32,
        max_model_len=32,
        vocab_size=100,
        eos_token_ids=(),
        bos_token_id=None,
        tokenizer="unused",
        gguf_file=None,
        weights_format="safetensors",
    )
    runner = EncoderPoolingRunner(model_config, CacheConfig(), SchedulerLimits(), "cpu")
    override = PoolerConfig.from_json({"seq_pooling_type": "MEAN", "use_activation": False})
    pooler = build_pooler(load_pooler_config(None, _HF, override, "embed"), H, {}, _HF)
    runner.load_model(_Encoder(), pooler)
    return runner


def _step(prompts: dict[str, list[int]]) -> SchedulerOutput:
    new = [
        NewRequestData(
            req_id=rid,
            prompt_token_ids=ids,
            sampling_params=SamplingParams(),
            block_ids=([0],),
            num_computed_tokens=0,
            pooling_params=PoolingParams(task="embed"),
        )
        for rid, ids in prompts.items()
    ]
    counts = {rid: len(ids) for rid, ids in prompts.items()}
    return SchedulerOutput(
        scheduled_new_reqs=new,
        num_scheduled_tokens=counts,
        total_num_scheduled_tokens=sum(counts.values()),
    )


def test_pooler_runs_on_one_thread_and_threads_come_back(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = _runner()
    assert runner.pooler is not None
    pooler = runner.pooler
    seen: list[int] = []
    seq_pool = pooler._seq_pool

    def recording_seq_pool(hs: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return seq_pool(hs)

    monkeypatch.setattr(pooler, "_seq_pool", recording_seq_pool)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = runner.execute_model(_step({"a": [1, 2, 3], "b": [10, 20]}))
        assert torch.get_num_threads() == 2  # the forward's threads are back
    finally:
        torch.set_num_threads(threads)
    assert seen == [1, 1]
    assert out.req_ids == ["a", "b"]
    assert out.pooler_output is not None
    for rid, mean in (("a", 2.0), ("b", 15.0)):  # MEAN of each prompt's own rows
        got = out.pooler_output[rid]
        values = struct.unpack(f"<{len(got.data) // 4}f", got.data)
        assert list(values) == [mean] * H
