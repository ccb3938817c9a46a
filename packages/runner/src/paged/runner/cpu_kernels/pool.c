/* A persistent worker pool for the CPU kernels (paged-runner, cpu_kernels/pool.py).
 *
 * One pool per engine process, created once with T threads: the caller of
 * paged_pool_run plus T - 1 workers. A run is a list of `ntasks` independent
 * tasks (a few tiles of a matmul, one KV head of one request, ...); every
 * participant takes the next task index from one shared counter until none
 * is left, so a core stalled by another process slows the run by the tasks it
 * holds at that moment, not by a fixed 1/T share (static splitting waits for
 * the slowest thread: measured 30-60x slower steps on a loaded machine).
 *
 * Exactness is the kernels' business and simple: a task computes its outputs
 * completely, in the same order whoever runs it, so results never depend on
 * the thread count nor on which thread took which task.
 *
 * The counter holds the run's generation in its high 32 bits and the next task
 * in its low 32 bits, and tasks are claimed by compare-and-swap: a worker that
 * wakes late, after its run has ended and another began, fails its CAS instead
 * of running a stale task with the new run's context. The caller returns once
 * `done` reaches ntasks (tasks finished, not workers arrived), so a worker that
 * never woke costs nothing.
 *
 * Idle workers spin for SPIN_NS (the fused layers call runs back to back: a
 * sleeping worker would pay a wake-up per matmul), then sleep on a condition
 * variable. A task's nonzero return is kept (the first one) and returned by
 * paged_pool_run after every task has run: a kernel error is an error code,
 * never a hang. Runs from two threads at once are serialised by a try-lock:
 * the second runs its tasks alone, on its own thread (same results).
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define POOL_PAUSE() _mm_pause()
#else
#define POOL_PAUSE() ((void)0)
#endif

int paged_pool_abi(void) { return 1; }

typedef int (*pool_task_fn)(void *ctx, int64_t task);

enum { SPIN_NS = 200000 }; /* 0.2 ms of spinning before a worker sleeps */
enum { BENCH_RUNS = 256, STALL_SLACK_NS = 50000 };

typedef struct Pool Pool;
typedef struct {
    Pool *pool;
    int index; /* 0 .. threads - 2 */
} Worker;

struct Pool {
    int threads; /* participants, the caller included */
    pthread_t *workers;
    Worker *slots;
    /* Stall backoff: workers with index >= active take no tasks. A run whose caller
     * waited longer for the others' last tasks than its own share took (a worker's
     * core was taken by another process) benches one worker for BENCH_RUNS runs, then
     * it is tried again: a stalled core then costs a few runs, not every run. */
    _Atomic int active;
    int bench_left; /* runs until a benched worker is tried again (caller-only) */
    int started; /* workers actually created */
    pthread_mutex_t run_lock; /* one run at a time */
    pthread_mutex_t sleep_lock;
    pthread_cond_t wake;
    _Atomic uint64_t counter; /* generation << 32 | next task */
    _Atomic int64_t done;     /* tasks finished in the current run */
    _Atomic int error;        /* the first nonzero task result of the current run */
    _Atomic int sleepers;
    _Atomic int stop;
    /* the current run, written before its generation is published */
    pool_task_fn fn;
    void *ctx;
    int64_t ntasks;
};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Claim and run tasks of generation `gen` until none is left (or the run changed);
 * index < 0: the caller, always allowed; a worker stops once it is benched. */
static void work(Pool *p, uint32_t gen, int index) {
    uint64_t c = atomic_load_explicit(&p->counter, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(c >> 32) != gen) return;
        if (index >= atomic_load_explicit(&p->active, memory_order_relaxed)) return;
        /* fields of `gen`: published before the counter that carried it (release) */
        const pool_task_fn fn = p->fn;
        void *ctx = p->ctx;
        const int64_t n = p->ntasks;
        const int64_t task = (int64_t)(uint32_t)c;
        if (task >= n) return;
        if (!atomic_compare_exchange_weak_explicit(&p->counter, &c, c + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* c reloaded: another took it, or a new run began */
        const int rc = fn(ctx, task);
        if (rc != 0) {
            int zero = 0;
            atomic_compare_exchange_strong(&p->error, &zero, rc);
        }
        atomic_fetch_add_explicit(&p->done, 1, memory_order_acq_rel);
        c = atomic_load_explicit(&p->counter, memory_order_acquire);
    }
}

/* Whether generation `gen`'s run still has tasks to claim. */
static int has_work(Pool *p, uint32_t *gen) {
    const uint64_t c = atomic_load_explicit(&p->counter, memory_order_acquire);
    if ((uint32_t)(c >> 32) == *gen) return 0;
    *gen = (uint32_t)(c >> 32);
    return 1;
}

static void *worker_main(void *arg) {
    const Worker *self = (const Worker *)arg;
    Pool *p = self->pool;
    const int index = self->index;
    uint32_t gen = (uint32_t)(atomic_load(&p->counter) >> 32);
    while (!atomic_load_explicit(&p->stop, memory_order_acquire)) {
        if (has_work(p, &gen)) {
            work(p, gen, index);
            continue;
        }
        const uint64_t until = now_ns() + SPIN_NS;
        int woke = 0;
        while (now_ns() < until) {
            for (int i = 0; i < 64; i++) POOL_PAUSE();
            if (has_work(p, &gen) || atomic_load_explicit(&p->stop, memory_order_acquire)) {
                woke = 1;
                break;
            }
        }
        if (woke) {
            if (!atomic_load(&p->stop)) work(p, gen, index);
            continue;
        }
        pthread_mutex_lock(&p->sleep_lock);
        atomic_fetch_add(&p->sleepers, 1);
        /* re-checked under the lock: run() broadcasts under it after publishing */
        while ((uint32_t)(atomic_load(&p->counter) >> 32) == gen && !atomic_load(&p->stop))
            pthread_cond_wait(&p->wake, &p->sleep_lock);
        atomic_fetch_sub(&p->sleepers, 1);
        pthread_mutex_unlock(&p->sleep_lock);
    }
    return NULL;
}

void paged_pool_destroy(Pool *p);

/* A pool of `threads` participants (>= 1; 1: no workers, runs are plain loops).
 * NULL when threads < 1 or a thread or allocation failed. */
Pool *paged_pool_create(int threads) {
    if (threads < 1) return NULL;
    Pool *p = calloc(1, sizeof(Pool));
    if (!p) return NULL;
    p->threads = threads;
    pthread_mutex_init(&p->run_lock, NULL);
    pthread_mutex_init(&p->sleep_lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    atomic_init(&p->counter, 0);
    atomic_init(&p->done, 0);
    atomic_init(&p->error, 0);
    atomic_init(&p->sleepers, 0);
    atomic_init(&p->stop, 0);
    atomic_init(&p->active, threads - 1);
    p->workers = calloc((size_t)threads, sizeof(pthread_t));
    p->slots = calloc((size_t)threads, sizeof(Worker));
    if (!p->workers || !p->slots) {
        paged_pool_destroy(p);
        return NULL;
    }
    for (int i = 0; i < threads - 1; i++) {
        p->slots[i] = (Worker){p, i};
        if (pthread_create(&p->workers[i], NULL, worker_main, &p->slots[i]) != 0) {
            paged_pool_destroy(p);
            return NULL;
        }
        p->started++;
    }
    return p;
}

int paged_pool_threads(const Pool *p) { return p ? p->threads : 1; }

/* Stop and join every worker, then free the pool (NULL: nothing). Not while a run
 * is in progress (the owner closes the pool after its last step). */
void paged_pool_destroy(Pool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->sleep_lock);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->sleep_lock);
    for (int i = 0; i < p->started; i++) pthread_join(p->workers[i], NULL);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->sleep_lock);
    pthread_mutex_destroy(&p->run_lock);
    free(p->workers);
    free(p->slots);
    free(p);
}

static int run_alone(int64_t ntasks, pool_task_fn fn, void *ctx) {
    int error = 0;
    for (int64_t t = 0; t < ntasks; t++) {
        const int rc = fn(ctx, t);
        if (rc != 0 && error == 0) error = rc;
    }
    return error;
}

/* Run fn(ctx, 0 .. ntasks - 1), each exactly once, on the pool's threads (the caller
 * among them); returns once all have finished: 0, or the first nonzero task result. */
int paged_pool_run(Pool *p, int64_t ntasks, pool_task_fn fn, void *ctx) {
    if (ntasks <= 0) return 0;
    if (!p || p->threads == 1 || ntasks == 1 || ntasks > 0x7fffffff ||
        pthread_mutex_trylock(&p->run_lock) != 0)
        return run_alone(ntasks, fn, ctx);
    if (p->bench_left > 0 && --p->bench_left == 0 && atomic_load(&p->active) < p->threads - 1)
        atomic_fetch_add(&p->active, 1); /* try a benched worker again */
    if (atomic_load(&p->active) == 0) {
        pthread_mutex_unlock(&p->run_lock);
        return run_alone(ntasks, fn, ctx);
    }
    p->fn = fn;
    p->ctx = ctx;
    p->ntasks = ntasks;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->error, 0, memory_order_relaxed);
    const uint32_t gen = (uint32_t)(atomic_load(&p->counter) >> 32) + 1;
    /* seq_cst: ordered before the sleepers check, as a sleeper's increment is before
     * its check of the counter (neither can miss the other) */
    atomic_store(&p->counter, (uint64_t)gen << 32);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->sleep_lock);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->sleep_lock);
    }
    const uint64_t start = now_ns();
    work(p, gen, -1);
    const uint64_t mine = now_ns() - start, waiting = now_ns();
    /* tasks others still hold: spin briefly, then yield the core to them */
    for (unsigned spins = 0; atomic_load_explicit(&p->done, memory_order_acquire) < ntasks;
         spins++) {
        if (spins < 4096) POOL_PAUSE();
        else sched_yield();
    }
    if (now_ns() - waiting > mine + STALL_SLACK_NS && atomic_load(&p->active) > 0) {
        atomic_fetch_sub(&p->active, 1); /* a worker's core was taken: bench one */
        p->bench_left = BENCH_RUNS;
    }
    const int error = atomic_load(&p->error);
    pthread_mutex_unlock(&p->run_lock);
    return error;
}

/* Workers currently taking tasks (tests: the stall backoff). */
int paged_pool_active(Pool *p) { return p ? atomic_load(&p->active) : 0; }

/* Tests: each task writes its index + 1 into out[task] (and sleeps `delay_us` when
 * task % 7 == 3, so that tasks interleave); the task `fail_at` returns -7 instead. */
typedef struct {
    int64_t *out;
    int64_t fail_at;
    int64_t delay_us;
} SelfTest;

static int selftest_task(void *ctx, int64_t task) {
    const SelfTest *s = (const SelfTest *)ctx;
    if (task % 7 == 3 && s->delay_us > 0) {
        struct timespec ts = {0, (long)s->delay_us * 1000};
        nanosleep(&ts, NULL);
    }
    if (task == s->fail_at) return -7;
    s->out[task] = task + 1;
    return 0;
}

int paged_pool_selftest(Pool *p, int64_t ntasks, int64_t *out, int64_t fail_at,
                        int64_t delay_us) {
    SelfTest s = {out, fail_at, delay_us};
    return paged_pool_run(p, ntasks, selftest_task, &s);
}
