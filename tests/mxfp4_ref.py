"""An MXFP4 decoder that shares no code with dist_glm5.quant.mxfp4: ml_dtypes' own E2M1 and E8M0
types give every element's and every scale's value (OCP Microscaling: two E2M1 codes per byte,
element 2j in the LOW nibble; one E8M0 scale per 32 consecutive elements of the last dim)."""

from __future__ import annotations

import numpy as np
import torch
from conftest import require


def decode_independent(
    packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """packed uint8 [..., n/2], scales uint8 [..., n/32] -> values [..., n] in dtype."""
    ml_dtypes = require("ml_dtypes")
    assert packed.dtype == torch.uint8 and scales.dtype == torch.uint8
    p = packed.contiguous().numpy()
    codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    scale = scales.contiguous().numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    assert values.shape[-1] == 32 * scale.shape[-1], (values.shape, scale.shape)
    # every product is exact in float64; one rounding (overflow only) on the way to dtype
    return torch.from_numpy(values * np.repeat(scale, 32, axis=-1)).to(dtype)
