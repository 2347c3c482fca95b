"""Builds libglm5_ops (torch.ops.glm5.*) on a Gaudi image: `python setup.py build_ext --inplace`
from this folder (see kernels/tpc/README.md). Never run on CPU machines."""

import os

from setuptools import setup
from torch.utils import cpp_extension

# the plugin's headers and library, through the backend's one habana importer
from dist_glm5.backends.hpu._hf import plugin_dirs

INCLUDE_DIR, LIB_DIR = plugin_dirs()

# the plugin matches the execution mode the library will be loaded in (Model-References example)
LAZY = os.environ.get("PT_HPU_LAZY_MODE", "1") == "1"

setup(
    name="glm5_ops",
    ext_modules=[
        cpp_extension.CppExtension(
            "glm5_ops",
            ["glm5_ops.cpp"],
            include_dirs=[INCLUDE_DIR, "/usr/include/habanalabs"],
            library_dirs=[LIB_DIR],
            libraries=["habana_pytorch_plugin" if LAZY else "habana_pytorch2_plugin"],
            extra_compile_args=["-std=c++17"],
        )
    ],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
