"""Column-panel copies of linear weights: faster CPU GEMMs for 2+ rows.

    weight [N, K] -> panels [N/c, K, c], each panel one contiguous block
    x [M, K] -> bmm(x, panels) [N/c, M, c] -> y [M, N]

MKL's sgemm with a few rows (decode batches) streams the weight from memory
and runs at a fraction of the bandwidth when the weight is one wide [K, N]
matrix; fed contiguous [K, c] panels (c about 384 floats, 1.5 KiB rows) it
prefetches well. Measured for SmolLM2-135M on one core of this CPU
(`benchmarks/runner_bench.py`): the MLP's 576 x 3072 GEMM takes 20-25% less
time at 2-64 rows, and the whole decode step 10-20% less at batch 8-64.

With one row the plain layout is faster (a GEMV over the wide matrix: about
25% slower through panels), and from about 128 rows (prefill) MKL's own
blocking is as good while the output permute costs extra, so a layer keeps
its plain weight too and picks per call. The cost is a second copy of every
linear weight (and of the LM head) on CPU: SmolLM2-135M takes 1026 MiB
instead of 513. `ModelConfig.cpu_weight_panels` (`--cpu-weight-panels`) is
"auto" by default: the loader builds the panels only when they take at most a
quarter of the host's available memory, so a large model is never pushed into
swap for them; "on" and "off" force the choice.
"""

from __future__ import annotations

import torch

TARGET_PANEL_WIDTH = 384
MIN_ROWS = 2  # below this the plain GEMV wins
MAX_ROWS = 128  # above this MKL's own blocking is as good and the permute costs extra


def panel_width(out_features: int, target: int = TARGET_PANEL_WIDTH) -> int:
    """The panel width for `out_features` columns.

    A divisor of out_features that is a multiple of 16 between target/3 and
    2*target, nearest to target; otherwise target (the last panel is then
    zero-padded).
    """
    if out_features <= 0:
        raise ValueError(f"out_features: must be positive, got {out_features}")
    if out_features <= 2 * target:
        return out_features
    candidates = [
        c for c in range(16, 2 * target + 1, 16) if c >= target // 3 and out_features % c == 0
    ]
    if not candidates:
        return target
    return min(candidates, key=lambda c: (abs(c - target), c))


def make_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] weight (any strides) -> [ceil(N/c), K, c] contiguous panels, zero-padded."""
    if weight.dim() != 2:
        raise ValueError(f"weight: expected [out, in], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    c = panel_width(n)
    num_panels = -(-n // c)
    panels = torch.zeros(num_panels * c, k, dtype=weight.dtype, device=weight.device)
    panels[:n].copy_(weight)
    # [P*c, K] -> [P, c, K] -> [P, K, c]: each panel's columns become rows.
    return panels.view(num_panels, c, k).transpose(1, 2).contiguous()


def panel_matmul(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] @ weight^T through `panels` -> [M, out_features] contiguous."""
    num_panels, k, c = panels.shape
    m = x.shape[0]
    y = torch.bmm(x.expand(num_panels, m, k), panels)  # [P, M, c]
    y = y.permute(1, 0, 2).reshape(m, num_panels * c)
    if num_panels * c != out_features:
        y = y[:, :out_features].contiguous()
    return y


def use_panels(x: torch.Tensor, panels: torch.Tensor | None) -> bool:
    """Whether a GEMM on `x` should go through `panels` (2-D input, MIN_ROWS..MAX_ROWS rows)."""
    return panels is not None and x.dim() == 2 and MIN_ROWS <= x.shape[0] <= MAX_ROWS
