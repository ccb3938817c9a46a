"""Offline pooling end to end: LLM.embed on a random tiny Qwen3 with a sentence-transformers
last-token pooling config equals transformers + last-token pooling + normalize (fp32, 1e-5),
one at a time, under chunked prefill, and in a batch mixed with generation requests;
LLM.embed / LLM.score on a tiny BERT; bad inputs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from paged.scheduler import PoolingParams, SamplingParams
from paged.server.errors import InvalidRequestError
from paged.server.llm import LLM
from paged.server.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput

pytestmark = pytest.mark.slow

_VOCAB = 128
_PROMPTS = [
    " ".join(f"w{(7 * i + 3 * k) % 120 + 5}" for k in range(n))
    for i, n in enumerate((5, 23, 40, 9, 31))
]


def _word_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fast_cls: Any = PreTrainedTokenizerFast  # untyped in transformers
    vocab = {f"w{i}": i for i in range(_VOCAB)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = fast_cls(tokenizer_object=tk, bos_token="w1", eos_token="w2")
    fast.save_pretrained(str(path))


def _st_last_token_files(path: Path) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    pooling = {
        "word_embedding_dimension": 64,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_lasttoken": True,
    }
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (path / "2_Normalize").mkdir()


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen3-embed")
    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    auto: Any = AutoModelForCausalLM
    auto.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    _word_tokenizer(path)
    _st_last_token_files(path)
    return path


def _reference(path: Path, prompts: list[str]) -> list[torch.Tensor]:
    """transformers' final hidden states, last token, L2-normalised (what ST computes)."""
    from transformers import AutoModel, AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(str(path))
    model: Any = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for text in prompts:
            ids = torch.tensor([tok.encode(text)])
            hidden = model(input_ids=ids).last_hidden_state[0, -1]
            out.append(torch.nn.functional.normalize(hidden, dim=-1))
    return out


def _engine(path: Path, **kw: Any) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", kv_cache_memory_bytes=8 << 20, **kw)


def test_embed_matches_transformers_last_token_chunked_and_whole(tiny_qwen3: Path) -> None:
    ref = _reference(tiny_qwen3, _PROMPTS)
    # Chunked: a 16-token budget splits the 23-, 31- and 40-token prompts over steps.
    with _engine(tiny_qwen3, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        assert llm.supported_tasks == ("embed", "token_embed")
        outs = llm.embed(_PROMPTS, use_tqdm=False)
        for out, expected in zip(outs, ref, strict=True):
            got = torch.tensor(out.outputs.embedding)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
        # Again: the prefix cache now holds these prompts (LAST pooling reads it, as vLLM).
        again = llm.embed(_PROMPTS[1], use_tqdm=False)[0]
        assert again.num_cached_tokens > 0
        torch.testing.assert_close(torch.tensor(again.outputs.embedding), ref[1], atol=1e-5, rtol=0)
        # A pooling model does not generate: vLLM's message.
        with pytest.raises(ValueError, match="only supported for generative models"):
            llm.generate("w5 w6", SamplingParams(max_tokens=2))
        # Over max_model_len without truncation: the limit is named; with it, truncated.
        long_prompt = " ".join(["w9"] * 300)
        with pytest.raises(InvalidRequestError, match="maximum context length is 256"):
            llm.embed(long_prompt, use_tqdm=False)
        kept = llm.embed(long_prompt, use_tqdm=False, truncate_prompt_tokens=10)[0]
        assert len(kept.prompt_token_ids) == 10
        with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens=300 cannot"):
            llm.embed("w5", use_tqdm=False, truncate_prompt_tokens=300)
        with pytest.raises(InvalidRequestError, match="does not support Matryoshka"):
            llm.embed("w5", use_tqdm=False, pooling_params=PoolingParams(dimensions=8))
        with pytest.raises(ValueError, match="Classification API is not supported"):
            llm.classify("w5", use_tqdm=False)
        with pytest.raises(InvalidRequestError, match="prompts must not be empty"):
            llm.embed([], use_tqdm=False)


def test_embed_in_a_batch_mixed_with_generation(tiny_qwen3: Path) -> None:
    ref = _reference(tiny_qwen3, _PROMPTS)
    # paged's extension: a generate runner with --pooler-config also embeds, in one batch.
    with _engine(
        tiny_qwen3,
        runner="generate",
        pooler_config={"seq_pooling_type": "LAST", "use_activation": True},
        max_num_batched_tokens=24,
        max_num_seqs=8,
    ) as llm:
        assert llm.supported_tasks == ("generate", "embed", "token_embed")
        greedy = SamplingParams(max_tokens=6, temperature=0.0)
        alone = [o.outputs[0].token_ids for o in llm.generate(_PROMPTS[:2], greedy, use_tqdm=False)]
        assert llm.pooling is not None
        embed_params = llm.pooling.resolve_params(None, "embed")
        gen_ids = [llm._add_request(p, greedy) for p in _PROMPTS[:2]]
        pool_ids = [llm._add_pooling_request(p, embed_params, None) for p in _PROMPTS]
        done = llm._run_until_finished(gen_ids + pool_ids, use_tqdm=False)
        mixed = [done[i] for i in gen_ids]
        assert [cast(RequestOutput, m).outputs[0].token_ids for m in mixed] == alone
        for rid, expected in zip(pool_ids, ref, strict=True):
            data = cast(PoolingRequestOutput[PoolingOutput], done[rid]).outputs.data
            torch.testing.assert_close(data, expected, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BertConfig, BertModel

    path = tmp_path_factory.mktemp("tiny-bert-embed")
    config: Any = BertConfig(
        vocab_size=_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    torch.manual_seed(1)
    bert: Any = BertModel(config)
    bert.eval().save_pretrained(str(path))
    _word_tokenizer(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True})
    )
    return path


def test_bert_embed_and_score_match_transformers_mean_pooling(tiny_bert: Path) -> None:
    from transformers import AutoModel, AutoTokenizer

    tok: Any = AutoTokenizer.from_pretrained(str(tiny_bert))
    model: Any = AutoModel.from_pretrained(str(tiny_bert), dtype=torch.float32).eval()
    prompts = _PROMPTS[:3]
    with torch.no_grad():
        ref = [
            model(input_ids=torch.tensor([tok.encode(p)])).last_hidden_state[0].mean(dim=0)
            for p in prompts
        ]
    with _engine(tiny_bert, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128) as llm:
        assert llm.supported_tasks == ("embed", "token_embed")
        outs = llm.embed(prompts, use_tqdm=False)
        for out, expected in zip(outs, ref, strict=True):
            torch.testing.assert_close(
                torch.tensor(out.outputs.embedding), expected, atol=1e-5, rtol=0
            )
        # Bi-encoder scoring: the cosine of the two embeddings, 1 -> N.
        scores = llm.score(prompts[0], prompts[1:], use_tqdm=False)
        for s, expected in zip(scores, ref[1:], strict=True):
            want = torch.nn.functional.cosine_similarity(ref[0], expected, dim=0)
            assert abs(s.outputs.score - float(want)) < 1e-5
        with pytest.raises(InvalidRequestError, match="data_1 has 2 inputs and data_2 3"):
            llm.score(prompts[:2], prompts, use_tqdm=False)


def _cross_encoder(path: Path) -> Path:
    from transformers import BertConfig, BertForSequenceClassification

    config_cls: Any = BertConfig
    config = config_cls(
        vocab_size=_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        num_labels=1,
        architectures=["BertForSequenceClassification"],
    )
    torch.manual_seed(2)
    cross: Any = BertForSequenceClassification(config)
    cross.eval().save_pretrained(str(path))
    _word_tokenizer(path)
    return path


def test_bert_cross_encoder_classify_and_score_match_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = _cross_encoder(tmp_path / "cross")
    tok: Any = AutoTokenizer.from_pretrained(str(path))
    model: Any = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    query, docs = _PROMPTS[0], _PROMPTS[1:4]
    with torch.no_grad():
        want = []
        for doc in docs:
            enc = tok(query, text_pair=doc, return_tensors="pt")
            want.append(float(torch.sigmoid(model(**enc).logits[0, 0])))
        single = float(
            torch.sigmoid(model(input_ids=torch.tensor([tok.encode(query)])).logits[0, 0])
        )
    with _engine(path, max_num_batched_tokens=128, max_num_seqs=8, max_model_len=128) as llm:
        assert llm.supported_tasks == ("classify", "token_classify")
        scores = llm.score(query, docs, use_tqdm=False)
        for s, expected in zip(scores, want, strict=True):
            assert abs(s.outputs.score - expected) < 1e-5
        probs = llm.classify(query, use_tqdm=False)[0].outputs.probs
        assert len(probs) == 1 and abs(probs[0] - single) < 1e-5
        with pytest.raises(ValueError, match="Embedding API is not supported"):
            llm.embed(query, use_tqdm=False)
