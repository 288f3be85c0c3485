/* Persistent thread pool, one per backend: n-1 workers plus the calling thread.
 *
 * Work is never stolen or balanced dynamically: every parallel region hands thread i of n a
 * fixed share, so results are deterministic for a given n, and kernels partition *outputs* so
 * that no value is reduced in a thread-count-dependent order. Workers spin briefly and then sleep
 * on a condition variable (the machines this runs on are shared; no long busy-waits). */
#if defined(__linux__) && !defined(__hexagon__) /* Linux hosts: not the Hexagon executor */
#define HTP_START_APART 1 /* workers start on other CPUs than their creator's (htp_pool_resize) */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getcpu, pthread_attr_setaffinity_np, pthread_setaffinity_np */
#endif
#endif
#include "htp_internal.h"

#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>

#define HTP_MAX_THREADS 64
#define HTP_SPIN 20000

typedef struct worker {
    pthread_t th;
    uint32_t ith;
    uint64_t start_gen; /* generation at creation: a new worker must not replay an old region */
    htp_pool *pool;
#ifdef HTP_START_APART
    int restore;       /* started on one CPU (start_on): widen to `allowed` once running */
    cpu_set_t allowed; /* the creating thread's CPUs */
#endif
} worker;

struct htp_pool {
    pthread_mutex_t lock; /* protects generation changes and sleeping */
    pthread_cond_t wake;
    uint32_t nth;
    pid_t pid; /* process the workers belong to */
    worker workers[HTP_MAX_THREADS];
    _Atomic uint64_t generation;
    _Atomic uint32_t pending;
    _Atomic uint32_t barrier_count;
    _Atomic uint32_t barrier_sense;
    _Atomic int quit;
    htp_task_fn fn;
    void *ctx;
    void *scratch[HTP_MAX_THREADS][4];
    size_t scratch_size[HTP_MAX_THREADS][4];
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

htp_pool *htp_pool_new(void) {
    htp_pool *p = (htp_pool *)calloc(1, sizeof(*p));
    if (!p) return NULL;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    p->nth = 1;
    p->pid = getpid();
    return p;
}

static void *worker_main(void *arg) {
    worker *w = (worker *)arg;
    htp_pool *pool = w->pool;
#ifdef HTP_START_APART
    /* running on the CPU it was started on: the scheduler leaves it there while both are busy */
    if (w->restore) pthread_setaffinity_np(pthread_self(), sizeof(w->allowed), &w->allowed);
#endif
    uint64_t seen = w->start_gen;
    for (;;) {
        uint64_t gen;
        int spins = 0;
        while ((gen = atomic_load_explicit(&pool->generation, memory_order_acquire)) == seen &&
               !atomic_load(&pool->quit)) {
            if (++spins < HTP_SPIN) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&pool->lock);
            while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->quit))
                pthread_cond_wait(&pool->wake, &pool->lock);
            pthread_mutex_unlock(&pool->lock);
        }
        if (atomic_load(&pool->quit)) return NULL;
        seen = gen;
        pool->fn(pool->ctx, w->ith, pool->nth);
        atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_acq_rel);
    }
}

uint32_t htp_pool_nth(const htp_pool *p) { return p->nth; }

void htp_pool_after_fork(htp_pool *p) {
    /* the child has no worker threads: it restarts single-threaded */
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->wake, NULL);
    p->nth = 1;
    p->pid = getpid();
    atomic_store(&p->quit, 0);
    atomic_store(&p->pending, 0);
}

void htp_parallel(htp_pool *p, htp_task_fn fn, void *ctx) {
    if (p->nth == 1) {
        fn(ctx, 0, 1);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    atomic_store(&p->barrier_count, 0);
    atomic_store(&p->pending, p->nth - 1);
    pthread_mutex_lock(&p->lock);
    atomic_fetch_add_explicit(&p->generation, 1, memory_order_release);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    fn(ctx, 0, p->nth);
    int spins = 0;
    while (atomic_load_explicit(&p->pending, memory_order_acquire) != 0) {
        if (++spins < HTP_SPIN)
            cpu_relax();
        else
            sched_yield();
    }
}

void htp_barrier(htp_pool *p) {
    uint32_t n = p->nth;
    if (n == 1) return;
    uint32_t sense = atomic_load_explicit(&p->barrier_sense, memory_order_acquire);
    if (atomic_fetch_add_explicit(&p->barrier_count, 1, memory_order_acq_rel) == n - 1) {
        atomic_store_explicit(&p->barrier_count, 0, memory_order_relaxed);
        atomic_store_explicit(&p->barrier_sense, sense ^ 1u, memory_order_release);
        return;
    }
    int spins = 0;
    while (atomic_load_explicit(&p->barrier_sense, memory_order_acquire) == sense) {
        if (++spins < HTP_SPIN)
            cpu_relax();
        else
            sched_yield();
    }
}

static void stop_workers(htp_pool *p) {
    if (p->nth <= 1) return;
    pthread_mutex_lock(&p->lock);
    atomic_store(&p->quit, 1);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->lock);
    for (uint32_t i = 1; i < p->nth; i++) pthread_join(p->workers[i].th, NULL);
    atomic_store(&p->quit, 0);
    p->nth = 1;
}

/* Callers hold the owning backend's lock (no region is running). */
htp_status htp_pool_resize(htp_pool *p, uint32_t n) {
    if (n < 1 || n > HTP_MAX_THREADS) return HTP_E_INVALID;
#ifdef HTP_NO_THREADS
    if (n > 1) return HTP_E_UNSUPPORTED; /* a build without threads (the Hexagon executor) */
#endif
    if (n == p->nth) return HTP_OK;
    stop_workers(p);
    for (uint32_t i = 1; i < n; i++) {
        worker *w = &p->workers[i];
        w->ith = i;
        w->pool = p;
        w->start_gen = atomic_load(&p->generation);
#ifdef HTP_START_APART
        pthread_attr_t attr, *ap = NULL;
        /* A new thread starts on its creator's CPU, and Linux takes ~40 ms to move it: until
         * then the two share one CPU, and a fresh process's first parallel ops ran at half
         * speed or worse (a 2-thread add took ~1 ms instead of ~80 us for its first ~45 calls
         * on a 2-vCPU VM; a peak measured then came out at half). So worker i starts on the
         * i-th of the creator's CPUs after the one it runs on, and widens its affinity back to
         * all of them once running (start_on: nothing stays pinned). */
        w->restore = 0;
        const int here = sched_getcpu();
        if (here >= 0 && sched_getaffinity(0, sizeof(w->allowed), &w->allowed) == 0 &&
            CPU_COUNT(&w->allowed) > 1 && pthread_attr_init(&attr) == 0) {
            /* the creator's other CPUs, in order from the one after its own */
            int others[CPU_SETSIZE], m = 0;
            for (int k = 1; k < CPU_SETSIZE; k++) {
                const int c = (here + k) % CPU_SETSIZE;
                if (CPU_ISSET(c, &w->allowed)) others[m++] = c;
            }
            const int start_on = m ? others[(i - 1) % (uint32_t)m] : -1;
            cpu_set_t one;
            CPU_ZERO(&one);
            if (start_on >= 0) CPU_SET(start_on, &one);
            if (start_on >= 0 && pthread_attr_setaffinity_np(&attr, sizeof(one), &one) == 0) {
                ap = &attr;
                w->restore = 1;
            } else {
                pthread_attr_destroy(&attr);
            }
        }
        int rc = pthread_create(&w->th, ap, worker_main, w);
        if (ap) pthread_attr_destroy(ap);
        if (rc != 0 && ap) { /* the start CPU refused (gone offline since): start anywhere */
            w->restore = 0;
            rc = pthread_create(&w->th, NULL, worker_main, w);
        }
#else
        const int rc = pthread_create(&w->th, NULL, worker_main, w);
#endif
        if (rc != 0) {
            p->nth = i;
            stop_workers(p);
            return HTP_E_NOMEM;
        }
        p->nth = i + 1;
    }
    return HTP_OK;
}

void htp_pool_free(htp_pool *p) {
    if (!p) return;
    if (p->pid == getpid()) stop_workers(p);
    for (int i = 0; i < HTP_MAX_THREADS; i++)
        for (int j = 0; j < 4; j++) free(p->scratch[i][j]);
    free(p);
}

void *htp_scratch(htp_pool *p, uint32_t ith, uint32_t which, size_t bytes) {
    if (p->scratch_size[ith][which] < bytes) {
        free(p->scratch[ith][which]);
        size_t sz = (bytes + 4095) & ~(size_t)4095;
        void *q = NULL;
        if (posix_memalign(&q, 64, sz) != 0) q = NULL;
        p->scratch[ith][which] = q;
        p->scratch_size[ith][which] = q ? sz : 0;
    }
    return p->scratch[ith][which];
}
