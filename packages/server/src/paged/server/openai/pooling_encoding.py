"""How a pooled tensor goes out in JSON: a float list, or base64 of its raw bytes.

vLLM 0.33 (vllm/entrypoints/pooling/utils.py:69-92, vllm/utils/serial_utils.py:
39-45,74-96): base64 is the flattened tensor cast to `embed_dtype`, in the
machine's byte order ("native") unless `endianness` names one. The openai
client asks for base64 by default and decodes it as native float32.
"""

from __future__ import annotations

import base64
import sys
from typing import Any

import torch

from paged.server.openai.pooling_protocol import EmbedDType, EncodingFormat, Endianness

# embed_dtype -> (the dtype cast to, the same-width dtype whose bytes are written).
# bfloat16 and fp8 have no numpy dtype: their bits go out through int views.
_DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "float32": (torch.float32, torch.float32),
    "float16": (torch.float16, torch.float16),
    "bfloat16": (torch.bfloat16, torch.int16),
    "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
    "fp8_e5m2": (torch.float8_e5m2, torch.uint8),
}


def tensor_bytes(data: torch.Tensor, embed_dtype: EmbedDType, endianness: Endianness) -> bytes:
    """The flattened tensor as `embed_dtype` in the requested byte order."""
    cast_to, view_as = _DTYPES[embed_dtype]
    array = data.detach().to("cpu", cast_to).flatten().contiguous().view(view_as).numpy()
    if endianness != "native" and endianness != sys.byteorder:
        array = array.byteswap()
    return array.tobytes()


def encode_tensor(
    data: torch.Tensor,
    encoding_format: EncodingFormat,
    embed_dtype: EmbedDType = "float32",
    endianness: Endianness = "native",
) -> Any:
    """A float list (nested for 2-D token outputs) or a base64 string."""
    if encoding_format == "float":
        return data.detach().to("cpu", torch.float32).tolist()
    raw = tensor_bytes(data, embed_dtype, endianness)
    return base64.b64encode(raw).decode("ascii")
