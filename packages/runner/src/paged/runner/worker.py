"""`Worker`: one device, one `ModelRunner` (seed: Executor / Worker).

The executor drives workers through the same small set of calls whether they
live in this process (`UniProcExecutor`) or in their own (`MultiprocExecutor`):
init_device -> load_model -> get_kv_cache_spec / determine_available_memory
-> initialize_from_config -> (execute_model, sample_tokens)* -> shutdown.

With tensor parallelism every rank runs every call; `init_device` joins the
torch.distributed group (gloo on CPU, NCCL on CUDA) before the model is built,
and seeds the global RNG identically on every rank so that unseeded random
sampling picks the same token everywhere (each rank keeps its own copy of the
sampled tokens).

With pipeline parallelism the world is TP x PP ranks (`PipelineStage.of_rank`:
rank = pp_rank * TP + tp_rank); each stage's TP ranks get their own process
group for their collectives, and the runner holds only the stage's layers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paged.kvcache import KVCacheConfig
from paged.runner.config import EngineConfig
from paged.runner.cpu_threads import CpuThreads, resolve_cpu_threads
from paged.runner.encode_only import EncodeOnlyRunner
from paged.runner.encoder_pooling_runner import EncoderPoolingRunner
from paged.runner.lora.config import LoRAAdapterSpec
from paged.runner.model_runner import ModelRunner
from paged.runner.pipeline.stage import PipelineStage, StageSetup, init_tp_groups
from paged.scheduler.boundary import GrammarOutput, ModelRunnerOutput, SchedulerOutput


class Worker:
    """Owns the device context and the model runner of one rank (a TP rank of a PP stage)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        rank: int = 0,
        local_rank: int = 0,
        distributed_init_method: str | None = None,
    ) -> None:
        parallel = engine_config.parallel_config
        world = parallel.world_size
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        if world > 1 and distributed_init_method is None:
            raise ValueError("distributed_init_method is required with more than one rank")
        self.engine_config = engine_config
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world
        self.stage = PipelineStage.of_rank(
            rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        )
        self.distributed_init_method = distributed_init_method
        self.device = torch.device("cpu")
        self._runner: ModelRunner | EncodeOnlyRunner | EncoderPoolingRunner | None = None
        self._cpu_threads: CpuThreads | None = None

    @property
    def model_runner(self) -> ModelRunner | EncodeOnlyRunner | EncoderPoolingRunner:
        if self._runner is None:
            raise RuntimeError("init_device() must be called first")
        return self._runner

    def init_device(self) -> None:
        model_config = self.engine_config.model_config
        device = torch.device(model_config.device)
        if device.type == "cuda":
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        self.device = device
        if device.type == "cpu":  # see paged.runner.cpu_threads
            parallel = self.engine_config.parallel_config
            local_world = max(1, self.world_size // parallel.nnodes)
            plan = resolve_cpu_threads(
                parallel.cpu_threads,
                local_rank=self.local_rank % local_world,
                local_world_size=local_world,
            )
            self._cpu_threads = CpuThreads.start(plan, kernels=model_config.keeps_weights_quantized)
        if self.world_size > 1 and not dist.is_initialized():
            dist.init_process_group(
                backend="nccl" if device.type == "cuda" else "gloo",
                init_method=self.distributed_init_method,
                world_size=self.world_size,
                rank=self.rank,
            )
        stage_setup = None
        if self.stage.pp_size > 1:
            stage_setup = StageSetup(
                self.stage,
                tp_group=init_tp_groups(self.stage),
                pp_layer_partition=self.engine_config.parallel_config.pp_layer_partition,
            )
        torch.manual_seed(self.engine_config.seed)
        factory = self.engine_config.kv_connector_factory
        kv_connector = (
            factory.make_worker_connector(self.rank, self.world_size)
            if factory is not None
            else None
        )
        ec_factory = self.engine_config.ec_connector_factory
        ec_connector = (
            ec_factory.make_worker_ec_connector(self.rank, self.world_size)
            if ec_factory is not None
            else None
        )
        encoder_only = model_config.is_encoder_only or (
            ec_connector is not None and ec_connector.is_producer and not ec_connector.is_consumer
        )
        if encoder_only and self.engine_config.lora_config is not None:
            raise ValueError(
                f"enable_lora: {model_config.architecture} runs as an encoder here; LoRA "
                "adapters serve decoder generation models"
            )
        if ec_connector is not None and ec_connector.is_producer and not ec_connector.is_consumer:
            # An EPD encoder producer: the vision encoder only, no KV cache, no sampling.
            self._runner = EncodeOnlyRunner(
                model_config,
                self.engine_config.cache_config,
                self.engine_config.scheduler_limits,
                device,
                ec_connector,
                encoder_cache_size=self.engine_config.encoder_cache_size,
            )
            return
        if model_config.is_encoder_only:
            # A BERT-family pooling model: no KV cache, whole prompts, pooled each step.
            if self.world_size > 1 or kv_connector is not None or ec_connector is not None:
                raise ValueError(
                    f"model: the encoder-only {model_config.architecture} runs on one rank "
                    "without KV or encoder-cache connectors"
                )
            self._runner = EncoderPoolingRunner(
                model_config,
                self.engine_config.cache_config,
                self.engine_config.scheduler_limits,
                device,
            )
            return
        self._runner = ModelRunner(
            model_config,
            self.engine_config.cache_config,
            self.engine_config.scheduler_limits,
            device,
            tp_rank=self.stage.tp_rank,
            tp_size=self.stage.tp_size,
            kv_connector=kv_connector,
            speculative_config=self.engine_config.speculative_config,
            ec_connector=ec_connector,
            encoder_cache_size=self.engine_config.encoder_cache_size,
            stage_setup=stage_setup,
            lora_config=self.engine_config.lora_config,
        )

    def load_model(self) -> None:
        self.model_runner.load_model()
        # Building the model may draw random numbers (default inits); re-seed so
        # every rank starts sampling from the same RNG state.
        torch.manual_seed(self.engine_config.seed)

    def get_kv_cache_spec(self) -> dict[str, Any]:
        return self.model_runner.get_kv_cache_spec()

    def determine_available_memory(self) -> int:
        return self.model_runner.determine_available_memory()

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self.model_runner.sample_tokens(grammar_output)

    def add_lora(self, spec: LoRAAdapterSpec) -> str | None:
        """Load an adapter; None, or the reason it was refused (the executor raises it)."""
        runner = self.model_runner
        try:
            if not isinstance(runner, ModelRunner):
                raise ValueError("LoRA is not enabled (start with --enable-lora)")
            runner.add_lora(spec)
        except ValueError as exc:
            return str(exc)
        return None

    def remove_lora(self, name: str) -> bool:
        runner = self.model_runner
        # Without LoRA nothing is loaded: False, as for an unknown name.
        return (
            isinstance(runner, ModelRunner) and runner.lora is not None and runner.remove_lora(name)
        )

    def list_loras(self) -> list[str]:
        runner = self.model_runner
        if isinstance(runner, ModelRunner) and runner.lora is not None:
            return runner.list_loras()
        return []

    def check_health(self) -> None:
        """Raise if the device is unusable (a CUDA error surfaces on synchronize)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shutdown(self) -> None:
        if isinstance(self._runner, ModelRunner) and self._runner.pipeline is not None:
            self._runner.pipeline.close()  # the last activations must reach the next stage
        if self._runner is not None and self._runner.kv_connector is not None:
            # Lets a connector finish its background writes (a disk tier must be
            # complete for the next engine on the same directory).
            self._runner.kv_connector.shutdown()
        if self._runner is not None and self._runner.ec_connector is not None:
            self._runner.ec_connector.shutdown()
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
        self._runner = None
        if self._cpu_threads is not None:  # after the last step: no kernel is running
            self._cpu_threads.close()
            self._cpu_threads = None
