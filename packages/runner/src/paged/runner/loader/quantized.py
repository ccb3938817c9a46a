"""The loader's quantised-weights hook, generic over models.

    prepare_quantized_load(model)      every layer that can hold quantised weights
                                       (ShardedLinear, VocabParallelEmbedding and
                                       subclasses) stages its next load
    model.load_weights(...)            checkpoint rows flow in as usual (quantised or not)
    finish_quantized_load(model, dt)   each staged layer picks its kernel; returns
                                       what each tensor kind became, for the log

A model gets the quantised path by building its projections from these layer
classes; nothing here knows a model family.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import torch
from torch import nn

from paged.runner.layers.linear import ShardedLinear
from paged.runner.layers.quantized_linear import QuantReport
from paged.runner.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantizedKind:
    """One row of the start-up summary: a tensor kind and what its layers became."""

    kind: str  # module name with layer indices replaced: "model.layers.*.mlp.down_proj"
    source: str
    kernel: str
    count: int
    max_rel_error: float
    nbytes: int


def _staged_modules(model: nn.Module) -> list[tuple[str, ShardedLinear | VocabParallelEmbedding]]:
    found = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (ShardedLinear, VocabParallelEmbedding))
    ]
    # Tied heads take their embedding's kernel, so they come last.
    return sorted(found, key=lambda nm: isinstance(nm[1], ParallelLMHead))


def prepare_quantized_load(model: nn.Module) -> None:
    """Stage every quantisable layer of `model` before `load_weights`."""
    for _, module in _staged_modules(model):
        module.start_quantized_load()


def finish_quantized_load(model: nn.Module, dtype: torch.dtype) -> list[QuantizedKind]:
    """Finalise every staged layer; log and return one summary row per tensor kind."""
    reports: dict[tuple[str, str, str], list[QuantReport]] = {}
    for name, module in _staged_modules(model):
        report = module.finish_quantized_load(dtype)
        if report is None:  # a tied head: its embedding's row says it
            continue
        kind = re.sub(r"\.\d+\.", ".*.", name)
        reports.setdefault((kind, report.source, report.kernel), []).append(report)
    summary = [
        QuantizedKind(
            kind=kind,
            source=source,
            kernel=kernel,
            count=len(rs),
            max_rel_error=max(r.rel_error for r in rs),
            nbytes=sum(r.nbytes for r in rs),
        )
        for (kind, source, kernel), rs in reports.items()
    ]
    log_quantized_summary(summary)
    return summary


def log_quantized_summary(summary: list[QuantizedKind]) -> None:
    """One INFO line for the whole model; the per-kind rows at DEBUG.

    The rows (five or more long lines for a GGUF) used to be INFO, so every
    `paged generate` printed them before its answer.
    """
    if not summary:
        return
    for row in summary:
        logger.debug(
            "quantized weights: %s x%d: %s -> %s (relative error vs the checkpoint %.2e, %.1f MiB)",
            row.kind, row.count, row.source, row.kernel, row.max_rel_error, row.nbytes / 2**20,
        )  # fmt: skip
    logger.info(
        "quantized weights: %d tensors kept quantized (from %s), %.1f MiB, relative error vs the "
        "checkpoint at most %.2e (--log-level debug lists each kind)",
        sum(row.count for row in summary),
        ", ".join(sorted({row.source for row in summary})),
        sum(row.nbytes for row in summary) / 2**20,
        max(row.max_rel_error for row in summary),
    )
