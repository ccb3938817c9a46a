"""Embeddings per second: paged `LLM.embed` vs sentence-transformers, same random checkpoint.

Builds a random MiniLM-L6-shaped BERT (hidden 384, 6 layers, 12 heads, vocab
30522; `--shape bert-base` for hidden 768 / 12 layers) as a sentence-transformers
directory (mean pooling + Normalize), or with `--shape qwen3-small` a decoder
embedder as Qwen3-Embedding is built (a random Qwen3ForCausalLM of the same width
and depth, last-token pooling + Normalize: paged runs it on its decoder runner with
the KV cache and chunked prefill), and `--num-inputs` texts of 16-512
tokens (uniform lengths, fixed seed). Both sides run in this process with the
same torch thread count (`--threads`), alternated round by round so drift in
machine load hits both alike; the median of `--runs` rounds is reported, with
the load average before and after, and the largest difference between the two
sides' embeddings (they must agree: same weights, same pooling).

paged batches by tokens (`--max-num-batched-tokens` per step, no padding rows);
sentence-transformers pads each `--st-batch-size` batch of length-sorted texts.
Both run float32 by default; `--paged-dtype bfloat16` runs paged in bf16
against float32 sentence-transformers (the JSON names both dtypes, and
max_abs_diff then shows bf16's error, not a bug).

Besides wall-clock rates, the JSON gives CPU-time rates (inputs per CPU second
of this process, all threads): on a machine shared with other jobs, wall time
swings with their load while CPU time mostly does not.

Run: .venvs/all/bin/python benchmarks/embed_bench.py [--num-inputs 1000 --runs 3 --threads 2]
Prints one JSON line.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, int]] = {
    "minilm": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
               "intermediate_size": 1536},
    "bert-base": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                  "intermediate_size": 3072},
}  # fmt: skip
# Decoder embedders (Qwen3-Embedding style: a causal LM, last-token pooling + Normalize),
# sized like MiniLM so the two kinds compare: hidden 384, 6 layers, GQA 6/2 heads.
DECODER_SHAPES: dict[str, dict[str, int]] = {
    "qwen3-small": {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6,
                    "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 1536},
}  # fmt: skip
VOCAB = 30522
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_checkpoint(path: Path, shape: str) -> None:
    """A random BERT (mean pooling), or a random Qwen3 causal LM (last-token pooling), with
    a word-piece vocabulary and sentence-transformers files."""
    import transformers
    from transformers import AutoTokenizer

    auto_tok: Any = AutoTokenizer

    vocab = SPECIAL + [f"w{i}" for i in range(VOCAB - len(SPECIAL))]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True})
    )
    tok = auto_tok.from_pretrained(str(path))
    tok.save_pretrained(str(path))
    torch.manual_seed(0)
    decoder = shape in DECODER_SHAPES
    if decoder:
        qwen3_config: Any = transformers.Qwen3Config
        qwen3_cls: Any = transformers.Qwen3ForCausalLM
        config = qwen3_config(
            vocab_size=VOCAB, max_position_embeddings=512, pad_token_id=0,
            tie_word_embeddings=True, **DECODER_SHAPES[shape],
        )  # fmt: skip
        qwen3_cls(config).eval().save_pretrained(str(path))
    else:
        config_cls: Any = transformers.BertConfig
        model_cls: Any = transformers.BertModel
        config = config_cls(vocab_size=VOCAB, max_position_embeddings=512, **SHAPES[shape])
        model_cls(config, add_pooling_layer=False).eval().save_pretrained(str(path))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    hidden = (DECODER_SHAPES if decoder else SHAPES)[shape]["hidden_size"]
    mode = "pooling_mode_lasttoken" if decoder else "pooling_mode_mean_tokens"
    pooling = {"word_embedding_dimension": hidden, mode: True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (path / "2_Normalize").mkdir()
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))


def make_texts(n: int, min_tokens: int, max_tokens: int, seed: int) -> list[str]:
    """Texts of min..max tokens including [CLS]/[SEP] (one word = one token)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        length = rng.randint(min_tokens, max_tokens) - 2
        texts.append(" ".join(f"w{rng.randrange(VOCAB - len(SPECIAL))}" for _ in range(length)))
    return texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-inputs", type=int, default=1000)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--shape", choices=sorted([*SHAPES, *DECODER_SHAPES]), default="minilm")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--st-batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--paged-dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from paged.server.llm import LLM

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        build_checkpoint(path, args.shape)
        texts = make_texts(args.num_inputs, args.min_tokens, args.max_tokens, args.seed)
        st: Any = SentenceTransformer(str(path), device="cpu")
        llm = LLM(
            str(path),
            dtype=args.paged_dtype,
            device="cpu",
            max_model_len=512,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=256,
            cpu_threads=args.threads,
            kv_cache_memory_bytes=64 << 20,
        )
        torch.set_num_threads(args.threads)  # the engine's start-up may have changed it
        num_tokens = int(st.tokenize(texts)["attention_mask"].sum())  # unpadded
        paged_rates: list[float] = []
        st_rates: list[float] = []
        paged_cpu_rates: list[float] = []
        st_cpu_rates: list[float] = []
        max_diff = 0.0
        for _ in range(args.runs):
            start, cpu = time.perf_counter(), time.process_time()
            ours = llm.embed(texts, use_tqdm=False)
            paged_rates.append(len(texts) / (time.perf_counter() - start))
            paged_cpu_rates.append(len(texts) / (time.process_time() - cpu))
            start, cpu = time.perf_counter(), time.process_time()
            theirs = st.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True)
            st_rates.append(len(texts) / (time.perf_counter() - start))
            st_cpu_rates.append(len(texts) / (time.process_time() - cpu))
            got = torch.tensor([o.outputs.embedding for o in ours])
            max_diff = max(max_diff, float((got - theirs.float().cpu()).abs().max()))
        st_dtype = str(next(st.parameters()).dtype).removeprefix("torch.")
        llm.shutdown()
    paged_median = statistics.median(paged_rates)
    st_median = statistics.median(st_rates)
    print(
        json.dumps(
            {
                "benchmark": "embed_bench",
                "shape": args.shape,
                "num_inputs": args.num_inputs,
                "tokens_per_input": [args.min_tokens, args.max_tokens],
                "num_tokens": num_tokens,
                "threads": args.threads,
                "torch_threads": torch.get_num_threads(),
                "runs": args.runs,
                "paged_embeddings_per_s": round(paged_median, 2),
                "sentence_transformers_embeddings_per_s": round(st_median, 2),
                "speedup": round(paged_median / st_median, 3),
                "paged_runs": [round(r, 2) for r in paged_rates],
                "sentence_transformers_runs": [round(r, 2) for r in st_rates],
                "paged_dtype": args.paged_dtype,
                "sentence_transformers_dtype": st_dtype,
                "paged_embeddings_per_cpu_s": round(statistics.median(paged_cpu_rates), 2),
                "sentence_transformers_embeddings_per_cpu_s": round(
                    statistics.median(st_cpu_rates), 2
                ),
                "cpu_speedup": round(
                    statistics.median(paged_cpu_rates) / statistics.median(st_cpu_rates), 3
                ),
                "max_abs_diff": max_diff,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "st_batch_size": args.st_batch_size,
                "loadavg_before": load_before,
                "loadavg_after": os.getloadavg(),
            }
        )
    )


if __name__ == "__main__":
    main()
