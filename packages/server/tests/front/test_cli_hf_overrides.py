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
