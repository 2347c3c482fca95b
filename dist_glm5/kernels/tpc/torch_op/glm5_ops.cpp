// torch.ops.glm5.mxfp4_dequant_perm(packed u8 [R, K/2], scales u8 [R, K/32]) -> bf16 [R, K],
// columns in the kernel's permuted order (see gaudi2/mxfp4_dequant_bf16_gaudi2.c). The HPU impl
// runs the TPC kernel through the PT2 custom-op API; the Meta impl lets torch.compile trace it.
// Whether this API accepts a u8 -> bf16 TPC kernel is open (Model-References: "BF16 or HMP is
// not supported yet" for its example): gaudi.md section 10 item 7.
#include <torch/extension.h>

#include "hpu_custom_op_pt2.h"

static const char* kGuid = "glm5_mxfp4_dequant_bf16_gaudi2";

static habana::PartialOutputMetaDataVector output_meta(const at::Stack& inputs) {
    auto sizes = inputs[0].toTensor().sizes().vec();
    sizes.back() *= 2;
    return {habana::PartialOutputMetaData{c10::ScalarType::BFloat16, sizes}};
}

static bool register_ops() {
    habana::custom_op::registerUserCustomOp("glm5::mxfp4_dequant_perm", kGuid, output_meta,
                                            nullptr);
    return true;
}

static void check(const at::Tensor& packed, const at::Tensor& scales) {
    TORCH_CHECK(packed.scalar_type() == c10::ScalarType::Byte &&
                    scales.scalar_type() == c10::ScalarType::Byte,
                "mxfp4_dequant_perm takes uint8 packed values and uint8 E8M0 scales");
    TORCH_CHECK((packed.size(-1) * 2) % 512 == 0 && packed.size(-1) == scales.size(-1) * 16,
                "mxfp4_dequant_perm needs K (= 2 * packed.size(-1)) a multiple of 512 and "
                "scales.size(-1) = K / 32");
}

at::Tensor mxfp4_dequant_perm(at::Tensor packed, at::Tensor scales) {
    check(packed, scales);
    auto op = habana::custom_op::UserCustomOpDescriptor::getUserCustomOpDescriptor(
        "glm5::mxfp4_dequant_perm");
    std::vector<c10::IValue> inputs{packed, scales};
    return op.execute(inputs)[0];
}

at::Tensor mxfp4_dequant_perm_meta(at::Tensor packed, at::Tensor scales) {
    auto sizes = packed.sizes().vec();
    sizes.back() *= 2;
    return packed.new_empty(sizes, c10::ScalarType::BFloat16);
}

TORCH_LIBRARY(glm5, m) { m.def("mxfp4_dequant_perm(Tensor packed, Tensor scales) -> Tensor"); }
TORCH_LIBRARY_IMPL(glm5, HPU, m) { m.impl("mxfp4_dequant_perm", mxfp4_dequant_perm); }
TORCH_LIBRARY_IMPL(glm5, Meta, m) { m.impl("mxfp4_dequant_perm", mxfp4_dequant_perm_meta); }

static const bool kRegistered = register_ops();
