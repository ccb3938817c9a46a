"""Write a random-weight Llama GGUF of a larger shape, with the default model's tokenizer.

For benchmarks only (the text it generates is noise): the metadata and tokenizer
are copied from the shipped SmolLM2-135M GGUF, the shape keys replaced, and every
projection filled with random values quantised by the gguf package's own
quantisers (Q8_0, Q4_0 or Q4_1; norms F32). Default shape: a Llama-3.2-1B-like
decoder (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192) on SmolLM2's
49,152-token vocabulary: ~1.1 B parameters, ~0.65 GB in Q4_0.

    .venvs/all/bin/python benchmarks/random_gguf.py /tmp/llama1b-q4_0.gguf --qtype Q4_0
"""

from __future__ import annotations

import argparse
import json
import time

import gguf
import numpy as np

from paged.runner.config import default_model_path

SHAPE_KEYS = {
    "llama.block_count": "layers",
    "llama.embedding_length": "hidden",
    "llama.feed_forward_length": "ffn",
    "llama.attention.head_count": "heads",
    "llama.attention.head_count_kv": "kv_heads",
}
SKIP = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.file_type"}


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, shape: dict[str, int]) -> None:
    for key, field in reader.fields.items():
        if key in SKIP or key == "general.architecture":
            continue
        if key in SHAPE_KEYS:
            writer.add_uint32(key, shape[SHAPE_KEYS[key]])
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--qtype", choices=["Q8_0", "Q4_0", "Q4_1"], default="Q4_0")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    shape = {
        "layers": args.layers, "hidden": args.hidden, "ffn": args.ffn,
        "heads": args.heads, "kv_heads": args.kv_heads,
    }  # fmt: skip
    reader = gguf.GGUFReader(str(default_model_path()))
    vocab = int(reader.fields["llama.vocab_size"].contents())
    writer = gguf.GGUFWriter(args.out, "llama")
    _copy_metadata(reader, writer, shape)
    qtype = gguf.GGMLQuantizationType[args.qtype]
    rng = np.random.default_rng(args.seed)
    head_dim = args.hidden // args.heads

    def quantised(name: str, rows: int, cols: int) -> None:
        w = (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)

    def norm(name: str, n: int) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    quantised("token_embd.weight", vocab, args.hidden)  # tied: also the LM head
    norm("output_norm.weight", args.hidden)
    for i in range(args.layers):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight", args.hidden)
        norm(b + "ffn_norm.weight", args.hidden)
        quantised(b + "attn_q.weight", args.heads * head_dim, args.hidden)
        quantised(b + "attn_k.weight", args.kv_heads * head_dim, args.hidden)
        quantised(b + "attn_v.weight", args.kv_heads * head_dim, args.hidden)
        quantised(b + "attn_output.weight", args.hidden, args.heads * head_dim)
        quantised(b + "ffn_gate.weight", args.ffn, args.hidden)
        quantised(b + "ffn_up.weight", args.ffn, args.hidden)
        quantised(b + "ffn_down.weight", args.hidden, args.ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    params = vocab * args.hidden + args.layers * (
        args.hidden * head_dim * (2 * args.heads + 2 * args.kv_heads) + 3 * args.hidden * args.ffn
    )
    print(
        json.dumps(
            {"out": args.out, "qtype": args.qtype, "params": params, **shape,
             "seconds": round(time.perf_counter() - start, 1)}
        )
    )  # fmt: skip


if __name__ == "__main__":
    main()
