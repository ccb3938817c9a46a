"""Stop checks run after each appended token (seed: update_from_output 完了判定).

Order matters and follows vLLM: below `min_tokens` no stop token or EOS can
end the request; then EOS (unless `ignore_eos`) and `stop_token_ids` (even with
`ignore_eos`) finish it as STOPPED, the stop token kept in the output; then the
length caps (`max_tokens`, `max_model_len`) finish it as LENGTH_CAPPED. The
length cap applies even below `min_tokens`: a request can never outgrow the
model. Stop *strings* are the frontend's job (they need detokenized text).
"""

from __future__ import annotations

from paged.scheduler.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Update `request.status`/`stop_reason` if its last token ends it; True if it did."""
    params = request.sampling_params
    tokens = request.all_token_ids
    num_output = request.num_output_tokens
    if num_output >= params.min_tokens:
        last = tokens[-1]
        if last == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.stop_token_ids and last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if num_output >= request.max_tokens or len(tokens) >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
