"""Fused C ops for the CPU decode step (bf16 activations): build on first use, typed wrappers.

`build.load_step_ops()` compiles `step_ops.c` with the system C compiler and
loads it with ctypes (None when that is impossible or disabled); `ops` wraps
each function with the shape, dtype and stride checks the C code relies on.
"""
