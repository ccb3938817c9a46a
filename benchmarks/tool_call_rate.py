"""How often the default model calls a tool when it should, and answers when it should not.

Starts `paged serve` on the default model (SmolLM2-135M-Instruct, whose chat
template ignores `tools`, so the generic tool format is used: the tools and an
example call in the system turn, the reply constrained to `{"tool_calls": [...]}`
or `{"response": "..."}`), or uses `--base-url` of a running server. Sends
`tool_choice: "auto"` requests with two tools under greedy decoding:

- should_call: 20 prompts that ask for the weather or the time in a city; a hit
  is a call of the right tool (`right_tool_rate`) and any call (`call_rate`);
  `city_in_arguments_rate`: the city of the prompt appears in the arguments.
- should_not_call: 20 prompts that need no tool (greetings, writing, facts); a
  hit is a plain answer (`answer_rate`).
- after_result: the should_call conversations continued with the right call and
  its result (`sunny, 21 C` / `14:05`) as a `tool` message; a hit is a plain
  answer (`answer_rate`) that uses the result (`uses_result_rate`: "sunny", "21"
  or "14:05" in it).

Run: .venvs/all/bin/python benchmarks/tool_call_rate.py [--base-url http://127.0.0.1:8000]
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "the city"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the current local time in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "the city"}},
                "required": ["city"],
            },
        },
    },
]
CITIES = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Cairo", "Sydney", "Lima", "Oslo"]
SHOULD_CALL: list[tuple[str, str, str]] = [
    *((f"What is the weather in {c}?", "get_weather", c) for c in CITIES[:5]),
    *((f"Is it raining in {c} right now?", "get_weather", c) for c in CITIES[5:]),
    *((f"What time is it in {c}?", "get_time", c) for c in CITIES[:5]),
    *((f"Tell me the current local time in {c}.", "get_time", c) for c in CITIES[5:]),
]
SHOULD_NOT_CALL = [
    "Hello!",
    "Hi, how are you?",
    "Thank you very much.",
    "Write a haiku about the sea.",
    "Tell me a joke.",
    "What is 2 + 2?",
    "What is the capital of France?",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "Give me a synonym for happy.",
    "What color is the sky?",
    "How many legs does a spider have?",
    "Write one sentence about dogs.",
    "What is your name?",
    "Can you help me?",
    "Spell the word cat.",
    "What is the opposite of hot?",
    "Name a fruit that is yellow.",
    "Say goodbye.",
    "What is the plural of mouse?",
]


RESULTS = {"get_weather": "sunny, 21 C", "get_time": "14:05"}


def _after_result(prompt: str, tool: str, city: str) -> list[dict[str, Any]]:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": tool, "arguments": json.dumps({"city": city})},
    }
    return [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": RESULTS[tool]},
    ]


async def _ask(client: httpx.AsyncClient, prompt: str | list[dict[str, Any]]) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = {
        "messages": messages,
        "tools": TOOLS,
        "temperature": 0,
        "max_tokens": 96,
    }
    resp = await client.post("/v1/chat/completions", json=body, timeout=600)
    resp.raise_for_status()
    message: dict[str, Any] = resp.json()["choices"][0]["message"]
    return message


def _calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for call in message.get("tool_calls") or []:
        out.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
    return out


async def measure(base_url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base_url) as client:
        prompts: list[str | list[dict[str, Any]]] = [p for p, _, _ in SHOULD_CALL]
        prompts += SHOULD_NOT_CALL
        t0 = time.perf_counter()
        messages = await asyncio.gather(*(_ask(client, p) for p in prompts))
        followups = await asyncio.gather(*(_ask(client, _after_result(*x)) for x in SHOULD_CALL))
        elapsed = time.perf_counter() - t0
    call_msgs, plain_msgs = messages[: len(SHOULD_CALL)], messages[len(SHOULD_CALL) :]
    answers = [m.get("content") or "" for m in followups if not m.get("tool_calls")]
    used = sum(any(w in a for w in ("sunny", "21", "14:05")) for a in answers)
    called = right = city = 0
    examples: list[dict[str, Any]] = []
    for (prompt, tool, c), message in zip(SHOULD_CALL, call_msgs, strict=True):
        calls = _calls(message)
        called += bool(calls)
        right += any(name == tool for name, _ in calls)
        city += any(c.lower() in json.dumps(args).lower() for _, args in calls)
        if len(examples) < 3:
            examples.append({"prompt": prompt, "calls": calls, "content": message["content"]})
    answered = sum(not message.get("tool_calls") for message in plain_msgs)
    wrong = [
        {"prompt": p, "calls": _calls(m)}
        for p, m in zip(SHOULD_NOT_CALL, plain_msgs, strict=True)
        if m.get("tool_calls")
    ]
    n_call, n_not = len(SHOULD_CALL), len(SHOULD_NOT_CALL)
    return {
        "should_call": {
            "prompts": n_call,
            "call_rate": called / n_call,
            "right_tool_rate": right / n_call,
            "city_in_arguments_rate": city / n_call,
            "examples": examples,
        },
        "should_not_call": {
            "prompts": n_not,
            "answer_rate": answered / n_not,
            "called_anyway": wrong[:5],
            "answer_examples": [m["content"] for m in plain_msgs[:3]],
        },
        "after_result": {
            "prompts": n_call,
            "answer_rate": len(answers) / n_call,
            "uses_result_rate": used / n_call,
            "answer_examples": answers[:3],
        },
        "seconds": round(elapsed, 1),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve() -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    script = Path(sys.executable).with_name("paged")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "paged.server.cli"]
    fd, log_name = tempfile.mkstemp(prefix="paged-tool-rate-", suffix=".log")
    with os.fdopen(fd, "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [*cmd, "serve", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"paged serve exited; see {log_name}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise SystemExit(f"paged serve did not start; see {log_name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--base-url", default=None, help="a running server (default: start one)")
    args = ap.parse_args()
    proc = None
    url = args.base_url
    if url is None:
        proc, url = _serve()
    try:
        result = asyncio.run(measure(url))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    print(json.dumps({"model": "default (SmolLM2-135M-Instruct)", **result}, indent=2))


if __name__ == "__main__":
    main()
