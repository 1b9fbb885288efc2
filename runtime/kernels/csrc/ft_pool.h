/* A tiny thread pool for the expert kernels: persistent workers, one job at a time, static shares + stealing.
 *
 * Each participant (the calling thread is one) owns a contiguous share of the items, so its rows stream in one
 * long run for the hardware prefetcher and its hand-outs touch only its own cache line; when its share is done it
 * steals the back half of what is left of another share (and runs it front to back), again and again. The caller
 * returns as soon as every item is done, never waiting for a worker that did not wake up (a busy core must not
 * stall the call by a scheduler slice): it steals that worker's share, and a late worker finds the job's shares
 * empty and goes back to sleep. Idle workers poll for ``spin_us`` (5 ms, as long as ggml's pool and libgomp poll;
 * ``FREETOKEN_CPU_SPIN_US``; the engine shortens it while torch's threads carry a prefill) and then sleep: the gaps
 * between the kernel calls of a decode step stay inside the poll, so no call waits for a sleeping worker's core.
 * A worker that finds itself on another participant's CPU moves off it (``ft_pool_avoid``).
 * (Before: one shared ticket, one CAS per item on a line both cores wrote: two threads ran slower than one at
 * M = 1, where an item is under a microsecond of work.)
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

/* One participant's share of the current job in one word: job sequence (24 bits) | next item (20) | end (20).
 * The owner takes items from the front, thieves from the back, each with one CAS; the word sits alone in its
 * cache line, so an owner's hand-outs never touch a line another core is writing. */
#define FT_SEQ_BITS 24
#define FT_IDX_BITS 20
#define FT_IDX_MASK ((1u << FT_IDX_BITS) - 1)
#define FT_MAX_ROUND ((int64_t)FT_IDX_MASK) /* items per round; bigger jobs run in rounds */

typedef struct {
    _Alignas(64) _Atomic uint64_t range;
    _Atomic int64_t done; /* items this participant finished in the current job */
    _Atomic int cpu;      /* the CPU this participant last ran on (-1 unknown); slot 0 is the caller */
} ft_slot;

typedef struct {
    pthread_t threads[FT_MAX_THREADS];
    int n_workers;          /* threads besides the caller */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic uint32_t gen;   /* job sequence number; workers sleep until it changes */
    _Atomic(ft_task_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t base;   /* item offset of this round */
    _Atomic int stop;
    _Atomic int spin_us;    /* how long an idle worker polls before it sleeps; read on every check */
    _Atomic uint32_t sleep_gen; /* a job after which workers sleep at once (its result goes to torch's threads) */
    ft_slot slots[FT_MAX_THREADS];
} ft_pool;

#define FT_SPIN_US_DEFAULT 5000
static ft_pool g_pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER, .spin_us = FT_SPIN_US_DEFAULT};

/* One job at a time owns the pool; a caller that finds it busy (another Python thread: ctypes releases the GIL)
 * runs its items on its own thread instead of corrupting the running job. */
static pthread_mutex_t g_run = PTHREAD_MUTEX_INITIALIZER;

#ifdef __linux__
static cpu_set_t g_allowed; /* the CPUs the pool's creator may run on (workers inherit them) */
#endif

/* A worker sharing a CPU with another participant (typically the caller: after an idle gap the OS may wake both on
 * one CPU and leave the other idle for milliseconds, and a spinning worker then only takes turns with the caller)
 * moves itself off the CPUs the others are on. Measured on this 2-vCPU machine: after a 10 ms sleep half the calls
 * ran with caller and worker on one vCPU, at 1-thread speed. Linux only; cheap (sched_getcpu is a vDSO read). */
static void ft_pool_avoid(int me) {
#ifdef __linux__
    int cpu = sched_getcpu(), parts = g_pool.n_workers + 1, clash = 0;
    if (cpu < 0) return;
    atomic_store_explicit(&g_pool.slots[me].cpu, cpu, memory_order_relaxed);
    for (int p = 0; p < parts; p++)
        if (p != me && atomic_load_explicit(&g_pool.slots[p].cpu, memory_order_relaxed) == cpu) clash = 1;
    if (!clash) return;
    cpu_set_t m = g_allowed;
    for (int p = 0; p < parts; p++) {
        int c = atomic_load_explicit(&g_pool.slots[p].cpu, memory_order_relaxed);
        if (p != me && c >= 0 && c < CPU_SETSIZE) CPU_CLR(c, &m);
    }
    if (CPU_COUNT(&m) > 0) pthread_setaffinity_np(pthread_self(), sizeof m, &m);
#else
    (void)me;
#endif
}

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

static inline uint64_t ft_range(uint32_t seq, int64_t lo, int64_t hi) {
    return ((uint64_t)(seq & ((1u << FT_SEQ_BITS) - 1)) << (2 * FT_IDX_BITS)) | ((uint64_t)lo << FT_IDX_BITS) |
           (uint64_t)hi;
}

/* Claim items of job `seq` from `slot`: the next one from the front when `own`, else (stealing) the back half of
 * what is left, run front to back so the thief also streams forward (stolen one at a time from the back, a share ran
 * in descending addresses and defeated the prefetcher: two threads were slower than one when a worker woke late).
 * Returns the first item and sets *count; -1 when the slot has none. The CAS succeeding proves the fn/ctx/base read
 * before it belong to job `seq`: the next job rewrites them only after every item of this one was claimed, and a
 * claimed word never comes back. */
static inline int64_t ft_claim(ft_slot *slot, uint32_t seq, int own, ft_task_fn *fn, void **ctx, int64_t *base,
                               int64_t *count) {
    for (;;) {
        uint64_t r = atomic_load(&slot->range);
        if ((uint32_t)(r >> (2 * FT_IDX_BITS)) != (seq & ((1u << FT_SEQ_BITS) - 1))) return -1;
        int64_t lo = (int64_t)((r >> FT_IDX_BITS) & FT_IDX_MASK), hi = (int64_t)(r & FT_IDX_MASK);
        if (lo >= hi) return -1;
        *fn = atomic_load(&g_pool.fn);
        *ctx = atomic_load(&g_pool.ctx);
        *base = atomic_load(&g_pool.base);
        int64_t n = own ? 1 : (hi - lo + 1) / 2;
        uint64_t next = own ? ft_range(seq, lo + 1, hi) : ft_range(seq, lo, hi - n);
        if (atomic_compare_exchange_weak(&slot->range, &r, next)) {
            *count = n;
            return own ? lo : hi - n;
        }
    }
}

/* Participant `me` runs its own share of job `seq`, then steals from the others' until nothing is left. */
static void ft_pool_work(uint32_t seq, int me) {
    int parts = g_pool.n_workers + 1;
    ft_task_fn fn;
    void *ctx;
    int64_t base, i, n;
    ft_slot *mine = &g_pool.slots[me];
    while ((i = ft_claim(mine, seq, 1, &fn, &ctx, &base, &n)) >= 0) {
        fn(ctx, base + i);
        atomic_fetch_add_explicit(&mine->done, 1, memory_order_release);
    }
    for (int k = 1; k < parts; k++) {
        ft_slot *other = &g_pool.slots[(me + k) % parts];
        while ((i = ft_claim(other, seq, 0, &fn, &ctx, &base, &n)) >= 0) {
            for (int64_t j = i; j < i + n; j++) fn(ctx, base + j);
            atomic_fetch_add_explicit(&mine->done, n, memory_order_release);
        }
    }
}

static void *ft_pool_main(void *arg) {
    int me = (int)(intptr_t)arg;
    uint32_t seen = atomic_load(&g_pool.gen);
    for (;;) {
        double t0 = ft_now_us();
        int spins = 0;
        const int poll = atomic_load(&g_pool.sleep_gen) != seen;
        while (poll && atomic_load(&g_pool.gen) == seen && !atomic_load(&g_pool.stop)) {
            ft_cpu_relax();
            if ((++spins & 255) == 0) {
                if (ft_now_us() - t0 > atomic_load_explicit(&g_pool.spin_us, memory_order_relaxed)) break;
                if ((spins & 4095) == 0) ft_pool_avoid(me);
            }
        }
        if (atomic_load(&g_pool.gen) == seen) {
            pthread_mutex_lock(&g_pool.mu);
            while (atomic_load(&g_pool.gen) == seen && !atomic_load(&g_pool.stop))
                pthread_cond_wait(&g_pool.cv, &g_pool.mu);
            pthread_mutex_unlock(&g_pool.mu);
        }
        if (atomic_load(&g_pool.stop)) return NULL;
        seen = atomic_load(&g_pool.gen);
        ft_pool_avoid(me);
        ft_pool_work(seen, me);
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
#ifdef __linux__
    if (sched_getaffinity(0, sizeof g_allowed, &g_allowed) != 0) CPU_ZERO(&g_allowed);
#endif
    for (int i = 0; i < FT_MAX_THREADS; i++) atomic_store(&g_pool.slots[i].cpu, -1);
    int want = n_threads - 1;
    for (int i = 0; i < want; i++) {
        if (pthread_create(&g_pool.threads[i], NULL, ft_pool_main, (void *)(intptr_t)(i + 1)) != 0) break;
        g_pool.n_workers = i + 1;
    }
    int running = g_pool.n_workers + 1;
    pthread_mutex_unlock(&g_run);
    return running;
}

/* One round of at most FT_MAX_ROUND items: equal contiguous shares, then wake the workers and work. The caller
 * returns once every item is done; it never waits for a worker the OS has not scheduled (it steals that share),
 * only for items already claimed. */
static void ft_pool_round(ft_task_fn fn, void *ctx, int64_t base, int64_t n, int sleep_after) {
    int parts = g_pool.n_workers + 1;
    uint32_t seq = atomic_load(&g_pool.gen) + 1;
    if (sleep_after) atomic_store(&g_pool.sleep_gen, seq);
#ifdef __linux__
    atomic_store_explicit(&g_pool.slots[0].cpu, sched_getcpu(), memory_order_relaxed);
#endif
    atomic_store(&g_pool.fn, fn);
    atomic_store(&g_pool.ctx, ctx);
    atomic_store(&g_pool.base, base);
    for (int p = 0; p < parts; p++) {
        atomic_store(&g_pool.slots[p].done, 0);
        atomic_store(&g_pool.slots[p].range, ft_range(seq, n * p / parts, n * (p + 1) / parts));
    }
    pthread_mutex_lock(&g_pool.mu);
    atomic_store(&g_pool.gen, seq);
    pthread_cond_broadcast(&g_pool.cv);
    pthread_mutex_unlock(&g_pool.mu);
    ft_pool_work(seq, 0);
    int spins = 0;
    for (;;) {
        int64_t done = 0;
        for (int p = 0; p < parts; p++) done += atomic_load_explicit(&g_pool.slots[p].done, memory_order_acquire);
        if (done >= n) break;
        ft_cpu_relax();
        if (++spins > 4096) sched_yield();
    }
}

/* Run fn(ctx, i) for i in [0, n) on the pool; returns when all are done. Safe to call from several threads
 * (only one of them uses the pool at a time; the others run their items serially). ``sleep_after``: the workers
 * sleep as soon as this job is done instead of polling (the caller hands the result to torch's threads, e.g. a
 * dequantized weight about to go through torch.mm: a polling worker would only take turns with them). */
static void ft_parallel_run(ft_task_fn fn, void *ctx, int64_t n, int sleep_after) {
    if (n <= 0) return;
    if (n == 1 || pthread_mutex_trylock(&g_run) != 0) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i);
        return;
    }
    if (g_pool.n_workers == 0) {
        for (int64_t i = 0; i < n; i++) fn(ctx, i);
    } else {
        for (int64_t base = 0; base < n; base += FT_MAX_ROUND)
            ft_pool_round(fn, ctx, base, n - base < FT_MAX_ROUND ? n - base : FT_MAX_ROUND,
                          sleep_after && base + FT_MAX_ROUND >= n);
    }
    pthread_mutex_unlock(&g_run);
}

static void ft_parallel_for(ft_task_fn fn, void *ctx, int64_t n) { ft_parallel_run(fn, ctx, n, 0); }

#endif
