"""Third-party MXFP4 encoders we check ourselves against (imported only when asked for).

quark_encode: AMD Quark 0.13's weight-only MXFP4 export path for one weight: a weight quantizer
from OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False) (the mxfp4_weight_only scheme) observes it, then
StaticScaledRealQuantizer.to_real_quantize_params packs `weight` uint8 [out, in/2] and
maybe_convert_and_transpose_scale gives `weight_scale` uint8 [out, in/32], as export does.
torchao_encode: torchao's to_mx with ScaleCalculationMode.FLOOR (the OCP rule).
"""

from __future__ import annotations

import torch


def quark_encoder():
    from quark.torch.export.nn.modules.realquantizer import get_real_quantizer
    from quark.torch.quantization.config.config import OCP_MXFP4Spec
    from quark.torch.quantization.tensor_quantize import FakeQuantizeBase

    spec = OCP_MXFP4Spec(ch_axis=-1, is_dynamic=False).to_quantization_spec()

    def run(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fq = FakeQuantizeBase.get_fake_quantize(spec, device=w.device)
        fq.disable_fake_quant()  # only the observer is needed to set the scale
        fq(w)
        rq = get_real_quantizer(
            qspec=spec,
            quantizer=fq,
            reorder=True,
            real_quantized=False,
            float_dtype=w.dtype,
            device=w.device,
        )
        packed = rq.to_real_quantize_params(w)
        rq.maybe_convert_and_transpose_scale()
        return packed, rq.scale

    return run


def torchao_encoder():
    from torchao.prototype.mx_formats import mx_tensor as mx
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    def run(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if w.dtype == torch.float16:  # torchao takes bf16/fp32 only; fp16 -> fp32 is exact
            w = w.float()
        scale, data = mx.to_mx(
            w.contiguous(), torch.float4_e2m1fn_x2, 32, ScaleCalculationMode.FLOOR
        )
        return data.view(torch.uint8), scale.view(torch.uint8)

    return run
