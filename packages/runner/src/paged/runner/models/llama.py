"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, one implementation.

    input_ids [T] -> embed -> N x LlamaDecoderLayer -> norm -> hidden [T, H]
    LlamaDecoderLayer (pre-norm, residual stream carried separately so the
    add and the norm fuse into one kernel):
        x, res = input_layernorm(x, res)
        x      = self_attn(positions, x)      qkv_proj -> [q/k norm] -> rope -> Attention -> o_proj
        x, res = post_attention_layernorm(x, res)
        x      = mlp(x)                       gate_up_proj -> silu_and_mul -> down_proj

Checkpoint names are the Hugging Face ones; q/k/v and gate/up are packed into
one matmul each and unpacked by `load_weights`.

Pipeline parallelism (`stage`): a stage builds only its decoder layers
(`pipeline.partition.layer_range`), the others are `PPMissingLayer`s so that
names keep the checkpoint's indices. The first stage holds the embedding, the
last the final norm and the LM head (and the embedding too when the head is
tied to it). `forward_stage` takes the previous stage's `IntermediateTensors`
instead of ids and returns them for the next stage, except on the last.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from paged.kvcache import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from paged.runner.attention.backends import select_attention_backend
from paged.runner.attention.layer import Attention
from paged.runner.attention.metadata import AttentionMetadata, ForwardContext
from paged.runner.config import ModelConfig
from paged.runner.cpu_step import fused
from paged.runner.layers.activation import get_gated_activation
from paged.runner.layers.layernorm import RMSNorm
from paged.runner.layers.linear import (
    CheckpointTensor,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from paged.runner.layers.parallel import TPGroup
from paged.runner.layers.rotary import RotaryEmbedding
from paged.runner.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from paged.runner.models.llama_config import LlamaArchConfig
from paged.runner.models.weight_loading import load_named_weights
from paged.runner.pipeline.partition import layer_range
from paged.runner.pipeline.stage import PipelineStage
from paged.runner.pipeline.tensors import IntermediateTensors, PPMissingLayer

# HF checkpoint name fragment -> (packed module attribute, shard id).


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: LlamaArchConfig,
        layer_idx: int,
        tp: TPGroup,
        model_config: ModelConfig,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        dtype = model_config.dtype
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
            bias=cfg.attention_bias, tp=tp, dtype=dtype,
        )  # fmt: skip
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim,
            cfg.hidden_size,
            bias=cfg.o_proj_bias,
            tp=tp,
            dtype=dtype,
            shard=self.qkv_proj.o_proj_shard,
        )
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.head_dim = cfg.head_dim
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.rotary_emb = rotary_emb  # one table shared by every layer
        self.attn = Attention(
            self.qkv_proj.num_heads,
            cfg.head_dim,
            cfg.head_dim**-0.5,
            self.qkv_proj.num_kv_heads,
            backend=select_attention_backend(model_config.device, model_config.attention_backend),
            sliding_window=cfg.sliding_windows[layer_idx],
            layer_name=f"model.layers.{layer_idx}.self_attn.attn",
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            # Qwen3: RMSNorm over each head's vector before rotary.
            t = q.shape[0]
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, self.q_size)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        attn_out = self.attn(q, k, v, kv_cache, attn_metadata)
        out: torch.Tensor = self.o_proj(attn_out)
        return out


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaArchConfig, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [size, size], bias=cfg.mlp_bias, tp=tp, dtype=dtype
        )
        self.down_proj = RowParallelLinear(
            size, cfg.hidden_size, bias=cfg.mlp_bias, tp=tp, dtype=dtype
        )
        self.act_fn = get_gated_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act_fn(self.gate_up_proj(x)))
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: LlamaArchConfig,
        layer_idx: int,
        tp: TPGroup,
        model_config: ModelConfig,
        rotary_emb: RotaryEmbedding,
    ) -> None:
        super().__init__()
        dtype = model_config.dtype
        self.self_attn = LlamaAttention(cfg, layer_idx, tp, model_config, rotary_emb)
        self.mlp = LlamaMLP(cfg, tp, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is float32 on CPU and updated in place (layers/cpu_eager.py).
        if residual is None:
            hidden_states, residual = self.input_layernorm.start_residual(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm.add_residual_norm_(
                hidden_states, residual
            )
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm.add_residual_norm_(
            hidden_states, residual
        )
        return self.mlp(hidden_states), residual

    def fused_spec(self) -> fused.LayerSpec | None:
        """This layer for the fused CPU path (cpu_step/fused.py), or None if it does not fit."""
        a, mlp = self.self_attn, self.mlp
        return fused.layer_spec(
            qkv=a.qkv_proj, o=a.o_proj, gate_up=mlp.gate_up_proj, down=mlp.down_proj,
            act=mlp.act_fn, rotary=a.rotary_emb, attn=a.attn, q_size=a.q_size,
            kv_size=a.kv_size, head_dim=a.head_dim, input_norm=self.input_layernorm,
            post_attn_norm=self.post_attention_layernorm, q_norm=a.q_norm, k_norm=a.k_norm,
        )  # fmt: skip


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: LlamaArchConfig,
        tp: TPGroup,
        model_config: ModelConfig,
        stage: PipelineStage,
        layers: tuple[int, int],
    ) -> None:
        super().__init__()
        dtype = model_config.dtype
        self.stage = stage
        self.start_layer, self.end_layer = layers
        # The last stage needs the table too when the LM head is tied to it.
        if stage.is_first or (stage.is_last and cfg.tie_word_embeddings):
            self.embed_tokens: VocabParallelEmbedding | PPMissingLayer = VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype
            )
        else:
            self.embed_tokens = PPMissingLayer()
        rotary_emb = RotaryEmbedding(
            cfg.head_dim, cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
            cfg.rope_scaling,
        )  # fmt: skip
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, tp, model_config, rotary_emb)
            if self.start_layer <= i < self.end_layer
            else PPMissingLayer()
            for i in range(cfg.num_hidden_layers)
        )
        self.norm: RMSNorm | PPMissingLayer = (
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
            if stage.is_last
            else PPMissingLayer()
        )
        # The quantised CPU path's decoder stack in two C calls a layer (cpu_step/fused.py).
        self.cpu_fused = fused.FusedLayers()

    def _fused_stack(self) -> fused.FusedDecoderStack | None:
        if not (self.stage.is_first and self.stage.is_last):
            return None
        first = self.layers[0]
        assert isinstance(first, LlamaDecoderLayer)  # a single stage holds every layer

        def build() -> fused.FusedDecoderStack | None:
            specs = [
                layer.fused_spec() if isinstance(layer, LlamaDecoderLayer) else None
                for layer in self.layers
            ]
            assert isinstance(self.norm, RMSNorm)
            return fused.build_stack(specs, self.norm)

        return self.cpu_fused.stack(first.self_attn.qkv_proj.quant, build)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        num_layers = self.end_layer - self.start_layer
        if ctx.attn_metadata is not None and len(ctx.kv_caches) != num_layers:
            raise ValueError(
                f"ctx.kv_caches has {len(ctx.kv_caches)} tensors for {num_layers} layers"
            )
        if ctx.layer_metadata is not None and len(ctx.layer_metadata) != num_layers:
            raise ValueError(
                f"ctx.layer_metadata has {len(ctx.layer_metadata)} entries for {num_layers} layers"
            )
        residual: torch.Tensor | None
        stack = self._fused_stack() if intermediate is None else None
        if self.stage.is_first:
            hidden_states = self.embed_tokens(input_ids)
            if stack is not None and stack.takes(hidden_states):
                return stack.forward(hidden_states, positions, ctx)
            residual = None
        elif intermediate is None:
            raise ValueError(
                "intermediate: a later pipeline stage needs the previous stage's output"
            )
        else:
            hidden_states, residual = intermediate.hidden_states, intermediate.residual
        # i: this stage's own index of the layer (its KV cache, metadata, connector name).
        for i in range(num_layers):
            layer = self.layers[self.start_layer + i]
            kv_cache = ctx.kv_caches[i] if ctx.kv_caches else None
            ctx.wait_for_layer_load(i)  # a KV connector may still be loading this layer
            hidden_states, residual = layer(
                positions, hidden_states, residual, kv_cache, ctx.metadata_for(i)
            )
            ctx.save_kv_layer(i)  # this step's K/V of layer i is in the cache now
        assert residual is not None  # at least one layer per stage
        if not self.stage.is_last:
            # The next stage receives the model dtype (its buffers are sized for it).
            return IntermediateTensors(hidden_states, residual.to(hidden_states.dtype))
        assert isinstance(self.norm, RMSNorm)  # the last stage holds it
        hidden_states, _ = self.norm.add_residual_norm_(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM implementing `paged.runner.models.interface.CausalLM`."""

    def __init__(
        self,
        model_config: ModelConfig,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        stage: PipelineStage | None = None,
        pp_layer_partition: str | None = None,
        tp_group: Any = None,
    ) -> None:
        super().__init__()
        self.model_config = model_config
        self.config = LlamaArchConfig.from_hf(model_config.hf_config)
        if self.config.num_hidden_layers < 1:
            raise ValueError("num_hidden_layers: the model config must have at least one layer")
        self.tp = TPGroup(tp_rank, tp_size, tp_group)
        self.stage = stage if stage is not None else PipelineStage()
        layers = layer_range(
            self.config.num_hidden_layers,
            self.stage.pp_rank,
            self.stage.pp_size,
            pp_layer_partition,
        )
        self.model = LlamaModel(self.config, self.tp, model_config, self.stage, layers)
        # A *ForSequenceClassification checkpoint has no LM head (its `score` head is
        # the pooler's): no vocab x hidden matrix is allocated for it.
        self.lm_head: ParallelLMHead | PPMissingLayer = PPMissingLayer()
        if self.stage.is_last and model_config.needs_lm_head:
            self.lm_head = ParallelLMHead(
                self.config.vocab_size,
                self.config.hidden_size,
                tp=self.tp,
                dtype=model_config.dtype,
            )
            if self.config.tie_word_embeddings:
                assert isinstance(self.model.embed_tokens, VocabParallelEmbedding)
                self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        hidden = self.model(input_ids, positions, ctx)
        if not isinstance(hidden, torch.Tensor):
            raise RuntimeError("forward: a pipeline stage before the last runs forward_stage")
        return hidden

    def forward_stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        intermediate: IntermediateTensors | None,
    ) -> torch.Tensor | IntermediateTensors:
        """One pipeline stage: hidden [T, H] on the last stage, else the tensors to send on."""
        result: torch.Tensor | IntermediateTensors = self.model(
            input_ids, positions, ctx, intermediate
        )
        return result

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not isinstance(self.lm_head, ParallelLMHead):
            raise RuntimeError("compute_logits: only the last pipeline stage holds the LM head")
        return self.lm_head.compute_logits(hidden_states)

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        """One spec per layer, in layer order; sliding layers get a SlidingWindowSpec."""
        if block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {block_size}")
        specs: dict[str, KVCacheSpec] = {}
        for attn in self.attention_layers():
            common: dict[str, Any] = {
                "block_size": block_size,
                "num_kv_heads": attn.num_kv_heads,
                "head_size": attn.head_size,
                "dtype": self.model_config.dtype_name,
            }
            if attn.sliding_window is None:
                specs[attn.layer_name] = FullAttentionSpec(**common)
            else:
                specs[attn.layer_name] = SlidingWindowSpec(
                    **common, sliding_window=attn.sliding_window
                )
        return specs

    def attention_layers(self) -> list[Attention]:
        """The Attention modules in layer order (kv_caches[i] belongs to the i-th)."""
        return [m for m in self.modules() if isinstance(m, Attention)]

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Load HF-named full tensors; returns the names of this model's parameters filled.

        Unknown names raise a ValueError (a checkpoint of another model); the
        caller checks that every parameter was filled.
        """
        skip = {"lm_head.weight"} if self.config.tie_word_embeddings else set()
        # Modules other pipeline stages hold: their tensors are not this stage's.
        elsewhere = tuple(
            f"{name}." for name, m in self.named_modules() if isinstance(m, PPMissingLayer)
        )

        # Head tensors of a classifier checkpoint are read by the pooler, not the body.
        head = ("score.",) if not self.model_config.needs_lm_head else ()

        def kept() -> Iterator[tuple[str, CheckpointTensor]]:
            for name, tensor in weights:
                # Derived from the config; some old checkpoints store it.
                if "rotary_emb.inv_freq" in name or name.startswith(elsewhere + head):
                    continue
                yield name, tensor

        return load_named_weights(self, kept(), skip=skip)

    def expected_weights(self) -> set[str]:
        """Parameter names that the checkpoint must fill (packed names count once)."""
        return {name for name, _ in self.named_parameters()}
