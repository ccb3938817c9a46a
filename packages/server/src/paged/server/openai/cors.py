"""CORS for the API, configured with vLLM's flags and off unless asked for.

vLLM's `--allowed-origins`, `--allowed-methods`, `--allowed-headers` take a
JSON list of strings (`'["https://a.example"]'`) and `--allow-credentials` is
a switch. vLLM always installs Starlette's `CORSMiddleware` with origins
`["*"]` by default, so any web page may call a vLLM server from a browser;
paged sends no CORS headers until `--allowed-origins` names at least one
origin (`'["*"]'` gives vLLM's default). Methods and headers default to
`["*"]` as in vLLM.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI reads these flags without loading the web stack
    from fastapi import FastAPI

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CorsConfig:
    """What cross-origin browser requests may do; no origins means CORS is off."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_origins)


def parse_json_list(text: str, flag: str) -> tuple[str, ...]:
    """A flag's JSON list of strings, e.g. `'["GET", "POST"]'`; ValueError naming `flag`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} must be a JSON list of strings, got {text!r}: {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{flag} must be a JSON list of strings, got {text!r}")
    return tuple(value)


def _json_list_type(flag: str) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        try:
            return parse_json_list(text, flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def add_cors_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's CORS flags, under their vLLM names."""
    g = parser.add_argument_group("CORS (off unless --allowed-origins is given)")
    g.add_argument(
        "--allowed-origins",
        type=_json_list_type("--allowed-origins"),
        default=(),
        metavar="JSON",
        help="origins browsers may call from, e.g. '[\"https://app.example\"]' or '[\"*\"]' "
        '(default: none, no CORS headers; vLLM\'s default is ["*"])',
    )
    g.add_argument(
        "--allowed-methods",
        type=_json_list_type("--allowed-methods"),
        default=("*",),
        metavar="JSON",
        help='HTTP methods allowed cross-origin (default: ["*"])',
    )
    g.add_argument(
        "--allowed-headers",
        type=_json_list_type("--allowed-headers"),
        default=("*",),
        metavar="JSON",
        help='request headers allowed cross-origin (default: ["*"])',
    )
    g.add_argument(
        "--allow-credentials",
        action="store_true",
        help="allow cookies and Authorization on cross-origin requests",
    )


def cors_config_from(ns: argparse.Namespace) -> CorsConfig:
    config = CorsConfig(
        allowed_origins=tuple(ns.allowed_origins),
        allowed_methods=tuple(ns.allowed_methods),
        allowed_headers=tuple(ns.allowed_headers),
        allow_credentials=bool(ns.allow_credentials),
    )
    customised = (
        config.allow_credentials
        or config.allowed_methods != ("*",)
        or config.allowed_headers != ("*",)
    )
    if customised and not config.enabled:
        logger.warning("CORS options are set but --allowed-origins is not: CORS stays off")
    return config


def install_cors(app: FastAPI, config: CorsConfig | None) -> None:
    """Put Starlette's CORSMiddleware in front of `app` when `config` is enabled.

    Call it after every other middleware is added: the last one added runs
    first, so preflight requests are answered before the API-key check (a
    browser sends no credentials on a preflight) and error responses carry
    the CORS headers a page needs to read them.
    """
    if config is None or not config.enabled:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(config.allowed_origins),
        allow_methods=list(config.allowed_methods),
        allow_headers=list(config.allowed_headers),
        allow_credentials=config.allow_credentials,
    )
