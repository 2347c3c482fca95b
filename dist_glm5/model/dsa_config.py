"""How DSA attention runs: the dense masked reference or the scaled sparse path, and its caps.

No torch here: the engine configuration carries it from the command line to the workers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DSAConfig:
    mode: str = (
        "reference"  # "reference": dense masked math (the oracle); "sparse": the scaled path
    )
    window: int = 64  # neighbouring queries whose selections are unioned in prefill
    dense_threshold: int = (
        32768  # contexts of at most this many keys attend densely (accurate softmax)
    )
    union_max_frac: float = 0.5  # a union above this fraction of the context attends densely
    gather_cap_bytes: int = 512 * 1024 * 1024
    indexer_row_chunk: int = 256  # query rows scored at once

    def __post_init__(self) -> None:
        if self.mode not in ("reference", "sparse"):
            raise ValueError(f"dsa mode {self.mode!r}: use 'reference' or 'sparse'")
        if self.window < 1 or self.gather_cap_bytes < 1 or not 0 < self.union_max_frac <= 1:
            raise ValueError(f"invalid DSA config {self}")
