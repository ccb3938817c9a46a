"""`LLM.score`'s two paths over the offline engine (cross-encoder, bi-encoder).

vllm/entrypoints/pooling/offline.py:292-340: the model's pooling task picks
the path (classify: cross-encoder, needs num_labels == 1; embed: cosine of
the two embeddings); other models have no Scoring API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

from paged.scheduler import PoolingParams
from paged.server.input_processor import ProcessedPrompt, PromptType
from paged.server.pooling_frontend import PoolingFrontend
from paged.server.pooling_outputs import PoolingOutput, PoolingRequestOutput, ScoringRequestOutput
from paged.server.pooling_score import cosine_score, cross_encoder_prompt, score_pairs
from paged.server.st_score_template import score_template_for
from paged.server.tokenizer import TokenizerLike


class LLM(Protocol):
    """The part of `paged.server.llm.LLM` scoring drives (a Protocol: no import cycle)."""

    tokenizer: TokenizerLike

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = ...,
        *,
        use_tqdm: bool = ...,
        pooling_task: str | None = ...,
        truncate_prompt_tokens: int | None = ...,
    ) -> list[PoolingRequestOutput[PoolingOutput]]: ...

    def _add_pooling_request(
        self,
        prompt: PromptType | ProcessedPrompt,
        params: PoolingParams,
        truncate_prompt_tokens: int | None,
    ) -> str: ...

    def _run_pooling(
        self, ids: list[str], use_tqdm: bool
    ) -> list[PoolingRequestOutput[PoolingOutput]]: ...

    def _abort(self, ids: list[str]) -> None: ...


def run_score(
    llm: LLM,
    pooling: PoolingFrontend,
    data_1: str | Sequence[str],
    data_2: str | Sequence[str],
    use_tqdm: bool,
    pooling_params: PoolingParams | None,
    truncate_prompt_tokens: int | None,
    chat_template: str | None = None,
) -> list[ScoringRequestOutput]:
    if pooling.runner_type != "pooling":
        raise ValueError(
            "LLM.score() is only supported for pooling models. "
            "Try passing `--runner pooling` to use the model as a pooling model."
        )
    task = pooling.pooling_task
    if task == "classify" and pooling.num_labels != 1:
        raise ValueError("Scoring API is only enabled for num_labels == 1.")
    if task not in ("classify", "embed"):
        raise ValueError("This model does not support the Scoring API.")
    pairs = score_pairs(data_1, data_2)
    if task == "classify":
        return _cross_encode(
            llm, pooling, pairs, use_tqdm, pooling_params, truncate_prompt_tokens, chat_template
        )
    return _bi_encode(llm, pairs, use_tqdm, pooling_params, truncate_prompt_tokens)


def _cross_encode(
    llm: LLM,
    pooling: PoolingFrontend,
    pairs: list[tuple[str, str]],
    use_tqdm: bool,
    pooling_params: PoolingParams | None,
    truncate_prompt_tokens: int | None,
    chat_template: str | None,
) -> list[ScoringRequestOutput]:
    params = pooling.resolve_params(pooling_params, "classify")
    # An explicit template wins; else a CrossEncoder's saved one (st_score_template.py).
    template, kwargs = score_template_for(chat_template, pooling.saved_score_template, None)
    ids: list[str] = []
    try:
        for text_1, text_2 in pairs:
            prompt, span = cross_encoder_prompt(
                llm.tokenizer,
                text_1,
                text_2,
                use_sep_token=pooling.use_sep_token,
                chat_template=template,
                chat_template_kwargs=kwargs,
            )
            p = params
            if span is not None:
                extra = {**(params.extra_kwargs or {}), "compressed_token_type_ids": list(span)}
                p = msgspec.structs.replace(params, extra_kwargs=extra)
            ids.append(llm._add_pooling_request(prompt, p, truncate_prompt_tokens))
    except BaseException:
        llm._abort(ids)
        raise
    return [ScoringRequestOutput.from_base(o) for o in llm._run_pooling(ids, use_tqdm)]


def _bi_encode(
    llm: LLM,
    pairs: list[tuple[str, str]],
    use_tqdm: bool,
    pooling_params: PoolingParams | None,
    truncate_prompt_tokens: int | None,
) -> list[ScoringRequestOutput]:
    # Each distinct text is embedded once (a 1 -> N query is not embedded N times).
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    embedded = llm.encode(
        texts,
        pooling_params,
        use_tqdm=use_tqdm,
        pooling_task="embed",
        truncate_prompt_tokens=truncate_prompt_tokens,
    )
    by_text = dict(zip(texts, embedded, strict=True))
    out: list[ScoringRequestOutput] = []
    for i, (text_1, text_2) in enumerate(pairs):
        a, b = by_text[text_1], by_text[text_2]
        base: PoolingRequestOutput[PoolingOutput] = PoolingRequestOutput(
            str(i),
            PoolingOutput(cosine_score(a.outputs.data, b.outputs.data)),
            a.prompt_token_ids + b.prompt_token_ids,
            a.num_cached_tokens + b.num_cached_tokens,
            True,
        )
        out.append(ScoringRequestOutput.from_base(base))
    return out
