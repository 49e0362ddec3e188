/* rb_parallel: run fn(ctx, part, parts) for part = 0..parts-1, part 0 on the calling thread and
   the others on persistent helper threads (thread_pool.c); returns when all parts are done.

   rb_units: a loop's work units, each part owning an equal run of them and taking the others'
   once its own are done. Why: a static split waits for its slowest part, and on a shared machine
   one core is often late (woken late from its sleep, or slowed by a neighbour): a 1,024-row
   matmul reached 1.84x its one-thread speed on two threads at the median, 1.93x at best. A part
   works through its own units in order (its weights stay in its core's cache) and takes another
   part's next unit only when it has none left. Which thread computes a unit never changes the
   unit's arithmetic. */
#ifndef RB_THREAD_POOL_H
#define RB_THREAD_POOL_H
#include <stdatomic.h>
#include <stdint.h>

typedef void (*rb_parallel_fn)(void *ctx, int64_t part, int64_t parts);
void rb_parallel(rb_parallel_fn fn, void *ctx, int64_t parts);

#define RB_MAX_PARTS 64

/* A loop over `rounds` x `groups` units (e.g. row chunks x blocks of weight rows): part p owns the
   groups [groups * p / parts, groups * (p + 1) / parts) in every round, and takes its units round
   by round, each round's groups in order. */
typedef struct {
    struct {
        _Alignas(64) _Atomic int64_t next; /* the owner's units handed out so far (a cache line each) */
    } cursor[RB_MAX_PARTS];
    int64_t parts, groups, rounds;
} rb_units;

typedef struct {
    int64_t round, group;
} rb_unit;

static inline void rb_units_init(rb_units *u, int64_t groups, int64_t rounds, int64_t parts) {
    u->parts = parts < 1 ? 1 : parts > RB_MAX_PARTS ? RB_MAX_PARTS : parts;
    u->groups = groups, u->rounds = rounds;
    for (int64_t p = 0; p < u->parts; p++) atomic_init(&u->cursor[p].next, 0);
}

/* The next unit for `part` (its own first, then the following parts'); 0 when none is left. Every
   unit is handed out exactly once, whichever parts ask and however many threads run them. */
static inline int rb_units_claim(rb_units *u, int64_t part, rb_unit *unit) {
    for (int64_t k = 0; k < u->parts; k++) {
        const int64_t p = (part + k) % u->parts, lo = u->groups * p / u->parts;
        const int64_t owned = u->groups * (p + 1) / u->parts - lo, total = owned * u->rounds;
        if (atomic_load_explicit(&u->cursor[p].next, memory_order_relaxed) >= total) continue;
        const int64_t i = atomic_fetch_add_explicit(&u->cursor[p].next, 1, memory_order_relaxed);
        if (i < total) {
            *unit = (rb_unit){i / owned, lo + i % owned};
            return 1;
        }
    }
    return 0;
}

#endif
