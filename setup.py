"""Build hvd_terngrad: pure Python plus one C++ shared library (csrc/) with a plain C ABI, and, where torch can be
imported at build time, the DDP hook's C++ path (csrc/ddp_hook.cpp).

The library is loaded with ctypes (see hvd_terngrad/codec/cpu.py), so it links against neither
libpython nor libtorch; it is built as an extension module only so that setuptools compiles and
installs it in the usual way. The hook's C++ path is a torch extension, hvd_terngrad._ddp_hook: it works with the
torch it was built against only, and where it is missing or does not load, the hook runs in Python
(hvd_terngrad/ddp, TernGradState.register). pip builds in an isolated environment without torch unless
given --no-build-isolation, as scripts/install.sh does.
"""
import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig

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

    def build_extension(self, ext):
        """With HVD_TERNGRAD_BUILD_CACHE (a folder: scripts/install.sh passes one shared between clones), an
        extension built before from the same inputs is copied, not compiled again (33 s of a fresh clone's
        install otherwise)."""
        folder = os.environ.get("HVD_TERNGRAD_BUILD_CACHE")
        if not folder:
            return super().build_extension(ext)
        target = self.get_ext_fullpath(ext.name)
        key = extension_key(ext, self.compiler, os.path.dirname(os.path.abspath(__file__)))
        cached = os.path.join(folder, f"{ext.name}-{key}{sysconfig.get_config_var('EXT_SUFFIX')}")
        if os.path.exists(cached):
            os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
            shutil.copyfile(cached, target)
            with contextlib.suppress(OSError):  # a cache it may only read
                os.utime(cached)  # recently used: kept longest (prune_cache)
            print(f"{ext.name}: from the build cache ({cached})")
            return None
        super().build_extension(ext)
        partial = f"{cached}.{os.getpid()}.tmp"
        try:  # a cache that cannot take it (read-only, full) leaves the build as it is
            os.makedirs(folder, exist_ok=True)
            shutil.copyfile(target, partial)
            os.replace(partial, cached)  # whole or absent, for a build running beside this one
            prune_cache(folder, ext.name)
        except OSError as exc:
            print(f"{ext.name}: not stored in the build cache: {exc}")
            with contextlib.suppress(OSError):
                os.unlink(partial)
        return None


def prune_cache(folder: str, name: str, keep: int = 8) -> None:
    """The build cache keeps the `keep` most recently used binaries of an extension (about 2 MB for both of
    this package's; each change to csrc/ adds one of each)."""
    entries = [e for e in os.scandir(folder) if e.name.startswith(f"{name}-") and not e.name.endswith(".tmp")]
    for e in sorted(entries, key=lambda e: e.stat().st_mtime, reverse=True)[keep:]:
        with contextlib.suppress(FileNotFoundError):  # another build pruned it first
            os.unlink(e.path)


def extension_key(ext, compiler, root: str) -> str:
    """What an extension's binary depends on: every file of csrc/ and setup.py, the extension's options (the torch
    extension's include folders and flags among them), the compiler's commands and version, and the Python and
    torch it is built for. Paths inside the clone (root) and the venv count from their roots: the same inputs in
    another clone and its venv build the same code (debug information aside, which may name the folders of the
    clone that built it)."""
    h = hashlib.sha256()
    for name in ["setup.py"] + sorted(os.path.join("csrc", f) for f in os.listdir(os.path.join(root, "csrc"))):
        with open(os.path.join(root, name), "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    options = [ext.name, ext.sources, ext.include_dirs, ext.define_macros, ext.undef_macros, ext.library_dirs,
               ext.libraries, ext.runtime_library_dirs, ext.extra_compile_args, ext.extra_link_args,
               ext.extra_objects, ext.language, sys.version, sysconfig.get_config_var("EXT_SUFFIX")]
    commands = [getattr(compiler, a, None) for a in ("compiler_so", "compiler_cxx", "linker_so")]
    for command in sorted({c[0] for c in commands if c}):
        options.append(subprocess.run([command, "--version"], capture_output=True, text=True).stdout)
    if "torch" in sys.modules:  # the torch extension's ABI
        torch = sys.modules["torch"]
        options += [torch.__version__, getattr(torch.version, "git_version", "")]
    h.update(repr(options + commands).replace(sys.prefix, "<venv>").replace(root, "<root>").encode())
    return h.hexdigest()[:32]


cxx_flags = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wextra", "-pthread"]
if os.environ.get("HVD_TERNGRAD_DEBUG"):
    cxx_flags += ["-g", "-O1", "-fsanitize=address,undefined"]

EXTENSIONS = [
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
                   extra_compile_args=["-O2", "-g0", "-std=c++20", "-Wall"])] if CppExtension else [])

if __name__ == "__main__":  # pip and setuptools run this file as __main__; tests import what is above
    setup(
        name="hvd_terngrad",
        version="0.1.0",
        description="TernGrad (ternary gradients, NeurIPS 2017) as a Horovod gradient compressor for PyTorch",
        packages=find_packages(include=["hvd_terngrad", "hvd_terngrad.*"]),
        package_data={"hvd_terngrad.codec": ["*.cu", "*.h"]},
        ext_modules=EXTENSIONS,
        cmdclass={"build_ext": ParallelBuildExt},
        python_requires=">=3.9",
        install_requires=["torch>=2.1", "numpy"],
        # Horovod is optional: the DDP hook (hvd_terngrad.ddp) needs torch alone. Horovod 0.28.1 builds against
        # today's torch only with a C++17 fix, which scripts/install.sh applies; `pip install .[horovod]` suits
        # an environment whose torch Horovod's release still builds with.
        extras_require={"horovod": ["horovod==0.28.1"], "cuda": ["cupy-cuda12x"],
                        "test": ["pytest", "pytest-timeout", "hypothesis", "mpi4py"]},
    )
