/* Persistent thread pool: n-1 workers plus the calling thread.
 *
 * Work is never stolen or balanced dynamically: every parallel region hands thread i of n a
 * fixed share, so results are deterministic for a given n, and kernels partition *outputs* so
 * that no value is reduced in a thread-count-dependent order. Workers spin briefly and then sleep
 * on a condition variable (the machines this runs on are shared; no long busy-waits). */
#include "htp_internal.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#define HTP_MAX_THREADS 64
#define HTP_SPIN 20000

typedef struct worker {
    pthread_t th;
    uint32_t ith;
    uint64_t start_gen; /* generation at creation: a new worker must not replay an old region */
} worker;

static struct {
    pthread_mutex_t lock;      /* protects generation changes and sleeping */
    pthread_cond_t wake;
    pthread_mutex_t call_lock; /* one parallel region at a time (cffi releases the GIL) */
    uint32_t nth;
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
} pool = {
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .call_lock = PTHREAD_MUTEX_INITIALIZER,
    .nth = 1,
};

/* Serialises whole ops (scratch reservation + parallel region) against each other and against
 * set_num_threads: cffi releases the GIL, so Python threads may call in concurrently. */
static pthread_mutex_t api_lock = PTHREAD_MUTEX_INITIALIZER;
void htp_api_lock(void) { pthread_mutex_lock(&api_lock); }
void htp_api_unlock(void) { pthread_mutex_unlock(&api_lock); }

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void *worker_main(void *arg) {
    worker *w = (worker *)arg;
    uint64_t seen = w->start_gen;
    for (;;) {
        uint64_t gen;
        int spins = 0;
        while ((gen = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen &&
               !atomic_load(&pool.quit)) {
            if (++spins < HTP_SPIN) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&pool.lock);
            while (atomic_load(&pool.generation) == seen && !atomic_load(&pool.quit))
                pthread_cond_wait(&pool.wake, &pool.lock);
            pthread_mutex_unlock(&pool.lock);
        }
        if (atomic_load(&pool.quit)) return NULL;
        seen = gen;
        pool.fn(pool.ctx, w->ith, pool.nth);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_acq_rel);
    }
}

uint32_t htp_nth(void) { return pool.nth; }

void htp_parallel(htp_task_fn fn, void *ctx) {
    htp_ensure_init();
    pthread_mutex_lock(&pool.call_lock);
    if (pool.nth == 1) {
        fn(ctx, 0, 1);
        pthread_mutex_unlock(&pool.call_lock);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    atomic_store(&pool.barrier_count, 0);
    atomic_store(&pool.pending, pool.nth - 1);
    pthread_mutex_lock(&pool.lock);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    fn(ctx, 0, pool.nth);
    int spins = 0;
    while (atomic_load_explicit(&pool.pending, memory_order_acquire) != 0) {
        if (++spins < HTP_SPIN)
            cpu_relax();
        else
            sched_yield();
    }
    pthread_mutex_unlock(&pool.call_lock);
}

void htp_barrier(void) {
    uint32_t n = pool.nth;
    if (n == 1) return;
    uint32_t sense = atomic_load_explicit(&pool.barrier_sense, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool.barrier_count, 1, memory_order_acq_rel) == n - 1) {
        atomic_store_explicit(&pool.barrier_count, 0, memory_order_relaxed);
        atomic_store_explicit(&pool.barrier_sense, sense ^ 1u, memory_order_release);
        return;
    }
    int spins = 0;
    while (atomic_load_explicit(&pool.barrier_sense, memory_order_acquire) == sense) {
        if (++spins < HTP_SPIN)
            cpu_relax();
        else
            sched_yield();
    }
}

/* fork(): the child has no worker threads; it restarts single-threaded (set_num_threads to
 * grow again). Locks are taken around fork so the child never inherits one held mid-op. */
static void atfork_prepare(void) {
    pthread_mutex_lock(&api_lock);
    pthread_mutex_lock(&pool.call_lock);
}
static void atfork_parent(void) {
    pthread_mutex_unlock(&pool.call_lock);
    pthread_mutex_unlock(&api_lock);
}
static void atfork_child(void) {
    pool.nth = 1;
    atomic_store(&pool.quit, 0);
    atomic_store(&pool.pending, 0);
    pthread_mutex_unlock(&pool.call_lock);
    pthread_mutex_unlock(&api_lock);
}
void htp_pool_register_atfork(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

static void stop_workers(void) {
    if (pool.nth <= 1) return;
    pthread_mutex_lock(&pool.lock);
    atomic_store(&pool.quit, 1);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    for (uint32_t i = 1; i < pool.nth; i++) pthread_join(pool.workers[i].th, NULL);
    atomic_store(&pool.quit, 0);
    pool.nth = 1;
}

htp_status htp_set_num_threads(uint32_t n) {
    if (n < 1 || n > HTP_MAX_THREADS) return HTP_E_INVALID;
    htp_ensure_init();
    htp_api_lock();
    pthread_mutex_lock(&pool.call_lock);
    stop_workers();
    for (uint32_t i = 1; i < n; i++) {
        pool.workers[i].ith = i;
        pool.workers[i].start_gen = atomic_load(&pool.generation);
        if (pthread_create(&pool.workers[i].th, NULL, worker_main, &pool.workers[i]) != 0) {
            pool.nth = i;
            pthread_mutex_unlock(&pool.call_lock);
            htp_api_unlock();
            return HTP_E_NOMEM;
        }
        pool.nth = i + 1;
    }
    pool.nth = n;
    pthread_mutex_unlock(&pool.call_lock);
    htp_api_unlock();
    return HTP_OK;
}

uint32_t htp_get_num_threads(void) { return pool.nth; }

void *htp_scratch(uint32_t ith, uint32_t which, size_t bytes) {
    if (pool.scratch_size[ith][which] < bytes) {
        free(pool.scratch[ith][which]);
        size_t sz = (bytes + 4095) & ~(size_t)4095;
        void *p = NULL;
        if (posix_memalign(&p, 64, sz) != 0) p = NULL;
        pool.scratch[ith][which] = p;
        pool.scratch_size[ith][which] = p ? sz : 0;
    }
    return pool.scratch[ith][which];
}
