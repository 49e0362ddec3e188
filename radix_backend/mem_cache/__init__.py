"""Where the KV lives: the paged pool and its slot allocator, the radix tree over it, and the disk
tier that keeps evicted prefixes across restarts. Nothing here knows a model or a scheduler."""
