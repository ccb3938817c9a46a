"""Which decoder layers each pipeline stage holds (vLLM's `get_pp_indices`).

Even split; the remainder goes one layer each to the stages before the last,
starting from the second-to-last (the last stage also runs the final norm and
the LM head). Example: 30 layers over 4 stages -> 7, 8, 8, 7.

`VLLM_PP_LAYER_PARTITION` ("8,7": layers per stage) overrides the rule, as
in vLLM; `ParallelConfig.pp_layer_partition` carries it from the engine
process (where the environment is read) to the workers.
"""

from __future__ import annotations

# Architectures whose model implements the pipeline-stage forward.
PIPELINE_ARCHITECTURES = frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)


def parse_layer_partition(text: str, pp_size: int, num_layers: int) -> list[int]:
    """Layers per stage from "8,7"; ValueError naming the setting when it does not fit."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"pp_layer_partition (VLLM_PP_LAYER_PARTITION): {text!r} is not a comma-separated "
            "list of integers"
        ) from None
    if len(counts) != pp_size:
        raise ValueError(
            f"pp_layer_partition (VLLM_PP_LAYER_PARTITION): {text!r} has {len(counts)} entries "
            f"for pipeline_parallel_size={pp_size}"
        )
    if any(c < 1 for c in counts):
        raise ValueError(
            f"pp_layer_partition (VLLM_PP_LAYER_PARTITION): {text!r}: every stage needs >= 1 layer"
        )
    if sum(counts) != num_layers:
        raise ValueError(
            f"pp_layer_partition (VLLM_PP_LAYER_PARTITION): {text!r} sums to {sum(counts)}, "
            f"the model has {num_layers} decoder layers"
        )
    return counts


def layer_partition(num_layers: int, pp_size: int, override: str | None = None) -> list[int]:
    """Decoder layers per stage, in stage order (see the module docstring)."""
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size: must be >= 1, got {pp_size}")
    if num_layers < pp_size:
        raise ValueError(
            f"pipeline_parallel_size: {pp_size} stages for a model of {num_layers} decoder "
            "layers; every stage needs at least one"
        )
    if override is not None:
        return parse_layer_partition(override, pp_size, num_layers)
    counts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        counts[-i] += 1
    return counts


def layer_range(
    num_layers: int, pp_rank: int, pp_size: int, override: str | None = None
) -> tuple[int, int]:
    """[start, end) of the decoder layers stage `pp_rank` holds."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank: must be in [0, {pp_size}), got {pp_rank}")
    counts = layer_partition(num_layers, pp_size, override)
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]
