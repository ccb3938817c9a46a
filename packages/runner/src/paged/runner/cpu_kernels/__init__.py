"""C kernels for CPU inference, compiled on first use (see build.py).

qgemm.c      y = x W^T for group-quantised W (4-bit d·q + m, 8-bit d·q)
qgemm_avx2.c      its AVX2 tile kernels, inlined
qgemm_native.c    GGUF's own bytes (Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q8_0) in its tiles, inlined
qgemm_quantize.c  its activation quantiser (int8 per 32, the residual level), inlined
qgemm_repack.c    GGUF blocks straight into the native tiles; rows of a packed weight, inlined
build.py     compile with the system C compiler into a cache, load with ctypes
packing.py   checkpoint codes/scales -> the kernel's tile layout, and back
packing_native.py  the same at the file's byte count (qgemm_native.c's layouts)
repack.py    a GGUF tensor's bytes -> QGemm in one C pass (the loader's fast path); row lookups
qgemm.py     QGemm: one packed weight and its matmul; quantized_activations (tests)
"""

from paged.runner.cpu_kernels.build import QGemmLibrary, load_qgemm
from paged.runner.cpu_kernels.qgemm import QGemm

__all__ = ["QGemm", "QGemmLibrary", "load_qgemm"]
