"""Opt-in cProfile of the API server's event-loop thread (`PAGED_API_PROFILE=PATH`).

Everything the API process does per request and per output token (HTTP
parsing, the output handler, detokenization, SSE encoding, uvicorn's writes)
runs on the thread that runs the asyncio loop; this profiles that thread for
the server's lifetime and writes, at exit, the functions sorted by own time
and by cumulative time (text, `pstats` format) plus the raw stats beside it
(`PATH.pstats`). cProfile makes Python calls slower (roughly 1.5-2x on this
code), so use it for where the time goes, and process CPU for how much.

The report is written when `uvicorn.run()` returns or raises: stop the server
with SIGINT (Ctrl-C; uvicorn re-raises it as KeyboardInterrupt), as
`benchmarks/cpu_vs_llamacpp.py` does. SIGTERM's re-raise ends the process
before any `finally` runs, so no report is written then.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import logging
import os
import pstats
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)
ENV_VAR = "PAGED_API_PROFILE"
_TOP = 60


@contextlib.contextmanager
def maybe_profile() -> Iterator[None]:
    """Profile the body on this thread when `PAGED_API_PROFILE` names a file."""
    path = os.environ.get(ENV_VAR)
    if not path:
        yield
        return
    logger.warning("API server profile on (cProfile of the event loop): written to %s", path)
    profiler = cProfile.Profile()
    cpu0, wall0 = time.process_time(), time.monotonic()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        write_report(profiler, path, time.process_time() - cpu0, time.monotonic() - wall0)


def write_report(profiler: cProfile.Profile, path: str, cpu_s: float, wall_s: float) -> None:
    profiler.dump_stats(path + ".pstats")
    out = io.StringIO()
    out.write(f"process CPU {cpu_s:.2f} s over {wall_s:.2f} s wall (all threads)\n")
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(_TOP)
    stats.sort_stats("cumulative").print_stats(_TOP)
    with open(path, "w") as f:
        f.write(out.getvalue())
