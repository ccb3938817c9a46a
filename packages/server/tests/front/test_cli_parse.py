"""`paged` CLI: argument parsing, help text, option -> EngineArgs mapping, errors."""

from __future__ import annotations

import pytest

from paged.server.cli import build_parser, engine_args_from, main
from paged.server.engine_args import EngineArgs, parse_bytes


def test_serve_defaults() -> None:
    ns = build_parser().parse_args(["serve"])
    assert ns.command == "serve" and ns.host == "127.0.0.1" and ns.port == 8000
    args = engine_args_from(ns)
    assert args == EngineArgs()  # every engine default matches EngineArgs'
    assert args.model_name() == "SmolLM2-135M-Instruct"


def test_engine_options_map_to_engine_args() -> None:
    ns = build_parser().parse_args(
        [
            "serve", "/models/x.gguf", "--block-size", "32", "--kv-cache-memory", "512MiB",
            "--max-model-len", "1024", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
            "--no-enable-chunked-prefill", "--no-enable-prefix-caching", "-tp", "2",
            "--dtype", "bfloat16", "--seed", "3", "--device", "cpu", "--served-model-name", "x",
            "--api-key", "k", "--port", "9000", "--host", "0.0.0.0", "--cpu-weight-panels", "off",
        ]
    )  # fmt: skip
    a = engine_args_from(ns)
    assert (a.model, a.block_size, a.kv_cache_memory_bytes, a.max_model_len) == (
        "/models/x.gguf", 32, 512 << 20, 1024,
    )  # fmt: skip
    assert (a.max_num_seqs, a.max_num_batched_tokens) == (8, 256)
    assert not a.enable_chunked_prefill and not a.enable_prefix_caching
    assert (a.tensor_parallel_size, a.dtype, a.seed, a.device) == (2, "bfloat16", 3, "cpu")
    assert a.model_name() == "x" and ns.api_key == "k" and (ns.host, ns.port) == ("0.0.0.0", 9000)
    assert a.cpu_weight_panels == "off"


@pytest.mark.parametrize(
    ("text", "value"),
    [("1000", 1000), ("512MiB", 512 << 20), ("2GiB", 2 << 30), ("1.5G", 1_500_000_000)],
)
def test_parse_bytes(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1GiB", "3XB"])
def test_parse_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes(text)


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--block-size", "0"],
        ["serve", "--kv-cache-memory", "lots"],
        ["serve", "--dtype", "int3"],
        ["generate"],  # --prompt is required
        ["frobnicate"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_help_reads_well(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--api-key", "--block-size", "--kv-cache-memory",
                 "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                 "--enable-chunked-prefill", "--enable-prefix-caching",
                 "--tensor-parallel-size", "--dtype", "--seed"):  # fmt: skip
        assert flag in out
    assert "default 127.0.0.1" in out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    top = capsys.readouterr().out
    assert all(cmd in top for cmd in ("serve", "generate", "chat"))


def test_bad_model_path_is_a_clean_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "/nonexistent/model.gguf", "-p", "hi", "--device", "cpu"])
    assert code == 2
    err = capsys.readouterr().err
    assert "paged generate: error: model:" in err and "Traceback" not in err


def test_engine_config_carries_the_model_options() -> None:
    config = EngineArgs(
        device="cpu", max_model_len=256, enforce_eager=True, cpu_weight_panels="off"
    ).create_engine_config()
    model = config.model_config
    assert (model.device, model.max_model_len, model.enforce_eager) == ("cpu", 256, True)
    assert model.cpu_weight_panels == "off"
    with pytest.raises(ValueError, match="cpu_weight_panels"):
        EngineArgs(device="cpu", cpu_weight_panels="yes").create_engine_config()


def test_scheduler_limits_vllm_rejects_fail_in_create_engine_config() -> None:
    args = EngineArgs(device="cpu", max_num_seqs=300, max_num_batched_tokens=256)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(256\) must be greater"):
        args.create_engine_config()


def test_serve_with_bad_scheduler_limits_is_a_clean_error_before_any_spawn(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import paged.server.engine.client as client

    def no_spawn(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine core was started with limits it rejects")

    monkeypatch.setattr(client, "AsyncMPClient", no_spawn)
    argv = ["serve", "--device", "cpu", "--max-num-seqs", "300", "--max-num-batched-tokens", "256"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    expected = (
        "paged serve: error: max_num_batched_tokens (256) must be greater than or equal to "
        "max_num_seqs (300)."
    )
    assert expected in err and "Traceback" not in err


def test_multimodal_flags_map_to_engine_args_and_engine_options() -> None:
    ns = build_parser().parse_args(
        [
            "serve", "m", "--limit-mm-per-prompt", '{"image": 2}',
            "--allowed-local-media-path", "/srv/img", "--mm-processor-cache-type", "shm",
            "--mm-processor-cache-gb", "0.5", "--disable-chunked-mm-input",
        ]
    )  # fmt: skip
    a = engine_args_from(ns)
    assert a.limit_mm_per_prompt == '{"image": 2}' and a.allowed_local_media_path == "/srv/img"
    options = a.engine_core_options()["mm_options"]
    assert options.disable_chunked_mm_input
    cache = options.processor_cache
    assert (cache.cache_type, cache.cache_gb) == ("shm", 0.5) and cache.shm_prefix
    # Frontend and engine get the same shared-memory prefix from one EngineArgs.
    assert a.mm_engine_options().processor_cache.shm_prefix == cache.shm_prefix
    defaults = engine_args_from(build_parser().parse_args(["serve"]))
    assert (defaults.mm_processor_cache_type, defaults.mm_processor_cache_gb) == ("lru", 4.0)


@pytest.mark.parametrize(
    "value,match",
    [
        ("{image: 2}", "must be JSON"),
        ('{"image": -1}', "integer >= 0"),
        ("[2]", "JSON object"),
    ],
)
def test_bad_limit_mm_per_prompt_fails_before_loading(value: str, match: str) -> None:
    from paged.server.engine_args import EngineArgs

    with pytest.raises(ValueError, match=match):
        EngineArgs(limit_mm_per_prompt=value).engine_core_options()
