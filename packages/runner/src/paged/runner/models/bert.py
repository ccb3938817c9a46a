"""BERT-family encoder (BertModel, XLM-RoBERTa / RoBERTa) over a token-packed batch.

    input_ids [T] (sequences packed, no padding), seq_lens [B], token_type_ids [T]
      -> word + position + token_type embeddings -> LayerNorm
      -> layers: x = LN(x + attn(x)); x = LN(x + out(act(inter(x))))   (post-norm)
      -> [T, hidden]    the pooler (paged.runner.pooling) reads CLS/MEAN/... from it

Attention is bidirectional within each sequence and never across sequences;
no T x T mask is built. How sequences meet SDPA depends on the device:
- CPU: one SDPA call per sequence on views of the packed q/k/v rows (no
  padding, no gather/scatter; the CPU flash kernel reads strided inputs and a
  call costs ~10-20 us, nothing next to a sequence's attention). The packed
  batch also runs through the layers in slices of about `CPU_SLICE_TOKENS`
  whole sequences, so each layer's activations ([tokens, 4 * hidden] for the
  FFN) stay nearer the cores than in one pass over a large step
  (pooling-speed.md has the measurements).
- other devices: sequences are sorted by length and cut into groups whose
  padding stays under a quarter of the group's tokens; each group runs one
  SDPA call ([B, heads, L, d], a key mask only when lengths differ), so a
  batch of many short prompts costs a few kernel launches, not one per prompt.

Positions are absolute and computed here from `seq_lens`: 0-based for BERT,
offset by `pad_token_id + 1` for the RoBERTa family (what HF's
create_position_ids_from_input_ids gives for an unpadded sequence).
vLLM reference: vllm/model_executor/models/bert.py:50-95 (embeddings), :127-366
(layers), :369-420 (BertModel, the HF `pooler.` tensors dropped), :790-842
(BertForSequenceClassification); roberta.py:47-92 (position offset), :266-348.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paged.runner.loader.safetensors_weights import iterate_safetensors

# The HF architectures this encoder serves (config.json `architectures[0]`).
ENCODER_ONLY_ARCHITECTURES: frozenset[str] = frozenset(
    {
        "BertModel",
        "BertForSequenceClassification",
        "RobertaModel",
        "RobertaForSequenceClassification",
        "XLMRobertaModel",
        "XLMRobertaForSequenceClassification",
    }
)
_ROBERTA_MODEL_TYPES = frozenset({"roberta", "xlm-roberta"})
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
# A group of sequences padded to its longest may hold at most this share of padding.
_MAX_PAD_FRACTION = 0.25
# On CPU the layers run over slices of about this many tokens (whole sequences).
# Measured on a 6x384 model: at one thread 512-4,096 all beat one 8,192-token
# pass by ~5-8% of CPU time; at two threads smaller slices cost more (an OpenMP
# barrier per op and slice) and 4,096 is level with no slicing.
CPU_SLICE_TOKENS = 4096


@dataclass(frozen=True)
class BertArchConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    position_offset: int  # 0 for BERT, pad_token_id + 1 for RoBERTa / XLM-R

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> BertArchConfig:
        kind = cfg.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"position_embedding_type: only 'absolute' is supported, got {kind!r}")
        act = str(cfg.get("hidden_act", "gelu"))
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act: {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        if hidden % heads:
            raise ValueError(
                f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
            )
        roberta = cfg.get("model_type") in _ROBERTA_MODEL_TYPES
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            intermediate_size=int(cfg["intermediate_size"]),
            hidden_act=act,
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            type_vocab_size=int(cfg.get("type_vocab_size", 2)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
            position_offset=int(cfg.get("pad_token_id", 1)) + 1 if roberta else 0,
        )

    @property
    def max_seq_len(self) -> int:
        """The longest sequence the position table holds."""
        return self.max_position_embeddings - self.position_offset


@dataclass(frozen=True)
class _Group:
    """Sequences attended together: packed rows `src` land at padded rows `dst`."""

    batch: int
    length: int
    src: torch.Tensor  # [n] indices into the packed token dimension
    dst: torch.Tensor  # [n] indices into the flattened [batch * length] padded rows
    mask: torch.Tensor | None  # [batch, 1, 1, length] bool (True = attend), None if no padding


@dataclass(frozen=True)
class _Span:
    """One sequence attended on its own: packed rows [start, start + length)."""

    start: int
    length: int


def _starts(seq_lens: list[int]) -> list[int]:
    starts = [0]
    for n in seq_lens[:-1]:
        starts.append(starts[-1] + n)
    return starts


def plan_attention(seq_lens: list[int], device: torch.device) -> list[_Group] | list[_Span]:
    """How a packed batch meets SDPA on `device` (see the module docstring)."""
    if device.type == "cpu":
        return [_Span(s, n) for s, n in zip(_starts(seq_lens), seq_lens, strict=True)]
    return _plan_groups(seq_lens, device)


def cpu_slices(seq_lens: list[int], max_tokens: int = CPU_SLICE_TOKENS) -> list[tuple[int, int]]:
    """Cut the packed sequences into runs of whole sequences of about `max_tokens`.

    Returns half-open ranges of sequence indices. A run closes once it holds
    `max_tokens` or more, so a sequence longer than that forms a run alone.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    runs: list[tuple[int, int]] = []
    first, tokens = 0, 0
    for i, n in enumerate(seq_lens):
        tokens += n
        if tokens >= max_tokens:
            runs.append((first, i + 1))
            first, tokens = i + 1, 0
    if first < len(seq_lens):
        runs.append((first, len(seq_lens)))
    return runs


def _plan_groups(seq_lens: list[int], device: torch.device) -> list[_Group]:
    starts = _starts(seq_lens)
    order = sorted(range(len(seq_lens)), key=lambda i: seq_lens[i])
    groups: list[list[int]] = []
    for i in order:
        # Sorted ascending: adding i pads every member to seq_lens[i].
        if groups:
            members = groups[-1]
            total = sum(seq_lens[j] for j in members) + seq_lens[i]
            padded = (len(members) + 1) * seq_lens[i]
            if padded - total <= _MAX_PAD_FRACTION * padded:
                members.append(i)
                continue
        groups.append([i])
    plans = []
    for members in groups:
        length = max(seq_lens[j] for j in members)
        src = torch.cat([torch.arange(starts[j], starts[j] + seq_lens[j]) for j in members])
        dst = torch.cat([torch.arange(seq_lens[j]) + b * length for b, j in enumerate(members)])
        mask = None
        if any(seq_lens[j] != length for j in members):
            lens = torch.tensor([seq_lens[j] for j in members])
            mask = (torch.arange(length)[None, :] < lens[:, None])[:, None, None, :]
            mask = mask.to(device)
        plans.append(_Group(len(members), length, src.to(device), dst.to(device), mask))
    return plans


class BertLayer(nn.Module):
    def __init__(self, cfg: BertArchConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h)  # query/key/value packed at load time
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.inter = nn.Linear(h, cfg.intermediate_size)
        self.out = nn.Linear(cfg.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, plan: list[_Group] | list[_Span]) -> torch.Tensor:
        h = x.shape[1]
        d = h // self.heads
        qkv = self.qkv(x)
        ctx = torch.empty_like(x)
        for g in plan:
            if isinstance(g, _Span):  # views of the packed rows: nothing copied in
                rows = qkv[g.start : g.start + g.length]
                q, k, v = rows.view(1, g.length, 3, self.heads, d).permute(2, 0, 3, 1, 4)
                o = F.scaled_dot_product_attention(q, k, v)
                ctx[g.start : g.start + g.length] = o.transpose(1, 2).reshape(g.length, h)
                continue
            padded = qkv.new_zeros(g.batch * g.length, 3 * h)
            padded[g.dst] = qkv[g.src]
            q, k, v = padded.view(g.batch, g.length, 3, self.heads, d).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask)
            ctx[g.src] = o.transpose(1, 2).reshape(g.batch * g.length, h)[g.dst]
        x = self.attn_norm(_linear_plus(ctx, self.attn_out, x))
        y: torch.Tensor = self.out_norm(_linear_plus(self.act(self.inter(x)), self.out, x))
        return y


def _linear_plus(x: torch.Tensor, linear: nn.Linear, residual: torch.Tensor) -> torch.Tensor:
    """residual + linear(x), with the residual as the GEMM's accumulator (one pass less)."""
    y = torch.addmm(residual, x, linear.weight.t())
    if linear.bias is not None:
        y += linear.bias
    return y


class BertModel(nn.Module):
    """The encoder body; returns the last hidden states of every packed token."""

    def __init__(self, cfg: BertArchConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        layers = [BertLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self._layers = layers  # a typed view of the same modules
        self.cpu_slice_tokens = CPU_SLICE_TOKENS  # see the module docstring

    @property
    def hidden_size(self) -> int:
        return self.cfg.hidden_size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None,
        seq_lens: list[int],
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T] ids of sequences packed back to back -> [T, hidden].

        `positions`, when given, must be the 0-based position of each token in
        its sequence (the runner's); they are checked against `seq_lens`.
        """
        self._check_inputs(input_ids, positions, seq_lens, token_type_ids)
        device = input_ids.device
        pos = torch.cat([torch.arange(n, device=device) for n in seq_lens])
        if positions is not None and not torch.equal(positions.to(device), pos):
            raise ValueError("positions: expected 0-based positions restarting at each sequence")
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        emb = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(pos + self.cfg.position_offset)
            + self.token_type_embeddings(types)
        )
        x: torch.Tensor = self.embed_norm(emb)
        if device.type != "cpu":
            return self._layers_forward(x, seq_lens)
        out = torch.empty_like(x)
        starts = [*_starts(seq_lens), x.shape[0]]
        for first, end in cpu_slices(seq_lens, self.cpu_slice_tokens):
            rows = slice(starts[first], starts[end])
            out[rows] = self._layers_forward(x[rows], seq_lens[first:end])
        return out

    def _layers_forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        plan = plan_attention(seq_lens, x.device)
        for layer in self._layers:
            x = layer.forward(x, plan)
        return x

    def _check_inputs(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None,
        seq_lens: list[int],
        token_type_ids: torch.Tensor | None,
    ) -> None:
        if input_ids.dim() != 1:
            raise ValueError(
                f"input_ids: expected a 1-D packed tensor, got {list(input_ids.shape)}"
            )
        if not seq_lens or any(n < 1 for n in seq_lens):
            raise ValueError(f"seq_lens: every sequence needs at least one token, got {seq_lens}")
        if sum(seq_lens) != input_ids.shape[0]:
            raise ValueError(
                f"seq_lens: they sum to {sum(seq_lens)}, input_ids holds {input_ids.shape[0]}"
            )
        if max(seq_lens) > self.cfg.max_seq_len:
            raise ValueError(
                f"seq_lens: a sequence of {max(seq_lens)} tokens exceeds the model's "
                f"{self.cfg.max_seq_len} positions"
            )
        for name, other in (("positions", positions), ("token_type_ids", token_type_ids)):
            if other is not None and other.shape != input_ids.shape:
                raise ValueError(
                    f"{name}: shape {list(other.shape)} does not match input_ids "
                    f"{list(input_ids.shape)}"
                )
        if (
            token_type_ids is not None
            and token_type_ids.numel()
            and (
                int(token_type_ids.min()) < 0
                or int(token_type_ids.max()) >= self.cfg.type_vocab_size
            )
        ):
            raise ValueError(f"token_type_ids: values must lie in [0, {self.cfg.type_vocab_size})")

    # -- loading -----------------------------------------------------------
    def load_hf_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named body tensors in; head tensors and HF's pooler are skipped."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        qkv_parts: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            target = _hf_to_param(name)
            if target is None:
                continue
            if isinstance(target, tuple):  # (packed qkv param, part)
                qkv_parts.setdefault(target[0], {})[target[1]] = tensor
                continue
            _copy(params, target, tensor, name)
            filled.add(target)
        for target, parts in qkv_parts.items():
            if set(parts) != {"query", "key", "value"}:
                raise ValueError(f"checkpoint: {target} lacks one of query/key/value")
            _copy(params, target, torch.cat([parts[p] for p in ("query", "key", "value")]), target)
            filled.add(target)
        missing = sorted(set(params) - filled)
        if missing:
            raise ValueError(f"checkpoint: tensors missing for {', '.join(missing[:8])}")


_LAYER_NAMES = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "inter",
    "output.dense": "out",
    "output.LayerNorm": "out_norm",
}
_EMBED_NAMES = {
    "embeddings.word_embeddings": "word_embeddings",
    "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings",
    "embeddings.LayerNorm": "embed_norm",
}


def _hf_to_param(name: str) -> str | tuple[str, str] | None:
    """Map an HF tensor name to this module's parameter (None: not a body tensor)."""
    for prefix in ("bert.", "roberta."):
        name = name.removeprefix(prefix)
    name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
        "LayerNorm.beta", "LayerNorm.bias"
    )
    # HF BertModel's own pooler (vLLM drops it for embedding models and reads it
    # as a head tensor for BertForSequenceClassification), the classifier heads,
    # masked-LM heads and the position_ids buffer are not body tensors.
    if name.startswith(("pooler.", "classifier.", "lm_head.", "cls.")) or name.endswith(
        "position_ids"
    ):
        return None
    module, _, leaf = name.rpartition(".")
    if module in _EMBED_NAMES:
        return f"{_EMBED_NAMES[module]}.{leaf}"
    parts = module.split(".", 3)  # encoder, layer, i, rest
    if len(parts) == 4 and parts[:2] == ["encoder", "layer"]:
        rest = parts[3]
        if rest.startswith("attention.self."):
            return (f"layers.{parts[2]}.qkv.{leaf}", rest.removeprefix("attention.self."))
        if rest in _LAYER_NAMES:
            return f"layers.{parts[2]}.{_LAYER_NAMES[rest]}.{leaf}"
    raise ValueError(
        f"checkpoint tensor {name!r} does not belong to a BERT-family encoder; "
        "is the checkpoint for a different architecture?"
    )


def _copy(params: dict[str, nn.Parameter], target: str, tensor: torch.Tensor, name: str) -> None:
    param = params.get(target)
    if param is None or param.shape != tensor.shape:
        shape = None if param is None else list(param.shape)
        raise ValueError(
            f"checkpoint tensor {name!r}: shape {list(tensor.shape)} does not match {shape}"
        )
    with torch.no_grad():
        param.copy_(tensor)


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: cannot read {str(path)!r} ({exc})") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"model: {str(path)!r} is not a JSON object")
    return cfg


def load_bert_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> BertModel:
    """Build the encoder of a HF safetensors directory, or of a llama.cpp `bert` GGUF file
    (loader/gguf_bert.py), and load its body weights."""
    if Path(model_dir).suffix == ".gguf":
        return _load_bert_gguf(Path(model_dir), dtype, device)
    cfg = read_hf_config(model_dir)
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in ENCODER_ONLY_ARCHITECTURES:
        raise ValueError(
            f"model: architecture {arch!r} is not a BERT-family encoder; supported: "
            f"{', '.join(sorted(ENCODER_ONLY_ARCHITECTURES))}"
        )
    model = BertModel(BertArchConfig.from_hf(cfg))
    model.load_hf_weights(list(iterate_safetensors(Path(model_dir))))
    return model.to(device=device, dtype=dtype).eval()


def _load_bert_gguf(path: Path, dtype: torch.dtype, device: str | torch.device) -> BertModel:
    from paged.runner.loader.gguf_bert import bert_hf_config, iterate_bert_gguf
    from paged.runner.loader.gguf_config import open_gguf

    reader = open_gguf(path)
    model = BertModel(BertArchConfig.from_hf(bert_hf_config(reader, path).to_dict()))
    model.load_hf_weights(iterate_bert_gguf(reader, path))
    return model.to(device=device, dtype=dtype).eval()
