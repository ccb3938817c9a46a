"""`SpecDecoder`: the speculative-decoding component the `ModelRunner` holds.

One step, from the runner's side:

    execute_model
      stage_drafts      the scheduled drafts go into the batch's token rows after
                        the known tokens, so `prepare_inputs` feeds them to the
                        target: one forward scores every drafted position
      follow_target     (draft model) the draft runs over the same tokens
    sample_tokens
      sample            grammar rows per position, rejection sampling, the
                        accepted tokens appended to the batch and the states
      propose           drafts for the next step (n-gram or draft model), for
                        the requests that sampled and may draft
      -> ModelRunnerOutput(sampled_token_ids = accepted drafts + one token,
                           draft_token_ids = the next step's drafts)

The scheduler rolls back the rejected positions (num_computed_tokens), so
their KV slots are simply written again by the next step.

A request may draft unless it uses penalties or a pending min-tokens (both
depend on every earlier token, so one processed distribution per position
would not be exact), has no room left before max_tokens, or is paused by
`AdaptiveDrafting`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt
import torch

from paged.runner.attention.backends import AttentionMetadataBuilder
from paged.runner.input_batch import CachedRequestState, InputBatch
from paged.runner.input_prep import StepInputs
from paged.runner.runner_output import packed_mask_bytes, unpack_bitmask
from paged.runner.sampler.build import build_sampling_metadata
from paged.runner.sampler.sampler import Sampler, SamplerOutput
from paged.runner.spec_decode.adaptive import AdaptiveDrafting
from paged.runner.spec_decode.config import SpeculativeConfig
from paged.runner.spec_decode.draft_model import DraftModelProposer
from paged.runner.spec_decode.ngram import NgramProposer
from paged.runner.spec_decode.policy import (
    AcceptanceHistory,
    RowCostModel,
    plan_request_drafts,
)
from paged.runner.spec_decode.rejection_sampler import RejectionOutput, rejection_sample
from paged.scheduler.boundary import GrammarOutput, LogprobsLists, ModelRunnerOutput


class SpecDecoder:
    """Drafts, verification and the draft model's state (see the module docstring)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        device: torch.device,
        builder: AttentionMetadataBuilder,
        max_model_len: int,
        max_num_reqs: int,
        quantized: bool = False,
    ) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.adaptive = AdaptiveDrafting(
            config.acceptance_rate_threshold, config.acceptance_backoff_steps
        )
        # The cost-aware policy (policy.py): per-request history, the row-cost curve
        # of the compute path (quantised CPU weights cost far more per row) or the config's.
        self.cost_model = (
            RowCostModel(config.row_costs)
            if config.row_costs is not None
            else RowCostModel.for_path(device.type, quantized)
        )
        self.histories: dict[str, AcceptanceHistory] = {}
        self.sampler = Sampler()  # steps in which no request drafted
        self.ngram: NgramProposer | None = None
        self.draft: DraftModelProposer | None = None
        if config.method == "ngram":
            self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            if config.draft_model_config is None:
                raise ValueError(
                    "speculative_config.model: the draft model was not resolved "
                    "(SpeculativeConfig.draft_model_config is None)"
                )
            self.draft = DraftModelProposer(
                config.draft_model_config, device, builder, self.k, max_num_reqs
            )

    # ---------------------------------------------------------- execute_model

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.adaptive.forget(req_id)
            self.histories.pop(req_id, None)

    def stage_drafts(
        self, batch: InputBatch, spec_tokens: dict[str, list[int]]
    ) -> npt.NDArray[np.int64]:
        """Write each row's scheduled drafts after its known tokens; drafts per batch row."""
        num_drafts = np.zeros(batch.num_reqs, dtype=np.int64)
        for req_id, drafts in spec_tokens.items():
            row = batch.req_id_to_index.get(req_id)
            if row is None or not drafts:
                continue
            n = int(batch.num_tokens[row])
            if n + len(drafts) > batch.max_model_len:
                raise ValueError(f"scheduler_output: drafts of {req_id!r} run past max_model_len")
            batch.token_ids_cpu[row, n : n + len(drafts)] = drafts
            num_drafts[row] = len(drafts)
        return num_drafts

    def follow_target(self, inputs: StepInputs) -> None:
        if self.draft is not None:
            self.draft.follow_target(inputs)

    # ----------------------------------------------------------- sample_tokens

    def sample(
        self,
        logits: torch.Tensor,
        inputs: StepInputs,
        batch: InputBatch,
        requests: dict[str, CachedRequestState],
        grammar_output: GrammarOutput | None,
    ) -> ModelRunnerOutput:
        """Verify, append the accepted tokens, propose the next drafts; the step's output."""
        rows = inputs.sampling_rows
        num_drafts = (
            inputs.num_drafts[rows]
            if inputs.num_drafts is not None
            else np.zeros(len(rows), np.int64)
        )
        req_ids = [inputs.req_ids[r] for r in rows.tolist()]
        if grammar_output is not None and grammar_output.structured_output_request_ids:
            position_req_ids = [
                rid
                for rid, k in zip(req_ids, num_drafts.tolist(), strict=True)
                for _ in range(k + 1)
            ]
            logits = apply_grammar_rows(logits, position_req_ids, grammar_output)
        metadata = build_sampling_metadata(batch, rows)
        if num_drafts.any():
            draft_ids = [
                batch.token_ids_cpu[r, n : n + k].tolist()
                for r, n, k in zip(
                    rows.tolist(), batch.num_tokens[rows].tolist(), num_drafts.tolist(), strict=True
                )
            ]
            result = rejection_sample(logits, num_drafts, draft_ids, metadata)
        else:
            # Nobody drafted (free text, paused requests): the plain sampler, so a
            # step without drafts costs what it costs without speculation.
            result = _as_rejection_output(self.sampler(logits, metadata))
        for row, req_id, tokens, k, accepted in zip(
            rows.tolist(),
            req_ids,
            result.token_ids,
            num_drafts.tolist(),
            result.num_accepted,
            strict=True,
        ):
            batch.append_token_ids(row, tokens)
            requests[req_id].output_token_ids.extend(tokens)
            self.adaptive.record(req_id, k, accepted)
            if k:
                self.histories.setdefault(req_id, AcceptanceHistory()).record(k, accepted)
        drafts = self.propose(batch, requests, rows, req_ids)
        return _build_output(inputs, req_ids, result, batch, drafts)

    def propose(
        self,
        batch: InputBatch,
        requests: dict[str, CachedRequestState],
        rows: npt.NDArray[np.int64],
        req_ids: Sequence[str],
    ) -> dict[str, list[int]]:
        """Next-step drafts for the requests that just sampled (batch `rows`)."""
        if len(rows) == 0:
            return {}
        max_drafts = self._draft_limits(batch, requests, rows, req_ids)
        if not max_drafts.any():
            return {}
        if self.ngram is not None:
            num_tokens = batch.num_tokens[rows]
            width = int(num_tokens.max())
            drafts, match_len = self.ngram.propose_with_match_len(
                batch.token_ids_cpu[rows, :width], num_tokens, max_drafts
            )
            if self.config.draft_policy == "cost":
                drafts = self._truncate_by_value(batch, rows, req_ids, drafts, match_len)
        else:
            assert self.draft is not None
            drafts = self.draft.propose(batch, rows, max_drafts)
        return {rid: d for rid, d in zip(req_ids, drafts, strict=True) if d}

    def _truncate_by_value(
        self,
        batch: InputBatch,
        rows: npt.NDArray[np.int64],
        req_ids: Sequence[str],
        drafts: list[list[int]],
        match_len: list[int],
    ) -> list[list[int]]:
        """Cut each request's drafts to the plan that maximises tokens per forward cost.

        A seeded request draws one uniform per draft it verifies, so its tokens
        must not depend on who else is in the batch: it is planned as if alone
        (its own match and history only). The others share one batch plan.
        """
        plan = plan_request_drafts(
            len(req_ids),
            match_len,
            [len(d) for d in drafts],
            [self.histories.get(rid) for rid in req_ids],
            [int(r) in batch.generators for r in rows.tolist()],
            self.cost_model,
        )
        return [d[:k] for d, k in zip(drafts, plan, strict=True)]

    def _draft_limits(
        self,
        batch: InputBatch,
        requests: dict[str, CachedRequestState],
        rows: npt.NDArray[np.int64],
        req_ids: Sequence[str],
    ) -> npt.NDArray[np.int64]:
        """How many drafts each row may get this time (0: none)."""
        num_tokens = batch.num_tokens[rows].astype(np.int64)
        # Drafts plus the bonus token must fit before max_model_len.
        limits = np.minimum(self.k, self.max_model_len - num_tokens - 1)
        exact = (
            (batch.presence_penalties.np[rows] == 0)
            & (batch.frequency_penalties.np[rows] == 0)
            & (batch.repetition_penalties.np[rows] == 1.0)
        )
        limits = np.where(exact, limits, 0)
        cap = self.config.disable_by_batch_size
        if cap is not None and len(rows) >= cap:
            # vLLM's override: a batch this large decodes without drafts.
            return np.zeros(len(rows), dtype=np.int64)
        for i, (row, req_id) in enumerate(zip(rows.tolist(), req_ids, strict=True)):
            if limits[i] <= 0:
                continue
            state = requests[req_id]
            params = state.sampling_params
            left = (
                params.max_tokens - len(state.output_token_ids) - 1 if params.max_tokens else None
            )
            if left is not None:
                limits[i] = min(limits[i], left)
            pending_min = batch.min_tokens.get(row)
            # (`or` short-circuits: a paused request's countdown runs only when it could draft.)
            min_tokens_pending = (
                pending_min is not None and len(state.output_token_ids) < pending_min[0]
            )
            if min_tokens_pending or not self.adaptive.should_draft(req_id):
                limits[i] = 0
        return limits.clip(min=0)


def apply_grammar_rows(
    logits: torch.Tensor, position_req_ids: Sequence[str], grammar_output: GrammarOutput
) -> torch.Tensor:
    """Mask, in place, each position by its own grammar row.

    The scheduler sends one bitmask row per position a request samples
    (drafts then bonus, so an id repeats); the n-th row of a request masks its
    n-th position. A drafted token the grammar forbids then has target
    probability 0 and is always rejected.
    """
    ids = grammar_output.structured_output_request_ids
    if len(ids) != len(grammar_output.grammar_bitmask):
        raise ValueError(
            f"grammar_output: {len(ids)} request ids but {len(grammar_output.grammar_bitmask)} "
            "bitmask rows"
        )
    positions: dict[str, list[int]] = {}
    for pos, req_id in enumerate(position_req_ids):
        positions.setdefault(req_id, []).append(pos)
    used: dict[str, int] = {}
    rows: list[int] = []
    masks: list[list[int]] = []
    for req_id, mask in zip(ids, grammar_output.grammar_bitmask, strict=True):
        mine = positions.get(req_id)
        n = used.get(req_id, 0)
        if mine is None or n >= len(mine):
            continue
        used[req_id] = n + 1
        rows.append(mine[n])
        masks.append(mask)
    if not rows:
        return logits
    mask_bytes = torch.from_numpy(packed_mask_bytes(masks)).to(logits.device)
    disallowed = ~unpack_bitmask(mask_bytes, logits.shape[-1])
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(disallowed, float("-inf"))
    return logits


def _as_rejection_output(out: SamplerOutput) -> RejectionOutput:
    """The plain sampler's one token per request, as a verification with no drafts."""
    tokens = out.sampled_token_ids.tolist()
    return RejectionOutput(
        token_ids=[[t] for t in tokens],
        num_accepted=[0] * len(tokens),
        position_start=list(range(len(tokens))),
        logprobs=out.logprobs,
        num_nans=[int(n) for n in out.num_nans.tolist()],
    )


def _build_output(
    inputs: StepInputs,
    sampling_req_ids: Sequence[str],
    result: RejectionOutput,
    batch: InputBatch,
    drafts: dict[str, list[int]],
) -> ModelRunnerOutput:
    by_req = dict(zip(sampling_req_ids, result.token_ids, strict=True))
    sampled = [by_req.get(rid, []) for rid in inputs.req_ids]
    logprobs: dict[str, LogprobsLists] = {}
    nans: dict[str, int] = {}
    for i, req_id in enumerate(sampling_req_ids):
        if result.num_nans[i]:
            nans[req_id] = result.num_nans[i]
        k = batch.num_logprobs.get(req_id)
        if k is not None and result.logprobs is not None:
            t = result.logprobs
            start, end = (
                result.position_start[i],
                result.position_start[i] + len(result.token_ids[i]),
            )
            logprobs[req_id] = LogprobsLists(
                token_ids=t.token_ids[start:end, : 1 + k].tolist(),
                logprobs=t.logprobs[start:end, : 1 + k].tolist(),
                ranks=t.ranks[start:end].tolist(),
            )
    return ModelRunnerOutput(
        req_ids=list(inputs.req_ids),
        sampled_token_ids=sampled,
        logprobs=logprobs,
        num_nans_in_logits=nans,
        draft_token_ids=drafts,
    )
