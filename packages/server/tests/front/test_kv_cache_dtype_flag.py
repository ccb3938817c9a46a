"""`--kv-cache-dtype` (vLLM's flag): parsed, mapped, and refused before any model loads."""

from __future__ import annotations

import pytest

from paged.server.cli import build_parser, engine_args_from, main
from paged.server.engine_args import EngineArgs


@pytest.mark.parametrize("name", ["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"])
def test_built_dtypes_parse_and_reach_engine_args(name: str) -> None:
    ns = build_parser().parse_args(["serve", "--kv-cache-dtype", name])
    assert engine_args_from(ns).kv_cache_dtype == name


def test_default_is_auto() -> None:
    assert engine_args_from(build_parser().parse_args(["serve"])).kv_cache_dtype == "auto"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("fp8_inc", "'fp8_inc' is a vLLM 0.33 KV cache format that paged does not build"),
        ("fp8_ds_mla", "'fp8_ds_mla' is a vLLM 0.33 KV cache format that paged does not build"),
        ("fp9", "'fp9' is not a KV cache dtype; use one of auto, float16, bfloat16, fp8"),
    ],
)
def test_unbuilt_or_unknown_dtypes_exit_2_at_parse_time(
    name: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The model path does not exist: the flag must fail first, before anything loads.
    with pytest.raises(SystemExit) as exited:
        main(["generate", "/nonexistent/model.gguf", "-p", "hi", "--kv-cache-dtype", name])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "argument --kv-cache-dtype" in err and message in err and "Traceback" not in err


def test_engine_args_refuse_before_the_model_loads() -> None:
    args = EngineArgs(model="/nonexistent/model.gguf", device="cpu", kv_cache_dtype="fp8_inc")
    with pytest.raises(ValueError, match=r"kv_cache_dtype: 'fp8_inc' is a vLLM 0\.33"):
        args.create_engine_config()


def test_engine_config_carries_the_cache_dtype() -> None:
    config = EngineArgs(
        device="cpu", max_model_len=256, kv_cache_dtype="fp8"
    ).create_engine_config()
    assert config.cache_config.cache_dtype == "fp8"


def test_fp8_cache_with_a_kv_connector_is_refused_before_loading() -> None:
    args = EngineArgs(
        model="/nonexistent/model.gguf",
        device="cpu",
        kv_cache_dtype="fp8",
        kv_offloading_size=1.0,
    )
    with pytest.raises(ValueError, match="not supported with a KV connector"):
        args.create_engine_config()
