"""`StructuredOutputBackend`: the scheduler's `StructuredOutputProvider`, on llguidance.

Lives in the engine process, one `LLMatcher` per constrained request:

    grammar_bitmask(scheduled)  new request -> matcher (compiled or copied from the LRU)
                                sampling rows -> packed allow-masks (one row per position)
    accept_tokens(id, tokens)   advance the matcher; False if a token breaks the grammar
    remove_request(id)          drop the matcher (finished, aborted, failed)

A finished grammar allows only the EOS tokens, so the model ends the request
with finish_reason "stop" as soon as the output is complete. Masks are
computed in parallel over the batch by llguidance's thread pool (it drops
the GIL), into one int32 array.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.numpy as llnp

from paged.scheduler.boundary import GrammarOutput, SchedulerOutput
from paged.scheduler.request import Request
from paged.server.structured_output.compiler import GrammarCompiler
from paged.server.structured_output.grammar import GrammarError, grammar_key


class StructuredOutputBackend:
    """Grammar state of every constrained request; satisfies `StructuredOutputProvider`.

    Not thread-safe: the engine core's driver thread makes every call.
    """

    def __init__(self, compiler: GrammarCompiler, *, num_threads: int | None = None) -> None:
        self.compiler = compiler
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        # Requests whose grammar failed to compile: they sample unmasked and
        # are failed on their first token (accept_tokens returns False).
        self._broken: set[str] = set()
        self._executor = llguidance.LLExecutor(num_threads=num_threads)

    @property
    def num_requests(self) -> int:
        return len(self._matchers) + len(self._broken)

    def grammar_bitmask(
        self, requests: Sequence[Request], scheduler_output: SchedulerOutput
    ) -> GrammarOutput | None:
        spec = scheduler_output.scheduled_spec_decode_tokens
        rows: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        ids: list[str] = []
        for request in requests:
            matcher = self._matcher_for(request)
            # A partial prefill chunk samples nothing (num_computed_tokens is
            # already advanced past this step's tokens when masks are asked for).
            if matcher is None or request.num_computed_tokens < request.num_tokens:
                continue
            drafts = list(spec.get(request.request_id, ())) if spec else []
            rows.append((matcher, len(ids), drafts))
            ids.extend([request.request_id] * (len(drafts) + 1))
        if not rows:
            return None
        bitmask = llnp.allocate_token_bitmask(len(ids), self.compiler.vocab_size)
        if any(drafts for _, _, drafts in rows):
            llnp.fill_next_token_bitmask_par_with_draft_tokens(self._executor, rows, bitmask)
        else:
            llnp.fill_next_token_bitmask_par(self._executor, [(m, i) for m, i, _ in rows], bitmask)
        return GrammarOutput(structured_output_request_ids=ids, grammar_bitmask=bitmask.tolist())

    def accept_tokens(self, request_id: str, token_ids: Sequence[int]) -> bool:
        if request_id in self._broken:
            return False
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return True  # not constrained
        eos = self.compiler.eos_token_ids
        for token in token_ids:
            if matcher.is_stopped():
                # A complete grammar's mask allows only EOS, which it then
                # refuses to consume ("parser stopped"); EOS is what we want.
                if token not in eos:
                    return False
                continue
            if not matcher.consume_token(token):
                return False
        return not matcher.is_error()

    def remove_request(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._broken.discard(request_id)

    def _matcher_for(self, request: Request) -> llguidance.LLMatcher | None:
        req_id = request.request_id
        matcher = self._matchers.get(req_id)
        if matcher is not None or req_id in self._broken:
            return matcher
        params = request.sampling_params.structured_outputs
        if params is None:
            return None
        try:
            matcher = self.compiler.new_matcher(grammar_key(params))
        except GrammarError:
            # The frontend validates first; only a direct engine user gets here.
            self._broken.add(req_id)
            return None
        self._matchers[req_id] = matcher
        return matcher
