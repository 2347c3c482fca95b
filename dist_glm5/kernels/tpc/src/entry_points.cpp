// The two symbols the graph compiler looks up in a TPC kernel library (found via GC_KERNEL_PATH).
#include <cstring>

#include "mxfp4_dequant_gaudi2.hpp"

extern "C" {

tpc_lib_api::GlueCodeReturn GetKernelGuids(_IN_ tpc_lib_api::DeviceId deviceId,
                                           _INOUT_ uint32_t* kernelCount,
                                           _OUT_ tpc_lib_api::GuidInfo* guids) {
    if (deviceId != tpc_lib_api::DEVICE_ID_GAUDI2) {
        *kernelCount = 0;
        return tpc_lib_api::GLUE_SUCCESS;
    }
    if (guids != nullptr && *kernelCount >= 1) {
        Mxfp4DequantGaudi2().GetKernelName(guids[0].name);
    }
    *kernelCount = 1;
    return tpc_lib_api::GLUE_SUCCESS;
}

tpc_lib_api::GlueCodeReturn InstantiateTpcKernel(_IN_ tpc_lib_api::HabanaKernelParams* params,
                                                 _OUT_ tpc_lib_api::HabanaKernelInstantiation* out) {
    if (strcmp(params->guid.name, Mxfp4DequantGaudi2::kGuid) == 0) {
        return Mxfp4DequantGaudi2().GetGcDefinitions(params, out);
    }
    return tpc_lib_api::GLUE_NODE_NOT_FOUND;
}

}  // extern "C"
