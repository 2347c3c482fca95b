// Glue for the TPC kernel gaudi2/mxfp4_dequant_bf16_gaudi2.c (GC 2.0 interface).
#pragma once

#include "gc_interface.h"
#include "tpc_kernel_lib_interface.h"

class Mxfp4DequantGaudi2 {
  public:
    static constexpr const char* kGuid = "glm5_mxfp4_dequant_bf16_gaudi2";
    tpc_lib_api::GlueCodeReturn GetKernelName(char name[tpc_lib_api::MAX_NODE_NAME]);
    tpc_lib_api::GlueCodeReturn GetGcDefinitions(tpc_lib_api::HabanaKernelParams* in,
                                                 tpc_lib_api::HabanaKernelInstantiation* out);
};
