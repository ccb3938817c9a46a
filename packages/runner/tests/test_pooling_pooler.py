"""The Pooler on hand-made hidden states: each pooling type, heads, dimensions, bad parameters.

Expected values are computed here from the definitions (vLLM 0.33's
layers/pooler/ and pooling_params.py), independently of the pooler's code.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from paged.runner.pooling import (
    DenseLayer,
    Pooler,
    PoolerConfig,
    PoolingInput,
    build_pooler,
    check_dimensions,
    load_pooler_config,
    score_weight_from_lm_head,
)

H = 8
EMBED_HF = {"architectures": ["BertModel"], "model_type": "bert", "_name_or_path": "tiny-bert"}
MATRYOSHKA_HF = {**EMBED_HF, "matryoshka_dimensions": [2, 4, 8]}
CLS_HF = {"architectures": ["Qwen3ForSequenceClassification"], "model_type": "qwen3"}


def _hidden(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed))


def _inp(hs: torch.Tensor, task: str, **kw: Any) -> PoolingInput:
    return PoolingInput(
        hidden_states=hs, prompt_token_ids=list(range(hs.shape[0])), task=task, **kw
    )


def _embedder(hf: dict[str, Any] = EMBED_HF, **cfg: Any) -> Pooler:
    config = load_pooler_config(None, hf, PoolerConfig.from_json(cfg), None)
    return build_pooler(config, H, {}, hf)


def _classifier(
    n_labels: int, hf: dict[str, Any] = CLS_HF, **cfg: Any
) -> tuple[Pooler, torch.Tensor]:
    w = torch.randn(n_labels, H, generator=torch.Generator().manual_seed(5))
    config = load_pooler_config(None, hf, PoolerConfig.from_json(cfg), None)
    return build_pooler(config, H, {"score.weight": w}, hf), w


@pytest.mark.parametrize(
    ("pooling", "pick"),
    [
        ("CLS", lambda hs: hs[0]),
        ("LAST", lambda hs: hs[-1]),
        ("MEAN", lambda hs: hs.mean(0)),
    ],
)
def test_sequence_pooling_types(pooling: str, pick: Any) -> None:
    pooler = _embedder(pooling_type=pooling)
    batch = [_hidden(n, seed=n) for n in (1, 5, 3)]
    out = pooler([_inp(hs, "embed") for hs in batch])
    for hs, got in zip(batch, out, strict=True):
        torch.testing.assert_close(got, F.normalize(pick(hs), dim=-1))
        assert got.dtype == torch.float32 and got.shape == (H,)


def test_bert_defaults_to_cls_and_normalises() -> None:
    hs = _hidden(4)
    (got,) = _embedder()([_inp(hs, "embed")])
    torch.testing.assert_close(got, hs[0] / hs[0].norm())


def test_use_activation_false_returns_raw_pooled_state() -> None:
    hs = _hidden(4)
    pooler = _embedder(pooling_type="MEAN")
    (raw,) = pooler([_inp(hs, "embed", use_activation=False)])
    torch.testing.assert_close(raw, hs.mean(0))
    # The config's use_activation is the default a request without one gets.
    (cfg_raw,) = _embedder(pooling_type="MEAN", use_activation=False)([_inp(hs, "embed")])
    torch.testing.assert_close(cfg_raw, hs.mean(0))


def test_all_pooling_for_token_embed() -> None:
    hs = _hidden(5)
    (got,) = _embedder()([_inp(hs, "token_embed")])
    torch.testing.assert_close(got, F.normalize(hs, dim=-1))


def test_step_pooling_keeps_step_rows_and_returned_columns() -> None:
    hs = _hidden(6)
    pooler = _embedder(pooling_type="STEP")
    inp = PoolingInput(
        hidden_states=hs,
        prompt_token_ids=[5, 9, 5, 1, 9, 9],
        task="token_embed",
        use_activation=False,
        step_tag_id=9,
        returned_token_ids=[0, 3],
    )
    (got,) = pooler([inp])
    torch.testing.assert_close(got, hs[[1, 4, 5]][:, [0, 3]])


def test_step_parameters_need_step_pooling() -> None:
    with pytest.raises(ValueError, match=r"does not support \['step_tag_id'\] parameters"):
        _embedder()([_inp(_hidden(3), "token_embed", step_tag_id=1)])


def test_matryoshka_dimensions_truncate_before_normalising() -> None:
    hs = _hidden(3)
    pooler = _embedder(MATRYOSHKA_HF)
    out = pooler([_inp(hs, "embed", dimensions=4), _inp(hs, "embed")])
    torch.testing.assert_close(out[0], F.normalize(hs[0][:4], dim=-1))
    assert out[1].shape == (H,)
    # The config's dimensions is the default of requests without one.
    (dflt,) = _embedder(MATRYOSHKA_HF, dimensions=2)([_inp(hs, "embed")])
    assert dflt.shape == (2,)


@pytest.mark.parametrize(
    ("hf", "dims", "match"),
    [
        (
            EMBED_HF,
            4,
            r"does not support Matryoshka embeddings; dimensions must be unset "
            r"\(received dimensions=4\)",
        ),
        (
            {**EMBED_HF, "is_matryoshka": True},
            9,
            r"only supports dimensions in range \[1, 8\], got 9",
        ),
        (MATRYOSHKA_HF, 3, r"only supports Matryoshka dimensions \[2, 4, 8\], got 3"),
    ],
)
def test_unsupported_dimensions_raise_vllms_message(
    hf: dict[str, Any], dims: int, match: str
) -> None:
    with pytest.raises(ValueError, match="^dimensions: Model 'tiny-bert' " + match):
        _embedder(hf)([_inp(_hidden(2), "embed", dimensions=dims)])
    with pytest.raises(ValueError, match=match):
        check_dimensions(dims, hf_config=hf, embedding_size=H, model_name="tiny-bert")


def test_dense_projector_runs_before_dimensions() -> None:
    w1, b1, w2 = torch.randn(6, H), torch.randn(6), torch.randn(4, 6)
    dense = [
        DenseLayer(w1, b1, "torch.nn.modules.activation.Tanh"),
        DenseLayer(w2, None, "torch.nn.modules.linear.Identity"),
    ]
    hf = {**EMBED_HF, "is_matryoshka": True}
    config = load_pooler_config(None, hf, None, None)
    pooler = build_pooler(config, H, {}, hf, dense_layers=dense)
    assert pooler.embedding_size == 4
    hs = _hidden(3)
    (got,) = pooler([_inp(hs, "embed", dimensions=3)])
    expected = (torch.tanh(hs[0] @ w1.T + b1) @ w2.T)[:3]
    torch.testing.assert_close(got, F.normalize(expected, dim=-1))


def test_single_label_classifier_uses_sigmoid() -> None:
    pooler, w = _classifier(1)
    hs = _hidden(4)
    (got,) = pooler([_inp(hs, "classify")])
    torch.testing.assert_close(got, torch.sigmoid(w @ hs[-1]))
    (raw,) = pooler([_inp(hs, "classify", use_activation=False)])
    torch.testing.assert_close(raw, w @ hs[-1])


def test_multi_label_classifier_uses_softmax_and_calibration() -> None:
    pooler, w = _classifier(3, logit_mean=0.5, logit_sigma=2.0)
    hs = _hidden(4)
    (got,) = pooler([_inp(hs, "classify")])
    torch.testing.assert_close(got, torch.softmax((w @ hs[-1] - 0.5) / 2.0, dim=-1))


@pytest.mark.parametrize(
    ("extra", "act"),
    [
        ({"problem_type": "regression"}, lambda x: x),
        ({"problem_type": "multi_label_classification"}, torch.sigmoid),
        (
            {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}},
            lambda x: x,
        ),
        ({"sbert_ce_default_activation_function": "torch.nn.modules.activation.Tanh"}, torch.tanh),
    ],
)
def test_classifier_activation_follows_config(extra: dict[str, Any], act: Any) -> None:
    pooler, w = _classifier(3, {**CLS_HF, **extra})
    hs = _hidden(2)
    (got,) = pooler([_inp(hs, "classify")])
    torch.testing.assert_close(got, act(w @ hs[-1]))


def test_activation_outside_torch_nn_is_refused() -> None:
    hf = {**CLS_HF, "sbert_ce_default_activation_function": "os.system"}
    with pytest.raises(ValueError, match=r"restricted to torch\.nn\.modules"):
        _classifier(1, hf)


def test_token_classify_applies_score_per_token() -> None:
    pooler, w = _classifier(2)
    hs = _hidden(5)
    (got,) = pooler([_inp(hs, "token_classify")])
    torch.testing.assert_close(got, torch.softmax(hs @ w.T, dim=-1))


def test_mixed_batch_keeps_input_order() -> None:
    pooler, w = _classifier(1)
    a, b = _hidden(3, 1), _hidden(2, 2)
    out = pooler([_inp(a, "token_classify"), _inp(b, "classify"), _inp(a, "classify")])
    assert [tuple(t.shape) for t in out] == [(3, 1), (1,), (1,)]
    torch.testing.assert_close(out[2], torch.sigmoid(w @ a[-1]))


def test_tasks_and_parameters_are_checked_per_model_kind() -> None:
    pooler, _ = _classifier(1)
    assert pooler.supported_tasks == {"classify", "token_classify"}
    assert pooler.default_task == "classify"
    assert _embedder().default_task == "embed"
    with pytest.raises(ValueError, match="task: 'embed' is not supported"):
        pooler([_inp(_hidden(2), "embed")])
    with pytest.raises(ValueError, match=r"Task 'classify' only supports \['use_activation'\]"):
        pooler([_inp(_hidden(2), "classify", dimensions=2)])
    with pytest.raises(ValueError, match="hidden_states: expected"):
        pooler([_inp(torch.zeros(2, H + 1), "classify")])


def test_config_task_must_be_supported() -> None:
    with pytest.raises(ValueError, match="task 'classify' is not supported"):
        _embedder(task="classify")


def test_missing_score_weight_is_named() -> None:
    config = load_pooler_config(None, CLS_HF, None, None)
    with pytest.raises(ValueError, match=r"no 'score\.weight'"):
        build_pooler(config, H, {}, CLS_HF)


def test_converted_lm_reranker_score_is_true_minus_false() -> None:
    lm_head = torch.randn(10, H)
    w = score_weight_from_lm_head(lm_head, [3, 7], "from_2_way_softmax")
    hf = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    config = load_pooler_config(None, hf, None, "classify")
    pooler = build_pooler(config, H, {"score.weight": w}, hf, convert="classify")
    hs = _hidden(3)
    (got,) = pooler([_inp(hs, "classify")])
    # sigmoid(l_true - l_false) is the "yes" probability of the 2-way softmax.
    logits = lm_head @ hs[-1]
    torch.testing.assert_close(got, torch.softmax(logits[[3, 7]], dim=-1)[1:])


def test_outputs_own_their_storage() -> None:
    # Without activation the embed rows would be views of one stacked tensor.
    pooler = _embedder(use_activation=False)
    out = pooler([_inp(_hidden(3, s), "embed") for s in range(4)])
    for t in out:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
