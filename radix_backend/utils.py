"""Small helpers several layers share (the radix tree, admission, the router, the adapters)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .errors import ConstraintError


def common_prefix_len(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """Length of the common prefix of `a` and `b[start:]` (token ids or any comparable items)."""
    n = min(len(a), len(b) - start)
    if list(a[:n]) == list(b[start:start + n]):  # the common case, compared in C
        return n
    i = 0
    while a[i] == b[start + i]:
        i += 1
    return i


def load_json_text(text: str | bytes, what: str) -> Any:
    """The data of a JSON text a caller sent (a schema, say); malformed text is a ConstraintError
    (a 400) that names `what`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConstraintError(f"{what} is not valid JSON: {exc}") from None
