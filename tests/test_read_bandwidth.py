"""benchmarks/read_bandwidth.py: the compiled read loop runs at every thread count asked."""

from __future__ import annotations

import pytest

from benchmarks.read_bandwidth import measure


def test_read_bandwidth_reports_each_thread_count() -> None:
    result = measure(mib=16, threads=[1, 2, 3], reps=1, runs=2)
    per_thread = result["threads"]
    assert isinstance(per_thread, dict) and sorted(per_thread) == ["1", "2", "3"]
    for entry in per_thread.values():
        assert len(entry["runs"]) == 2 and entry["gb_s"] > 0


def test_read_bandwidth_refuses_empty_sizes() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        measure(mib=0, threads=[1], reps=1, runs=1)
    with pytest.raises(ValueError, match="must be >= 1"):
        measure(mib=1, threads=[0], reps=1, runs=1)
