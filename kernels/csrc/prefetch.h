/* Software prefetches of data a kernel streams from memory (KV pool rows, weight blocks), asked of
   the L2 cache (prefetcht1), not of L1 (prefetcht0). A core tracks only a few outstanding L1
   misses, and a kernel that asks for a whole block ahead (an attention block's 256 K and V lines, a
   weight group's lines) asks for more: with every prefetch into L1 compiled out, decode attention
   over cold KV took the same time, so they were evidently dropped (this VM exposes no counters to
   show it). Into L2 (AMD EPYC Zen 4, 2 threads, the embedded model's shape, 30 layers of KV out of
   cache): decode attention of 8 requests over 1,500 keys 32.4 -> 13.0 ms, the fp32 pool's kernel
   48-55 -> 40-43 ms; batch-1 decode of a 0.54B Q4_K_M file 1.44x, of the embedded Q4_1 model
   1.05x (batch 32 1.12x), with fp32 weights 1.24x; warm data level. A line then reaches L1 from L2
   on use, which out-of-order execution hides. */
#ifndef RB_PREFETCH_H
#define RB_PREFETCH_H

#define rb_prefetch(address) __builtin_prefetch((address), 0, 2) /* read, locality 2: prefetcht1 */

#endif
