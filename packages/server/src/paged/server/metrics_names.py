"""How the engine metrics are named: paged's own scheme or vLLM's, for its scrapers.

Both schemes use vLLM's metric names after the prefix (`num_requests_waiting`,
`prompt_tokens`, ...). `--metrics-prefix vllm` publishes them exactly as
vLLM v1's `PrometheusStatLogger` does, so dashboards and routers that scrape
`vllm:num_requests_waiting` work unchanged: the `vllm:` prefix, the label set
`{model_name, engine}` (engine "0", or each data-parallel engine's index)
and vLLM's histogram buckets. The default `paged` scheme keeps the `paged:`
prefix, the single `model_name` label and paged's buckets.
"""

from __future__ import annotations

from dataclasses import dataclass

METRICS_PREFIXES = ("paged", "vllm")

# paged's buckets (the `paged` scheme).
_PAGED_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
_PAGED_ITL_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip
# vLLM v1's buckets (vllm/v1/metrics/loggers.py): recording rules and SLO
# thresholds written against vLLM's `le` values must find the same ones.
_VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_VLLM_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class MetricsNaming:
    """Prefix, engine-metric labels and histogram buckets of one naming scheme."""

    prefix: str
    engine_label: bool  # vLLM labels every engine metric with its engine index too
    ttft_buckets: tuple[float, ...]
    itl_buckets: tuple[float, ...]
    e2e_buckets: tuple[float, ...]

    def name(self, base: str) -> str:
        """`base` (vLLM's name without prefix) under this scheme's prefix."""
        return f"{self.prefix}:{base}"

    @property
    def labelnames(self) -> tuple[str, ...]:
        return ("model_name", "engine") if self.engine_label else ("model_name",)

    def label_values(self, model_name: str, engine_index: int = 0) -> tuple[str, ...]:
        """The engine metrics' label values for `model_name`, in `labelnames` order."""
        return (model_name, str(engine_index)) if self.engine_label else (model_name,)


PAGED_NAMING = MetricsNaming(
    prefix="paged",
    engine_label=False,
    ttft_buckets=_PAGED_LATENCY_BUCKETS,
    itl_buckets=_PAGED_ITL_BUCKETS,
    e2e_buckets=_PAGED_LATENCY_BUCKETS,
)
VLLM_NAMING = MetricsNaming(
    prefix="vllm",
    engine_label=True,
    ttft_buckets=_VLLM_TTFT_BUCKETS,
    itl_buckets=_VLLM_ITL_BUCKETS,
    e2e_buckets=_VLLM_REQUEST_LATENCY_BUCKETS,
)


def metrics_naming(prefix: str) -> MetricsNaming:
    """The naming scheme for `--metrics-prefix`; ValueError for an unknown prefix."""
    schemes = {"paged": PAGED_NAMING, "vllm": VLLM_NAMING}
    try:
        return schemes[prefix]
    except KeyError:
        raise ValueError(
            f"metrics_prefix must be one of {', '.join(METRICS_PREFIXES)}; got {prefix!r}"
        ) from None
