// Index space and access patterns of the MXFP4 dequant kernel; the kernel ELF is embedded by
// objcopy (CMakeLists.txt) as _binary___mxfp4_dequant_bf16_gaudi2_o_{start,end}.
#include "mxfp4_dequant_gaudi2.hpp"

#include <cstring>

extern unsigned char _binary___mxfp4_dequant_bf16_gaudi2_o_start;
extern unsigned char _binary___mxfp4_dequant_bf16_gaudi2_o_end;

namespace {
// f(i) = a*i + b over index-space dim `dim`, for tensor dim `tdim`
void map(tpc_lib_api::TensorAccessPattern& p, int tdim, int dim, int a) {
    p.mapping[tdim].indexSpaceDim = dim;
    p.mapping[tdim].a = a;
    p.mapping[tdim].start_b = 0;
    p.mapping[tdim].end_b = a - 1;
}
}  // namespace

tpc_lib_api::GlueCodeReturn Mxfp4DequantGaudi2::GetKernelName(
    char name[tpc_lib_api::MAX_NODE_NAME]) {
    strcpy(name, kGuid);
    return tpc_lib_api::GLUE_SUCCESS;
}

tpc_lib_api::GlueCodeReturn Mxfp4DequantGaudi2::GetGcDefinitions(
    tpc_lib_api::HabanaKernelParams* in, tpc_lib_api::HabanaKernelInstantiation* out) {
    if (in->inputTensorNr != 2) {
        in->inputTensorNr = 2;
        return tpc_lib_api::GLUE_INCOMPATIBLE_INPUT_COUNT;
    }
    if (in->outputTensorNr != 1) {
        in->outputTensorNr = 1;
        return tpc_lib_api::GLUE_INCOMPATIBLE_OUTPUT_COUNT;
    }
    const auto& packed = in->inputTensors[0].geometry;
    const auto& scales = in->inputTensors[1].geometry;
    const auto& dst = in->outputTensors[0].geometry;
    if (packed.dataType != tpc_lib_api::DATA_U8 || scales.dataType != tpc_lib_api::DATA_U8 ||
        dst.dataType != tpc_lib_api::DATA_BF16) {
        return tpc_lib_api::GLUE_INCOMPATIBLE_DATA_TYPE;
    }
    const uint64_t K = dst.maxSizes[0], R = dst.maxSizes[1];
    // K a multiple of 512: whole vectors and the permutation's block; shapes must agree
    if (K % 512 != 0 || packed.maxSizes[0] * 2 != K || scales.maxSizes[0] * 32 != K ||
        packed.maxSizes[1] != R || scales.maxSizes[1] != R) {
        return tpc_lib_api::GLUE_INCOMPATIBLE_INPUT_SIZE;
    }
    out->indexSpaceRank = 2;
    out->indexSpaceGeometry[0] = K / 512;  // one 256-byte packed vector per index
    out->indexSpaceGeometry[1] = R;
    map(out->inputTensorAccessPattern[0], 0, 0, 256);  // packed bytes
    map(out->inputTensorAccessPattern[1], 0, 0, 16);   // scale bytes
    map(out->outputTensorAccessPattern[0], 0, 0, 512); // bf16 elements
    for (auto* p : {&out->inputTensorAccessPattern[0], &out->inputTensorAccessPattern[1],
                    &out->outputTensorAccessPattern[0]}) {
        map(*p, 1, 1, 1);
    }
    const unsigned size = &_binary___mxfp4_dequant_bf16_gaudi2_o_end -
                          &_binary___mxfp4_dequant_bf16_gaudi2_o_start;
    const unsigned given = out->kernel.elfSize;
    out->kernel.elfSize = size;
    if (given < size) {
        return tpc_lib_api::GLUE_INSUFFICIENT_ELF_BUFFER;
    }
    memcpy(out->kernel.kernelElf, &_binary___mxfp4_dequant_bf16_gaudi2_o_start, size);
    return tpc_lib_api::GLUE_SUCCESS;
}
