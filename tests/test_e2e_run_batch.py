"""End to end: `paged run-batch` on the default model, good and bad lines in one file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def _paged() -> list[str]:
    script = Path(sys.executable).with_name("paged")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "paged.server.cli"]


def _chat(custom_id: str, question: str, **extra: object) -> dict[str, object]:
    body = {
        **extra,
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
    }
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def test_run_batch_file_with_bad_lines(tmp_path: Path) -> None:
    lines = [
        json.dumps(_chat("capital", "What is the capital of France?")),
        "{this is not json",
        json.dumps({**_chat("nowhere", "hi"), "url": "/v1/unknown"}),
        json.dumps(
            {
                "custom_id": "cmpl",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": "One, two,", "max_tokens": 4, "temperature": 0},
            }
        ),
        json.dumps({**_chat("bad-body", "hi"), "body": {"messages": "not a list"}}),
    ]
    guided = _chat("guided", "Is the sky blue?", structured_outputs={"choice": ["yes", "no"]})
    lines.append(json.dumps(guided))
    src, dst = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text("\n".join(lines) + "\n")
    cmd = [*_paged(), "run-batch", "-i", str(src), "-o", str(dst)]
    cmd += ["--max-model-len", "512", "--kv-cache-memory", "128MiB"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Running batch" in done.stderr  # the progress bar
    outs = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [o["custom_id"] for o in outs] == [
        "capital", None, "nowhere", "cmpl", "bad-body", "guided"
    ]  # fmt: skip
    codes = [o["response"]["status_code"] for o in outs]
    assert codes == [200, 400, 400, 200, 400, 200]
    chat = outs[0]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["model"] == MODEL
    assert "Paris" in chat["choices"][0]["message"]["content"]
    assert outs[3]["response"]["body"]["choices"][0]["text"]
    assert outs[5]["response"]["body"]["choices"][0]["message"]["content"] in ("yes", "no")
    assert "not a supported endpoint" in outs[2]["error"]
    assert outs[4]["error"]["error"]["type"] == "invalid_request_error"
