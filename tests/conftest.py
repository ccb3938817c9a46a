"""Shared fixtures for the end-to-end tests: a live `paged serve` subprocess.

`launch_server(*args)` starts `paged serve` (the console script of this
environment, as the README runs it) on a free port of 127.0.0.1 with the
default model, waits until /health answers, and stops it at teardown.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import pytest

STARTUP_TIMEOUT_S = 600.0


@dataclass
class LiveServer:
    process: subprocess.Popen[str]
    port: int
    log_path: Path
    log_file: IO[str]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engine_pids(self) -> list[int]:
        """Pids of the engine-core process(es) this server spawned."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.process.pid and "spawn_main" in cmdline:
                pids.append(int(entry.name))
        return pids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _paged_command() -> list[str]:
    script = Path(sys.executable).with_name("paged")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "paged.server.cli"]


def start_server(tmp_dir: Path, *args: str) -> LiveServer:
    port = _free_port()
    log_path = tmp_dir / f"paged-serve-{port}.log"
    log = log_path.open("w")
    cmd = [*_paged_command(), "serve", "--port", str(port), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    server = LiveServer(process, port, log_path, log)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.close()
            raise RuntimeError(f"paged serve exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop_server(server)
    raise RuntimeError(f"paged serve did not start in {STARTUP_TIMEOUT_S}s:\n{server.log()}")


def stop_server(server: LiveServer) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGINT)
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=30)
    server.log_file.close()


@pytest.fixture(scope="module")
def launch_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., LiveServer]]:
    started: list[LiveServer] = []

    def launch(*args: str) -> LiveServer:
        server = start_server(tmp_path_factory.mktemp("serve"), *args)
        started.append(server)
        return server

    yield launch
    for server in started:
        stop_server(server)


def _build_tiny_word_llama(path: Path) -> Path:
    """A 2-layer random llama with a 128-word word-level tokenizer, saved to `path`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    config = AutoConfig.for_model(
        "llama",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    auto: Any = AutoModelForCausalLM
    auto.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    vocab = {f"w{i}": i for i in range(128)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast_cls: Any = PreTrainedTokenizerFast  # untyped in transformers
    fast = fast_cls(tokenizer_object=tk, bos_token="w1", eos_token="w2")
    fast.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_word_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny random llama for every test that wants it (read-only: built once)."""
    return _build_tiny_word_llama(tmp_path_factory.mktemp("tiny-word-llama"))
