"""Gemma 3 text decoder (`Gemma3ForCausalLM`), also the language model of the multimodal one.

Differences from the Llama family, each from the HF config:

    layer_types[i]          "sliding_attention" (window `sliding_window`) or "full_attention",
                            each type with its own rope base (rope_parameters[type].rope_theta;
                            older configs: rope_local_base_freq / rope_theta)
    norms                   Gemma's y = norm(x) * (1 + w); four per layer: input,
                            post-attention, pre- and post-feed-forward (GemmaRMSNorm)
    q_norm / k_norm         the same norm over each head's vector, before rotary
    attention scale         query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5)
    MLP                     GeGLU with gelu_tanh
    embeddings              scaled by sqrt(hidden_size) (cast to the model dtype, as HF)
    soft-capping            attn_logit_softcapping (scores), final_logit_softcapping (logits)

Sliding layers get a `SlidingWindowSpec`, so the KV cache manager frees the
blocks that left the window (one KV cache group per spec, kv_cache_setup).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paged.kvcache import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from paged.runner.attention.backends import select_attention_backend
from paged.runner.attention.layer import Attention
from paged.runner.attention.metadata import AttentionMetadata, ForwardContext
from paged.runner.config import ModelConfig
from paged.runner.cpu_step import fused
from paged.runner.layers import cpu_eager
from paged.runner.layers.activation import get_gated_activation
from paged.runner.layers.layernorm import GemmaRMSNorm
from paged.runner.layers.linear import (
    CheckpointTensor,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from paged.runner.layers.parallel import TPGroup
from paged.runner.layers.rotary import RotaryEmbedding, rope_scaling_from_hf
from paged.runner.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from paged.runner.models.weight_loading import load_named_weights


@dataclass(frozen=True)
class Gemma3ArchConfig:
    """The Gemma3 text hyper-parameters paged uses, read once from the HF text config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    hidden_act: str
    query_pre_attn_scalar: float
    sliding_windows: tuple[int | None, ...]  # per layer; None = global attention
    rope_global: dict[str, Any]
    rope_local: dict[str, Any]
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    attention_bias: bool

    @classmethod
    def from_hf(cls, cfg: Any) -> Gemma3ArchConfig:
        layers = int(cfg.num_hidden_layers)
        types = getattr(cfg, "layer_types", None)
        if types is None:  # older configs: every `sliding_window_pattern`-th layer is global
            pattern = int(getattr(cfg, "sliding_window_pattern", 6))
            types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(layers)
            ]
        if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types: {types!r} is not one type per layer")
        window = getattr(cfg, "sliding_window", None)
        if "sliding_attention" in types and not window:
            raise ValueError("sliding_window: sliding layers need a positive window")
        rope = getattr(cfg, "rope_parameters", None) or {}
        glob = dict(rope.get("full_attention") or {})
        glob.setdefault("rope_theta", float(getattr(cfg, "rope_theta", 1_000_000.0)))
        local = dict(rope.get("sliding_attention") or {})
        local.setdefault("rope_theta", float(getattr(cfg, "rope_local_base_freq", 10_000.0)))
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        act = getattr(cfg, "hidden_activation", None) or getattr(
            cfg, "hidden_act", "gelu_pytorch_tanh"
        )
        return cls(
            vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_hidden_layers=layers,
            num_attention_heads=int(cfg.num_attention_heads),
            num_key_value_heads=int(cfg.num_key_value_heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.rms_norm_eps),
            max_position_embeddings=int(cfg.max_position_embeddings),
            hidden_act=str(act),
            query_pre_attn_scalar=float(getattr(cfg, "query_pre_attn_scalar", None) or head_dim),
            sliding_windows=tuple(
                int(window or 0) if t == "sliding_attention" else None for t in types
            ),
            rope_global=glob,
            rope_local=local,
            attn_logit_softcapping=getattr(cfg, "attn_logit_softcapping", None),
            final_logit_softcapping=getattr(cfg, "final_logit_softcapping", None),
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
        )


def _rotary(cfg: Gemma3ArchConfig, params: dict[str, Any]) -> RotaryEmbedding:
    return RotaryEmbedding(
        cfg.head_dim, cfg.head_dim, cfg.max_position_embeddings, float(params["rope_theta"]),
        rope_scaling_from_hf(params),
    )  # fmt: skip


class Gemma3Attention(nn.Module):
    def __init__(
        self,
        cfg: Gemma3ArchConfig,
        layer_idx: int,
        tp: TPGroup,
        model_config: ModelConfig,
        rotary_emb: RotaryEmbedding,
        prefix: str,
    ) -> None:
        super().__init__()
        dtype = model_config.dtype
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
            bias=cfg.attention_bias, tp=tp, dtype=dtype,
        )  # fmt: skip
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
            bias=cfg.attention_bias, tp=tp, dtype=dtype, shard=self.qkv_proj.o_proj_shard,
        )  # fmt: skip
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.head_dim = cfg.head_dim
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype)
        self.rotary_emb = rotary_emb  # shared by the layers of one type
        self.attn = Attention(
            self.qkv_proj.num_heads,
            cfg.head_dim,
            cfg.query_pre_attn_scalar**-0.5,
            self.qkv_proj.num_kv_heads,
            backend=select_attention_backend(model_config.device, model_config.attention_backend),
            sliding_window=cfg.sliding_windows[layer_idx],
            logits_soft_cap=cfg.attn_logit_softcapping,
            layer_name=f"{prefix}.layers.{layer_idx}.self_attn.attn",
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
        t = q.shape[0]
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(t, self.q_size)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(t, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        out: torch.Tensor = self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))
        return out


class Gemma3MLP(nn.Module):
    def __init__(self, cfg: Gemma3ArchConfig, tp: TPGroup, dtype: torch.dtype) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [size, size], bias=False, tp=tp, dtype=dtype
        )
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, bias=False, tp=tp, dtype=dtype)
        self.act_fn = get_gated_activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(self.act_fn(self.gate_up_proj(x)))
        return out


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: x + post_attn(attn(in(x))), then + post_ffw(mlp(pre_ffw(.)))."""

    def __init__(
        self,
        cfg: Gemma3ArchConfig,
        layer_idx: int,
        tp: TPGroup,
        model_config: ModelConfig,
        rotary_emb: RotaryEmbedding,
        prefix: str,
    ) -> None:
        super().__init__()
        dtype, h, eps = model_config.dtype, cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma3Attention(cfg, layer_idx, tp, model_config, rotary_emb, prefix)
        self.mlp = Gemma3MLP(cfg, tp, dtype)
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        attn = self.self_attn(
            positions, self.input_layernorm(hidden_states), kv_cache, attn_metadata
        )
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        out: torch.Tensor = hidden_states + self.post_feedforward_layernorm(mlp)
        return out

    def fused_spec(self) -> fused.LayerSpec | None:
        """This layer for the fused CPU path (cpu_step/fused.py), or None if it does not fit."""
        a, mlp = self.self_attn, self.mlp
        return fused.layer_spec(
            qkv=a.qkv_proj, o=a.o_proj, gate_up=mlp.gate_up_proj, down=mlp.down_proj,
            act=mlp.act_fn, rotary=a.rotary_emb, attn=a.attn, q_size=a.q_size,
            kv_size=a.kv_size, head_dim=a.head_dim, input_norm=self.input_layernorm,
            post_attn_norm=self.post_attention_layernorm,
            pre_ff_norm=self.pre_feedforward_layernorm,
            post_ff_norm=self.post_feedforward_layernorm, q_norm=a.q_norm, k_norm=a.k_norm,
        )  # fmt: skip


class Gemma3TextModel(nn.Module):
    """Embedding (scaled), the decoder layers, the final norm."""

    def __init__(
        self, cfg: Gemma3ArchConfig, tp: TPGroup, model_config: ModelConfig, prefix: str
    ) -> None:
        super().__init__()
        dtype = model_config.dtype
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, tp=tp, dtype=dtype
        )
        # HF multiplies by sqrt(hidden) rounded to the model dtype (55.4256 -> 55.5 in bf16).
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, dtype=dtype))
        self.rotary_global = _rotary(cfg, cfg.rope_global)
        self.rotary_local = _rotary(cfg, cfg.rope_local)
        layers = []
        for i in range(cfg.num_hidden_layers):
            rotary = self.rotary_local if cfg.sliding_windows[i] is not None else self.rotary_global
            layers.append(Gemma3DecoderLayer(cfg, i, tp, model_config, rotary, prefix))
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        # The quantised CPU path's decoder stack in two C calls a layer (cpu_step/fused.py).
        self.cpu_fused = fused.FusedLayers()

    def _fused_stack(self) -> fused.FusedDecoderStack | None:
        first = self.layers[0]
        assert isinstance(first, Gemma3DecoderLayer)

        def build() -> fused.FusedDecoderStack | None:
            specs = [
                layer.fused_spec() if isinstance(layer, Gemma3DecoderLayer) else None
                for layer in self.layers
            ]
            return fused.build_stack(specs, self.norm)

        return self.cpu_fused.stack(first.self_attn.qkv_proj.quant, build)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.embed_tokens(input_ids) * self.embed_scale
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if ctx.attn_metadata is not None and len(ctx.kv_caches) != len(self.layers):
            raise ValueError(
                f"ctx.kv_caches has {len(ctx.kv_caches)} tensors for {len(self.layers)} layers"
            )
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        stack = self._fused_stack()
        if stack is not None and stack.takes(hidden):
            return stack.forward(hidden, positions, ctx)
        # The residual stream is float32 on CPU (layers/cpu_eager.py); the norms
        # return the model dtype, so every sub-layer still runs in it.
        hidden = cpu_eager.residual_stream(hidden)
        for i, layer in enumerate(self.layers):
            kv_cache = ctx.kv_caches[i] if ctx.kv_caches else None
            ctx.wait_for_layer_load(i)
            hidden = layer(positions, hidden, kv_cache, ctx.metadata_for(i))
            ctx.save_kv_layer(i)
        out: torch.Tensor = self.norm(hidden)
        return out


def attention_specs(
    layers: Iterable[Attention], block_size: int, dtype_name: str
) -> dict[str, KVCacheSpec]:
    """One KV cache spec per attention layer; sliding layers get a SlidingWindowSpec."""
    if block_size <= 0:
        raise ValueError(f"block_size: must be positive, got {block_size}")
    specs: dict[str, KVCacheSpec] = {}
    for attn in layers:
        common: dict[str, Any] = {
            "block_size": block_size,
            "num_kv_heads": attn.num_kv_heads,
            "head_size": attn.head_size,
            "dtype": dtype_name,
        }
        if attn.sliding_window is None:
            specs[attn.layer_name] = FullAttentionSpec(**common)
        else:
            specs[attn.layer_name] = SlidingWindowSpec(**common, sliding_window=attn.sliding_window)
    return specs


class Gemma3ForCausalLM(nn.Module):
    """Gemma 3 text-only causal LM implementing `paged.runner.models.interface.CausalLM`."""

    def __init__(self, model_config: ModelConfig, *, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.model_config = model_config
        self.config = Gemma3ArchConfig.from_hf(model_config.text_config)
        if self.config.num_hidden_layers < 1:
            raise ValueError("num_hidden_layers: the model config must have at least one layer")
        self.tp = TPGroup(tp_rank, tp_size)
        self.model = Gemma3TextModel(self.config, self.tp, model_config, "model")
        # Gemma always ties the LM head to the embedding.
        self.lm_head = ParallelLMHead(
            self.config.vocab_size, self.config.hidden_size, tp=self.tp, dtype=model_config.dtype
        )
        self.lm_head.tie_to(self.model.embed_tokens)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        hidden: torch.Tensor = self.model(input_ids, positions, ctx)
        return hidden

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return soft_capped_logits(self.lm_head, hidden_states, self.config.final_logit_softcapping)

    def attention_layers(self) -> list[Attention]:
        return [m for m in self.modules() if isinstance(m, Attention)]

    def kv_cache_specs(self, block_size: int) -> dict[str, KVCacheSpec]:
        return attention_specs(self.attention_layers(), block_size, self.model_config.dtype_name)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        return load_named_weights(self, weights, skip={"lm_head.weight"})

    def expected_weights(self) -> set[str]:
        return {name for name, _ in self.named_parameters()}


def soft_capped_logits(
    lm_head: ParallelLMHead, hidden_states: torch.Tensor, cap: float | None
) -> torch.Tensor:
    """float32 logits, `cap * tanh(logits / cap)` when the config sets final soft-capping."""
    logits = lm_head.compute_logits(hidden_states)
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits
