/* The kernel library's thread pool (pool.c): pool_run(fn, arg, n_chunks, nth) calls fn(arg, c)
 * for every chunk c over the calling thread and nth - 1 workers. Every file that splits work over
 * the cores includes this. */
#ifndef LT_POOL_H
#define LT_POOL_H

#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "common.h"

typedef void (*task_fn)(void *arg, int64_t chunk);

LT_INTERNAL void pool_run(task_fn fn, void *arg, int64_t n_chunks, int nth);

/* The thread count of a pooled kernel called with nth <= 0 (sgemm.c lt_set_gemm_threads sets it). */
LT_INTERNAL extern atomic_int gemm_threads;

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

#endif
