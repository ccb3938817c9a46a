"""SigLIP vision tower (the encoder of Gemma 3's images), HF `SiglipVisionModel` names.

    pixel_values [N, C, S, S]
      -> patch_embedding (Conv2d, stride = patch) -> [N, P, Hv] + position_embedding
      -> encoder layers: x + attn(layer_norm1(x)); x + mlp(layer_norm2(x))   (bidirectional)
      -> post_layernorm -> [N, P, Hv]                     P = (S / patch)^2 patches

The pooling head (`vision_use_head`) is not built: Gemma 3 reads the last
hidden state, so its weights are skipped at load time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged.runner.layers.linear import ReplicatedLinear


@dataclass(frozen=True)
class SiglipVisionArchConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, cfg: Any) -> SiglipVisionArchConfig:
        act = str(getattr(cfg, "hidden_act", "gelu_pytorch_tanh"))
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"vision_config.hidden_act: {act!r} is not supported")
        out = cls(
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_hidden_layers=int(cfg.num_hidden_layers),
            num_attention_heads=int(cfg.num_attention_heads),
            num_channels=int(getattr(cfg, "num_channels", 3)),
            image_size=int(cfg.image_size),
            patch_size=int(cfg.patch_size),
            layer_norm_eps=float(cfg.layer_norm_eps),
            hidden_act=act,
        )
        if out.image_size % out.patch_size:
            raise ValueError(
                f"vision_config: image_size {out.image_size} is not a multiple of "
                f"patch_size {out.patch_size}"
            )
        return out

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipVisionArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            cfg.num_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size, dtype=dtype
        )
        self.position_embedding = nn.Embedding(
            cfg.patches_per_side**2, cfg.hidden_size, dtype=dtype
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        x = patches.flatten(2).transpose(1, 2)  # [N, P, Hv]
        out: torch.Tensor = x + self.position_embedding.weight[None]
        return out


class SiglipAttention(nn.Module):
    def __init__(self, cfg: SiglipVisionArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = h // self.num_heads
        self.q_proj = ReplicatedLinear(h, h, bias=True, dtype=dtype)
        self.k_proj = ReplicatedLinear(h, h, bias=True, dtype=dtype)
        self.v_proj = ReplicatedLinear(h, h, bias=True, dtype=dtype)
        self.out_proj = ReplicatedLinear(h, h, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, p, h = x.shape
        flat = x.reshape(n * p, h)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, p, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(flat)), heads(self.k_proj(flat)), heads(self.v_proj(flat))
        o = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        out: torch.Tensor = self.out_proj(o.transpose(1, 2).reshape(n * p, h)).view(n, p, h)
        return out


class SiglipMLP(nn.Module):
    def __init__(self, cfg: SiglipVisionArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = ReplicatedLinear(cfg.hidden_size, cfg.intermediate_size, bias=True, dtype=dtype)
        self.fc2 = ReplicatedLinear(cfg.intermediate_size, cfg.hidden_size, bias=True, dtype=dtype)
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = F.gelu(self.fc1(x.reshape(-1, shape[-1])), approximate=self.approximate)
        out: torch.Tensor = self.fc2(y).view(shape)
        return out


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: SiglipVisionArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.self_attn = SiglipAttention(cfg, dtype)
        self.layer_norm2 = nn.LayerNorm(h, eps=eps, dtype=dtype)
        self.mlp = SiglipMLP(cfg, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        out: torch.Tensor = x + self.mlp(self.layer_norm2(x))
        return out


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: SiglipVisionArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            SiglipEncoderLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class SiglipVisionModel(nn.Module):
    """pixel_values [N, C, S, S] -> last hidden state [N, (S / patch)^2, Hv]."""

    def __init__(self, cfg: SiglipVisionArchConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = SiglipVisionEmbeddings(cfg, dtype)
        self.encoder = SiglipEncoder(cfg, dtype)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        expected = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(
                f"pixel_values: expected [N, {expected[0]}, {expected[1]}, {expected[2]}], "
                f"got {list(pixel_values.shape)}"
            )
        out: torch.Tensor = self.post_layernorm(self.encoder(self.embeddings(pixel_values)))
        return out
