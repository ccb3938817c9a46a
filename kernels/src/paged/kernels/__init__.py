"""paged.kernels: paged attention and model hot ops, Triton kernels with torch references.

Use the ops through ``paged.kernels.ops`` (dispatches per device). Importing this
package never imports triton.
"""

from paged.kernels.interface import KernelBackend
from paged.kernels.layout import (
    PAD_SLOT_ID,
    kv_cache_shape,
    slot_mapping_from_block_table,
    split_kv_cache,
)
from paged.kernels.rope import RopeScaling, compute_cos_sin_cache

__all__ = [
    "PAD_SLOT_ID",
    "KernelBackend",
    "RopeScaling",
    "compute_cos_sin_cache",
    "kv_cache_shape",
    "slot_mapping_from_block_table",
    "split_kv_cache",
]
