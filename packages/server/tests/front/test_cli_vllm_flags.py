"""vLLM 0.33's model and frontend flags on `paged serve/generate/chat` (compat_cli.py):
accepted or refused at parse time, and carried to where they act."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from paged.server import serve
from paged.server.cli import build_parser, engine_args_from, main
from paged.server.compat_cli import FrontendOptions
from paged.server.engine_args import EngineArgs

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What `paged serve ...` hands to run_server (nothing loads)."""
    seen: dict[str, Any] = {}

    def fake_run_server(args: EngineArgs, **kw: Any) -> None:
        seen.update(kw, args=args)

    monkeypatch.setattr(serve, "run_server", fake_run_server)
    return seen


def _exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


# -- --model -------------------------------------------------------------------------
def test_model_flag_is_the_positional(served: dict[str, Any]) -> None:
    assert main(["serve", "--model", "/m"]) == 0
    assert served["args"].model == "/m"
    assert main(["serve", "/m", "--model", "/m"]) == 0  # the same twice: fine
    assert served["args"].model == "/m"
    assert main(["serve"]) == 0
    assert served["args"].model is None  # the default model


def test_model_flag_and_positional_that_differ_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    err = _exit_2(["serve", "/a", "--model", "/b"], capsys)
    assert "MODEL '/a' and --model '/b' differ" in err


def test_model_flag_on_generate() -> None:
    ns = build_parser().parse_args(["generate", "--model", "/m", "-p", "x"])
    assert ns.model_flag == "/m"


# -- --chat-template -----------------------------------------------------------------
def test_chat_template_from_a_file_or_inline(served: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert main(["serve", "--chat-template", str(path)]) == 0
    assert served["frontend"].chat_template == TEMPLATE
    assert main(["serve", "--chat-template", TEMPLATE]) == 0  # Jinja text: itself
    assert served["frontend"].chat_template == TEMPLATE
    assert main(["serve"]) == 0
    assert served["frontend"] == FrontendOptions()


def test_chat_template_path_that_does_not_open_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = str(tmp_path / "missing.jinja")
    err = _exit_2(["serve", "--chat-template", missing], capsys)
    assert "looks like a file path, but it could not be opened" in err


# -- --trust-remote-code -------------------------------------------------------------
def test_trust_remote_code_is_accepted_and_logged(
    served: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="paged.server.cli"):
        assert main(["serve", "--trust-remote-code"]) == 0
    assert served["args"].trust_remote_code is True
    notes = [r for r in caplog.records if "--trust-remote-code" in r.getMessage()]
    assert len(notes) == 1 and "runs no code from the checkpoint" in notes[0].getMessage()


# -- request logging -----------------------------------------------------------------
def test_log_requests_flags(
    served: dict[str, Any], caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve"]) == 0
    assert served["frontend"].enable_log_requests is False  # vLLM 0.33's default
    assert main(["serve", "--enable-log-requests"]) == 0
    assert served["frontend"].enable_log_requests is True
    assert main(["serve", "--no-enable-log-requests"]) == 0
    assert served["frontend"].enable_log_requests is False
    with caplog.at_level(logging.WARNING, logger="paged.server.cli"):
        assert main(["serve", "--disable-log-requests"]) == 0
    assert served["frontend"].enable_log_requests is False
    assert any("--disable-log-requests is deprecated" in r.getMessage() for r in caplog.records)
    err = _exit_2(["serve", "--disable-log-requests", "--enable-log-requests"], capsys)
    assert "contradict" in err


def test_disable_log_stats_turns_engine_statistics_off(served: dict[str, Any]) -> None:
    assert main(["serve"]) == 0
    assert served["args"].engine_core_options()["log_stats"] is True
    assert main(["serve", "--disable-log-stats"]) == 0
    assert served["args"].disable_log_stats is True
    assert served["args"].engine_core_options()["log_stats"] is False


# -- --uvicorn-log-level -------------------------------------------------------------
@pytest.mark.parametrize("level", ["critical", "error", "warning", "info", "debug", "trace"])
def test_uvicorn_log_levels_of_vllm(served: dict[str, Any], level: str) -> None:
    assert main(["serve", "--uvicorn-log-level", level]) == 0
    assert served["frontend"].uvicorn_log_level == level


def test_unknown_uvicorn_log_level_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert "invalid choice: 'verbose'" in _exit_2(
        ["serve", "--uvicorn-log-level", "verbose"], capsys
    )


# -- --tokenizer-mode ----------------------------------------------------------------
@pytest.mark.parametrize("mode", ["auto", "hf"])
def test_tokenizer_modes_paged_honours(served: dict[str, Any], mode: str) -> None:
    assert main(["serve", "--tokenizer-mode", mode]) == 0
    assert served["args"].tokenizer_mode == mode


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("mistral", "tokenizer mode 'mistral' is not supported by paged"),
        ("deepseek_v32", "tokenizer mode 'deepseek_v32' is not supported by paged"),
        ("slow", "unknown tokenizer mode 'slow'"),  # gone from vLLM 0.33
    ],
)
def test_other_tokenizer_modes_exit_2(
    mode: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in _exit_2(["serve", "--tokenizer-mode", mode], capsys)


def test_llm_kwargs_are_checked_like_the_flags() -> None:
    with pytest.raises(ValueError, match="tokenizer_mode: 'mistral'"):
        EngineArgs(tokenizer_mode="mistral").engine_core_options()
    with pytest.raises(ValueError, match="generation_config: '/nowhere'"):
        EngineArgs(generation_config="/nowhere").engine_core_options()


# -- --generation-config -------------------------------------------------------------
def test_generation_config_values(served: dict[str, Any], tmp_path: Path) -> None:
    assert main(["serve"]) == 0
    assert served["args"].generation_config == "auto"  # vLLM's default
    assert main(["serve", "--generation-config", "vllm"]) == 0
    assert served["args"].generation_config == "vllm"
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.5}))
    assert main(["serve", "--generation-config", str(tmp_path)]) == 0
    assert served["args"].generation_config == str(tmp_path)
    assert served["args"].generation_defaults().sampling == {"temperature": 0.5}


def test_generation_config_dir_without_the_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _exit_2(["serve", "--generation-config", str(tmp_path)], capsys)
    assert "holds no generation_config.json" in err
    err = _exit_2(["serve", "--generation-config", str(tmp_path / "no")], capsys)
    assert "is neither 'auto', 'vllm' nor a directory" in err


def test_engine_args_from_carries_every_flag(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{}")
    ns = build_parser().parse_args(
        ["chat", "--model", "/m", "--tokenizer-mode", "hf", "--trust-remote-code",
         "--generation-config", str(tmp_path), "--disable-log-stats"]
    )  # fmt: skip
    args = engine_args_from(ns)
    assert (args.tokenizer_mode, args.trust_remote_code) == ("hf", True)
    assert (args.generation_config, args.disable_log_stats) == (str(tmp_path), True)
