"""`ParentRequest.get_outputs`: what an n > 1 request reports per output kind (vLLM's rule)."""

from __future__ import annotations

from paged.scheduler import RequestOutputKind, SamplingParams
from paged.server.outputs import CompletionOutput
from paged.server.parent import ParentRequest


def _out(index: int, text: str, finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(index, text, [], None, None, finish_reason=finish)


def _parent(kind: RequestOutputKind) -> ParentRequest:
    return ParentRequest("r", SamplingParams(n=2, output_kind=kind))


def test_delta_reports_each_child_as_it_comes() -> None:
    parent = _parent(RequestOutputKind.DELTA)
    assert parent.get_outputs(_out(1, "a")) == ([_out(1, "a")], False)
    assert parent.get_outputs(_out(0, "b", "stop")) == ([_out(0, "b", "stop")], False)
    assert parent.get_outputs(_out(1, "c", "length")) == ([_out(1, "c", "length")], True)


def test_cumulative_reports_every_childs_latest_by_index() -> None:
    parent = _parent(RequestOutputKind.CUMULATIVE)
    assert parent.get_outputs(_out(1, "a")) == ([_out(1, "a")], False)
    assert parent.get_outputs(_out(0, "b")) == ([_out(0, "b"), _out(1, "a")], False)
    outputs, finished = parent.get_outputs(_out(1, "ab", "stop"))
    assert (outputs, finished) == ([_out(0, "b"), _out(1, "ab", "stop")], False)


def test_final_only_reports_nothing_until_every_child_finished() -> None:
    parent = _parent(RequestOutputKind.FINAL_ONLY)
    assert parent.get_outputs(_out(1, "x", "stop")) == ([], False)
    outputs, finished = parent.get_outputs(_out(0, "y", "length"))
    assert finished
    assert outputs == [_out(0, "y", "length"), _out(1, "x", "stop")]
