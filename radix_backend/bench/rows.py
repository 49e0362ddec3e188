"""One benchmark row: our side against a baseline, timed, with their outputs compared."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Side:
    """One side's wall time and its outputs, item by item."""

    wall_s: float
    outputs: list[str]


def compare(name: str, ours: Side, base: Side, extra: dict[str, Any],
            baseline: str = "HF transformers") -> dict[str, Any]:
    """The row: both times, the speedup (base / ours), how many outputs are equal, and `extra`."""
    same = sum(a == b for a, b in zip(ours.outputs, base.outputs))
    return {"workload": name, "baseline": baseline, "radix_s": round(ours.wall_s, 3), "hf_s": round(base.wall_s, 3),
            "speedup": round(base.wall_s / ours.wall_s, 2) if ours.wall_s > 0 else float("inf"),
            "agreement": f"{same}/{len(ours.outputs)}", **extra}
