"""--allowed-media-domains and vLLM's media env vars: parsed, mapped, checked before loading."""

from __future__ import annotations

import pytest

from paged.server.cli import build_parser, engine_args_from, main
from paged.server.engine_args import EngineArgs


def test_flag_maps_to_engine_args_and_policy() -> None:
    ns = build_parser().parse_args(
        ["serve", "m", "--allowed-media-domains", "upload.wikimedia.org", "Img.Example.com"]
    )
    args = engine_args_from(ns)
    assert args.allowed_media_domains == ["upload.wikimedia.org", "Img.Example.com"]
    exposed = args.media_url_policy("0.0.0.0")
    assert exposed.allowed_domains == frozenset({"upload.wikimedia.org", "img.example.com"})
    assert exposed.block_private
    assert not args.media_url_policy("127.0.0.1").block_private  # loopback: vLLM's behaviour
    assert not args.media_url_policy(None).block_private  # in-process LLM
    default = engine_args_from(build_parser().parse_args(["serve"]))
    assert default.allowed_media_domains is None
    assert default.media_url_policy("0.0.0.0").allowed_domains is None


@pytest.mark.parametrize(
    "domains,match",
    [(["https://img.example.com"], "not a bare hostname"), ([""], "empty entry")],
)
def test_bad_domains_fail_in_engine_core_options(domains: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(allowed_media_domains=domains).engine_core_options()


@pytest.mark.parametrize(
    "name,value,match",
    [
        ("VLLM_IMAGE_FETCH_TIMEOUT", "soon", "VLLM_IMAGE_FETCH_TIMEOUT must be a number"),
        ("VLLM_IMAGE_FETCH_TIMEOUT", "0", "VLLM_IMAGE_FETCH_TIMEOUT must be a number"),
        ("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "yes", "VLLM_MEDIA_URL_ALLOW_REDIRECTS must be 0 or 1"),
    ],
)
def test_bad_media_env_fails_in_engine_core_options(
    name: str, value: str, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        EngineArgs().engine_core_options()


def test_media_env_is_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineArgs().media_limits().fetch_timeout_s == 5.0  # vLLM's default
    assert EngineArgs().media_url_policy().allow_redirects
    monkeypatch.setenv("VLLM_IMAGE_FETCH_TIMEOUT", "12")
    monkeypatch.setenv("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")
    assert EngineArgs().media_limits().fetch_timeout_s == 12.0
    assert not EngineArgs().media_url_policy("0.0.0.0").allow_redirects


def test_serve_with_a_bad_domain_is_a_clean_error_before_the_model_loads(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_load(self: EngineArgs) -> None:
        raise AssertionError("the model was loaded with a bad --allowed-media-domains")

    monkeypatch.setattr(EngineArgs, "create_engine_config", no_load)
    argv = ["serve", "--device", "cpu", "--allowed-media-domains", "https://img.example.com/"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "paged serve: error: allowed_media_domains entry 'https://img.example.com/'" in err
    assert "Traceback" not in err
