"""Set-up shared by the connector end-to-end tests (KV offloading, storage, P/D, EPD, Redis).

A small engine on CPU (8-token blocks, 4 MiB of KV, 128 tokens of context),
offline as `LLM` or as `paged serve` flags; a greedy run of one token prompt
and what it found cached; the connector configs the tests start engines
with; and `paged proxy` as a process. The live `paged serve` processes
themselves come from conftest's `launch_server`.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from paged.scheduler.sampling_params import SamplingParams
from paged.server.input_processor import TokensPrompt
from paged.server.llm import LLM
from tests.conftest import _free_port, _paged_command

BLOCK = 8
MAX_TOKENS = 6


def small_cpu_llm(model: Path, **options: Any) -> LLM:
    """An offline engine on CPU with `BLOCK`-token blocks, 4 MiB of KV, 128 tokens of context.

    `options`: more `EngineArgs` (`kv_transfer_config`, ...).
    """
    return LLM(
        str(model),
        device="cpu",
        block_size=BLOCK,
        kv_cache_memory_bytes=4 << 20,
        max_model_len=128,
        **options,
    )


@contextmanager
def small_cpu_engine(model: Path, **options: Any) -> Iterator[LLM]:
    """`small_cpu_llm`, its engine shut down on leaving the block (a disk writer flushes)."""
    llm = small_cpu_llm(model, **options)
    try:
        yield llm
    finally:
        llm.engine_client.shutdown()


def small_cpu_serve_args(model: Path) -> list[str]:
    """`paged serve` flags for the engine `small_cpu_llm` builds offline."""
    return [str(model), "--device", "cpu", "--block-size", str(BLOCK),
            "--max-model-len", "128", "--kv-cache-memory", "4MiB"]  # fmt: skip


def greedy(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    """`MAX_TOKENS` greedy tokens for the token prompt, and how many prompt tokens were cached."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens: TokensPrompt = {"prompt_token_ids": prompt}
    (out,) = llm.generate([tokens], params, use_tqdm=False)
    return list(out.outputs[0].token_ids), out.num_cached_tokens


def greedy_body(model: Path, prompt: list[int]) -> dict[str, Any]:
    """The /v1/completions body of `greedy` over HTTP."""
    return {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip


def complete(base_url: str, body: dict[str, Any]) -> tuple[str, int]:
    """POST /v1/completions: the text and the prompt tokens the server found cached."""
    with httpx.Client(base_url=base_url, timeout=300) as client:
        resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def scheduler_connector(llm: LLM) -> Any:
    """The KV connector on the scheduler side of an offline engine (it runs in this process)."""
    client: Any = llm.engine_client
    return client.core.kv_connector


def offloading_config(extra: dict[str, Any]) -> dict[str, Any]:
    """An OffloadingConnector `kv_transfer_config` whose extra config is `extra`."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def shared_storage_config(path: Path) -> dict[str, Any]:
    """A SharedStorageConnector `kv_transfer_config` over the directory `path`."""
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def zmq_config(role: str, side_port: int | None = None, **extra: Any) -> str:
    """A PagedZmqConnector `--kv-transfer-config` for a P/D role (a free side port if None)."""
    return json.dumps(
        {
            "kv_connector": "PagedZmqConnector",
            "kv_role": role,
            "kv_connector_extra_config": {
                "side_channel_host": "127.0.0.1",
                "side_channel_port": _free_port() if side_port is None else side_port,
                **extra,
            },
        }
    )


def metric_total(text: str, name: str, **labels: str) -> float:
    """The sum of a /metrics series' samples with these labels; AssertionError if there is none."""
    total, found = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"no {name} {labels} in /metrics"
    return total


@dataclass
class Proxy:
    """A running `paged proxy` process."""

    process: subprocess.Popen[str]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def start_proxy(tmp: Path, *args: str) -> Proxy:
    """`paged proxy --port FREE *args`, once it answers /health (its log under `tmp`)."""
    port = _free_port()
    log_path = tmp / f"proxy-{port}.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [*_paged_command(), "proxy", "--port", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
    proxy = Proxy(process, port, log_path)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"paged proxy exited:\n{log_path.read_text()}")
        try:
            httpx.get(proxy.base_url + "/health", timeout=2)
            return proxy
        except httpx.HTTPError:
            time.sleep(0.3)
    process.kill()
    raise RuntimeError("paged proxy did not start")
