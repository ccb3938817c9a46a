"""The BERT-family encoder and the classification heads against transformers (fp32).

Tiny random checkpoints are saved with save_pretrained and loaded both by
transformers and by paged; several sequences of different lengths run in one
packed batch through paged and one at a time through transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from paged.runner.models.bert import (
    ENCODER_ONLY_ARCHITECTURES,
    BertModel,
    cpu_slices,
    load_bert_model,
    plan_attention,
)
from paged.runner.pooling import (
    PoolingInput,
    build_pooler,
    is_head_tensor,
    load_converted_score_head,
    load_head_state_dict,
    load_pooler_config,
)
from paged.runner.pooling.st_files import read_modules

ATOL = 1e-5
TINY = {
    "vocab_size": 60,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 40,
}
LENS = [5, 9, 3, 9, 17, 1, 4, 4]
QWEN3: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
}


def _save(path: Path, cls_name: str, cfg_cls: str, **extra: Any) -> tuple[Path, Any]:
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**TINY, **extra})
    model = getattr(transformers, cls_name)(cfg).eval()
    model.save_pretrained(path)
    return path, model


def _prompts(seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY["vocab_size"], (n,), generator=g) for n in LENS]


def _hf_config(path: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = transformers.AutoConfig.from_pretrained(path).to_dict()
    return cfg


def _run_packed(
    model: BertModel, prompts: list[torch.Tensor], types: Any = None
) -> list[torch.Tensor]:
    lens = [len(p) for p in prompts]
    positions = torch.cat([torch.arange(n) for n in lens])
    out = model(torch.cat(prompts), positions, lens, types)
    return list(torch.split(out, lens))


@pytest.mark.parametrize(
    ("cls_name", "cfg_cls", "extra"),
    [
        ("BertModel", "BertConfig", {"pad_token_id": 0}),
        # XLM-R: positions start at pad_token_id + 1 = 2; one token type.
        ("XLMRobertaModel", "XLMRobertaConfig", {"pad_token_id": 1, "type_vocab_size": 1}),
    ],
)
def test_packed_encoder_matches_transformers(
    tmp_path: Path, cls_name: str, cfg_cls: str, extra: dict[str, Any]
) -> None:
    path, hf = _save(tmp_path, cls_name, cfg_cls, **extra)
    ours = load_bert_model(path)
    prompts = _prompts()
    with torch.no_grad():
        for prompt, got in zip(prompts, _run_packed(ours, prompts), strict=True):
            ref = hf(input_ids=prompt[None]).last_hidden_state[0]
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def test_cpu_slices_are_runs_of_whole_sequences() -> None:
    # A run closes once it holds max_tokens; a longer sequence is a run alone.
    assert cpu_slices([5, 9, 3, 9, 17, 1, 4, 4], 10) == [(0, 2), (2, 4), (4, 5), (5, 8)]
    assert cpu_slices([3, 3], 100) == [(0, 2)]
    assert cpu_slices([], 10) == []
    with pytest.raises(ValueError, match="max_tokens"):
        cpu_slices([3], 0)


def test_cpu_attention_needs_no_padding() -> None:
    # One span per sequence over the packed rows: no padded copy, no mask.
    plan = plan_attention([5, 9, 3], torch.device("cpu"))
    assert [(p.start, p.length) for p in plan] == [(0, 5), (5, 9), (14, 3)]  # type: ignore[union-attr]


def test_cpu_slices_run_the_layers_and_match_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, hf = _save(tmp_path / "m", "BertModel", "BertConfig", pad_token_id=0)
    model = load_bert_model(path)
    model.cpu_slice_tokens = 10
    rows_seen: list[int] = []
    first_layer = model.layers[0]
    forward = first_layer.forward

    def counting_forward(x: torch.Tensor, plan: Any) -> torch.Tensor:
        rows_seen.append(x.shape[0])
        out: torch.Tensor = forward(x, plan)
        return out

    monkeypatch.setattr(first_layer, "forward", counting_forward)
    prompts = _prompts()
    with torch.inference_mode():
        got = _run_packed(model, prompts)
        for p, g in zip(prompts, got, strict=True):
            want = hf(input_ids=p[None]).last_hidden_state[0]
            torch.testing.assert_close(g, want, atol=ATOL, rtol=0)
    # LENS = [5, 9, 3, 9, 17, 1, 4, 4] in runs of >= 10 tokens: 14, 12, 17, 9.
    assert rows_seen == [14, 12, 17, 9]


def test_token_type_ids_match_transformers(tmp_path: Path) -> None:
    path, hf = _save(tmp_path, "BertModel", "BertConfig")
    ours = load_bert_model(path)
    prompts = _prompts(2)
    types = [(torch.arange(len(p)) >= len(p) // 2).long() for p in prompts]
    with torch.no_grad():
        outs = _run_packed(ours, prompts, torch.cat(types))
        for prompt, tt, got in zip(prompts, types, outs, strict=True):
            ref = hf(input_ids=prompt[None], token_type_ids=tt[None]).last_hidden_state[0]
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


def _classifier_outputs(path: Path, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    hf_config = _hf_config(path)
    arch = hf_config["architectures"][0]
    ours = load_bert_model(path)
    config = load_pooler_config(path, hf_config, None, None)
    pooler = build_pooler(config, ours.hidden_size, load_head_state_dict(path, arch), hf_config)
    with torch.no_grad():
        hidden = _run_packed(ours, prompts)
    return pooler(
        [PoolingInput(h, p.tolist(), "classify") for h, p in zip(hidden, prompts, strict=True)]
    )


def test_bert_cross_encoder_matches_transformers_sigmoid(tmp_path: Path) -> None:
    path, hf = _save(tmp_path, "BertForSequenceClassification", "BertConfig", num_labels=1)
    prompts = _prompts(3)
    got = _classifier_outputs(path, prompts)
    with torch.no_grad():
        for prompt, score in zip(prompts, got, strict=True):
            logits = hf(input_ids=prompt[None]).logits[0]
            torch.testing.assert_close(score, torch.sigmoid(logits), atol=ATOL, rtol=0)


def test_xlmr_classifier_matches_transformers_softmax(tmp_path: Path) -> None:
    path, hf = _save(
        tmp_path,
        "XLMRobertaForSequenceClassification",
        "XLMRobertaConfig",
        num_labels=3,
        pad_token_id=1,
    )
    prompts = _prompts(4)
    got = _classifier_outputs(path, prompts)
    with torch.no_grad():
        for prompt, probs in zip(prompts, got, strict=True):
            logits = hf(input_ids=prompt[None]).logits[0]
            torch.testing.assert_close(probs, torch.softmax(logits, -1), atol=ATOL, rtol=0)


def test_qwen3_score_head_on_transformers_hidden_states(tmp_path: Path) -> None:
    torch.manual_seed(0)
    qwen3: dict[str, Any] = {**QWEN3, "num_hidden_layers": 2, "num_labels": 1}
    model_cls: Any = transformers.Qwen3ForSequenceClassification
    hf = model_cls(transformers.Qwen3Config(**qwen3)).eval()
    hf.save_pretrained(tmp_path)
    hf_config = _hf_config(tmp_path)
    arch = "Qwen3ForSequenceClassification"
    head = load_head_state_dict(tmp_path, arch)
    assert set(head) == {"score.weight"}
    config = load_pooler_config(tmp_path, hf_config, None, None)
    assert config.seq_pooling_type == "LAST"
    pooler = build_pooler(config, 32, head, hf_config)
    for prompt in _prompts(5)[:4]:
        with torch.no_grad():
            hidden = hf.model(input_ids=prompt[None]).last_hidden_state[0]
            logits = hf(input_ids=prompt[None]).logits[0]
        (raw,) = pooler([PoolingInput(hidden, prompt.tolist(), "classify", use_activation=False)])
        (score,) = pooler([PoolingInput(hidden, prompt.tolist(), "classify")])
        torch.testing.assert_close(raw, logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(score, torch.sigmoid(logits), atol=ATOL, rtol=0)


def test_head_tensors_are_told_apart_from_the_body() -> None:
    assert is_head_tensor("BertForSequenceClassification", "bert.pooler.dense.weight")
    assert is_head_tensor("BertForSequenceClassification", "classifier.bias")
    assert not is_head_tensor(
        "BertForSequenceClassification", "bert.encoder.layer.0.output.dense.weight"
    )
    assert is_head_tensor("XLMRobertaForSequenceClassification", "classifier.out_proj.weight")
    assert is_head_tensor("Qwen3ForSequenceClassification", "score.weight")
    assert not is_head_tensor("Qwen3ForSequenceClassification", "model.norm.weight")
    assert "XLMRobertaModel" in ENCODER_ONLY_ARCHITECTURES


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    path, _ = _save(tmp_path, "BertModel", "BertConfig")
    ours = load_bert_model(path)
    ids = torch.tensor([5, 6, 7, 8])
    with pytest.raises(ValueError, match="seq_lens: they sum to 3"):
        ours(ids, None, [1, 2])
    with pytest.raises(ValueError, match="positions: expected 0-based positions"):
        ours(ids, torch.arange(4), [2, 2])
    with pytest.raises(ValueError, match="exceeds the model's 40 positions"):
        ours(torch.full((41,), 5), None, [41])
    with pytest.raises(ValueError, match=r"token_type_ids: values must lie in \[0, 2\)"):
        ours(ids, None, [4], torch.tensor([0, 0, 2, 0]))


def test_wrong_architecture_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(**{**QWEN3, "num_hidden_layers": 1})
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'Qwen3ForCausalLM' is not a BERT-family encoder"):
        load_bert_model(tmp_path)
    assert read_modules(tmp_path) is None


@pytest.mark.parametrize("tied", [False, True])
def test_converted_qwen3_reranker_equals_two_way_softmax(tmp_path: Path, tied: bool) -> None:
    # Qwen3-Reranker style: a causal LM whose "yes" probability against "no" at
    # the last token is the relevance score (vLLM's from_2_way_softmax).
    torch.manual_seed(0)
    extra = {"method": "from_2_way_softmax", "classifier_from_token": ["no", "yes"]}
    cfg = transformers.Qwen3Config(**{**QWEN3, "num_hidden_layers": 1, "tie_word_embeddings": tied})
    model_cls: Any = transformers.Qwen3ForCausalLM
    hf = model_cls(cfg).eval()
    hf.save_pretrained(tmp_path)
    hf_config = {**_hf_config(tmp_path), **extra}
    no_id, yes_id = 7, 11  # what the tokenizer would give for "no", "yes"
    head = load_converted_score_head(tmp_path, hf_config, [no_id, yes_id])
    config = load_pooler_config(tmp_path, hf_config, None, "classify")
    pooler = build_pooler(config, 32, head, hf_config, convert="classify")
    for prompt in _prompts(6)[:3]:
        with torch.no_grad():
            hidden = hf.model(input_ids=prompt[None]).last_hidden_state[0]
            logits = hf(input_ids=prompt[None]).logits[0, -1]
        (score,) = pooler([PoolingInput(hidden, prompt.tolist(), "classify")])
        expected = torch.softmax(logits[[no_id, yes_id]], dim=-1)[1:]
        torch.testing.assert_close(score, expected, atol=ATOL, rtol=0)


def test_converted_head_needs_a_method(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="method: a converted classifier needs"):
        load_converted_score_head(tmp_path, {}, [1, 2])
