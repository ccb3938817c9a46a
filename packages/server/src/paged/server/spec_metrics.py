"""Prometheus counters for speculative decoding (vLLM's `spec_decode_*` metrics).

From `SchedulerStats.spec_decoding_stats`, under the naming scheme's prefix:

    spec_decode_num_drafts_total                    drafts verified
    spec_decode_num_draft_tokens_total              tokens drafted
    spec_decode_num_accepted_tokens_total           drafted tokens accepted
    spec_decode_num_accepted_tokens_per_pos_total   accepted, by draft position

The acceptance rate is accepted / draft tokens and the mean accepted length
per step is 1 + accepted / drafts, as vLLM's dashboards compute them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from paged.scheduler.boundary import SpecDecodingStats
from paged.server.metrics_names import MetricsNaming


class SpecDecodingMetrics:
    """Adds each report's counts to the four counters."""

    def __init__(
        self,
        registry: CollectorRegistry,
        naming: MetricsNaming,
        label_values: tuple[str, ...],
        num_speculative_tokens: int,
    ) -> None:
        labels = list(naming.labelnames)
        n = naming.name
        self._lv = label_values
        self.num_drafts = Counter(
            n("spec_decode_num_drafts"),
            "Number of spec decoding drafts.",
            labels,
            registry=registry,
        )
        self.num_draft_tokens = Counter(
            n("spec_decode_num_draft_tokens"), "Number of draft tokens.", labels, registry=registry
        )
        self.num_accepted_tokens = Counter(
            n("spec_decode_num_accepted_tokens"),
            "Number of accepted tokens.",
            labels,
            registry=registry,
        )
        self.per_pos = Counter(
            n("spec_decode_num_accepted_tokens_per_pos"),
            "Accepted tokens per draft position.",
            [*labels, "position"],
            registry=registry,
        )
        for counter in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens):
            counter.labels(*label_values)
        for pos in range(num_speculative_tokens):  # zeros, so every series exists
            self.per_pos.labels(*label_values, str(pos))

    def record(self, stats: SpecDecodingStats) -> None:
        lv = self._lv
        self.num_drafts.labels(*lv).inc(stats.num_drafts)
        self.num_draft_tokens.labels(*lv).inc(stats.num_draft_tokens)
        self.num_accepted_tokens.labels(*lv).inc(stats.num_accepted_tokens)
        for pos, count in enumerate(stats.num_accepted_tokens_per_pos):
            if count:
                self.per_pos.labels(*lv, str(pos)).inc(count)
