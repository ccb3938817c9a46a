"""vLLM's --hf-overrides on `paged serve`: both spellings carried to the engine args, a
value that is not a JSON object refused at parse time (exit 2, nothing loads)."""

from __future__ import annotations

from typing import Any

import pytest

from paged.server import serve
from paged.server.cli import main
from paged.server.engine_args import EngineArgs

RERANKER = (
    '{"architectures": ["Qwen3ForSequenceClassification"], '
    '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'
)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What `paged serve ...` hands to run_server (nothing loads)."""
    seen: dict[str, Any] = {}

    def fake_run_server(args: EngineArgs, **kw: Any) -> None:
        seen.update(kw, args=args)

    monkeypatch.setattr(serve, "run_server", fake_run_server)
    return seen


@pytest.mark.parametrize("flag", ["--hf-overrides", "--hf_overrides"])
def test_hf_overrides_reach_the_engine_args(served: dict[str, Any], flag: str) -> None:
    assert main(["serve", "/m", "--runner", "pooling", flag, RERANKER]) == 0
    assert served["args"].hf_overrides == RERANKER
    assert main(["serve", "/m"]) == 0
    assert served["args"].hf_overrides is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{architectures", "hf_overrides: not valid JSON"),
        ("[1, 2]", "hf_overrides: must be a JSON object"),
        ('{"architectures": "Qwen3ForSequenceClassification"}', "'architectures' must be"),
    ],
)
def test_bad_hf_overrides_exit_2(
    served: dict[str, Any], capsys: pytest.CaptureFixture[str], value: str, message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "/m", "--hf-overrides", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--hf-overrides" in err and message in err
    assert served == {}  # nothing started


@pytest.mark.parametrize(
    ("flag", "name"), [("--hf-overrides", "hf_overrides"), ("--pooler-config", "pooler_config")]
)
@pytest.mark.parametrize(("value", "got"), [("[1, 2]", "list"), ('"text"', "str"), ("3", "int")])
def test_json_object_flags_refuse_other_json_alike(
    served: dict[str, Any],
    capsys: pytest.CaptureFixture[str],
    flag: str,
    name: str,
    value: str,
    got: str,
) -> None:
    # One parser (paged.runner.json_flag) for both flags: the same message, naming the flag.
    with pytest.raises(SystemExit) as info:
        main(["serve", "/m", flag, value])
    assert info.value.code == 2
    assert f"{name}: must be a JSON object, got {got}" in capsys.readouterr().err
    assert served == {}  # nothing started
