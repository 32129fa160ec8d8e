"""Compile the CUDA kernels as CuPy will on a user's GPU, without one: NVRTC, then registers and spills.

    python -m benchmarks.kernel_resources            # the table of docs/cuda-kernels.md
    python -m benchmarks.kernel_resources --check    # exit 1 on a compile failure or a spill (CI runs this)

nvcc accepting terngrad_kernels.cu proves little about the user's first GPU step: CuPy's RawModule compiles
with NVRTC (no host headers, its own defaults) for the device's architecture. This tool loads NVRTC from the
nvidia-cuda-nvrtc-cu12 wheel (the NVRTC of cupy-cuda12x) and compiles the source with the options codec/cuda.py
gives CuPy plus the ones CuPy adds itself, two ways:
- to a cubin with -arch=sm_XX, what CuPy 13+ does when NVRTC knows the architecture;
- to PTX with -arch=compute_XX (CuPy's path for newer devices and CUPY_CUDA_COMPILE_WITH_PTX), assembled by
  ptxas -v, whose report gives each kernel's registers and spill bytes.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hvd_terngrad.codec import cuda

ARCHS = ("80", "90")
CUPY_ADDS = ("-ftz=true",)  # cupy.cuda.compiler._compile_with_cache_cuda adds it to every RawModule's options


class CompileFailure(RuntimeError):
    pass


@dataclass(frozen=True)
class KernelUse:
    arch: str
    kernel: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int


def nvrtc_library() -> Path:
    spec = importlib.util.find_spec("nvidia.cuda_nvrtc")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("NVRTC is not installed: pip install nvidia-cuda-nvrtc-cu12")
    libs = sorted(Path(next(iter(spec.submodule_search_locations)), "lib").glob("libnvrtc.so.*"))
    if not libs:
        raise FileNotFoundError("the nvidia-cuda-nvrtc wheel holds no libnvrtc.so")
    return libs[0]


class Nvrtc:
    def __init__(self, path: Path | None = None):
        self.lib = ctypes.CDLL(str(path or nvrtc_library()))

    def version(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._ok(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return f"{major.value}.{minor.value}"

    def compile(self, source: str, name: str, options: tuple[str, ...], output: str) -> bytes:
        """The PTX ("ptx") or cubin ("cubin") of `source`; CompileFailure with NVRTC's log on an error."""
        prog = ctypes.c_void_p()
        self._ok(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None),
                 "nvrtcCreateProgram")
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            if self.lib.nvrtcCompileProgram(prog, len(options), opts) != 0:
                raise CompileFailure(f"NVRTC {self.version()} with {' '.join(options)}:\n{self._log(prog)}")
            get_size, get = {"ptx": ("nvrtcGetPTXSize", "nvrtcGetPTX"),
                             "cubin": ("nvrtcGetCUBINSize", "nvrtcGetCUBIN")}[output]
            size = ctypes.c_size_t()
            self._ok(getattr(self.lib, get_size)(prog, ctypes.byref(size)), get_size)
            buf = ctypes.create_string_buffer(size.value)
            self._ok(getattr(self.lib, get)(prog, buf), get)
            return buf.raw[: size.value]
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))

    def _log(self, prog) -> str:
        size = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(prog, buf)
        return buf.value.decode(errors="replace")

    @staticmethod
    def _ok(code: int, what: str) -> None:
        if code != 0:
            raise CompileFailure(f"{what} returned NVRTC error {code}")


def cupy_options(arch: str, output: str) -> tuple[str, ...]:
    """The options CuPy's RawModule hands NVRTC for codec/cuda.py's kernels on a device of this arch."""
    target = f"-arch=sm_{arch}" if output == "cubin" else f"-arch=compute_{arch}"
    return (*cuda.NVRTC_OPTIONS, *CUPY_ADDS, target)


def ptxas_usage(ptx: bytes, arch: str, ptxas: str) -> list[KernelUse]:
    """Assemble PTX for sm_<arch> with ptxas -v and read each kernel's registers, spills and stack."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "k.ptx")
        src.write_bytes(ptx.rstrip(b"\0"))
        res = subprocess.run([ptxas, "-v", f"-arch=sm_{arch}", "-o", str(Path(tmp, "k.cubin")), str(src)],
                             capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise CompileFailure(f"ptxas -arch=sm_{arch} failed:\n{res.stderr}")
    return parse_ptxas(res.stderr, arch)


def parse_ptxas(report: str, arch: str) -> list[KernelUse]:
    uses, kernel, stack, stores, loads = [], None, 0, 0, 0
    for line in report.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            kernel = m.group(1)
        elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            stack, stores, loads = (int(g) for g in m.groups())
        elif (m := re.search(r"Used (\d+) registers", line)) and kernel is not None:
            uses.append(KernelUse(arch, kernel, int(m.group(1)), stores, loads, stack))
            kernel, stack, stores, loads = None, 0, 0, 0
    return uses


def check(nvrtc: Nvrtc, ptxas: str | None) -> list[KernelUse]:
    """Compile for every arch both ways; the kernels' resources when ptxas is there. Raises on a failure."""
    source = cuda.SOURCE.read_text()
    uses = []
    for arch in ARCHS:
        cubin = nvrtc.compile(source, cuda.SOURCE.name, cupy_options(arch, "cubin"), "cubin")
        if not cubin.startswith(b"\x7fELF"):
            raise CompileFailure(f"NVRTC's cubin for sm_{arch} is no ELF image")
        ptx = nvrtc.compile(source, cuda.SOURCE.name, cupy_options(arch, "ptx"), "ptx")
        if ptxas is not None:
            uses += ptxas_usage(ptx, arch, ptxas)
    return sorted(uses, key=lambda u: (u.arch, u.kernel))


def table(uses: list[KernelUse]) -> str:
    rows = ["| arch | kernel | registers | spill stores (B) | spill loads (B) | stack (B) |",
            "|---|---|---:|---:|---:|---:|"]
    rows += [f"| sm_{u.arch} | `{u.kernel}` | {u.registers} | {u.spill_stores} | {u.spill_loads} | {u.stack} |"
             for u in uses]
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 on a compile failure or any spill")
    args = ap.parse_args(argv)
    nvrtc = Nvrtc()
    ptxas = shutil.which("ptxas")
    print(f"NVRTC {nvrtc.version()} ({nvrtc_library().name}); options {' '.join(cupy_options('XX', 'cubin'))}; "
          f"ptxas: {ptxas or 'not found'}")
    try:
        uses = check(nvrtc, ptxas)
    except CompileFailure as exc:
        print(exc, file=sys.stderr)
        return 1
    print(table(uses))
    spills = [u for u in uses if u.spill_stores or u.spill_loads]
    if args.check and spills:
        print("spills: " + ", ".join(f"{u.kernel} on sm_{u.arch}" for u in spills), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
