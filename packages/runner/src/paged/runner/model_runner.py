"""`ModelRunner`: one `SchedulerOutput` in, one `ModelRunnerOutput` out (seed: GPUModelRunner).

Two-phase execution, so grammar masks can be computed while the model runs:

    execute_model(scheduler_output) -> None
        update_states      new / cached / resumed / finished / unscheduled requests
        prepare_inputs     positions, input ids, query_start_loc, seq_lens, slots
        forward            (a captured CUDA graph for uniform decode on CUDA)
        compute_logits     only for the rows that sample (+ prompt-logprob rows)
    sample_tokens(grammar_output) -> ModelRunnerOutput
        grammar bitmask -> sampler -> append sampled tokens -> plain-list output

The attention metadata and KV caches reach the model in an explicit
`ForwardContext`; nothing is global. An optional worker-side KV connector
(`paged.runner.kv_connector`) is held by composition: each step binds its
metadata and starts loads before the forward, the model calls it around
every attention layer through the `ForwardContext`, and after the forward the
runner waits for saves and reports `KVConnectorOutput` on the step's output.
A step with nothing scheduled still drives the connector (pending transfers).

Multimodal models get an `EncoderRunner` (`encoder_runner.py`), also held by
composition: it frees what the scheduler evicted, runs the vision encoder for
the step's scheduled items, and turns the step's tokens into inputs_embeds
(encoder rows merged with masked_scatter) plus the bidirectional image spans
the attention metadata carries. Its encoder cache is one preallocated buffer;
an optional worker-side EC connector is handed to it (loads, saves, and the
step's `ECConnectorOutput`, carried on the step's output like the KV one).

Pipeline parallelism (`stage_setup` with PP > 1): a `StageForward` held by
composition runs this stage's layers, receiving the previous stage's
activations and sending its own on; only the last stage computes logits and
samples. The others learn each step's input tokens from the scheduler
(`CachedRequestData.new_token_ids`), and allocate KV cache for their own
layers only (`pipeline.kv.stage_kv_cache_config`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import torch
from torch import nn

from paged.kvcache import KVCacheConfig
from paged.runner.attention.backends import select_attention_backend
from paged.runner.attention.metadata import ForwardContext
from paged.runner.config import CacheConfig, ModelConfig, SchedulerLimits
from paged.runner.cuda_graphs import CudaGraphRunner
from paged.runner.ec_connector import ECConnectorWorker
from paged.runner.encoder_cache_buffer import PreallocatedEncoderCache
from paged.runner.encoder_runner import (
    EncoderRunner,
    MultiModalStepInputs,
    encoder_cache_capacity,
)
from paged.runner.input_batch import CachedRequestState, InputBatch
from paged.runner.input_prep import InputBuffers, StepInputs, prepare_inputs
from paged.runner.kv_cache_dtype import with_kv_cache_dtype
from paged.runner.kv_cache_setup import allocate_kv_caches, available_kv_cache_memory
from paged.runner.kv_connector import KVConnectorStep, KVConnectorWorker
from paged.runner.lora.config import LoRAAdapterSpec, LoRAConfig
from paged.runner.lora.loading import BaseModelFacts, load_adapter
from paged.runner.lora.manager import LoRAManager
from paged.runner.models.interface import CausalLM, SupportsMultiModal, supports_multimodal
from paged.runner.pipeline.forward import StageForward
from paged.runner.pipeline.kv import stage_kv_cache_config
from paged.runner.pipeline.stage import StageSetup
from paged.runner.pooling_setup import build_model_pooler
from paged.runner.pooling_step import PoolingStep
from paged.runner.runner_output import apply_grammar_bitmask, build_output, prompt_logprobs
from paged.runner.sampler import Sampler
from paged.runner.sampler.build import build_sampling_metadata
from paged.runner.spec_decode.config import SpeculativeConfig
from paged.runner.spec_decode.decoder import SpecDecoder
from paged.runner.state_updates import update_states
from paged.scheduler.boundary import (
    ECConnectorOutput,
    GrammarOutput,
    KVConnectorOutput,
    LogprobsLists,
    ModelRunnerOutput,
    PoolerOutput,
    SchedulerOutput,
)


@dataclass
class _ExecuteState:
    """What `execute_model` leaves for `sample_tokens` (device tensors, never serialised)."""

    inputs: StepInputs
    logits: torch.Tensor | None  # [S, V] for the sampling rows
    prompt_logprobs: dict[str, LogprobsLists]
    kv_connector_output: KVConnectorOutput | None = None
    ec_connector_output: ECConnectorOutput | None = None
    # Pooling requests whose prefill ended this step (PoolingStep.collect).
    pooler_output: dict[str, PoolerOutput] = field(default_factory=dict)


class ModelRunner:
    """Owns the model, the KV cache tensors, the persistent batch and the sampler."""

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_limits: SchedulerLimits,
        device: torch.device | str,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        kv_connector: KVConnectorWorker | None = None,
        speculative_config: SpeculativeConfig | None = None,
        ec_connector: ECConnectorWorker | None = None,
        encoder_cache_size: int | None = None,
        stage_setup: StageSetup | None = None,
        lora_config: LoRAConfig | None = None,
    ) -> None:
        if stage_setup is not None:
            tp_rank, tp_size = stage_setup.stage.tp_rank, stage_setup.stage.tp_size
        self.model_config = model_config
        self.cache_config = cache_config
        self.limits = scheduler_limits
        self.device = torch.device(device)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.max_num_reqs = scheduler_limits.max_num_seqs
        self.max_num_tokens = scheduler_limits.max_num_batched_tokens
        self.max_model_len = model_config.max_model_len
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = self._make_batch([cache_config.block_size])
        self.buffers = InputBuffers(self.max_num_tokens, self.max_num_reqs, self.device)
        self.attn_backend = select_attention_backend(self.device, model_config.attention_backend)
        self.builder = self.attn_backend.get_builder()
        self.sampler = Sampler()
        self.model: CausalLM | None = None
        self.kv_caches: list[torch.Tensor] = []
        # Hybrid models: the KV cache group of each attention layer (None: one group).
        self.layer_groups: list[int] | None = None
        self.cuda_graphs: CudaGraphRunner | None = None
        self._pending: _ExecuteState | None = None
        self.kv_connector = kv_connector
        self.layer_names: list[str] = []
        self.encoder_runner: EncoderRunner | None = None  # set by load_model for mm models
        # The worker side of an EC connector, handed to the EncoderRunner (which holds it).
        self.ec_connector = ec_connector
        self.encoder_cache_size = encoder_cache_size  # None: the scheduler's default
        self.stage_setup = stage_setup
        # Pooling requests' hidden states and the pooler (set by load_model for a
        # pooling model); None: every request samples.
        self.pooling: PoolingStep | None = None
        # Pipeline parallelism: this stage's forward and its links to the neighbours.
        self.pipeline = (
            StageForward(
                stage_setup.stage, self.device, model_config.hidden_size, model_config.dtype
            )
            if stage_setup is not None and stage_setup.is_pipelined
            else None
        )
        if self.pipeline is not None and (kv_connector is not None or speculative_config):
            raise ValueError(
                "pipeline_parallel_size > 1 runs without a KV connector or speculative decoding"
            )
        if lora_config is not None and (self.pipeline is not None or speculative_config):
            # Draft and verification rows would need their own adapter slots; not built.
            raise ValueError(
                "enable_lora: LoRA runs without pipeline parallelism or speculative decoding"
            )
        self.lora_config = lora_config
        # LoRA adapters (lora/manager.py), built by load_model when lora_config is set.
        self.lora: LoRAManager | None = None
        # Speculative decoding (drafts, verification, a draft model): a component.
        self.spec_decoder = (
            SpecDecoder(
                speculative_config,
                self.device,
                self.builder,
                self.max_model_len,
                self.max_num_reqs,
                quantized=model_config.keeps_weights_quantized,
            )
            if speculative_config is not None
            else None
        )

    def _make_batch(self, block_sizes: list[int]) -> InputBatch:
        return InputBatch(
            max_num_reqs=self.max_num_reqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_tokens,
            device=self.device,
            vocab_size=self.model_config.vocab_size,
            block_sizes=block_sizes,
            eos_token_ids=self.model_config.eos_token_ids,
        )

    # ----------------------------------------------------------- start-up

    def load_model(self, model: CausalLM | None = None) -> None:
        """Build the model and load its weights (or adopt `model`, e.g. in tests)."""
        if model is None:
            from paged.runner.loader import load_model

            model = load_model(
                self.model_config,
                self.device,
                self.tp_rank,
                self.tp_size,
                stage_setup=self.stage_setup,
            )
        self.model = model
        if self.model_config.is_pooling:
            if self.pipeline is not None or self.spec_decoder is not None:
                raise ValueError(
                    "runner: a pooling model runs without pipeline parallelism or "
                    "speculative decoding"
                )
            self.pooling = PoolingStep(
                build_model_pooler(self.model_config), self.model_config.hidden_size
            )
        if self.lora_config is not None:
            if self.model_config.is_pooling:
                raise ValueError("enable_lora: LoRA adapters serve generation models only")
            self.lora = self._make_lora_manager(self.lora_config, cast(nn.Module, model))
        if supports_multimodal(model):
            self.encoder_runner = self._make_encoder_runner(cast(SupportsMultiModal, model))
        elif self.ec_connector is not None:
            raise ValueError(
                f"ec_transfer_config: the model {self.model_config.architecture} has no "
                "encoder (an encoder-cache connector needs a multimodal model)"
            )
        if self.spec_decoder is not None and self.spec_decoder.draft is not None:
            if self.tp_size > 1:
                raise ValueError(
                    "speculative_config.model: a draft model needs tensor_parallel_size 1"
                )
            if self.spec_decoder.draft.model is None:
                self.spec_decoder.draft.load_model()

    def _make_lora_manager(self, config: LoRAConfig, model: nn.Module) -> LoRAManager:
        facts = BaseModelFacts.of(self.model_config.text_config)
        return LoRAManager(
            config,
            model,
            self.model_config.dtype,
            self.device,
            loader=lambda path: load_adapter(path, config, facts),
        )

    def _make_encoder_runner(self, model: SupportsMultiModal) -> EncoderRunner:
        """The encoder runner with its preallocated cache, sized as the scheduler's."""
        hf = self.model_config.hf_config
        tokens_per_item = int(getattr(hf, "mm_tokens_per_image", 0) or 0)
        capacity = encoder_cache_capacity(
            self.max_num_tokens, tokens_per_item, self.encoder_cache_size
        )
        cache = PreallocatedEncoderCache(
            capacity,
            int(self.model_config.text_config.hidden_size),
            self.model_config.dtype,
            self.device,
        )
        return EncoderRunner(model, self.device, cache, self.ec_connector)

    def _require_model(self) -> CausalLM:
        if self.model is None:
            raise RuntimeError("load_model() must be called before running the model")
        return self.model

    def get_kv_cache_spec(self) -> dict[str, Any]:
        """Layer name -> `paged.kvcache` spec, in layer order, stored as --kv-cache-dtype says."""
        specs = self._require_model().kv_cache_specs(self.cache_config.block_size)
        return with_kv_cache_dtype(specs, self.cache_config.cache_dtype)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """Forward the largest batch without a cache, plus logits and sampling for max_num_seqs."""
        model = self._require_model()
        n = self.max_num_tokens
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        positions = torch.arange(n, dtype=torch.int64, device=self.device) % self.max_model_len
        if self.pipeline is not None:
            stage_hidden = self.pipeline.profile(model, ids, positions)
            if stage_hidden is None:
                return  # a stage before the last: no logits
            hidden = stage_hidden
        else:
            hidden = model.forward(ids, positions, ForwardContext(attn_metadata=None))
        if not self.model_config.needs_lm_head:
            return  # a decoder classifier: no LM head, nothing samples
        rows = min(self.max_num_reqs, n)
        model.compute_logits(hidden[:rows]).softmax(dim=-1)

    def determine_available_memory(self) -> int:
        """Bytes the KV cache may use (the CPU budget, or profiled free CUDA memory)."""
        return available_kv_cache_memory(
            self.device,
            self.cache_config.kv_cache_memory_bytes,
            self.cache_config.gpu_memory_utilization,
            self.profile_run,
        )

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the cache tensors; one block table per KV cache group, sized to its blocks.

        Hybrid models (full and sliding-window layers) get several groups; each
        layer then reads and writes its cache through its own group's table.
        """
        specs = self.get_kv_cache_spec()
        if self.pipeline is not None:
            # The engine's config spans every stage's layers; allocate ours only.
            kv_cache_config = stage_kv_cache_config(kv_cache_config, specs)
        self.kv_caches = allocate_kv_caches(kv_cache_config, specs, self.device)
        self.layer_names = list(specs)
        if self.kv_connector is not None:
            # Each group's layers, in the scheduler's group order (hybrid models index a
            # layer's cache with its group's block ids); a pipeline stage keeps its own.
            layer_groups = [
                [name for name in group.layer_names if name in specs]
                for group in kv_cache_config.kv_cache_groups
            ]
            self.kv_connector.register_kv_caches(
                dict(zip(self.layer_names, self.kv_caches, strict=True)), layer_groups
            )
        if self.spec_decoder is not None and self.spec_decoder.draft is not None:
            self.spec_decoder.draft.initialize_kv_cache(
                kv_cache_config, self.cache_config.block_size
            )
        groups = kv_cache_config.kv_cache_groups
        group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        self.layer_groups = [group_of[name] for name in specs] if len(groups) > 1 else None
        block_sizes = [group.kv_cache_spec.block_size for group in groups]
        current = [t.block_size for t in self.input_batch.block_table.block_tables]
        if block_sizes != current:
            if self.requests:
                raise RuntimeError("initialize_kv_cache must run before any request")
            self.input_batch = self._make_batch(block_sizes)
        # CUDA graphs capture one group's metadata; hybrid models and pipeline
        # stages (whose forward sends and receives) run eagerly.
        if (
            self.device.type == "cuda"
            and not self.model_config.enforce_eager
            and len(groups) == 1
            and self.pipeline is None
        ):
            self.capture_cuda_graphs()

    def capture_cuda_graphs(self) -> None:
        graphs = CudaGraphRunner(
            self._require_model(),
            self.kv_caches,
            max_num_reqs=min(self.max_num_reqs, self.max_num_tokens),
            max_blocks_per_req=self.input_batch.block_table[0].max_num_blocks_per_req,
            max_model_len=self.max_model_len,
            device=self.device,
        )
        graphs.capture()
        self.cuda_graphs = graphs

    # ---------------------------------------------------------------- step

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the forward pass; returns None (then call `sample_tokens`) or an empty output."""
        model = self._require_model()
        if not self.kv_caches:
            raise RuntimeError("initialize_kv_cache() must be called before execute_model()")
        spec = self.spec_decoder
        if scheduler_output.scheduled_spec_decode_tokens and spec is None:
            raise ValueError(
                "scheduler_output: draft tokens were scheduled, but the runner was built "
                "without a speculative_config"
            )
        encoder = self.encoder_runner
        if scheduler_output.scheduled_encoder_inputs and encoder is None:
            raise ValueError(
                "scheduler_output: encoder inputs were scheduled but the model "
                f"{self.model_config.architecture} takes no images"
            )
        update_states(
            self.requests,
            self.input_batch,
            scheduler_output,
            self.device,
            stage=self.pipeline.stage if self.pipeline is not None else None,
            lora_enabled=self.lora is not None,
        )
        if self.lora is not None:
            self.lora.note_requests(scheduler_output.scheduled_new_reqs)
        pooling = self.pooling
        if pooling is not None:
            pooling.update(scheduler_output)
        elif any(r.pooling_params is not None for r in scheduler_output.scheduled_new_reqs):
            raise ValueError(
                "scheduler_output: a pooling request reached a runner whose model does not "
                "pool (runner_type 'generate')"
            )
        ec_output = None
        if encoder is not None:
            ec_output = encoder.step(scheduler_output, self.requests)
        num_drafts = None
        if spec is not None:
            spec.forget(scheduler_output.finished_req_ids)
            if scheduler_output.scheduled_spec_decode_tokens:
                num_drafts = spec.stage_drafts(
                    self.input_batch, scheduler_output.scheduled_spec_decode_tokens
                )
        self._pending = None
        step = (
            KVConnectorStep(self.kv_connector, scheduler_output)
            if self.kv_connector is not None
            else None
        )
        if self.input_batch.num_reqs == 0:
            # Async EC loads finish while their requests wait unscheduled: report them.
            empty = self._kv_connector_no_forward(step)
            if ec_output is None:
                return empty
            return msgspec.structs.replace(empty, ec_connector_output=ec_output)
        inputs = prepare_inputs(
            self.input_batch,
            scheduler_output.num_scheduled_tokens,
            self.buffers,
            self.builder,
            num_drafts,
        )
        finishing: list[int] = []
        computed_before = None
        if pooling is not None:
            split = pooling.split(inputs)
            inputs, finishing = split.inputs, split.finishing_rows
            computed_before = self.input_batch.num_computed_tokens_cpu[: len(inputs.req_ids)].copy()
        if self.pipeline is not None:
            layer_metadata = None
            if self.layer_groups is not None:
                layer_metadata = [inputs.group_metadata[g] for g in self.layer_groups]
            ctx = ForwardContext(inputs.attn_metadata, self.kv_caches, layer_metadata)
            stage_hidden = self.pipeline.run(model, inputs.input_ids, inputs.positions, ctx)
            if stage_hidden is None:
                return None  # sent on to the next stage; the last one samples
            hidden, kv_output = stage_hidden, None
        elif self.lora is not None:
            hidden, kv_output = self._forward_with_lora(self.lora, model, inputs, step)
        else:
            hidden, kv_output = self._forward_with_connector(model, inputs, step)
        if spec is not None:
            spec.follow_target(inputs)
        logits = None
        if len(inputs.sampling_rows):
            logits = model.compute_logits(hidden[inputs.logits_indices])
        pooled: dict[str, PoolerOutput] = {}
        if pooling is not None and computed_before is not None:
            pooled = pooling.collect(inputs, hidden, computed_before, finishing)
        self._pending = _ExecuteState(
            inputs=inputs,
            logits=logits,
            prompt_logprobs=prompt_logprobs(model, hidden, inputs.prompt_logprobs),
            kv_connector_output=kv_output,
            ec_connector_output=ec_output,
            pooler_output=pooled,
        )
        return None

    def _forward_with_connector(
        self, model: CausalLM, inputs: StepInputs, step: KVConnectorStep | None
    ) -> tuple[torch.Tensor, KVConnectorOutput | None]:
        """The forward, wrapped in the connector's begin/finish when there is one."""
        if step is None:
            return self._forward(model, inputs), None
        try:
            step.begin()
            hidden = self._forward(model, inputs, step)
        except BaseException:
            step.abort()  # the next step must not find this step's metadata bound
            raise
        return hidden, step.finish()

    def _forward_with_lora(
        self, lora: LoRAManager, model: CausalLM, inputs: StepInputs, step: KVConnectorStep | None
    ) -> tuple[torch.Tensor, KVConnectorOutput | None]:
        """The forward with this step's LoRA rows published to the LoRA layers, then withdrawn."""
        adapters = [self.requests[req_id].lora_request for req_id in inputs.req_ids]
        lora.begin_step(adapters, inputs.num_scheduled)
        try:
            return self._forward_with_connector(model, inputs, step)
        finally:
            lora.end_step()

    # -------------------------------------------------------------- LoRA

    def add_lora(self, spec: LoRAAdapterSpec) -> None:
        """Load and validate an adapter (ValueError with the cause, or "already loaded")."""
        self._require_lora().add_lora(spec)

    def remove_lora(self, name: str) -> bool:
        return self._require_lora().remove_lora(name)

    def list_loras(self) -> list[str]:
        return self._require_lora().list_loras()

    def _require_lora(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("LoRA is not enabled (start with --enable-lora)")
        return self.lora

    def _kv_connector_no_forward(self, step: KVConnectorStep | None) -> ModelRunnerOutput:
        """Nothing to compute: still let the connector finish pending transfers (seed)."""
        if step is None:
            return ModelRunnerOutput()
        step.begin()
        return ModelRunnerOutput(kv_connector_output=step.finish())

    def _forward(
        self, model: CausalLM, inputs: StepInputs, step: KVConnectorStep | None = None
    ) -> torch.Tensor:
        meta = inputs.attn_metadata
        mm: MultiModalStepInputs | None = None
        if self.encoder_runner is not None:
            mm = self.encoder_runner.prepare(self.input_batch, inputs, self.requests)
        if mm is not None:
            for group_meta in inputs.group_metadata:
                group_meta.bidirectional_ranges = mm.bidirectional_ranges
        graphs = self.cuda_graphs
        # A captured graph would skip the connector's per-layer calls: run eagerly.
        connector = self.kv_connector if step is not None and step.bound else None
        lora_rows = self.lora is not None and self.lora.batch.active
        if (
            connector is None
            and mm is None
            and not lora_rows  # a captured graph holds no LoRA delta
            and graphs is not None
            and inputs.is_uniform_decode
            and graphs.padded_size(meta.num_reqs) is not None
        ):
            return graphs.run(inputs.input_ids, inputs.positions, meta)
        layer_metadata = None
        if self.layer_groups is not None:
            layer_metadata = [inputs.group_metadata[g] for g in self.layer_groups]
        ctx = ForwardContext(
            meta,
            self.kv_caches,
            layer_metadata,
            kv_connector=connector,
            layer_names=self.layer_names if connector is not None else (),
        )
        if mm is not None:
            mm_model = cast(SupportsMultiModal, model)
            return mm_model.forward(
                inputs.input_ids, inputs.positions, ctx, inputs_embeds=mm.inputs_embeds
            )
        return model.forward(inputs.input_ids, inputs.positions, ctx)

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Sample the rows `execute_model` prepared and record the tokens."""
        pending, self._pending = self._pending, None
        if pending is None:
            return ModelRunnerOutput()
        inputs = pending.inputs
        batch = self.input_batch
        if self.spec_decoder is not None:
            return self._sample_speculative(self.spec_decoder, pending, grammar_output)
        sampled: list[int] = []
        sampler_output = None
        if pending.logits is not None:
            logits = pending.logits
            if grammar_output is not None and grammar_output.structured_output_request_ids:
                sampling_ids = [inputs.req_ids[int(r)] for r in inputs.sampling_rows]
                logits = apply_grammar_bitmask(logits, sampling_ids, grammar_output)
            metadata = build_sampling_metadata(batch, inputs.sampling_rows)
            sampler_output = self.sampler(logits, metadata)
            sampled = sampler_output.sampled_token_ids.tolist()
            for row, token in zip(inputs.sampling_rows.tolist(), sampled, strict=True):
                batch.append_token_ids(row, [token])
                self.requests[inputs.req_ids[row]].output_token_ids.append(token)
        output = build_output(inputs, sampled, sampler_output, batch, pending.prompt_logprobs)
        return _with_connector_outputs(output, pending)

    def _sample_speculative(
        self, spec: SpecDecoder, pending: _ExecuteState, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput:
        """Verify drafts (rejection sampling), append accepted tokens, propose the next drafts."""
        inputs = pending.inputs
        if pending.logits is None:
            output = build_output(inputs, [], None, self.input_batch, pending.prompt_logprobs)
        else:
            output = spec.sample(
                pending.logits, inputs, self.input_batch, self.requests, grammar_output
            )
            output = msgspec.structs.replace(output, prompt_logprobs=pending.prompt_logprobs)
        return _with_connector_outputs(output, pending)


def _with_connector_outputs(output: ModelRunnerOutput, pending: _ExecuteState) -> ModelRunnerOutput:
    """The step's KV and EC connector reports on its output (when there are any)."""
    if pending.kv_connector_output is not None:
        output = msgspec.structs.replace(output, kv_connector_output=pending.kv_connector_output)
    if pending.ec_connector_output is not None:
        output = msgspec.structs.replace(output, ec_connector_output=pending.ec_connector_output)
    if pending.pooler_output:
        output = msgspec.structs.replace(output, pooler_output=pending.pooler_output)
    return output
