/* The thread pool of the kernel library (declared in pool.h).
 * A job is n_chunks calls fn(arg, chunk); the calling thread and the workers claim chunks from one
 * atomic ticket (job generation << 40 | n_chunks << 20 | next chunk), so on a busy machine a worker
 * that is not scheduled takes nothing and the caller does the rest: the caller waits only for
 * chunks a worker has claimed. Workers spin LT_SPIN_NS for the next job, then sleep: 5 ms, since
 * a training step's products come a few small ops apart and a worker woken from sleep joins a
 * product late (200 us cost a SmolLM2 LoRA step ~3 %). */
#include <pthread.h>
#include <sched.h>

#include "pool.h"

#define LT_MAX_THREADS 64
#define LT_SPIN_NS 5000000
#define LT_MAX_CHUNKS ((1 << 20) - 1)

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_workers, sleepers;
    atomic_uint gen;          /* bumped when a job is published */
    atomic_uint_fast64_t ticket;
    atomic_int busy;          /* workers inside a job */
    atomic_uintptr_t fn, arg; /* the job (read by workers that may come late: see claim) */
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, 0, 0, 0};
static pthread_mutex_t pool_start = PTHREAD_MUTEX_INITIALIZER;  /* one job on the pool at a time */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* The next chunk of job `gen`, or -1 when it has none left (or is no longer the current job). */
static int64_t claim(unsigned gen) {
    uint_fast64_t t = atomic_load_explicit(&pool.ticket, memory_order_acquire);
    for (;;) {
        const uint_fast64_t next = t & LT_MAX_CHUNKS, total = (t >> 20) & LT_MAX_CHUNKS;
        if ((unsigned)((t >> 40) & 0xFFFFFF) != (gen & 0xFFFFFF) || next >= total) return -1;
        if (atomic_compare_exchange_weak_explicit(&pool.ticket, &t, t + 1, memory_order_acq_rel, memory_order_acquire))
            return (int64_t)next;
    }
}

static void run_chunks(unsigned gen, task_fn fn, void *arg) {
    for (int64_t c; (c = claim(gen)) >= 0;) fn(arg, c);
}

static void *worker_main(void *p) {
    (void)p;
    unsigned seen = 0;
    for (;;) {
        int64_t t0 = 0;
        int spins = 0;
        while (atomic_load_explicit(&pool.gen, memory_order_acquire) == seen) {
            if (++spins % 256 == 0) {
                const int64_t t = now_ns();
                if (!t0) t0 = t;
                else if (t - t0 > LT_SPIN_NS) {
                    pthread_mutex_lock(&pool.mu);
                    pool.sleepers++;
                    while (atomic_load_explicit(&pool.gen, memory_order_acquire) == seen)
                        pthread_cond_wait(&pool.cv, &pool.mu);
                    pool.sleepers--;
                    pthread_mutex_unlock(&pool.mu);
                    break;
                }
            }
            cpu_relax();
        }
        atomic_fetch_add_explicit(&pool.busy, 1, memory_order_acq_rel);
        /* a late worker may read the next job's fn/arg with this gen: claim() then finds the
         * ticket of another generation (or none left) and nothing runs */
        seen = atomic_load_explicit(&pool.gen, memory_order_acquire);
        const task_fn fn = (task_fn)atomic_load_explicit(&pool.fn, memory_order_acquire);
        void *arg = (void *)atomic_load_explicit(&pool.arg, memory_order_acquire);
        run_chunks(seen, fn, arg);
        atomic_fetch_sub_explicit(&pool.busy, 1, memory_order_acq_rel);
    }
    return NULL;
}

static void pool_after_fork(void) {  /* the child has no workers: start afresh */
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
    pthread_mutex_init(&pool_start, NULL);
    pool.n_workers = pool.sleepers = 0;
    atomic_store(&pool.busy, 0);
}

static int pool_grow(int n_workers) {
    static int atfork_done = 0;
    if (!atfork_done) { pthread_atfork(NULL, NULL, pool_after_fork); atfork_done = 1; }
    while (pool.n_workers < n_workers) {
        pthread_t th;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&th, &attr, worker_main, NULL);
        pthread_attr_destroy(&attr);
        if (rc) break;
        pool.n_workers++;
    }
    return pool.n_workers;
}

/* fn(arg, c) for every chunk c < n_chunks, over the calling thread and nth - 1 workers */
void pool_run(task_fn fn, void *arg, int64_t n_chunks, int nth) {
    if (nth > LT_MAX_THREADS) nth = LT_MAX_THREADS;
    if (nth <= 1 || n_chunks <= 1 || n_chunks > LT_MAX_CHUNKS || pthread_mutex_trylock(&pool_start) != 0) {
        for (int64_t c = 0; c < n_chunks; c++) fn(arg, c);  /* alone (or another caller has the pool) */
        return;
    }
    if (pool_grow(nth - 1) == 0) {
        pthread_mutex_unlock(&pool_start);
        for (int64_t c = 0; c < n_chunks; c++) fn(arg, c);
        return;
    }
    const unsigned gen = atomic_load_explicit(&pool.gen, memory_order_relaxed) + 1;
    atomic_store_explicit(&pool.fn, (uintptr_t)fn, memory_order_release);
    atomic_store_explicit(&pool.arg, (uintptr_t)arg, memory_order_release);
    atomic_store_explicit(&pool.ticket, ((uint_fast64_t)(gen & 0xFFFFFF) << 40) | ((uint_fast64_t)n_chunks << 20),
                          memory_order_release);
    pthread_mutex_lock(&pool.mu);
    atomic_store_explicit(&pool.gen, gen, memory_order_release);
    if (pool.sleepers) pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    run_chunks(gen, fn, arg);
    int spins = 0;
    while (atomic_load_explicit(&pool.busy, memory_order_acquire) > 0) {  /* chunks a worker still runs */
        if (++spins % 1024 == 0) sched_yield();
        cpu_relax();
    }
    pthread_mutex_unlock(&pool_start);
}


atomic_int gemm_threads = 1;
