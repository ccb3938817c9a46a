"""vLLM 0.33's model and frontend flags that paged accepts as a vLLM user writes them.

    --model M                  the model (as the positional MODEL; both given must agree)
    --tokenizer-mode MODE      auto | hf (vLLM's HF modes); vLLM's others are refused here
    --trust-remote-code        accepted; paged runs no remote code (logged once)
    --generation-config SRC    auto | vllm | DIR: the sampling defaults requests fall back to
    --disable-log-stats        no engine statistics (scheduler stats, engine metrics)
    serve only:
    --chat-template T          a file path or an inline Jinja template
    --enable-log-requests      log each request (id and parameters; the prompt at DEBUG)
    --disable-log-requests     vLLM < 0.11's spelling of the default (logged as deprecated)
    --uvicorn-log-level L      uvicorn's log level (vLLM's choices)

Argparse only: every value is checked here, at parse time, so a bad one
exits 2 before anything loads.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from paged.server.generation_defaults import GENERATION_CONFIG_NAME
from paged.server.lora import LoRAModulePath

logger = logging.getLogger("paged.server.cli")

# vllm/config/model.py TokenizerMode (0.33.0): what each mode needs.
VLLM_TOKENIZER_MODES = (
    "auto",
    "hf",
    "alpamayo2_super",
    "mistral",
    "deepseek_v32",
    "deepseek_v4",
    "inkling",
    "kimi_k3",
    "cohere",
)
# "auto" picks mistral_common only for Mistral repos that ship it; paged loads the
# HF tokenizer (fast when there is one), which is vLLM's "hf".
SUPPORTED_TOKENIZER_MODES = ("auto", "hf")
# vllm/entrypoints/common/cli_args.py FrontendArgs.uvicorn_log_level (0.33.0).
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_JINJA_CHARS = "{}\n"  # vLLM's test for "this is a template, not a path"


@dataclass(frozen=True, slots=True)
class FrontendOptions:
    """The serve-only options of this module, as `run_server` takes them."""

    chat_template: str | None = None  # the template's text (already read from a file)
    enable_log_requests: bool = False
    uvicorn_log_level: str | None = None  # None: as --log-level
    # --lora-modules: adapters loaded at start-up (paged.server.lora_cli).
    lora_modules: tuple[LoRAModulePath, ...] = ()


def _tokenizer_mode(text: str) -> str:
    if text in SUPPORTED_TOKENIZER_MODES:
        return text
    if text in VLLM_TOKENIZER_MODES:
        raise argparse.ArgumentTypeError(
            f"tokenizer mode {text!r} is not supported by paged (it needs that model "
            f"family's own tokenizer library); use {' or '.join(SUPPORTED_TOKENIZER_MODES)}"
        )
    raise argparse.ArgumentTypeError(
        f"unknown tokenizer mode {text!r}; vLLM's are {', '.join(VLLM_TOKENIZER_MODES)} "
        f"(paged supports {', '.join(SUPPORTED_TOKENIZER_MODES)})"
    )


def _generation_config(text: str) -> str:
    if text in ("auto", "vllm"):
        return text
    directory = Path(text)
    if not directory.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither 'auto', 'vllm' nor a directory holding {GENERATION_CONFIG_NAME}"
        )
    if not (directory / GENERATION_CONFIG_NAME).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} holds no {GENERATION_CONFIG_NAME}")
    return text


def add_model_compat_args(group: argparse._ArgumentGroup) -> None:
    """vLLM's engine flags about the model (`serve`, `generate` and `chat`)."""
    group.add_argument(
        "--model",
        dest="model_flag",
        default=None,
        metavar="MODEL",
        help="the model, as the positional MODEL (vLLM's spelling; both given must agree)",
    )
    group.add_argument(
        "--tokenizer-mode",
        type=_tokenizer_mode,
        default="auto",
        metavar="{auto,hf}",
        help="auto or hf: the Hugging Face tokenizer (fast when there is one); vLLM's "
        "mistral, deepseek_v32, ... modes are refused",
    )
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM command lines; paged runs no model code from the checkpoint",
    )
    group.add_argument(
        "--generation-config",
        type=_generation_config,
        default="auto",
        metavar="{auto,vllm,DIR}",
        help="auto (default): the model's generation_config.json sets the defaults of "
        "temperature, top_p, top_k, min_p, repetition/presence/frequency penalties and "
        "max_tokens for requests that omit them; vllm: ignore it; DIR: read it from DIR "
        "(its max_new_tokens then also caps every request's max_tokens)",
    )
    group.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="collect no engine statistics (the engine's /metrics series stay at zero)",
    )


def add_frontend_compat_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's frontend flags of `serve`."""
    g = parser.add_argument_group("vLLM frontend flags")
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="the chat template: a file, or the Jinja text itself (as vLLM: text with "
        "'{', '}' or a newline is a template, anything else must be a readable file)",
    )
    g.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each request: id and sampling parameters at INFO, the prompt at DEBUG",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help=argparse.SUPPRESS,  # vLLM < 0.11; 0.33 logs no requests by default
    )
    g.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=UVICORN_LOG_LEVELS,
        help="uvicorn's log level (default: --log-level's, info unless given)",
    )


def load_chat_template(value: str) -> str:
    """`--chat-template`'s text: the file's contents, or `value` itself if it is Jinja.

    vLLM 0.33 (renderers/chat_utils/chat_template.py): a value that opens as a
    file is read; one that does not, yet has none of '{', '}', newline, is a
    path that failed (vLLM then tries its built-in templates, which paged
    does not ship) and is refused; anything else is the template itself.
    """
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(
                f"--chat-template {value!r} looks like a file path, but it could not be "
                f"opened: {e.strerror or e}"
            ) from None
        return value


def check_compat_args(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """Merge `--model` into MODEL and check what one flag alone cannot (exit 2)."""
    flag = getattr(ns, "model_flag", None)
    if flag is not None:
        if ns.model is not None and ns.model != flag:
            parser.error(f"MODEL {ns.model!r} and --model {flag!r} differ; give one")
        ns.model = flag
    if getattr(ns, "chat_template", None) is not None:
        try:
            ns.chat_template = load_chat_template(ns.chat_template)
        except ValueError as e:
            parser.error(str(e))
    if getattr(ns, "disable_log_requests", False):
        if ns.enable_log_requests:
            parser.error("--disable-log-requests and --enable-log-requests contradict")
        logger.warning(
            "--disable-log-requests is deprecated (removed in vLLM 0.11): requests are "
            "not logged unless --enable-log-requests is given"
        )
    if getattr(ns, "trust_remote_code", False):
        logger.info(
            "--trust-remote-code: accepted, but paged runs no code from the checkpoint; "
            "the model loads with paged's own implementation"
        )


def frontend_options_from(ns: argparse.Namespace) -> FrontendOptions:
    return FrontendOptions(
        chat_template=ns.chat_template,
        enable_log_requests=ns.enable_log_requests,
        uvicorn_log_level=ns.uvicorn_log_level,
        lora_modules=tuple(getattr(ns, "lora_modules", None) or ()),
    )
