"""End to end: stopping `paged serve` stops its engine process too (SIGTERM or SIGKILL).

On SIGTERM, uvicorn re-raises the signal once the app has shut down, so
nothing after `uvicorn.run()` runs; the engine used to be left behind,
generating for minutes. The model is a tiny random Llama built here (no
download) with a long context, so its requests would run far longer than
the test waits.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from tests.conftest import LiveServer

pytestmark = pytest.mark.slow

CONTEXT = 8192
# uvicorn's graceful shutdown waits up to 5 s for in-flight requests; then
# the lifespan stops the engine (a second or two).
GONE_WITHIN_S = 15.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator(["hello world, tell me a long story about the sea"], trainer)
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _stream_forever(url: str, started: threading.Event) -> None:
    body = {"prompt": "tell me", "max_tokens": CONTEXT - 16, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    started.set()
    except httpx.HTTPError:
        pass  # the server went away, as it should


def test_sigterm_with_requests_in_flight_stops_the_engine(
    launch_server: Callable[..., LiveServer], tiny_model: Path
) -> None:
    server = launch_server(
        str(tiny_model), "--max-model-len", str(CONTEXT), "--kv-cache-memory", "64MiB"
    )
    (engine_pid,) = server.engine_pids()
    streams = [threading.Event() for _ in range(3)]
    threads = [
        threading.Thread(target=_stream_forever, args=(server.base_url, ev), daemon=True)
        for ev in streams
    ]
    for t in threads:
        t.start()
    for ev in streams:
        assert ev.wait(60), "generation never started"
    server.process.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    while _alive(engine_pid) and time.monotonic() - signalled < 4 * GONE_WITHIN_S:
        time.sleep(0.1)
    lived = time.monotonic() - signalled
    print(f"engine gone {lived:.2f}s after SIGTERM")
    try:
        assert not _alive(engine_pid), f"the engine outlived the server:\n{server.log()}"
        assert lived < GONE_WITHIN_S, f"the engine lived {lived:.1f}s after SIGTERM"
        server.process.wait(timeout=30)
        assert "stopping the engine" in server.log()
    finally:
        if _alive(engine_pid):
            import os

            os.kill(engine_pid, signal.SIGKILL)


def test_sigkill_of_the_api_process_stops_a_busy_engine(
    launch_server: Callable[..., LiveServer], tiny_model: Path
) -> None:
    server = launch_server(
        str(tiny_model), "--max-model-len", str(CONTEXT), "--kv-cache-memory", "64MiB"
    )
    (engine_pid,) = server.engine_pids()
    started = threading.Event()
    threading.Thread(target=_stream_forever, args=(server.base_url, started), daemon=True).start()
    assert started.wait(60), "generation never started"
    server.process.send_signal(signal.SIGKILL)  # no cleanup runs in the API process
    server.process.wait(timeout=30)
    killed = time.monotonic()
    while _alive(engine_pid) and time.monotonic() - killed < 30:
        time.sleep(0.02)
    lived = time.monotonic() - killed
    print(f"busy engine gone {lived:.2f}s after its API process was killed")
    try:
        assert lived < 3.0, f"the engine lived {lived:.1f}s after its API process"
    finally:
        if _alive(engine_pid):
            import os

            os.kill(engine_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
