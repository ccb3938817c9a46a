"""paged's BERT-family encoder + pooler against sentence-transformers itself (fp32, 1e-5).

Tiny random BERT and XLM-RoBERTa models are saved with sentence_transformers,
so modules.json, the Pooling config, Normalize and Dense modules are the real
files; paged reads them with load_pooler_config / load_st_dense_layers, runs
all sentences as one packed batch and must equal SentenceTransformer.encode.
A BERT cross-encoder (num_labels=1) must equal CrossEncoder.predict (sigmoid).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.sentence_transformer.modules import (
    Dense,
    Normalize,
    Pooling,
    Transformer,
)

from paged.runner.models.bert import load_bert_model
from paged.runner.pooling import (
    PoolingInput,
    build_pooler,
    load_head_state_dict,
    load_pooler_config,
    load_st_dense_layers,
)

ATOL = 1e-5
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "dog",
    "runs",
    "fast",
    "slow",
    "red",
    "blue",
    "green",
    "big",
    "small",
    "house",
    "tree",
    "bird",
    "sings",
    "and",
]
SENTENCES = [
    "the cat sat on a mat",
    "dog",
    "big red house",
    "the small bird sings on the green tree and the big dog runs fast",
    "blue",
    "a slow dog sat",
]
TINY = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "pad_token_id": 1,  # "[PAD]" below; XLM-R's positions start at 2
}


def _hf_dir(root: Path, cls_name: str, cfg_cls: str, **extra: Any) -> Path:
    """A tiny random transformers model with a WordPiece tokenizer over WORDS."""
    root.mkdir()
    vocab = ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    tok = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(vocab_size=len(vocab), **{**TINY, **extra})
    getattr(transformers, cls_name)(cfg).save_pretrained(root)
    tok.save_pretrained(root)
    return root


def _paged_embed(st_dir: Path) -> torch.Tensor:
    hf_config = json.loads((st_dir / "config.json").read_text())
    encoder = load_bert_model(st_dir)
    config = load_pooler_config(st_dir, hf_config, None, None)
    pooler = build_pooler(
        config, encoder.hidden_size, {}, hf_config, dense_layers=load_st_dense_layers(st_dir)
    )
    tok = transformers.AutoTokenizer.from_pretrained(st_dir)
    ids = [torch.tensor(tok(s)["input_ids"]) for s in SENTENCES]
    # Every word is in the vocabulary: no [UNK] (nor [PAD], which XLM-R treats as padding).
    assert not {tok.unk_token_id, tok.pad_token_id} & set(torch.cat(ids).tolist())
    lens = [len(i) for i in ids]
    with torch.no_grad():
        hidden = torch.split(encoder(torch.cat(ids), None, lens), lens)
    inputs = [PoolingInput(h, i.tolist(), "embed") for h, i in zip(hidden, ids, strict=True)]
    return torch.stack(pooler(inputs))


def test_bert_mean_normalize_equals_sentence_transformers(tmp_path: Path) -> None:
    hf = _hf_dir(tmp_path / "hf", "BertModel", "BertConfig")
    word = Transformer(str(hf))
    model = SentenceTransformer(modules=[word, Pooling(32, pooling_mode="mean"), Normalize()])
    model.save(str(tmp_path / "st"))
    expected = model.encode(SENTENCES, convert_to_tensor=True, batch_size=4)
    got = _paged_embed(tmp_path / "st")
    torch.testing.assert_close(got, expected.cpu().float(), atol=ATOL, rtol=0)


def test_xlmr_cls_dense_equals_sentence_transformers(tmp_path: Path) -> None:
    hf = _hf_dir(tmp_path / "hf", "XLMRobertaModel", "XLMRobertaConfig", type_vocab_size=1)
    word = Transformer(str(hf))
    dense = Dense(32, 16, activation_function=torch.nn.Tanh())
    model = SentenceTransformer(modules=[word, Pooling(32, pooling_mode="cls"), dense])
    model.save(str(tmp_path / "st"))
    expected = model.encode(SENTENCES, convert_to_tensor=True, batch_size=4)
    got = _paged_embed(tmp_path / "st")
    # No Normalize module: vLLM (and paged) leave the embeddings unnormalised.
    assert got.shape == (len(SENTENCES), 16)
    torch.testing.assert_close(got, expected.cpu().float(), atol=ATOL, rtol=0)


def test_bert_cross_encoder_equals_sentence_transformers(tmp_path: Path) -> None:
    hf = _hf_dir(tmp_path / "hf", "BertModel", "BertConfig")
    ce = CrossEncoder(str(hf), num_labels=1)
    ce_dir = tmp_path / "ce"
    ce.save(str(ce_dir))
    pairs = [
        (SENTENCES[0], SENTENCES[2]),
        (SENTENCES[3], SENTENCES[1]),
        (SENTENCES[4], SENTENCES[5]),
    ]
    expected = torch.as_tensor(ce.predict(pairs, batch_size=2)).float()

    hf_config = json.loads((ce_dir / "config.json").read_text())
    arch = hf_config["architectures"][0]
    assert arch == "BertForSequenceClassification"
    encoder = load_bert_model(ce_dir)
    config = load_pooler_config(ce_dir, hf_config, None, None)
    pooler = build_pooler(
        config, encoder.hidden_size, load_head_state_dict(ce_dir, arch), hf_config
    )
    tok = transformers.AutoTokenizer.from_pretrained(ce_dir)
    enc = [tok(a, b) for a, b in pairs]
    ids = [torch.tensor(e["input_ids"]) for e in enc]
    types = torch.cat([torch.tensor(e["token_type_ids"]) for e in enc])
    assert int(types.max()) == 1  # the second segment really is type 1
    lens = [len(i) for i in ids]
    with torch.no_grad():
        hidden = torch.split(encoder(torch.cat(ids), None, lens, types), lens)
    scores = pooler(
        [PoolingInput(h, i.tolist(), "classify") for h, i in zip(hidden, ids, strict=True)]
    )
    torch.testing.assert_close(torch.cat(scores), expected, atol=ATOL, rtol=0)


def test_qwen3_lasttoken_embedding_equals_sentence_transformers(tmp_path: Path) -> None:
    # A decoder embedding model (Qwen3-Embedding style): paged's model runner
    # hands the pooler final hidden states; transformers' stand in for them here.
    hf = tmp_path / "hf"
    hf.mkdir()
    vocab = ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    tok = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    torch.manual_seed(0)
    qwen3: dict[str, Any] = {
        "vocab_size": len(vocab),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "pad_token_id": 1,
    }
    model_cls: Any = transformers.Qwen3Model
    model_cls(transformers.Qwen3Config(**qwen3)).save_pretrained(hf)
    tok.save_pretrained(hf)
    model = SentenceTransformer(
        modules=[Transformer(str(hf)), Pooling(32, pooling_mode="lasttoken"), Normalize()]
    )
    st_dir = tmp_path / "st"
    model.save(str(st_dir))
    expected = model.encode(SENTENCES, convert_to_tensor=True, batch_size=4)

    hf_config = json.loads((st_dir / "config.json").read_text())
    config = load_pooler_config(st_dir, hf_config, None, "embed")
    assert (config.seq_pooling_type, config.use_activation) == ("LAST", True)
    pooler = build_pooler(config, 32, {}, hf_config, convert="embed")
    body: Any = transformers.AutoModel.from_pretrained(st_dir).eval()
    inputs = []
    for sentence in SENTENCES:
        ids = torch.tensor(tok(sentence)["input_ids"])
        with torch.no_grad():
            hidden = body(input_ids=ids[None]).last_hidden_state[0]
        inputs.append(PoolingInput(hidden, ids.tolist(), "embed"))
    got = torch.stack(pooler(inputs))
    torch.testing.assert_close(got, expected.cpu().float(), atol=ATOL, rtol=0)
