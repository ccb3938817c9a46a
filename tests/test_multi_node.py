"""Multi-node TP/PP with the mp executor (no Ray), two "nodes" as two OS processes on loopback.

Node 0 is an `EngineCore` in this process (its executor starts rank 0 and
listens at 127.0.0.1:P+1); node 1 is `paged serve --headless --nnodes 2
--node-rank 1` through the CLI, holding rank 1. torch.distributed meets at
127.0.0.1:P (gloo, CPU, float32). Greedy tokens must equal one node's (TP=1 /
PP=1); a killed remote worker or headless process fails the engine's step
within seconds with `WorkerDiedError`; the headless node exits non-zero when
node 0's process dies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from paged.runner.config import EngineConfig, ModelConfig, ParallelConfig
from paged.runner.executor import MultiprocExecutor, WorkerDiedError
from paged.runner.executor.node_wire import free_port_pair
from paged.scheduler.boundary import EngineCoreRequest
from paged.scheduler.sampling_params import SamplingParams
from paged.server.engine.core import EngineCore
from tests.conftest import LiveServer, _paged_command
from tests.test_pipeline_parallel import PROMPTS, engine_config, generate, pp1, tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def one_thread_per_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both "nodes" share this machine: one torch thread per worker, not the cores each."""
    monkeypatch.setenv("PAGED_WORKER_NUM_THREADS", "1")


__all__ = ["pp1", "tiny_llama"]  # fixtures shared with test_pipeline_parallel

# test_pipeline_parallel.engine_config's settings, as `paged serve` flags (every node the same).
NODE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "64",
              "--block-size", "4", "--kv-cache-memory", "1MiB", "--max-num-seqs", "4",
              "--max-num-batched-tokens", "12"]  # fmt: skip


def start_headless(model: Path, log_dir: Path, port: int, flags: list[str]) -> LiveServer:
    """`paged serve --headless --nnodes 2 --node-rank 1` (node 1), its own OS process."""
    log_path = log_dir / f"node1-{port}.log"
    log = log_path.open("w")
    cmd = [*_paged_command(), "serve", str(model), *flags, "--nnodes", "2", "--node-rank", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(port), "--headless"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    return LiveServer(process, 0, log_path, log)


def stop_headless(node: LiveServer) -> None:
    if node.process.poll() is None:
        node.process.kill()
        node.process.wait(timeout=30)
    node.log_file.close()


def two_node_config(model: ModelConfig, port: int, tp: int = 1, pp: int = 1) -> EngineConfig:
    base = engine_config(model, tp=tp, pp=pp)
    parallel = ParallelConfig(
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        nnodes=2,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=port,
    )
    return EngineConfig(base.model_config, base.cache_config, parallel, base.scheduler_limits)


@pytest.fixture
def two_nodes(
    tiny_llama: Path, tmp_path: Path
) -> Iterator[Callable[..., tuple[EngineCore, LiveServer]]]:
    """start(tp=, pp=) -> (node 0's EngineCore here, node 1's headless process)."""
    started: list[tuple[EngineCore | None, LiveServer]] = []

    def start(tp: int = 1, pp: int = 1) -> tuple[EngineCore, LiveServer]:
        port = free_port_pair()
        node = start_headless(
            tiny_llama, tmp_path, port, [*NODE_FLAGS, "-tp", str(tp), "-pp", str(pp)]
        )
        started.append((None, node))
        model = ModelConfig.from_pretrained(str(tiny_llama), max_model_len=64)
        try:
            core = EngineCore(two_node_config(model, port, tp=tp, pp=pp))
        except BaseException:
            print(node.log())
            raise
        started[-1] = (core, node)
        return core, node

    yield start
    for core, node in started:
        if core is not None:
            core.shutdown()
        stop_headless(node)


def _step_forever(core: EngineCore) -> None:
    for _ in range(100_000):
        core.run_step()


def _add_long_requests(core: EngineCore, prefix: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineCoreRequest(f"{prefix}{i}", prompt, params, None, 0.0))
    for _ in range(3):
        core.run_step()


def test_tp2_over_two_nodes_equals_tp1_then_a_killed_headless_node_fails_fast(
    two_nodes: Callable[..., tuple[EngineCore, LiveServer]],
    pp1: tuple[dict[str, list[int]], dict[str, int], int, int],
) -> None:
    core, node = two_nodes(tp=2)
    got, cached, _ = generate(core, PROMPTS, 10)
    assert got == pp1[0]
    assert cached == pp1[1]  # prefix-cache hits are the same
    # The whole headless process dies (SIGKILL): its connection closes.
    _add_long_requests(core, "k")
    node.process.kill()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"node 1 \(.*\) is gone: its connection closed"):
        _step_forever(core)
    assert time.monotonic() - start < 10.0
    with pytest.raises(WorkerDiedError):  # and keeps failing fast
        core.model_executor.check_health()
    start = time.monotonic()
    core.shutdown()
    assert time.monotonic() - start < 15.0


def test_pp2_over_two_nodes_equals_pp1_then_a_killed_remote_worker_fails_fast(
    two_nodes: Callable[..., tuple[EngineCore, LiveServer]],
    pp1: tuple[dict[str, list[int]], dict[str, int], int, int],
) -> None:
    """Rank 1, the last stage and output rank, runs on node 1: every token comes over TCP."""
    core, node = two_nodes(pp=2)
    got, cached, in_flight = generate(core, PROMPTS, 10)
    assert got == pp1[0] and cached == pp1[1]
    assert in_flight == 2  # two micro-batches in flight across the nodes
    _add_long_requests(core, "k")
    (worker_pid,) = node.engine_pids()  # node 1's one worker process
    os.kill(worker_pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"node 1 .*worker 1 \(pid \d+\) on node 1 died"):
        _step_forever(core)
    assert time.monotonic() - start < 10.0
    assert node.process.wait(timeout=15) == 1  # the headless node gives up too
    executor = core.model_executor
    assert isinstance(executor, MultiprocExecutor)
    core.shutdown()
    assert all(not p.is_alive() for p in executor.procs)


def test_node0_that_never_gets_its_node_times_out_with_a_clear_error(tiny_llama: Path) -> None:
    from paged.runner.executor.node_wire import LinkTimeouts

    model = ModelConfig.from_pretrained(str(tiny_llama), max_model_len=64)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"node\(s\) \[1\] never joined at tcp://127.0.0.1:"):
        MultiprocExecutor(
            two_node_config(model, free_port_pair(), tp=2), link_timeouts=LinkTimeouts(join_s=2.0)
        )
    assert time.monotonic() - start < 30.0


# Node 0's end of the node link alone, in a process of its own for the test to kill: the
# object the engine core's executor holds, without the engine (its death is the same TCP close).
NODE0_LINK = """
import sys, time, msgspec
from paged.runner.config import ParallelConfig
from paged.runner.executor.node_wire import Fingerprint, LinkTimeouts
from paged.runner.executor.remote_nodes import RemoteNodes
port = int(sys.argv[1])
fingerprint = msgspec.msgpack.decode(bytes.fromhex(sys.argv[2]), type=Fingerprint)
parallel = ParallelConfig(
    tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1", master_port=port
)
link = RemoteNodes(parallel, fingerprint, output_rank=0, timeouts=LinkTimeouts())
link.wait_joined(time.monotonic() + 240)
print("joined", flush=True)
time.sleep(600)
"""


def test_headless_node_exits_nonzero_when_node0_is_killed(tiny_llama: Path, tmp_path: Path) -> None:
    """`paged serve --headless` (the real CLI) joins node 0, then node 0's process is killed."""
    import sys

    import msgspec

    from paged.runner.executor.node_wire import Fingerprint

    port = free_port_pair()
    model = ModelConfig.from_pretrained(str(tiny_llama), max_model_len=64)
    fingerprint = Fingerprint.of(two_node_config(model, port, tp=2))
    encoded = msgspec.msgpack.encode(fingerprint).hex()
    node0 = subprocess.Popen(
        [sys.executable, "-c", NODE0_LINK, str(port), encoded], stdout=subprocess.PIPE, text=True
    )
    node = start_headless(tiny_llama, tmp_path, port, [*NODE_FLAGS, "-tp", "2"])
    try:
        assert node0.stdout is not None
        assert node0.stdout.readline().strip() == "joined", node.log()
        node0.kill()
        start = time.monotonic()
        assert node.process.wait(timeout=30) == 1, node.log()
        assert time.monotonic() - start < 10.0
        assert "node 0 closed the connection" in node.log()
    finally:
        if node0.poll() is None:
            node0.kill()
        node0.wait(timeout=30)
        if node0.stdout is not None:
            node0.stdout.close()
        stop_headless(node)
