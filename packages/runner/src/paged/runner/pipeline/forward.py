"""`StageForward`: the runner's forward pass as one pipeline stage (held by `ModelRunner`).

    stage 0:      ids -> layers [0, a)   -> send IntermediateTensors
    stage s:      recv -> layers [a, b)  -> send
    last stage:   recv -> layers [b, L) -> norm -> hidden (logits, sampling)

Every stage builds the same `StepInputs` from the same `SchedulerOutput`, so
the receiver knows the message's shape ([2, T, H]) without a header. Stages
run micro-batches in the order the executor sent them, which is the order
the sends and receives pair up in.
"""

from __future__ import annotations

from typing import cast

import torch

from paged.runner.attention.metadata import ForwardContext
from paged.runner.models.interface import CausalLM, SupportsPipelineParallel
from paged.runner.pipeline.stage import PipelineStage, StageLink
from paged.runner.pipeline.tensors import IntermediateTensors


class StageForward:
    def __init__(
        self, stage: PipelineStage, device: torch.device, hidden_size: int, dtype: torch.dtype
    ) -> None:
        self.stage = stage
        self.link = StageLink(stage, device)
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device

    @staticmethod
    def stage_model(model: CausalLM) -> SupportsPipelineParallel:
        if not callable(getattr(model, "forward_stage", None)):
            raise ValueError(
                f"pipeline_parallel_size: {type(model).__name__} cannot run as a pipeline stage"
            )
        return cast(SupportsPipelineParallel, model)  # checked structurally above

    def run(
        self, model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor | None:
        """This stage's share of the forward: hidden [T, H] on the last stage, else None."""
        stage_model = self.stage_model(model)
        intermediate = None
        if not self.stage.is_first:
            intermediate = self.link.recv(int(input_ids.shape[0]), self.hidden_size, self.dtype)
        out = stage_model.forward_stage(input_ids, positions, ctx, intermediate)
        if isinstance(out, IntermediateTensors):
            self.link.send(out)
            return None
        return out

    def profile(
        self, model: CausalLM, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor | None:
        """The memory-profiling forward, without talking to other stages (zeros come in)."""
        stage_model = self.stage_model(model)
        intermediate = None
        if not self.stage.is_first:
            n = int(input_ids.shape[0])
            zeros = torch.zeros(n, self.hidden_size, dtype=self.dtype, device=self.device)
            intermediate = IntermediateTensors(zeros, zeros.clone())
        out = stage_model.forward_stage(
            input_ids, positions, ForwardContext(attn_metadata=None), intermediate
        )
        return None if isinstance(out, IntermediateTensors) else out

    def close(self) -> None:
        self.link.wait()
