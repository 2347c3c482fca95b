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
    # Prefill attention of the sparse path: "rows" = each query over its own top-k rows, gathered
    # (cost ~ queries x top-k: the CPU's choice, measured: `bench longctx`); "windows" = the union
    # of a window's selections as one batched GEMM, or dense with the mask below dense_threshold
    # (Gaudi's rule: big static GEMMs, and its accuracy rule below 32K).
    prefill_attention: str = "rows"
    # "windows" beyond dense_threshold: the union of a window's selections found with a static
    # size (window x top-k slots, the unused ones masked) and the dense-or-union choice made from
    # that size alone, so no step reads a value back (Gaudi's rule); False: the exact union
    # (`nonzero`) and the choice by its real size (the CPU's default)
    static_union: bool = False
    # The indexer's keys in the cache: "exact" (the cache's dtype, the reference's scores) or
    # "int8" (quant/index_q8.py: D + 4 bytes a key, scored as int8 products; the sparse path only,
    # a speed and memory option whose selections may differ from the exact ones at near-ties)
    index_keys: str = "exact"

    @property
    def sparse(self) -> bool:
        """The scaled sparse path (else the dense masked reference)."""
        return self.mode == "sparse"

    def __post_init__(self) -> None:
        if self.prefill_attention not in ("rows", "windows"):
            raise ValueError(
                f"prefill_attention {self.prefill_attention!r}: use 'rows' or 'windows'"
            )
        if self.mode not in ("reference", "sparse"):
            raise ValueError(f"dsa mode {self.mode!r}: use 'reference' or 'sparse'")
        if self.index_keys not in ("exact", "int8"):
            raise ValueError(f"index_keys {self.index_keys!r}: use 'exact' or 'int8'")
        if self.index_keys == "int8" and self.mode != "sparse":
            raise ValueError(
                "index_keys 'int8' is for the sparse DSA path (--dsa sparse): the dense "
                "reference scores exact keys"
            )
        if self.window < 1 or self.gather_cap_bytes < 1 or not 0 < self.union_max_frac <= 1:
            raise ValueError(f"invalid DSA config {self}")
