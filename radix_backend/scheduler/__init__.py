"""The scheduler: requests, admission (which waiting request runs next), constrained decoding and
sampling, and the loop that batches them into forward steps, one per engine."""
