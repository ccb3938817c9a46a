"""Encoder-only embeddings: paged's packed BERT encoder + pooler vs sentence-transformers.

A random BERT (MiniLM-L6 shape by default: 6 layers of 384, 12 heads, MEAN
pooling) is saved with sentence-transformers in a temp dir (no download);
`--inputs` prompts of uniform random length in [--min-len, --max-len] tokens
are embedded by
- `sentence_transformers`: `SentenceTransformer.encode(batch_size=32)` (it sorts
  by length, then pads each batch to its longest);
- `paged`: the prompts cut into batches of at most `--max-tokens` packed
  tokens (no padding), `BertModel.forward` + `Pooler`, as the engine would.
Both on `--threads` torch threads, alternated, best of `--reps`. This times the
model and the pooler alone (no tokenizer, no engine, no server); the engine
figure is benchmarks/embed_bench.py where present. Prints one JSON object.

    python benchmarks/encoder_bench.py --inputs 200 --min-len 16 --max-len 256 --threads 1
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

from paged.runner.models.bert import BertModel, load_bert_model
from paged.runner.pooling import Pooler, PoolingInput, build_pooler, load_pooler_config

VOCAB = ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(995)]


def _build(root: Path, args: argparse.Namespace) -> Path:
    tok: Any = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(VOCAB)})
    cfg = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=514,
        pad_token_id=1,
    )
    torch.manual_seed(0)
    model_cls: Any = transformers.BertModel
    model_cls(cfg).save_pretrained(root / "hf")
    tok.save_pretrained(root / "hf")
    st = SentenceTransformer(
        modules=[
            Transformer(str(root / "hf"), max_seq_length=512),
            Pooling(args.hidden, pooling_mode="mean"),
        ]
    )
    st.save(str(root / "st"))
    return root / "st"


def _paged(
    encoder: BertModel, pooler: Pooler, ids: list[torch.Tensor], max_tokens: int
) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    i = 0
    with torch.inference_mode():
        while i < len(ids):  # token-budget batches, as the scheduler forms them
            j, total = i, 0
            while j < len(ids) and (j == i or total + len(ids[j]) <= max_tokens):
                total += len(ids[j])
                j += 1
            batch = ids[i:j]
            lens = [len(x) for x in batch]
            hidden = torch.split(encoder(torch.cat(batch), None, lens), lens)
            out += pooler(
                [PoolingInput(h, x.tolist(), "embed") for h, x in zip(hidden, batch, strict=True)]
            )
            i = j
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=200)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        st_dir = _build(Path(tmp), args)
        st = SentenceTransformer(str(st_dir))
        hf_config = json.loads((st_dir / "config.json").read_text())
        encoder = load_bert_model(st_dir)
        config = load_pooler_config(st_dir, hf_config, None, None)
        pooler = build_pooler(config, args.hidden, {}, hf_config)
        g = torch.Generator().manual_seed(0)
        lens = torch.randint(args.min_len, args.max_len + 1, (args.inputs,), generator=g).tolist()
        texts = [
            " ".join(f"w{int(t)}" for t in torch.randint(0, 995, (n - 2,), generator=g))
            for n in lens
        ]
        tok: Any = transformers.AutoTokenizer.from_pretrained(st_dir)
        ids = [torch.tensor(tok(t)["input_ids"]) for t in texts]
        times: dict[str, list[float]] = {"sentence_transformers": [], "paged": []}
        for _ in range(args.reps):  # alternated, so load changes hit both alike
            t0 = time.perf_counter()
            ref = st.encode(texts, batch_size=32, convert_to_tensor=True)
            times["sentence_transformers"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = torch.stack(_paged(encoder, pooler, ids, args.max_tokens))
            times["paged"].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in times.items()}
    result = {
        "inputs": args.inputs,
        "tokens": sum(lens),
        "len_range": [args.min_len, args.max_len],
        "model": f"random BERT {args.layers}x{args.hidden}, MEAN pooling",
        "threads": args.threads,
        "max_tokens_per_batch": args.max_tokens,
        "sentence_transformers_inputs_per_s": round(args.inputs / best["sentence_transformers"], 2),
        "paged_inputs_per_s": round(args.inputs / best["paged"], 2),
        "speedup": round(best["sentence_transformers"] / best["paged"], 2),
        "max_abs_diff": float((got - ref.cpu().float()).abs().max()),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
