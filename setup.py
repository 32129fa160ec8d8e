"""Build hvd_terngrad: pure Python plus one C++ shared library (csrc/) with a plain C ABI.

The library is loaded with ctypes (see hvd_terngrad/codec/cpu.py), so it links against neither
libpython nor libtorch; it is built as an extension module only so that setuptools compiles and
installs it in the usual way.
"""
import os

from setuptools import Extension, find_packages, setup

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
    ],
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy"],
    # Horovod is optional: the DDP hook (hvd_terngrad.ddp) needs torch alone. Horovod 0.28.1 builds against
    # today's torch only with a C++17 fix, which scripts/install.sh applies; `pip install .[horovod]` suits
    # an environment whose torch Horovod's release still builds with.
    extras_require={"horovod": ["horovod==0.28.1"], "cuda": ["cupy-cuda12x"],
                    "test": ["pytest", "pytest-timeout", "hypothesis", "mpi4py"]},
)
