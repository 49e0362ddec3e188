/* rb_parallel: run fn(ctx, part, parts) for part = 0..parts-1, part 0 on the calling thread and
   the others on persistent helper threads (thread_pool.c); returns when all parts are done. */
#ifndef RB_THREAD_POOL_H
#define RB_THREAD_POOL_H
#include <stdint.h>

typedef void (*rb_parallel_fn)(void *ctx, int64_t part, int64_t parts);
void rb_parallel(rb_parallel_fn fn, void *ctx, int64_t parts);

#endif
