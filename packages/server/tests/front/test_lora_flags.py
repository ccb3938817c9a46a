"""LoRA flags (vLLM 0.33's names and parsing), checked before anything loads; the gauge;
offline `LLM.generate(lora_request=...)`.

vLLM 0.33: vllm/engine/arg_utils.py:694-706, 1603-1630, 2691-2711 (flags, LoRAConfig);
vllm/entrypoints/common/cli_args.py:38-69 (--lora-modules); vllm/config/lora.py:121-126
(max_cpu_loras >= max_loras); vllm/v1/metrics/loggers.py:1086-1112, 1224-1236 (gauge).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from paged.runner.lora.config import LoRAConfig
from paged.scheduler import SamplingParams, SchedulerStats
from paged.server import LoRARequest, serve
from paged.server.cli import build_parser, engine_args_from, main
from paged.server.compat_cli import frontend_options_from
from paged.server.engine_args import EngineArgs
from paged.server.llm import LLM
from paged.server.lora import LoRAModulePath, parse_lora_modules
from paged.server.metrics import PrometheusStatLogger
from paged.server.metrics_names import VLLM_NAMING

NO_MODEL = "/no/such/model"


def _exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_lora_modules_both_forms() -> None:
    modules = parse_lora_modules(
        [
            "sql=/loras/sql",
            '{"name": "chat", "path": "/loras/chat", "base_model_name": "base"}',
            "",
            "eq=/a=b",  # split at the first "=" only
        ]
    )
    assert modules == [
        LoRAModulePath("sql", "/loras/sql"),
        LoRAModulePath("chat", "/loras/chat", "base"),
        LoRAModulePath("eq", "/a=b"),
    ]


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("{not json", "Invalid JSON format for --lora-modules: {not json"),
        ('{"name": "a"}', "Invalid fields for --lora-modules"),
        ('{"name": "a", "path": "/p", "rank": 8}', "Invalid fields for --lora-modules"),
        ("[1, 2]", "Invalid fields for --lora-modules"),
        ("=/p", "name and path must not be empty"),
    ],
)
def test_bad_lora_modules_exit_2(
    item: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _exit_2(["serve", NO_MODEL, "--enable-lora", "--lora-modules", item], capsys)
    assert message in err


def test_a_name_given_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    err = _exit_2(["serve", "--lora-modules", "a=/x", "a=/y"], capsys)
    assert "adapter name(s) given twice: a" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-lora-rank", "7"], "invalid choice: 7"),
        (["--max-loras", "0"], "must be >= 1"),
        (["--lora-dtype", "int8"], "invalid choice: 'int8'"),
        (["--max-cpu-loras", "x"], "expected an integer"),
    ],
)
def test_bad_limits_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in _exit_2(["serve", NO_MODEL, "--enable-lora", *flags], capsys)


def test_flags_reach_engine_args_and_lora_config() -> None:
    ns = build_parser().parse_args(
        [
            *["serve", NO_MODEL, "--enable-lora", "--max-loras", "4", "--max-lora-rank", "64"],
            *["--max-cpu-loras", "8", "--lora-dtype", "bfloat16", "--lora-modules", "a=/x"],
        ]
    )
    args = engine_args_from(ns)
    assert args.lora_config() == LoRAConfig(
        max_loras=4, max_lora_rank=64, max_cpu_loras=8, lora_dtype="bfloat16"
    )
    assert frontend_options_from(ns).lora_modules == (LoRAModulePath("a", "/x"),)
    # vLLM's defaults; the limits mean nothing without --enable-lora.
    plain = engine_args_from(build_parser().parse_args(["serve", NO_MODEL, "--max-loras", "3"]))
    assert plain.lora_config() is None
    default = EngineArgs(enable_lora=True).lora_config()
    assert default == LoRAConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=None)
    # --max-cpu-loras <= 0: as --max-loras (vLLM's rule).
    assert EngineArgs(enable_lora=True, max_cpu_loras=0).lora_config() == default


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_loras": 4, "max_cpu_loras": 2}, r"max_cpu_loras \(2\) must be >= max_loras \(4\)"),
        ({"max_lora_rank": 7}, "max_lora_rank: must be one of"),
        ({"async_scheduling": True}, "enable_lora: not supported with async_scheduling"),
        ({"pipeline_parallel_size": 2}, "enable_lora: not supported with pipeline_parallel"),
    ],
)
def test_bad_combinations_fail_before_the_model_loads(kwargs: Any, message: str) -> None:
    # The model path does not exist: the LoRA check must come first.
    args = EngineArgs(model=NO_MODEL, device="cpu", enable_lora=True, **kwargs)
    with pytest.raises(ValueError, match=message):
        args.create_engine_config()


def test_lora_modules_checked_before_anything_loads(tmp_path: Path) -> None:
    served = EngineArgs(model=NO_MODEL, served_model_name="base", enable_lora=True)
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        serve.check_lora_modules(EngineArgs(), [LoRAModulePath("a", str(tmp_path))])
    with pytest.raises(ValueError, match="conflicts with the served base model name"):
        serve.check_lora_modules(served, [LoRAModulePath("base", str(tmp_path))])
    with pytest.raises(ValueError, match="does not exist"):
        serve.check_lora_modules(served, [LoRAModulePath("a", str(tmp_path / "nope"))])
    serve.check_lora_modules(served, [LoRAModulePath("a", str(tmp_path))])


def test_serve_refuses_lora_modules_without_enable_lora(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["serve", NO_MODEL, "--lora-modules", f"a={tmp_path}", "--port", "0"])
    assert code == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err


def test_lora_requests_info_gauge_under_both_namings() -> None:
    stats = SchedulerStats(
        running_lora_adapters={"sql": 2, "chat": 1}, waiting_lora_adapters={"big": 1}
    )
    vllm = PrometheusStatLogger("m", naming=VLLM_NAMING, max_loras=2)
    vllm.record(stats, None)
    text = generate_latest(vllm.registry).decode()
    assert (
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",'
        'waiting_lora_adapters="big"}'
    ) in text
    paged = PrometheusStatLogger("m", max_loras=1)
    paged.record(SchedulerStats(), None)
    text = generate_latest(paged.registry).decode()
    assert (
        'paged:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}'
    ) in text
    # Without --enable-lora the gauge does not exist (as vLLM).
    off = PrometheusStatLogger("m")
    off.record(stats, None)
    assert "lora_requests_info" not in generate_latest(off.registry).decode()


def test_lora_request_checks_as_vllm() -> None:
    with pytest.raises(ValueError, match="lora_int_id: must be > 0"):
        LoRARequest("a", 0, "/p")
    with pytest.raises(ValueError, match="lora_path: must not be empty"):
        LoRARequest("a", 1, "")
    # Equal by name, as vLLM's.
    assert LoRARequest("a", 1, "/p") == LoRARequest("a", 2, "/q")


class _SyncLoRAEngine:
    """Records add_lora calls; else the conftest fake engine."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[tuple[Any, ...]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def call_utility(self, method: str, *args: Any) -> Any:
        self.calls.append((method, *args))
        if args and str(args[1]).endswith("missing"):
            raise ValueError(f"{args[1]}: no adapter_config.json")
        return None


def test_offline_generate_one_or_a_list_of_lora_requests(
    tokenizer: Any, engine_cls: type[Any]
) -> None:
    engine = _SyncLoRAEngine(engine_cls())
    llm = LLM.from_engine_client(engine, tokenizer, max_model_len=64)
    a, b = LoRARequest("a", 1, "/loras/a"), LoRARequest("b", 2, "/loras/b")
    params = SamplingParams(max_tokens=2)
    outs = llm.generate(["hello", "world", "hello"], params, use_tqdm=False, lora_request=[a, b, a])
    assert len(outs) == 3
    assert [(r.lora_request, r.lora_path) for r in engine.added] == [
        ("a", "/loras/a"),
        ("b", "/loras/b"),
        ("a", "/loras/a"),
    ]
    # Each adapter loaded once, before its first request.
    assert engine.calls == [("add_lora", "a", "/loras/a", 1), ("add_lora", "b", "/loras/b", 2)]
    llm.generate("hello", params, use_tqdm=False, lora_request=a)
    assert engine.added[-1].lora_request == "a" and len(engine.calls) == 2
    with pytest.raises(ValueError, match="lora_request: got 1 for 2 prompts"):
        llm.generate(["x", "y"], params, use_tqdm=False, lora_request=[a])
    with pytest.raises(ValueError, match=r"no adapter_config\.json") as info:
        llm.generate("x", params, use_tqdm=False, lora_request=LoRARequest("m", 3, "/missing"))
    assert getattr(info.value, "param", None) == "lora_request"
