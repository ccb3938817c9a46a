"""How long `paged serve MODEL.gguf` takes to start, and where the time goes.

    # start-up: process start until /health answers (cpu_vs_llamacpp.py's startup_s),
    # alternated runs of this checkout and another copy of the source tree
    python benchmarks/startup_bench.py serve --gguf FILE.gguf --runs 3 --threads 2 \
        [--baseline-src /tmp/paged-base]

    # one in-process LLM(...) construction under cProfile: phases and top functions
    python benchmarks/startup_bench.py profile --gguf FILE.gguf --threads 2

--baseline-src is the root of another checkout (e.g. `git archive <commit> | tar -x -C
DIR`): its packages/*/src go first on PYTHONPATH, so the same environment runs the
older code. Each line printed is JSON: the wall time, the CPU time of paged's processes
(start-up and shutdown) and the load average taken before the run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

# (phase, function name as cProfile reports it): cumulative seconds of each.
PHASES = (
    ("model build + weight load", "load_model"),
    ("GGUF tensors decoded (old path: int4/int8 groups)", "int4_groups"),
    ("GGUF tensors decoded (old path: int8 groups)", "int8_groups"),
    ("layers finalised (pack to tiles)", "finish_quantized_load"),
    ("  fast path: repack from the file's bytes", "repack_gguf"),
    ("  old path: QGemm.int4", "int4"),
    ("  old path: QGemm.int8", "int8"),
    ("  old path: relative error vs the checkpoint", "_rel_error"),
    ("KV cache allocated", "allocate_kv_caches"),
    ("tokenizer", "load_tokenizer"),
    ("C kernels compiled / loaded", "load_qgemm"),
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def serve_once(
    gguf: str, threads: int, src: Path | None, log: Path, args: list[str]
) -> tuple[float, float]:
    """Seconds from launching `paged serve` until /health answers 200, and the CPU seconds
    its processes used (until they exited after SIGINT: start-up and shutdown; less
    sensitive than the wall time to other processes on the machine)."""
    cpu0 = _children_cpu()
    port = _free_port()
    paged = str(Path(sys.executable).parent / "paged")
    cmd = [paged, "serve", "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "32",
           "--max-model-len", "2048", gguf, *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    if src is not None:
        paths = sorted(str(p) for p in (src / "packages").glob("*/src"))
        env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(":")
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    try:
        while proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    wall = time.perf_counter() - t
                    _stop(proc)
                    return wall, _children_cpu() - cpu0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"paged serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cmd_serve(ns: argparse.Namespace) -> None:
    sides: list[tuple[str, Path | None]] = [("this", None)]
    if ns.baseline_src is not None:
        sides.append(("baseline", ns.baseline_src))
    times: dict[str, list[float]] = {name: [] for name, _ in sides}
    cpus: dict[str, list[float]] = {name: [] for name, _ in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(ns.runs):
            for name, src in sides if run % 2 == 0 else list(reversed(sides)):
                load = os.getloadavg()[0]
                log = Path(tmp) / f"{name}.log"
                s, cpu = serve_once(ns.gguf, ns.threads, src, log, ns.paged_args)
                times[name].append(s)
                cpus[name].append(cpu)
                print(json.dumps({"run": run, "side": name, "gguf": Path(ns.gguf).name,
                                  "threads": ns.threads, "startup_s": round(s, 2),
                                  "cpu_s": round(cpu, 2), "load_avg_1m": round(load, 2)}),
                      flush=True)  # fmt: skip
    print(json.dumps({"gguf": Path(ns.gguf).name, "median_startup_s": _medians(times),
                      "median_cpu_s": _medians(cpus)}), flush=True)  # fmt: skip


def _medians(values: dict[str, list[float]]) -> dict[str, float]:
    return {name: round(sorted(v)[len(v) // 2], 2) for name, v in values.items()}


def cmd_profile(ns: argparse.Namespace) -> None:
    os.environ["OMP_NUM_THREADS"] = str(ns.threads)
    from paged.server.llm import LLM

    profiler = cProfile.Profile()
    t = time.perf_counter()
    profiler.enable()
    llm = LLM(ns.gguf, max_model_len=2048, max_num_seqs=32)
    profiler.disable()
    total = time.perf_counter() - t
    stats = pstats.Stats(profiler)
    cumulative: dict[str, float] = {}
    for (_, _, func), row in stats.stats.items():  # type: ignore[attr-defined]
        cumulative[func] = cumulative.get(func, 0.0) + row[3]
    phases: dict[str, Any] = {label: round(cumulative.get(f, 0.0), 2) for label, f in PHASES}
    line = {"gguf": Path(ns.gguf).name, "threads": ns.threads,
            "llm_construct_s": round(total, 2), "phases_s": phases}  # fmt: skip
    print(json.dumps(line), flush=True)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(ns.top)
    print(out.getvalue())
    del llm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="time `paged serve` until /health answers")
    profile = sub.add_parser("profile", help="cProfile one in-process LLM(...) construction")
    for p in (serve, profile):
        p.add_argument("--gguf", required=True)
        p.add_argument("--threads", type=int, default=2)
    serve.add_argument("--runs", type=int, default=3)
    serve.add_argument("--baseline-src", type=Path, default=None)
    serve.add_argument("--paged-args", nargs=argparse.REMAINDER, default=[])
    profile.add_argument("--top", type=int, default=40)
    ns = parser.parse_args()
    cmd_serve(ns) if ns.command == "serve" else cmd_profile(ns)


if __name__ == "__main__":
    main()
