/* A small persistent thread pool for the native decode step (decode_stack.c).

   Why not OpenMP or torch's pool: a decode step splits ~150 short loops (30-150 us each) over the
   cores, and an OpenMP region entered from the engine's scheduler thread costs ~100 us of
   hand-off in libgomp. Here helpers spin briefly on a generation counter between the loops of a
   step (a hand-off costs about a microsecond) and sleep on a condition variable after
   SPIN_ROUNDS idle rounds, so they hold no core between steps or while torch runs. One caller at
   a time uses the pool; a second concurrent caller runs its loop on its own thread. */
#define _GNU_SOURCE /* sched_getaffinity */
#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <unistd.h>

#define POOL_MAX 64
#define SPIN_ROUNDS 20000 /* idle rounds (~100-300 us) before a helper sleeps */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static struct {
    pthread_mutex_t caller;                 /* held by the thread dispatching a loop */
    pthread_mutex_t sleep_lock;             /* guards sleeping helpers and their wake-up */
    pthread_cond_t wake;
    int64_t started;                        /* helper threads running (parts 1..started) */
    _Atomic uint64_t generation;            /* bumped once per dispatched loop */
    _Atomic int64_t pending;                /* helpers not yet done with the current loop */
    rb_parallel_fn fn;
    void *ctx;
    int64_t parts;
} pool = {.caller = PTHREAD_MUTEX_INITIALIZER, .sleep_lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER};

/* the generation current when helper i was created: its first loop is the next one */
static uint64_t birth_generation[POOL_MAX];

static void *helper(void *arg) {
    const int64_t part = (int64_t)(intptr_t)arg;
    uint64_t seen = birth_generation[part];
    for (;;) {
        uint64_t now;
        int64_t idle = 0;
        while ((now = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen) {
            if (++idle < SPIN_ROUNDS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&pool.sleep_lock);
            while ((now = atomic_load(&pool.generation)) == seen) pthread_cond_wait(&pool.wake, &pool.sleep_lock);
            pthread_mutex_unlock(&pool.sleep_lock);
            break;
        }
        seen = now;
        if (part < pool.parts) pool.fn(pool.ctx, part, pool.parts);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_acq_rel);
    }
    return NULL;
}

/* a forked child has none of the parent's helpers: start again from an empty pool */
static void reset_after_fork(void) {
    pthread_mutex_init(&pool.caller, NULL);
    pthread_mutex_init(&pool.sleep_lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.started = 0;
}

static pthread_once_t fork_hook = PTHREAD_ONCE_INIT;
static void install_fork_hook(void) { pthread_atfork(NULL, NULL, reset_after_fork); }

/* The CPUs this process may run on. Every dispatch waits for each started helper to see it, so a
   helper beyond them (a caller once asked for more threads than there are cores) makes every later
   loop wait for its turn on a busy core: the pool stops at one helper fewer than this count. */
static int64_t usable_cpus(void) {
#ifdef __linux__
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
#endif
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? n : 1;
}

static void grow(int64_t helpers) {
    static int64_t most = -1; /* helpers worth starting; the caller lock is held here */
    pthread_once(&fork_hook, install_fork_hook);
    if (most < 0) most = usable_cpus() - 1;
    if (helpers > most) helpers = most;
    while (pool.started < helpers && pool.started < POOL_MAX - 1) {
        pthread_t thread;
        birth_generation[pool.started + 1] = atomic_load(&pool.generation);
        if (pthread_create(&thread, NULL, helper, (void *)(intptr_t)(pool.started + 1)) != 0) break;
        pthread_detach(thread);
        pool.started++;
    }
}

void rb_parallel(rb_parallel_fn fn, void *ctx, int64_t parts) {
    if (parts > 1 && pthread_mutex_trylock(&pool.caller) == 0) {
        grow(parts - 1);
        if (parts > pool.started + 1) parts = pool.started + 1;
        if (parts > 1) {
            pool.fn = fn;
            pool.ctx = ctx;
            pool.parts = parts;
            atomic_store(&pool.pending, pool.started);
            pthread_mutex_lock(&pool.sleep_lock); /* a helper between its last check and its wait holds it */
            atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
            pthread_cond_broadcast(&pool.wake);
            pthread_mutex_unlock(&pool.sleep_lock);
            fn(ctx, 0, parts);
            while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0) cpu_relax();
            pthread_mutex_unlock(&pool.caller);
            return;
        }
        pthread_mutex_unlock(&pool.caller);
    }
    for (int64_t part = 0; part < parts; part++) fn(ctx, part, parts);
}
