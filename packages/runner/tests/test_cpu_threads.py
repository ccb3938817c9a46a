"""The C kernels' worker pool (cpu_kernels/pool.c) and the thread count (cpu_threads.py).

Results must not depend on the thread count: qgemm, the attention and a whole
quantised model's logits are compared bit for bit at 1, 2 and 3 threads (3 on a
2-core machine also checks that a thread waiting for a core only delays the
call). A task's error comes back as the call's return code, never a hang, and
the pool stops cleanly.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from paged.runner.config import ModelConfig
from paged.runner.cpu_kernels import QGemm, load_qgemm
from paged.runner.cpu_kernels.pool import CpuPool, load_pool_library
from paged.runner.cpu_step import attention_ops
from paged.runner.cpu_threads import (
    CpuThreads,
    ThreadPlan,
    parse_cpu_list,
    physical_cores,
    resolve_cpu_threads,
)

pytestmark = pytest.mark.skipif(load_pool_library() is None, reason="no C compiler")
THREADS = (1, 2, 3)


@pytest.fixture
def threads() -> Iterator[Callable[[int], CpuThreads]]:
    """threads(n): a CpuThreads of n attached to the kernels; every one is closed after."""
    started: list[CpuThreads] = []

    def start(n: int) -> CpuThreads:
        for t in started:
            t.close()
        started.append(CpuThreads.start(ThreadPlan(n, None, "test")))
        return started[-1]

    yield start
    for t in started:
        t.close()


# ------------------------------------------------------------------ the pool


@pytest.mark.parametrize("n", THREADS)
def test_every_task_runs_exactly_once(n: int) -> None:
    with CpuPool(n) as pool:
        for _ in range(20):  # many runs back to back: generations never mix
            out = (ctypes.c_int64 * 257)()
            assert pool.selftest(out, fail_at=-1, delay_us=20) == 0
            assert list(out) == list(range(1, 258))


def test_a_failing_task_is_the_runs_error_and_the_pool_goes_on() -> None:
    with CpuPool(3) as pool:
        out = (ctypes.c_int64 * 100)()
        assert pool.selftest(out, fail_at=42, delay_us=50) == -7
        # every other task still ran (the run waited for them, then reported)
        assert [v for i, v in enumerate(out) if i != 42] == [i + 1 for i in range(100) if i != 42]
        out = (ctypes.c_int64 * 100)()
        assert pool.selftest(out, fail_at=-1, delay_us=0) == 0
        assert list(out) == list(range(1, 101))


def test_close_detaches_joins_and_is_idempotent() -> None:
    calls: list[tuple[int | None, int | None, int]] = []
    pool = CpuPool(2)
    pool.attach(lambda run, handle, n: calls.append((run, handle, n)))
    assert calls[0][0] and calls[0][1] and calls[0][2] == 2
    pool.close()
    pool.close()
    assert calls[1:] == [(None, None, 1)]
    assert pool.closed
    with pytest.raises(RuntimeError, match="closed"):
        _ = pool.handle


@pytest.mark.parametrize("bad", [0, -1, True])
def test_a_pool_needs_a_positive_count(bad: int) -> None:
    with pytest.raises(ValueError, match="threads"):
        CpuPool(bad)


# ------------------------------------------------ the kernels, bit for bit


def _qgemm_outputs(lib: Any) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n, k = 1000, 512  # 63 tiles, the last one partial; over the threshold at one row
    w4 = QGemm.int4(
        lib, torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen),
        torch.rand(n, k // 32, generator=gen), torch.rand(n, k // 32, generator=gen),
    )  # fmt: skip
    w8 = QGemm.int8(
        lib, torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen),
        torch.rand(n, k // 16, generator=gen),
    )  # fmt: skip
    # GGUF-native layouts (qgemm_native.c): f16 super-block scales times small integers
    d = (torch.rand(n, k // 256, 1, generator=gen) * 0.01).half().float()
    sc = torch.randint(0, 64, (n, k // 256, 16), generator=gen).float()
    w4k = QGemm.int4(
        lib, torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen),
        (d * sc[..., :8]).reshape(n, k // 32), (-(d * sc[..., 8:])).reshape(n, k // 32),
    )  # fmt: skip
    w6k = QGemm.int8(
        lib, torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=gen),
        (d * (sc - 32)).reshape(n, k // 16),
    )  # fmt: skip
    d0 = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
    codes4 = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    w40 = QGemm.int4(lib, codes4, d0, -8 * d0)
    w80 = QGemm.int8(lib, torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), d0)
    w5k = QGemm.int4(  # Q5_K: 5-bit codes, Q4_K's scales
        lib, torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=gen),
        (d * sc[..., 8:]).reshape(n, k // 32), (-(d * sc[..., :8])).reshape(n, k // 32),
    )  # fmt: skip
    assert (w4k.fmt, w6k.fmt, w40.fmt, w80.fmt, w5k.fmt) == (5, 6, 7, 9, 11)
    outs = []
    for m in (1, 2, 3, 37, 300):  # decode, a few rows, prefill, more than one chunk of rows
        x = torch.randn(m, k, generator=gen)
        x[:, 5] *= 40  # outliers: the residual level's groups
        for w in (w4, w8, w4k, w6k, w40, w80, w5k):
            outs.append(w.matmul(x))
            outs.append(w.matmul(x.bfloat16(), torch.bfloat16, outlier_ratio=4.0))
    return outs


def test_qgemm_is_the_same_bits_at_every_thread_count(
    threads: Callable[[int], CpuThreads],
) -> None:
    lib = load_qgemm()
    if lib is None:
        pytest.skip("no qgemm library")
    results = []
    for n in THREADS:
        threads(n)
        results.append(_qgemm_outputs(lib))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


def _attention(window: int | None, cap: float | None) -> torch.Tensor:
    """A mixed step: decode rows, a verification run and a 70-row prefill chunk."""
    gen = torch.Generator().manual_seed(1)
    bf16 = torch.bfloat16
    block, hq, hkv, d = 16, 8, 2, 64
    q_lens, seq_lens = [1, 4, 70, 1], [30, 50, 90, 7]
    width = max(-(-s // block) for s in seq_lens)
    num_blocks = len(seq_lens) * width + 1
    key_cache = torch.randn(num_blocks, block, hkv, d, generator=gen).to(bf16)
    value_cache = torch.randn(num_blocks, block, hkv, d, generator=gen).to(bf16)
    table = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * width]
    table = table.view(len(seq_lens), width).to(torch.int32)
    slots = [
        int(table[r, p // block]) * block + p % block
        for r, (q, s) in enumerate(zip(q_lens, seq_lens, strict=True))
        for p in range(s - q, s)
    ]
    t = sum(q_lens)
    starts = torch.tensor([0, 1, 5, 75, 76], dtype=torch.int32)
    q = torch.randn(t, hq * d, generator=gen).to(bf16)
    k, v = (torch.randn(t, hkv * d, generator=gen).to(bf16) for _ in range(2))
    return attention_ops.attention_rows(
        q, k, v, key_cache, value_cache,
        torch.tensor(slots), table, starts, torch.tensor(seq_lens, dtype=torch.int32),
        0.125, window, cap,
    )  # fmt: skip


@pytest.mark.parametrize(("window", "cap"), [(None, None), (20, 30.0)])
def test_attention_is_the_same_bits_at_every_thread_count(
    threads: Callable[[int], CpuThreads], window: int | None, cap: float | None
) -> None:
    if not attention_ops.available():
        pytest.skip("no attention library")
    results = []
    for n in THREADS:
        threads(n)
        results.append(_attention(window, cap))
    assert all(torch.equal(results[0], other) for other in results[1:])


def test_the_default_models_logits_are_the_same_bits_at_every_thread_count(
    threads: Callable[[int], CpuThreads], make_driver: Callable[..., Any]
) -> None:
    """The quantised default model (fused layers, C attention, LM head): a two-prompt
    prefill, then greedy decode steps; logits equal at 1, 2 and 3 threads."""
    from paged.runner.loader import load_model

    model = load_model(ModelConfig.from_pretrained(None), "cpu")
    prompts = {"a": [1, 504, 3365, 282, 4649, 314, 28, 2], "b": [1, 12, 19, 44]}
    results = []
    for n in THREADS:
        threads(n)
        driver = make_driver(model, num_blocks=16, block_size=16, seed=5)
        for rid, prompt in prompts.items():
            driver.add(rid, prompt)
        logits = [driver.step([(rid, len(p)) for rid, p in prompts.items()])]
        for _ in range(3):
            for i, rid in enumerate(prompts):
                driver.tokens[rid].append(int(logits[-1][i].argmax()))
            logits.append(driver.step([(rid, 1) for rid in prompts]))
        results.append(logits)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


# ------------------------------------------------------------- the count


def test_an_explicit_count_wins() -> None:
    env = {"OMP_NUM_THREADS": "3", "VLLM_CPU_OMP_THREADS_BIND": "0-7"}
    assert resolve_cpu_threads(5, env=env) == ThreadPlan(5, None, "--cpu-threads")
    with pytest.raises(ValueError, match="cpu_threads"):
        resolve_cpu_threads(0, env={})


def test_a_bind_list_gives_each_local_rank_its_cpus() -> None:
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-3,6|4,5", "OMP_NUM_THREADS": "1"}
    assert resolve_cpu_threads(env=env) == ThreadPlan(
        5, (0, 1, 2, 3, 6), "VLLM_CPU_OMP_THREADS_BIND"
    )
    second = resolve_cpu_threads(env=env, local_rank=1, local_world_size=2)
    assert second.threads == 2 and second.cpus == (4, 5)
    with pytest.raises(ValueError, match="1 CPU list"):
        resolve_cpu_threads(
            env={"VLLM_CPU_OMP_THREADS_BIND": "0-3"}, local_rank=1, local_world_size=2
        )
    with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND"):
        parse_cpu_list("0-x")
    assert parse_cpu_list("5,2-4,2") == (2, 3, 4, 5)


def test_omp_num_threads_is_honoured_under_auto() -> None:
    plan = resolve_cpu_threads(env={"OMP_NUM_THREADS": "3", "VLLM_CPU_OMP_THREADS_BIND": "auto"})
    assert plan == ThreadPlan(3, None, "OMP_NUM_THREADS")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS"):
        resolve_cpu_threads(env={"OMP_NUM_THREADS": "zero"})


def _fake_sysfs(root: Path, cores: dict[int, int]) -> Path:
    """cpu -> core id, one package."""
    for cpu, core in cores.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text("0\n")
        (topo / "core_id").write_text(f"{core}\n")
    return root


def test_auto_counts_physical_cores_the_process_may_use(tmp_path: Path) -> None:
    # 4 cores with 2 SMT siblings each (cpu i and i + 4 share core i); CPU 3 not allowed
    sysfs = _fake_sysfs(tmp_path, {c: c % 4 for c in range(8)})
    allowed = {0, 1, 2, 4, 5, 6, 7}
    assert physical_cores(allowed, sysfs) == [4, 5, 6, 7]
    plan = resolve_cpu_threads(env={}, allowed=allowed, sys_cpu=sysfs)
    assert plan.threads == 4 and plan.cpus is None
    halves = [
        resolve_cpu_threads(
            env={}, allowed=allowed, sys_cpu=sysfs, local_rank=r, local_world_size=2
        )
        for r in (0, 1)
    ]
    assert [p.threads for p in halves] == [2, 2]
    reserved = resolve_cpu_threads(
        env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}, allowed=allowed, sys_cpu=sysfs
    )
    assert reserved.threads == 3
    # no topology in sysfs: each CPU counts as a core
    assert resolve_cpu_threads(env={}, allowed={0, 1}, sys_cpu=tmp_path / "none").threads == 2


def test_binding_to_cpus_this_process_may_not_use_names_the_variable() -> None:
    with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND: cannot bind"):
        CpuThreads.start(ThreadPlan(1, (100_000,), "VLLM_CPU_OMP_THREADS_BIND"))
