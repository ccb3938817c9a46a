"""Speculative decoding: n-gram and draft-model proposers, exact rejection sampling."""

from paged.runner.spec_decode.config import SpeculativeConfig, parse_speculative_config

__all__ = ["SpeculativeConfig", "parse_speculative_config"]
