/* A tiny thread pool for the expert kernels: persistent workers, one job at a time, items handed out by CAS.
 *
 * The calling thread works too. It returns as soon as every item is done, without waiting for workers that
 * never woke up (a busy core must not stall the call by a scheduler slice): a late worker finds the job's
 * ticket closed and goes back to sleep. The ticket packs (job sequence << 32 | next item) in one atomic.
 */
#ifndef FT_POOL_H
#define FT_POOL_H

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#define FT_MAX_THREADS 256

typedef void (*ft_task_fn)(void *ctx, int64_t item);

typedef struct {
    pthread_t threads[FT_MAX_THREADS];
    int n_workers;          /* threads besides the caller */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic uint32_t gen;   /* job sequence number; workers sleep until it changes */
    _Atomic uint64_t ticket;
    _Atomic int64_t done;
    _Atomic(ft_task_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n_items;
    _Atomic int stop;
    int spin_us;
} ft_pool;

static ft_pool g_pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .spin_us = 300};

/* One job at a time owns the pool; a caller that finds it busy (another Python thread: ctypes releases the GIL)
 * runs its items on its own thread instead of corrupting the running job. */
static pthread_mutex_t g_run = PTHREAD_MUTEX_INITIALIZER;

static inline double ft_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

static inline void ft_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Run items of job `seq` until its ticket is closed or exhausted. */
static void ft_pool_work(uint32_t seq) {
    for (;;) {
        uint64_t t = atomic_load(&g_pool.ticket);
        if ((uint32_t)(t >> 32) != seq) return;
        int64_t i = (int64_t)(t & 0xffffffffu);
        ft_task_fn fn = atomic_load(&g_pool.fn);
        void *ctx = atomic_load(&g_pool.ctx);
        int64_t n = atomic_load(&g_pool.n_items);
        if (i >= n) return;
        /* the CAS succeeding proves fn/ctx/n above belong to job `seq` (they are rewritten only after the
           ticket has moved to the next sequence) */
        if (!atomic_compare_exchange_weak(&g_pool.ticket, &t, t + 1)) continue;
        fn(ctx, i);
        atomic_fetch_add(&g_pool.done, 1);
    }
}

static void *ft_pool_main(void *arg) {
    (void)arg;
    uint32_t seen = atomic_load(&g_pool.gen);
    for (;;) {
        double t0 = ft_now_us();
        int spins = 0;
        while (atomic_load(&g_pool.gen) == seen && !atomic_load(&g_pool.stop)) {
            ft_cpu_relax();
            if ((++spins & 255) == 0 && ft_now_us() - t0 > g_pool.spin_us) break;
        }
        if (atomic_load(&g_pool.gen) == seen) {
            pthread_mutex_lock(&g_pool.mu);
            while (atomic_load(&g_pool.gen) == seen && !atomic_load(&g_pool.stop))
                pthread_cond_wait(&g_pool.cv, &g_pool.mu);
            pthread_mutex_unlock(&g_pool.mu);
        }
        if (atomic_load(&g_pool.stop)) return NULL;
        seen = atomic_load(&g_pool.gen);
        ft_pool_work(seen);
    }
}

static void ft_pool_stop(void) {
    if (g_pool.n_workers == 0) return;
    pthread_mutex_lock(&g_pool.mu);
    atomic_store(&g_pool.stop, 1);
    pthread_cond_broadcast(&g_pool.cv);
    pthread_mutex_unlock(&g_pool.mu);
    for (int i = 0; i < g_pool.n_workers; i++) pthread_join(g_pool.threads[i], NULL);
    g_pool.n_workers = 0;
    atomic_store(&g_pool.stop, 0);
}

/* Total threads including the caller; returns the number actually running. */
static int ft_pool_resize(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > FT_MAX_THREADS) n_threads = FT_MAX_THREADS;
    pthread_mutex_lock(&g_run);
    if (n_threads - 1 == g_pool.n_workers) {
        pthread_mutex_unlock(&g_run);
        return n_threads;
    }
    ft_pool_stop();
    int want = n_threads - 1;
    for (int i = 0; i < want; i++) {
        if (pthread_create(&g_pool.threads[i], NULL, ft_pool_main, NULL) != 0) break;
        g_pool.n_workers = i + 1;
    }
    int running = g_pool.n_workers + 1;
    pthread_mutex_unlock(&g_run);
    return running;
}

/* Run fn(ctx, i) for i in [0, n) on the pool; returns when all are done. Safe to call from several threads
 * (only one of them uses the pool at a time; the others run their items serially). */
static void ft_parallel_for(ft_task_fn fn, void *ctx, int64_t n) {
    if (n <= 0) return;
    if (n == 1 || pthread_mutex_trylock(&g_run) != 0) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    if (g_pool.n_workers == 0) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i);
        pthread_mutex_unlock(&g_run);
        return;
    }
    uint32_t seq = atomic_load(&g_pool.gen) + 1;
    atomic_store(&g_pool.ticket, ((uint64_t)seq << 32) | 0xffffffffu); /* closed while fields change */
    atomic_store(&g_pool.fn, fn);
    atomic_store(&g_pool.ctx, ctx);
    atomic_store(&g_pool.n_items, n);
    atomic_store(&g_pool.done, 0);
    atomic_store(&g_pool.ticket, (uint64_t)seq << 32);
    pthread_mutex_lock(&g_pool.mu);
    atomic_store(&g_pool.gen, seq);
    pthread_cond_broadcast(&g_pool.cv);
    pthread_mutex_unlock(&g_pool.mu);
    ft_pool_work(seq);
    int spins = 0;
    while (atomic_load(&g_pool.done) < n) {
        ft_cpu_relax();
        if (++spins > 4096) sched_yield();
    }
    pthread_mutex_unlock(&g_run);
}

#endif
