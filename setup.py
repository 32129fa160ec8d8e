"""Build hvd_terngrad: pure Python plus one C++ shared library (csrc/) with a plain C ABI, and, where torch can be
imported at build time, the DDP hook's C++ path (csrc/ddp_hook.cpp).

The library is loaded with ctypes (see hvd_terngrad/codec/cpu.py), so it links against neither
libpython nor libtorch; it is built as an extension module only so that setuptools compiles and
installs it in the usual way. The hook's C++ path is a torch extension, hvd_terngrad._ddp_hook: it works with the
torch it was built against only, and where it is missing or does not load, the hook runs in Python
(hvd_terngrad/ddp.py, TernGradState.register). pip builds in an isolated environment without torch unless
given --no-build-isolation, as scripts/install.sh does.
"""
import os

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # no torch at build time: the hook stays in Python
    BuildExtension = CppExtension = None


class ParallelBuildExt(BuildExtension.with_options(use_ninja=False) if BuildExtension else build_ext):
    """The two extensions compiled side by side, one per core (as `build_ext -j`, which pip's editable install
    cannot pass on): 21 s instead of 26-28 s on two cores, in every install, image build and fresh venv."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

cxx_flags = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wextra", "-pthread"]
if os.environ.get("HVD_TERNGRAD_DEBUG"):
    cxx_flags += ["-g", "-O1", "-fsanitize=address,undefined"]

setup(
    name="hvd_terngrad",
    version="0.1.0",
    description="TernGrad (ternary gradients, NeurIPS 2017) as a Horovod gradient compressor for PyTorch",
    packages=find_packages(include=["hvd_terngrad", "hvd_terngrad.*"]),
    package_data={"hvd_terngrad.codec": ["*.cu", "*.h"]},
    ext_modules=[
        Extension(
            "hvd_terngrad._terngrad_cpu",
            sources=["csrc/terngrad_cpu.cpp", "csrc/terngrad_avx512.cpp", "csrc/terngrad_sums.cpp",
                     "csrc/terngrad_half.cpp"],
            include_dirs=["csrc"],
            language="c++",
            extra_compile_args=cxx_flags,
            extra_link_args=["-pthread"],
        )
    ] + ([CppExtension("hvd_terngrad._ddp_hook", sources=["csrc/ddp_hook.cpp"],
                       extra_compile_args=["-O2", "-g0", "-std=c++20", "-Wall"])] if CppExtension else []),
    cmdclass={"build_ext": ParallelBuildExt},
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy"],
    # Horovod is optional: the DDP hook (hvd_terngrad.ddp) needs torch alone. Horovod 0.28.1 builds against
    # today's torch only with a C++17 fix, which scripts/install.sh applies; `pip install .[horovod]` suits
    # an environment whose torch Horovod's release still builds with.
    extras_require={"horovod": ["horovod==0.28.1"], "cuda": ["cupy-cuda12x"],
                    "test": ["pytest", "pytest-timeout", "hypothesis", "mpi4py"]},
)
