"""PAGED_API_PROFILE: cProfile of the API server's loop thread, written when it exits."""

from __future__ import annotations

import pstats
from pathlib import Path

import pytest

from paged.server.api_profile import ENV_VAR, maybe_profile


def _busy() -> int:
    return sum(i * i for i in range(20_000))


def test_profile_written_with_the_profiled_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "api.txt"
    monkeypatch.setenv(ENV_VAR, str(path))
    with maybe_profile():
        _busy()
    report = path.read_text()
    assert report.startswith("process CPU ") and "_busy" in report
    raw = pstats.Stats(str(path) + ".pstats").stats  # type: ignore[attr-defined]
    assert any(func == "_busy" for (_file, _line, func) in raw)


def test_profile_written_when_the_body_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "api.txt"
    monkeypatch.setenv(ENV_VAR, str(path))
    with pytest.raises(KeyboardInterrupt), maybe_profile():
        raise KeyboardInterrupt
    assert path.exists()


def test_off_without_the_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    with maybe_profile():
        _busy()
    assert list(tmp_path.iterdir()) == []
