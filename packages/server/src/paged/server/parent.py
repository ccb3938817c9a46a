"""n > 1: one user request fanned out as n engine requests, gathered back.

Each child is an ordinary engine request `"{index}_{request_id}"` with
`n=1` (and `seed + index` when seeded, so samples differ yet reproduce).
The parent merges the children's `CompletionOutput`s by `index`.
"""

from __future__ import annotations

import msgspec

from paged.scheduler import EngineCoreRequest, RequestOutputKind, SamplingParams
from paged.server.outputs import CompletionOutput


def child_request_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


class ParentRequest:
    """Gathers the `n` children of one user request into `RequestOutput`s."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.n = params.n
        self._latest: dict[int, CompletionOutput] = {}
        self._finished: set[int] = set()

    def child_ids(self) -> list[str]:
        return [child_request_id(i, self.request_id) for i in range(self.n)]

    def child_params(self, index: int) -> SamplingParams:
        seed = self.params.seed + index if self.params.seed is not None else None
        return msgspec.structs.replace(self.params, n=1, seed=seed)

    def all_finished(self) -> bool:
        return len(self._finished) == self.n

    def get_outputs(self, completion: CompletionOutput) -> tuple[list[CompletionOutput], bool]:
        """Record a child's completion; the completions to report now and whether all finished.

        vLLM's `ParentRequest.get_outputs`: DELTA reports the child's own delta;
        CUMULATIVE every child's latest, by index; FINAL_ONLY nothing (an empty
        list) until every child has finished, then all of them.
        """
        if completion.finished():
            self._finished.add(completion.index)
        kind = self.params.output_kind
        if kind == RequestOutputKind.DELTA:
            return [completion], self.all_finished()
        self._latest[completion.index] = completion
        if kind == RequestOutputKind.FINAL_ONLY and not self.all_finished():
            return [], False
        return [self._latest[i] for i in sorted(self._latest)], self.all_finished()


def fan_out(request: EngineCoreRequest) -> tuple[ParentRequest | None, list[EngineCoreRequest]]:
    """The engine requests for a user request: itself when n == 1, else n children."""
    if request.sampling_params.n == 1:
        return None, [request]
    parent = ParentRequest(request.request_id, request.sampling_params)
    children = [
        msgspec.structs.replace(
            request,
            request_id=child_request_id(i, request.request_id),
            sampling_params=parent.child_params(i),
        )
        for i in range(parent.n)
    ]
    return parent, children
