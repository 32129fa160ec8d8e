#!/usr/bin/env bash
# Build hvd_terngrad's CPU image and check it; with --cluster, also run a 2-container job.
#
#   docker/build.sh              build hvd_terngrad:cpu and run `horovodrun --check-build` in it
#   docker/build.sh --cluster    then two containers on one network: the synthetic benchmark with TernGrad
#                                and a 2-worker digits training whose parameters must agree
#
# Engine: podman (Debian's, installed when missing and this is root with apt), else docker. podman here runs
# with runc, cgroupfs and the host's hard ulimits (build/docker/containers.conf; nproc at most pid_max):
# crun and podman's default ulimits fail on hosts with hybrid cgroups and lower hard limits.
# Base image: BASE_IMAGE if set; else the public python:3.11-slim-bookworm when its registry answers; else a
# local Debian bookworm made once by mmdebstrap from the configured mirror (tar cached under the cache).
# Wheels: everything scripts/install.sh installs, as this machine's pip finds it (torch: the CPU wheel), and
# the Horovod wheel that scripts/install.sh built are staged in the build context
# (build/docker-context/wheels) and installed from there: an index a build can reach would serve the CUDA
# torch (GBs), Horovod would be compiled again, and a build's TLS may not trust this machine's proxy.
#
# Environment: IMAGE (default hvd_terngrad:cpu), BASE_IMAGE, HVD_TERNGRAD_CACHE (default
# ~/.cache/hvd_terngrad), ENGINE (podman or docker), COMPOSE=0 (skip podman-compose, plain podman only).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${HVD_TERNGRAD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_terngrad}
WORK=$ROOT/build/docker
CONTEXT_WHEELS=build/docker-context/wheels
IMAGE=${IMAGE:-hvd_terngrad:cpu}
PUBLIC_BASE=docker.io/library/python:3.11-slim-bookworm  # fully qualified: podman has no default registry
LOCAL_BASE=localhost/debian-base:bookworm
TORCH_VERSION=$(sed -n 's/^TORCH_VERSION=//p' "$ROOT/scripts/install.sh")
HOROVOD_VERSION=$(sed -n 's/^HOROVOD_VERSION=//p' "$ROOT/scripts/install.sh")
CLUSTER=0
[ "${1:-}" = "--cluster" ] && CLUSTER=1
mkdir -p "$WORK" "$CACHE"

say() { echo "docker/build.sh: $*"; }
die() { echo "docker/build.sh: $*" >&2; exit 1; }
elapsed() { echo "$(( $(date +%s) - $1 ))s"; }

# --- engine ---------------------------------------------------------------------------------
pick_engine() {
  if [ -n "${ENGINE:-}" ]; then return; fi
  if command -v podman >/dev/null; then ENGINE=podman; return; fi
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker; return; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    say "installing podman (Debian packages)"
    local t0; t0=$(date +%s)
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman buildah uidmap \
      mmdebstrap runc netavark aardvark-dns containernetworking-plugins iptables catatonit >/dev/null \
      || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
           podman buildah uidmap mmdebstrap runc netavark aardvark-dns containernetworking-plugins iptables \
           catatonit >/dev/null; }
    say "podman installed in $(elapsed "$t0")"
    ENGINE=podman
    return
  fi
  die "neither podman nor docker can run here (as root with apt, this script installs podman)"
}

# The ulimits a container may get: this host's hard limits, nproc at most pid_max (runc is refused more here).
NOFILE=$(ulimit -Hn)
NPROC=$(ulimit -Hu)
PID_MAX=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo "$NPROC")
[ "$NPROC" = unlimited ] || [ "$NPROC" -gt "$PID_MAX" ] && NPROC=$PID_MAX
[ "$NOFILE" = unlimited ] && NOFILE=1048576

configure_podman() {
  [ "$ENGINE" = podman ] || return 0
  cat >"$WORK/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$NOFILE:$NOFILE", "nproc=$NPROC:$NPROC"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
  export CONTAINERS_CONF=$WORK/containers.conf
}

# --- base image -----------------------------------------------------------------------------
local_base() {
  if $ENGINE image exists "$LOCAL_BASE" 2>/dev/null || $ENGINE image inspect "$LOCAL_BASE" >/dev/null 2>&1; then
    return
  fi
  local tar=$CACHE/debian-bookworm-minbase.tar t0
  if [ ! -s "$tar" ]; then
    command -v mmdebstrap >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null
    local sources=/etc/apt/sources.list.d/debian.sources
    [ -f "$sources" ] || sources=/etc/apt/sources.list
    say "making a Debian bookworm base with mmdebstrap (mirror from $sources)"
    t0=$(date +%s)
    mmdebstrap --mode=root --variant=minbase --format=tar bookworm "$tar.tmp" "$sources" >"$WORK/mmdebstrap.log" 2>&1 \
      || die "mmdebstrap failed; log: $WORK/mmdebstrap.log"
    mv "$tar.tmp" "$tar"
    say "base rootfs made in $(elapsed "$t0") ($(du -h "$tar" | cut -f1))"
  fi
  $ENGINE import "$tar" "$LOCAL_BASE" >/dev/null
}

pick_base() {
  if [ -n "${BASE_IMAGE:-}" ]; then return; fi
  if timeout 30 $ENGINE pull -q "$PUBLIC_BASE" >/dev/null 2>&1; then
    BASE_IMAGE=$PUBLIC_BASE
  else
    say "no registry answers for $PUBLIC_BASE: using a local Debian base"
    local_base
    BASE_IMAGE=$LOCAL_BASE
  fi
}

# --- wheels ---------------------------------------------------------------------------------
stage_wheels() {
  local dir=$ROOT/$CONTEXT_WHEELS py=$ROOT/.venv/bin/python t0
  mkdir -p "$dir"
  [ -x "$py" ] || py=python3
  local hdir=$CACHE/wheels/horovod-$HOROVOD_VERSION-torch-$TORCH_VERSION-cp311
  if ! ls "$hdir"/horovod-*.whl >/dev/null 2>&1; then
    say "no cached Horovod wheel for Python 3.11: building it with scripts/install.sh"
    bash "$ROOT/scripts/install.sh" >/dev/null
  fi
  ls "$hdir"/horovod-*.whl >/dev/null 2>&1 || die "no Horovod wheel in $hdir (the image's Python is 3.11)"
  cp -u "$hdir"/horovod-*.whl "$dir"/
  t0=$(date +%s)
  # everything scripts/install.sh installs, as this machine's pip finds it (its torch: the CPU wheel)
  bash "$ROOT/scripts/install.sh" --requirements >"$WORK/requirements.txt"
  "$py" -m pip download -q -d "$dir" -r "$WORK/requirements.txt" >"$WORK/pip-download.log" 2>&1 \
    || die "cannot stage the wheels (pip download); log: $WORK/pip-download.log"
  case "$(ls "$dir"/torch-"$TORCH_VERSION"*.whl)" in
    *+cpu*) ;;
    *) die "the staged torch wheel is not the CPU build: $(ls "$dir"/torch-*.whl)";;
  esac
  say "wheels staged in $CONTEXT_WHEELS in $(elapsed "$t0") ($(du -sh "$dir" | cut -f1))"
}

# --- build and check ------------------------------------------------------------------------
build_image() {
  local t0; t0=$(date +%s)
  say "building $IMAGE from $BASE_IMAGE with $ENGINE"
  local limits=()  # build containers take podman's default ulimits, not containers.conf's
  [ "$ENGINE" = podman ] && limits=(--ulimit "nofile=$NOFILE:$NOFILE" --ulimit "nproc=$NPROC:$NPROC")
  $ENGINE build "${limits[@]}" -f "$ROOT/docker/Dockerfile.cpu" --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    --build-arg "LOCAL_WHEELS=$CONTEXT_WHEELS" -t "$IMAGE" "$ROOT" >"$WORK/build.log" 2>&1 \
    || { tail -n 30 "$WORK/build.log" >&2; die "image build failed; log: $WORK/build.log"; }
  local size; size=$($ENGINE image inspect --format '{{.Size}}' "$IMAGE")
  say "built $IMAGE in $(elapsed "$t0"), $(( size / 1000000 )) MB"
  $ENGINE image prune -f >/dev/null 2>&1 || true  # the build stage's image, with the staged wheels
  say "horovodrun --check-build in the image:"
  $ENGINE run --rm "$IMAGE" horovodrun --check-build
}

# --- the 2-container job --------------------------------------------------------------------
have_compose() {  # podman-compose, installed from Debian where missing and possible
  command -v podman-compose >/dev/null && return 0
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman-compose >/dev/null 2>&1
}

cluster_compose() {
  say "the compose file with podman-compose"
  local compose=(podman-compose -p hvdtg -f "$ROOT/docker/compose.yaml") rc
  IMAGE=$IMAGE "${compose[@]}" down -v >/dev/null 2>&1 || true  # what an interrupted run left
  IMAGE=$IMAGE "${compose[@]}" up --abort-on-container-exit >"$WORK/compose.log" 2>&1 || true
  grep -E '^\[|^Total|^Model|^Iter|parameters' "$WORK/compose.log" || true
  # podman-compose's own exit code is not the job's: ask the container
  rc=$($ENGINE inspect hvdtg_worker1_1 --format '{{.State.ExitCode}}' 2>/dev/null || echo missing)
  IMAGE=$IMAGE "${compose[@]}" down -v >>"$WORK/compose.log" 2>&1 || true
  [ "$rc" = 0 ] || { tail -n 40 "$WORK/compose.log" >&2; die "the compose job failed (worker1 exit $rc); log: $WORK/compose.log"; }
}

cluster_plain() {
  local tag=hvdtg-$$
  say "the same topology with plain $ENGINE commands (network $tag)"
  cleanup_plain() { $ENGINE rm -f "$tag-w1" "$tag-w2" >/dev/null 2>&1 || true
                    $ENGINE network rm "$tag" >/dev/null 2>&1 || true
                    $ENGINE volume rm "$tag-keys" >/dev/null 2>&1 || true; }
  trap cleanup_plain EXIT
  $ENGINE network create --internal "$tag" >/dev/null
  $ENGINE volume create "$tag-keys" >/dev/null
  $ENGINE run -d --name "$tag-w2" --hostname worker2 --network "$tag" --network-alias worker2 \
    -v "$tag-keys:/cluster-keys" "$IMAGE" >/dev/null
  $ENGINE run --name "$tag-w1" --hostname worker1 --network "$tag" --network-alias worker1 \
    -v "$tag-keys:/cluster-keys" "$IMAGE" bash docker/cluster_job.sh
  cleanup_plain
  trap - EXIT
}

pick_engine
configure_podman
pick_base
stage_wheels
build_image
if [ $CLUSTER = 1 ]; then
  t0=$(date +%s)
  if [ "$ENGINE" = podman ] && [ "${COMPOSE:-1}" = 1 ] && have_compose; then
    cluster_compose
    say "2-container job (podman-compose) done in $(elapsed "$t0")"
  else
    cluster_plain
    say "2-container job done in $(elapsed "$t0")"
  fi
fi
