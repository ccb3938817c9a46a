"""`RayDistributedExecutor`: one Ray actor per rank, placed by a placement group.

    engine core (driver) --actor.call(bytes)--> RayWorkerActor rank 0..N-1 -> Worker
                         <-------- Reply bytes --------

- Cluster: `ray.init()` joins the cluster named by `RAY_ADDRESS` (e.g. one
  started with `ray start --head`) when set, else starts a small local one
  (`num_cpus` = the ranks it needs on CPU, no dashboard) that `shutdown()`
  stops again. If the process already called `ray.init`, that connection is
  used and left alone.
- Placement: one bundle per rank ({"CPU": 1} on CPU, {"GPU": 1} on CUDA),
  strategy `ParallelConfig.ray_placement_strategy` (PACK by default); bundle 0
  also asks for a sliver of this node's `node:<ip>` resource, so rank 0, the
  output rank, runs on the engine core's node.
- torch.distributed: rank 0's actor names a tcp:// address on its node; every
  actor joins with it (gloo on CPU, NCCL on CUDA) inside `Worker.init_device`.
- Calls: the same msgpack `WorkerCall`s as the multiproc executor, sent to
  every actor; results come back in rank order. An actor that dies (killed,
  OOM, node lost) shows up as Ray's `RayActorError` on its reply and becomes
  `WorkerDiedError` naming the rank, at once, without waiting for the other
  ranks (which may be blocked in a collective with the dead one); later calls
  fail fast with the same error.
- Shutdown: `Shutdown` to every live actor (leaves the process group), then
  `ray.kill` each actor, remove the placement group and, if this executor
  made the connection, `ray.shutdown()` (which stops a local cluster it
  started, and only disconnects from a `RAY_ADDRESS` one); nothing started
  here outlives it.

Pipeline parallelism: `collective_rpc_async` submits the call to every actor
and returns at once (an actor runs its calls in submission order, so stage 0
starts micro-batch N+1 while the last stage runs N); one helper thread
gathers the replies in call order and settles the futures.

Ray's known cost: its core workers poll, and every call is a task submission
through the driver's core worker (a gRPC round trip per actor);
benchmarks/scaleout_bench.py measures the per-step overhead against the
multiproc executor's shared-memory ring.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from paged.runner.config import EngineConfig
from paged.runner.executor.abstract import Executor, WorkerDiedError, WorkerError
from paged.runner.executor.messages import Reply, Shutdown, WorkerCall, decode_reply, decode_result
from paged.runner.executor.messages import encode as encode_call
from paged.runner.executor.rank_layout import world_size
from paged.runner.executor.ray_worker import RayWorkerActor

_POLL_S = 0.5
_ERROR_GRACE_S = 10.0
# Environment handed to every actor (a Ray worker inherits the raylet's, not ours).
_ENV_PREFIXES = ("PAGED_", "TRITON_", "HF_", "TORCH_", "NCCL_", "GLOO_")
_ENV_KEYS = ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM")


def _import_ray() -> Any:
    # Under `uv run`, Ray by default starts every worker through `uv run` again
    # and ships the working directory to it (its uv runtime-env hook): seconds
    # per actor here, and a copy of the tree. paged's workers run from the
    # installed environment instead (the same on every node; docs/multi-node.md).
    # Read by ray at import time; set RAY_ENABLE_UV_RUN_RUNTIME_ENV=1 to keep the hook.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    try:
        import ray
    except ImportError as exc:
        raise ValueError(
            "distributed_executor_backend: 'ray' needs Ray; install paged-runner[ray]"
        ) from exc
    return ray


def start_local_ray(num_cpus: int) -> None:
    """`ray.init` of a private local cluster, as small as Ray allows.

    `num_cpus` bundles' worth of CPUs, no dashboard UI, worker logs not
    forwarded. Two Ray defaults are changed unless already set in the
    environment (the raylet reads them at start):
    - RAY_worker_niceness=0: Ray starts worker processes at nice 15, which on
      a busy machine starves the actors that run the model (measured: a
      batch-32 step of the benchmark's tiny model 9x slower than the
      multiproc executor's under load ~10; benchmarks/scaleout_bench.py).
    - RAY_agent_register_timeout_ms=120000: the raylet waits 30 s for its agent
      processes to report their ports; on a loaded machine they start slower
      and the cluster fails to come up.
    """
    ray = _import_ray()
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    ray.init(
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )


def _actor_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) or k in _ENV_KEYS}


def _is_error_reply(data: bytes) -> bool:
    return decode_reply(data).error is not None


class RayDistributedExecutor(Executor):
    def __init__(self, engine_config: EngineConfig, *, startup_timeout: float = 900.0) -> None:
        super().__init__(engine_config)
        self._ray = _import_ray()
        self.world_size = world_size(engine_config.parallel_config)
        self._dead: str | None = None
        self._closed = False
        self._owns_cluster = False
        self.actors: list[Any] = []
        self.pids: list[int] = []
        self._placement_group: Any = None
        # PP > 1: gathers replies of calls submitted without waiting, in call order.
        self._replies: ThreadPoolExecutor | None = None
        try:
            self._connect()
            self._start(startup_timeout)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------ start-up

    def _connect(self) -> None:
        ray = self._ray
        if ray.is_initialized():
            return
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        else:
            start_local_ray(self.world_size)
        self._owns_cluster = True

    def _bundles(self) -> list[dict[str, float]]:
        ray = self._ray
        on_gpu = self.engine_config.model_config.device.startswith("cuda")
        unit = {"GPU": 1.0} if on_gpu else {"CPU": 1.0}
        bundles = [dict(unit) for _ in range(self.world_size)]
        bundles[0][f"node:{ray.util.get_node_ip_address()}"] = 0.001
        return bundles

    def _start(self, timeout: float) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        deadline = time.monotonic() + timeout
        bundles = self._bundles()
        strategy = self.engine_config.parallel_config.ray_placement_strategy
        self._placement_group = placement_group(bundles, strategy=strategy)
        ready, _ = ray.wait([self._placement_group.ready()], timeout=min(timeout, 120.0))
        if not ready:
            raise RuntimeError(
                f"the Ray cluster cannot place {self.world_size} bundles like {bundles[-1]} "
                f"with strategy {strategy} (rank 0 on this node); it has "
                f"{ray.available_resources()} available"
            )
        on_gpu = "GPU" in bundles[0]
        remote_cls = ray.remote(RayWorkerActor)
        env = _actor_env()
        for rank in range(self.world_size):
            options = remote_cls.options(
                num_cpus=0 if on_gpu else 1,
                num_gpus=1 if on_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._placement_group, placement_group_bundle_index=rank
                ),
                max_restarts=0,
            )
            self.actors.append(options.remote(rank, env))
        self.pids = [int(p) for p in self._gather([a.pid.remote() for a in self.actors], deadline)]
        init_method = self._gather([self.actors[0].rendezvous_address.remote()], deadline)[0]
        errors = self._gather(
            [a.start.remote(self.engine_config, init_method) for a in self.actors], deadline
        )
        failed = [f"worker {r} failed to start:\n{e}" for r, e in enumerate(errors) if e]
        if failed:
            raise WorkerError("\n".join(failed))

    # --------------------------------------------------------------- calls

    def _died(self, rank: int, exc: BaseException) -> WorkerDiedError:
        pid = self.pids[rank] if rank < len(self.pids) else "?"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        self._dead = (
            f"worker {rank} (Ray actor, pid {pid}) died: {first_line}; the executor cannot continue"
        )
        return WorkerDiedError(self._dead)

    def _gather(
        self,
        refs: list[Any],
        deadline: float | None,
        failed: Callable[[Any], bool] | None = None,
    ) -> list[Any]:
        """ray.get of `refs` in order; a dead actor raises WorkerDiedError as soon as it shows.

        `failed(value)` tells whether a value is a rank's error reply: once one
        arrives, the other ranks get `_ERROR_GRACE_S` to answer, since a rank
        that raised mid-step leaves the others blocked in a collective with it
        for good; then the executor is marked broken rather than left hanging.
        """
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        values: list[Any] = [None] * len(refs)
        pending = list(refs)
        error_since: float | None = None
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    values[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise self._died(rank, exc) from exc
                if error_since is None and failed is not None and failed(values[rank]):
                    error_since = time.monotonic()
            now = time.monotonic()
            if pending and error_since is not None and now - error_since > _ERROR_GRACE_S:
                ranks = sorted(rank_of[r] for r in pending)
                self._dead = (
                    f"workers {ranks} did not answer after another rank failed (blocked in a "
                    "collective with it); the executor cannot continue"
                )
                errors = [decode_reply(v).error for v in values if v is not None]
                raise WorkerError(self._dead + "\n" + "\n".join(e for e in errors if e))
            if pending and deadline is not None and now > deadline:
                ranks = sorted(rank_of[r] for r in pending)
                raise TimeoutError(f"workers {ranks} did not answer in time")
        return values

    def collective_rpc(self, call: WorkerCall, timeout: float | None = None) -> list[Any]:
        if self._closed:
            raise RuntimeError("the executor is shut down")
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        deadline = None if timeout is None else time.monotonic() + timeout
        payload = encode_call(call)
        raw = self._gather(
            [a.call.remote(payload) for a in self.actors], deadline, failed=_is_error_reply
        )
        results: list[Any] = []
        errors: list[str] = []
        for data in raw:
            reply: Reply = decode_reply(data)
            if reply.error is not None:
                errors.append(f"worker {reply.rank}: {reply.error}")
            else:
                results.append(decode_result(call, reply.result))
        if errors:
            raise WorkerError("\n".join(errors))
        return results

    def collective_rpc_async(self, call: WorkerCall) -> Future[list[Any]]:
        if self.pp_size == 1:
            return super().collective_rpc_async(call)
        if self._closed:
            raise RuntimeError("the executor is shut down")
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        if self._replies is None:
            self._replies = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paged-ray")
        refs = [a.call.remote(encode_call(call)) for a in self.actors]
        return self._replies.submit(self._settle, call, refs)

    def _settle(self, call: WorkerCall, refs: list[Any]) -> list[Any]:
        results: list[Any] = []
        errors: list[str] = []
        for data in self._gather(refs, None, failed=_is_error_reply):
            reply: Reply = decode_reply(data)
            if reply.error is not None:
                errors.append(f"worker {reply.rank}: {reply.error}")
            else:
                results.append(decode_result(call, reply.result))
        if errors:
            raise WorkerError("\n".join(errors))
        return results

    # ------------------------------------------------------------ shutdown

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        if self._replies is not None:
            self._replies.shutdown(wait=False, cancel_futures=True)
        if self.actors and self._dead is None:
            # Let every rank leave the process group cleanly; a dead one is killed below.
            with contextlib.suppress(TimeoutError, WorkerDiedError):
                self._gather(
                    [a.call.remote(encode_call(Shutdown())) for a in self.actors],
                    time.monotonic() + 30.0,
                )
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement_group)
        if self._owns_cluster and ray.is_initialized():
            ray.shutdown()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.shutdown()
