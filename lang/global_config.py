"""Process-wide DSL settings, SGLang's `sgl.global_config` (same fields, same defaults).

`default_backend` is where `set_default_backend` writes and what programs run on when none is
passed (the in-process shared engine when unset). `skip_special_tokens_in_output` reaches every
gen; `enable_precache_with_tracing` turns run_batch's common-prefix caching on or off. The rest are
kept for programs that set them: `verbosity` (2 prints each finished run's text),
`enable_parallel_encoding` and `spaces_between_special_tokens_in_out` change nothing here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GlobalConfig:
    verbosity: int = 0
    default_backend: Any = None  # a lang.backends.BaseBackend
    skip_special_tokens_in_output: bool = True
    spaces_between_special_tokens_in_out: bool = True
    enable_precache_with_tracing: bool = True
    enable_parallel_encoding: bool = True


global_config = GlobalConfig()
