"""`StructuredOutputBackend`: the scheduler's `StructuredOutputProvider`, on llguidance.

Lives in the engine process, one `RequestGrammar` (an `LLMatcher`) per constrained request:

    grammar_bitmask(scheduled)  new request -> matcher (compiled or copied from the LRU)
                                sampling rows -> packed allow-masks (one row per position)
    accept_tokens(id, tokens)   advance the matcher; False if a token breaks the grammar
    validate_draft_tokens(id, drafts)  valid prefix length of drafted tokens (state unchanged)
    remove_request(id)          drop the matcher (finished, aborted, failed)

Speculative decoding (vLLM's design): the scheduler truncates a request's
drafts to the prefix its grammar accepts (`validate_draft_tokens`). The
bitmask then has one row per draft position plus the bonus: row i is the
mask after drafts[:i], computed by advancing the grammar through the drafts
and rolling it back before the runner runs, so the grammar never holds
unverified tokens. After verification `accept_tokens` advances it by the
accepted drafts and the bonus token only: rejected drafts were already undone.

A grammar not in the compiler's cache compiles on a worker thread
(`grammar_ready`, the scheduler's `GrammarCompileGate`): the request stays
WAITING until it is done, other requests keep running (llguidance drops the GIL
while it compiles). A finished grammar allows only the EOS tokens, so the model ends the request
with finish_reason "stop" as soon as the output is complete. Masks are
computed in parallel over the batch by llguidance's thread pool (it drops
the GIL), into one int32 array.

With a reasoning parser (`reasoning`, a `ReasoningEndDetector`), each request
has a `ReasoningGate`: while it thinks it gets no mask row and its tokens
bypass the grammar, which starts after the end-of-think tag (vLLM 0.33's
`should_advance`/`reasoning_ended`); drafts are not checked while it thinks.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy as llnp

from paged.scheduler.boundary import GrammarOutput, SchedulerOutput
from paged.scheduler.request import Request
from paged.server.reasoning.gate import ReasoningEndDetector, ReasoningGate
from paged.server.structured_output.compiler import GrammarCompiler
from paged.server.structured_output.grammar import GrammarError, grammar_key
from paged.server.structured_output.request_grammar import RequestGrammar


class StructuredOutputBackend:
    """Grammar state of every constrained request; a `StructuredOutputProvider`
    and a `GrammarCompileGate`.

    Not thread-safe: the engine core's driver thread makes every call (only
    compilation runs on the backend's own worker thread).
    """

    def __init__(
        self,
        compiler: GrammarCompiler,
        *,
        num_threads: int | None = None,
        reasoning: ReasoningEndDetector | None = None,
    ) -> None:
        self.compiler = compiler
        self.reasoning = reasoning
        self._gates: dict[str, ReasoningGate] = {}
        self._grammars: dict[str, RequestGrammar] = {}
        # Requests whose grammar failed to compile: they sample unmasked and
        # are failed on their first token (accept_tokens returns False).
        self._broken: set[str] = set()
        self._executor = llguidance.LLExecutor(num_threads=num_threads)
        # Grammars compiling for WAITING requests, by request id.
        self._compiling: dict[str, Future[llguidance.LLMatcher]] = {}
        self.num_draft_rows = 0  # mask rows filled for draft positions, for tests and stats
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paged-grammar")

    @property
    def num_requests(self) -> int:
        return len(self._grammars) + len(self._broken)

    def grammar_of(self, request_id: str) -> RequestGrammar | None:
        """The request's grammar state (None: unconstrained, failed or not compiled yet)."""
        return self._grammars.get(request_id)

    def grammar_bitmask(
        self, requests: Sequence[Request], scheduler_output: SchedulerOutput
    ) -> GrammarOutput | None:
        spec = scheduler_output.scheduled_spec_decode_tokens
        rows: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        ids: list[str] = []
        for request in requests:
            grammar = self._grammar_for(request)
            # A partial prefill chunk samples nothing (num_computed_tokens is
            # already advanced past this step's tokens when masks are asked for).
            if grammar is None or request.num_computed_tokens < request.num_tokens:
                continue
            if self._thinking(request):
                continue  # free sampling until the end-of-think tag
            drafts = list(spec.get(request.request_id, ())) if spec else []
            rows.append((grammar.matcher, len(ids), drafts))
            ids.extend([request.request_id] * (len(drafts) + 1))
        if not rows:
            return None
        bitmask = llnp.allocate_token_bitmask(len(ids), self.compiler.vocab_size)
        # Row i after drafts[:i]: llguidance advances each matcher through its
        # drafts and rolls it back (in parallel); a draft the grammar refuses
        # leaves the later rows all-allowed, and verification rejects it there.
        # Its draft call refuses rows without drafts: the two kinds go separately.
        with_drafts = [row for row in rows if row[2]]
        plain = [(m, i) for m, i, drafts in rows if not drafts]
        if with_drafts:
            llnp.fill_next_token_bitmask_par_with_draft_tokens(self._executor, with_drafts, bitmask)
            self.num_draft_rows += sum(len(d) for _, _, d in with_drafts)
        if plain:
            llnp.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        return GrammarOutput(structured_output_request_ids=ids, grammar_bitmask=bitmask.tolist())

    def validate_draft_tokens(self, request_id: str, draft_token_ids: Sequence[int]) -> int:
        """How many leading drafts the request's grammar accepts (all of them if unconstrained)."""
        if request_id in self._broken:
            return 0
        grammar = self._grammars.get(request_id)
        gate = self._gates.get(request_id)
        if grammar is None or (gate is not None and not gate.ended):
            return len(draft_token_ids)
        return grammar.validate_tokens(draft_token_ids)

    def accept_tokens(self, request_id: str, token_ids: Sequence[int]) -> bool:
        if request_id in self._broken:
            return False
        grammar = self._grammars.get(request_id)
        if grammar is None:
            return True  # not constrained
        gate = self._gates.get(request_id)
        if gate is not None:
            answer = gate.feed(token_ids)
            if not answer:  # still thinking, or it just ended with the tag
                return True
            token_ids = answer
        return grammar.accept_tokens(token_ids)

    def grammar_ready(self, request: Request) -> bool:
        req_id = request.request_id
        if req_id in self._grammars or req_id in self._broken:
            return True
        params = request.sampling_params.structured_outputs
        if params is None:
            return True
        future = self._compiling.get(req_id)
        if future is None:
            try:
                key = grammar_key(params)
            except GrammarError:
                self._broken.add(req_id)
                return True
            if self.compiler.is_cached(key):  # the common case: no thread hop
                self._grammars[req_id] = self._new_grammar(self.compiler.new_matcher(key))
                return True
            future = self._pool.submit(self.compiler.new_matcher, key)
            self._compiling[req_id] = future
        if not future.done():
            return False
        del self._compiling[req_id]
        try:
            self._grammars[req_id] = self._new_grammar(future.result())
        except GrammarError:
            self._broken.add(req_id)
        return True

    def remove_request(self, request_id: str) -> None:
        self._grammars.pop(request_id, None)
        self._broken.discard(request_id)
        self._compiling.pop(request_id, None)  # a running compile is left to finish
        self._gates.pop(request_id, None)

    def _thinking(self, request: Request) -> bool:
        """Whether `request` is still reasoning (its gate made on first sight)."""
        if self.reasoning is None:
            return False
        gate = self._gates.get(request.request_id)
        if gate is None:
            params = request.sampling_params.structured_outputs
            ended = params.reasoning_ended if params is not None else None
            gate = self.reasoning.gate(request.prompt_token_ids, ended)
            self._gates[request.request_id] = gate
        return not gate.ended

    def _new_grammar(self, matcher: llguidance.LLMatcher) -> RequestGrammar:
        return RequestGrammar(matcher, self.compiler.eos_token_ids)

    def _grammar_for(self, request: Request) -> RequestGrammar | None:
        req_id = request.request_id
        grammar = self._grammars.get(req_id)
        if grammar is not None or req_id in self._broken:
            return grammar
        params = request.sampling_params.structured_outputs
        if params is None:
            return None
        future = self._compiling.pop(req_id, None)
        try:
            # Without the gate (or scheduled before it said ready): compile here.
            matcher = (
                future.result()
                if future is not None
                else self.compiler.new_matcher(grammar_key(params))
            )
        except GrammarError:
            # The frontend validates first; only a direct engine user gets here.
            self._broken.add(req_id)
            return None
        grammar = self._new_grammar(matcher)
        self._grammars[req_id] = grammar
        return grammar
