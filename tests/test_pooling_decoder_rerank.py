"""Decoder rerankers and classifiers offline: a transformers Qwen3ForSequenceClassification
checkpoint (score head, no LM head), and an original Qwen3-Reranker-style causal LM served
through vLLM 0.33's `hf_overrides` (score head from the LM head rows of "no"/"yes") with a
score template, offline and through `paged serve` (/rerank, /score, their 400s). Scores
equal transformers' within 1e-5 in fp32."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import torch

from paged.server.llm import LLM

if TYPE_CHECKING:
    from tests.conftest import LiveServer

pytestmark = pytest.mark.slow

_VOCAB = 128
_NO, _YES = "w10", "w11"
_QUERY = "w20 w21 w22 w23"
_DOCS = ["w30 w31 w32 w33 w34 w35", "w40 w41", "w50 w51 w52 w53 w54 w55 w56 w57 w58"]
# A Qwen3-Reranker-shaped score template (vLLM's examples/pooling/score/template/
# qwen3_reranker.jinja) written in this word tokenizer's vocabulary.
_TEMPLATE = (
    "w3 w4 {{ instruction | default('w5 w6', true) }} w7 "
    '{{ messages | selectattr("role", "eq", "query") | map(attribute="content") | first }} w8 '
    '{{ messages | selectattr("role", "eq", "document") | map(attribute="content") | first }}'
    " w9 w12"
)


def _word_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fast_cls: Any = PreTrainedTokenizerFast  # untyped in transformers
    vocab = {f"w{i}": i for i in range(_VOCAB)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # A decoder's tokenizer: no token type ids (Qwen2TokenizerFast has none either).
    fast = fast_cls(
        tokenizer_object=tk,
        bos_token="w1",
        eos_token="w2",
        model_input_names=["input_ids", "attention_mask"],
    )
    fast.save_pretrained(str(path))


def _qwen3_config(**kw: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(
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
        **kw,
    )


def _engine(path: Path, **kw: Any) -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        device="cpu",
        kv_cache_memory_bytes=8 << 20,
        max_num_batched_tokens=16,  # the longer prompts are chunked over steps
        max_num_seqs=4,
        **kw,
    )


def test_qwen3_seq_cls_checkpoint_matches_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tmp_path / "qwen3-seq-cls"
    torch.manual_seed(0)
    auto: Any = AutoModelForSequenceClassification
    config = _qwen3_config(
        num_labels=1, architectures=["Qwen3ForSequenceClassification"], tie_word_embeddings=False
    )
    auto.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    _word_tokenizer(path)
    tok: Any = AutoTokenizer.from_pretrained(str(path))
    model: Any = auto.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        # vLLM's pair encoding for a cross-encoder (use_sep_token: true by default).
        want = [
            float(
                torch.sigmoid(model(input_ids=torch.tensor([tok(_QUERY, d)["input_ids"]])).logits)
            )
            for d in _DOCS
        ]
        single = float(torch.sigmoid(model(input_ids=torch.tensor([tok.encode(_QUERY)])).logits))
    with _engine(path) as llm:
        assert llm.supported_tasks == ("classify", "token_classify")
        scores = [s.outputs.score for s in llm.score(_QUERY, _DOCS, use_tqdm=False)]
        assert scores == pytest.approx(want, abs=1e-5)
        (probs,) = [c.outputs.probs for c in llm.classify(_QUERY, use_tqdm=False)]
        assert probs == pytest.approx([single], abs=1e-5)
        with pytest.raises(ValueError, match="only supported for generative models"):
            llm.generate("w5 w6")


@dataclass(frozen=True)
class _Reranker:
    """An original Qwen3-Reranker-style causal LM, and transformers' references for it."""

    path: Path
    tokenizer: Any
    causal: Any  # AutoModelForCausalLM: the 2-way softmax of the "no"/"yes" logits
    seq_cls: Any  # Qwen3ForSequenceClassification holding score = lm_head[yes] - lm_head[no]

    def rendered(self, doc: str, instruction: str | None = None) -> list[int]:
        messages = [{"role": "query", "content": _QUERY}, {"role": "document", "content": doc}]
        kw = {} if instruction is None else {"instruction": instruction}
        text = self.tokenizer.apply_chat_template(
            messages, chat_template=_TEMPLATE, tokenize=False, **kw
        )
        return list(self.tokenizer(text)["input_ids"])

    def seq_cls_score(self, ids: list[int]) -> float:
        with torch.no_grad():
            return float(torch.sigmoid(self.seq_cls(input_ids=torch.tensor([ids])).logits[0, 0]))

    def lm_score(self, ids: list[int]) -> float:
        no_id, yes_id = self.tokenizer.convert_tokens_to_ids([_NO, _YES])
        with torch.no_grad():
            logits = self.causal(input_ids=torch.tensor([ids])).logits[0, -1]
        return float(torch.softmax(logits[[no_id, yes_id]], dim=0)[1])


_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": [_NO, _YES],
    "is_original_qwen3_reranker": True,
}


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> _Reranker:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForSequenceClassification

    path = tmp_path_factory.mktemp("qwen3-reranker")
    torch.manual_seed(1)
    auto_causal: Any = AutoModelForCausalLM
    causal: Any = auto_causal.from_config(
        _qwen3_config(tie_word_embeddings=False), dtype=torch.float32
    ).eval()
    causal.save_pretrained(str(path))
    _word_tokenizer(path)
    tok: Any = AutoTokenizer.from_pretrained(str(path))
    no_id, yes_id = tok.convert_tokens_to_ids([_NO, _YES])
    # transformers' sequence classifier holding the converted head (what vLLM's
    # convert_model_to_seq_cls produces): score = lm_head[yes] - lm_head[no].
    seq_cls_class: Any = Qwen3ForSequenceClassification
    seq_cls: Any = seq_cls_class(_qwen3_config(num_labels=1)).eval()
    state = {k: v for k, v in causal.state_dict().items() if k.startswith("model.")}
    lm_head = causal.lm_head.weight.detach()
    state["score.weight"] = lm_head[[yes_id]] - lm_head[[no_id]]
    seq_cls.load_state_dict(state, strict=True)
    return _Reranker(path, tok, causal, seq_cls)


def test_original_qwen3_reranker_with_hf_overrides_matches_transformers(
    reranker: _Reranker,
) -> None:
    tok = reranker.tokenizer
    want = [reranker.seq_cls_score(reranker.rendered(d)) for d in _DOCS]
    assert want == pytest.approx([reranker.lm_score(reranker.rendered(d)) for d in _DOCS], abs=1e-5)
    concat = [reranker.seq_cls_score(tok.encode(_QUERY + d)) for d in _DOCS]
    with _engine(reranker.path, runner="pooling", hf_overrides=_OVERRIDES) as llm:
        assert llm.supported_tasks == ("classify", "token_classify")
        scored = llm.score(_QUERY, _DOCS, use_tqdm=False, chat_template=_TEMPLATE)
        assert [s.outputs.score for s in scored] == pytest.approx(want, abs=1e-5)
        assert scored[0].prompt_token_ids == reranker.rendered(_DOCS[0])
        # No template: an LLM reranker's query and document are concatenated (use_sep_token
        # false), as vLLM does without --chat-template.
        plain = llm.score(_QUERY, _DOCS, use_tqdm=False)
        assert [s.outputs.score for s in plain] == pytest.approx(concat, abs=1e-5)


def test_paged_serve_reranks_with_hf_overrides_and_chat_template(
    reranker: _Reranker, launch_server: Callable[..., LiveServer], tmp_path: Path
) -> None:
    template = tmp_path / "qwen3_reranker.jinja"
    template.write_text(_TEMPLATE)
    server = launch_server(
        str(reranker.path),
        "--runner", "pooling",
        "--hf-overrides", json.dumps(_OVERRIDES),
        "--chat-template", str(template),
        "--dtype", "float32",
        "--max-num-batched-tokens", "16",
        "--max-num-seqs", "4",
        "--kv-cache-memory", str(8 << 20),
    )  # fmt: skip
    instruction = "w60 w61"
    want = [reranker.seq_cls_score(reranker.rendered(d, instruction)) for d in _DOCS]
    body = {"query": _QUERY, "documents": _DOCS, "instruction": instruction}
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        res = http.post("/rerank", json=body)
        bad = [
            http.post("/rerank", json={**body, "chat_template_kwargs": {"tokenize": True}}),
            http.post("/rerank", json={**body, "documents": []}),
            http.post("/v1/completions", json={"prompt": _QUERY}),
        ]
        scored = http.post("/score", json={"queries": _QUERY, "documents": _DOCS[:1]})
    assert res.status_code == 200, res.text
    results = res.json()["results"]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -want[i])
    for r in results:
        assert r["relevance_score"] == pytest.approx(want[r["index"]], abs=1e-5)
    assert res.json()["usage"]["prompt_tokens"] == sum(
        len(reranker.rendered(d, instruction)) for d in _DOCS
    )
    for r in bad:
        assert r.status_code == 400, r.text
    assert "(task: classify)" in bad[-1].json()["error"]["message"]
    assert scored.status_code == 200  # still serving
    default_instruction = reranker.seq_cls_score(reranker.rendered(_DOCS[0]))
    assert scored.json()["data"][0]["score"] == pytest.approx(default_instruction, abs=1e-5)
