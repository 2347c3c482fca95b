"""Builds libglm5_ops (torch.ops.glm5.*) on a Gaudi image: `python setup.py build_ext --inplace`
from this folder (see kernels/tpc/README.md). Never run on CPU machines."""

import os

from habana_frameworks.torch.utils.lib_utils import get_include_dir, get_lib_dir
from setuptools import setup
from torch.utils import cpp_extension

# the plugin matches the execution mode the library will be loaded in (Model-References example)
LAZY = os.environ.get("PT_HPU_LAZY_MODE", "1") == "1"

setup(
    name="glm5_ops",
    ext_modules=[
        cpp_extension.CppExtension(
            "glm5_ops",
            ["glm5_ops.cpp"],
            include_dirs=[get_include_dir(), "/usr/include/habanalabs"],
            library_dirs=[get_lib_dir()],
            libraries=["habana_pytorch_plugin" if LAZY else "habana_pytorch2_plugin"],
            extra_compile_args=["-std=c++17"],
        )
    ],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
