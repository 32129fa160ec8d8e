#!/usr/bin/env bash
# Build hvd_terngrad's CPU image and check it; with --cluster, also run a 2-container job.
#
#   docker/build.sh              build hvd_terngrad:cpu and run `horovodrun --check-build` in it
#   docker/build.sh --cluster    then two containers on one network: the synthetic benchmark with TernGrad
#                                and a 2-worker digits training whose parameters must agree
#   docker/build.sh --cleanup    remove what a killed run left: the job's containers, network and volume, the
#                                working containers of unfinished builds, and untagged images (the images
#                                hvd_terngrad:cpu and its build stage, and the layer cache, stay)
#
# Each step says its name; a failure names the step and shows the end of its log. The job's containers,
# network and volume are removed when the script ends, however it ends (a kill by SIGTERM included).
# The build stage is kept as ${IMAGE}-build (about 2.8 GB, the staged wheels): with it a second build with
# nothing changed takes every layer from the cache.
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
BUILD_STAGE=$IMAGE-build
PROJECT=hvdtg  # podman-compose's project: containers hvdtg_worker<k>_1, network hvdtg_cluster
CLUSTER=0 CLEANUP_ONLY=0
case "${1:-}" in
  --cluster) CLUSTER=1 ;;
  --cleanup) CLEANUP_ONLY=1 ;;
  "") ;;
  *) echo "usage: docker/build.sh [--cluster | --cleanup]" >&2; exit 2 ;;
esac
mkdir -p "$WORK" "$CACHE"

say() { echo "docker/build.sh: $*"; }
die() { echo "docker/build.sh: $*" >&2; exit 1; }
elapsed() { echo "$(( $(date +%s) - $1 ))s"; }

# The step running now and its log: a failure names them (on_exit).
STEP="" STEP_LOG=""
step() { STEP=$1 STEP_LOG=${2:-}; say "[$STEP]${STEP_LOG:+ (log: $STEP_LOG)}"; }

# The 2-container job's containers, network and volume (compose's and the plain commands'), and untagged images.
# With "interrupted": also the working containers of builds that did not finish (podman build leaves them when
# it is killed), which hold their partial images. That is every unfinished build on this machine: hence only
# then (--cleanup, or a failed run).
cleanup() {
  [ -n "${ENGINE:-}" ] || return 0
  local c
  if [ "${1:-}" = interrupted ] && [ "$ENGINE" = podman ]; then
    for c in $(podman ps -a --external --format '{{.ID}} {{.Names}}' 2>/dev/null | awk '$2 ~ /-working-container$/ {print $1}'); do
      podman rm -f "$c" >/dev/null 2>&1 || true
    done
  fi
  for c in $($ENGINE ps -a --format '{{.Names}}' 2>/dev/null | grep -E "^(${PROJECT}_worker[0-9]+_1|${PROJECT}-[0-9]+-w[0-9])$"); do
    $ENGINE rm -f "$c" >/dev/null 2>&1 || true
  done
  for c in $($ENGINE network ls --format '{{.Name}}' 2>/dev/null | grep -E "^(${PROJECT}_cluster|${PROJECT}-[0-9]+)$"); do
    $ENGINE network rm -f "$c" >/dev/null 2>&1 || true
  done
  for c in $($ENGINE volume ls --format '{{.Name}}' 2>/dev/null | grep -E "^(${PROJECT}_cluster-keys|${PROJECT}-[0-9]+-keys)$"); do
    $ENGINE volume rm -f "$c" >/dev/null 2>&1 || true
  done
  $ENGINE image prune -f >/dev/null 2>&1 || true  # untagged: an interrupted build's layers, replaced tags
}

exec 3>&2  # the script's stderr: a trap may run inside a step whose output goes to its log
on_exit() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$rc" != 0 ] && [ -n "$STEP" ]; then
    if [ -n "$STEP_LOG" ] && [ -s "$STEP_LOG" ]; then
      echo "docker/build.sh: the end of $STEP_LOG:" >&3
      tail -n 25 "$STEP_LOG" >&3
    fi
    echo "docker/build.sh: FAILED in step '$STEP' (exit $rc)${STEP_LOG:+; full log: $STEP_LOG}" >&3
  fi
  if [ "$rc" != 0 ]; then cleanup interrupted; else cleanup; fi
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# --- engine ---------------------------------------------------------------------------------
pick_engine() {
  if [ -n "${ENGINE:-}" ]; then return; fi
  if command -v podman >/dev/null; then ENGINE=podman; return; fi
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker; return; fi
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    step "install podman (Debian packages, apt)"
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
    step "make a Debian bookworm base with mmdebstrap (mirror from $sources)" "$WORK/mmdebstrap.log"
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
    step "no cached Horovod wheel for Python 3.11: build it with scripts/install.sh" "$ROOT/build/install-logs/horovod.log"
    bash "$ROOT/scripts/install.sh" >/dev/null
  fi
  ls "$hdir"/horovod-*.whl >/dev/null 2>&1 || die "no Horovod wheel in $hdir (the image's Python is 3.11)"
  cp -u "$hdir"/horovod-*.whl "$dir"/
  step "stage the wheels" "$WORK/pip-download.log"
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
  step "build $IMAGE from $BASE_IMAGE with $ENGINE" "$WORK/build.log"
  local args=(-f "$ROOT/docker/Dockerfile.cpu" --build-arg "BASE_IMAGE=$BASE_IMAGE"
              --build-arg "LOCAL_WHEELS=$CONTEXT_WHEELS")
  # build containers take podman's default ulimits, not containers.conf's
  [ "$ENGINE" = podman ] && args+=(--ulimit "nofile=$NOFILE:$NOFILE" --ulimit "nproc=$NPROC:$NPROC")
  # The build stage gets a tag of its own: untagged, the next prune would drop it and its cached layers.
  { $ENGINE build "${args[@]}" --target build -t "$BUILD_STAGE" "$ROOT" &&
    $ENGINE build "${args[@]}" -t "$IMAGE" "$ROOT"; } >"$WORK/build.log" 2>&1
  local size cached
  size=$($ENGINE image inspect --format '{{.Size}}' "$IMAGE")
  cached=$(grep -c -i 'using cache' "$WORK/build.log" || true)
  say "built $IMAGE in $(elapsed "$t0"), $(( size / 1000000 )) MB ($cached steps from the layer cache)"
  step "horovodrun --check-build in the image"
  $ENGINE run --rm "$IMAGE" horovodrun --check-build
}

# --- the 2-container job --------------------------------------------------------------------
have_compose() {  # podman-compose, installed from Debian where missing and possible
  command -v podman-compose >/dev/null && return 0
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 1
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman-compose >/dev/null 2>&1
}

# The job's lines as make train shows them: rank 0's, without horovodrun's tags; every rank's in $WORK/ranks/.
# podman-compose's own lines (the commands it runs) stay in its log.
job_report() {
  local py=$ROOT/.venv/bin/python
  [ -x "$py" ] || py=python3
  grep -a -E '\[[0-9]+,[0-9]+\]<std(out|err)>:' "$1" | "$py" "$ROOT/scripts/rank0_report.py" "$WORK/ranks"
  say "these figures check that the image trains across two containers, not how fast or how well: the"
  say "synthetic benchmark times the tiny model for 3 iterations (+- is 1.96 standard deviations over them),"
  say "and the digits training runs 2 epochs (make train runs 12, to about 98.6%)"
}

cluster_compose() {
  step "the 2-container job with podman-compose" "$WORK/compose.log"
  local compose=(podman-compose -p "$PROJECT" -f "$ROOT/docker/compose.yaml") rc
  cleanup  # what an interrupted run left
  IMAGE=$IMAGE "${compose[@]}" up --abort-on-container-exit >"$WORK/compose.log" 2>&1 || true
  job_report "$WORK/compose.log"
  # podman-compose's own exit code is not the job's: ask the container
  rc=$($ENGINE inspect "${PROJECT}_worker1_1" --format '{{.State.ExitCode}}' 2>/dev/null || echo missing)
  IMAGE=$IMAGE "${compose[@]}" down -v >>"$WORK/compose.log" 2>&1 || true
  [ "$rc" = 0 ] || die "the compose job failed (worker1 exit $rc)"
}

cluster_plain() {
  local tag=$PROJECT-$$
  step "the 2-container job with plain $ENGINE commands (network $tag)" "$WORK/job.log"
  $ENGINE network create --internal "$tag" >/dev/null
  $ENGINE volume create "$tag-keys" >/dev/null
  $ENGINE run -d --name "$tag-w2" --hostname worker2 --network "$tag" --network-alias worker2 \
    -v "$tag-keys:/cluster-keys" "$IMAGE" >/dev/null
  local rc=0
  $ENGINE run --name "$tag-w1" --hostname worker1 --network "$tag" --network-alias worker1 \
    -v "$tag-keys:/cluster-keys" "$IMAGE" bash docker/cluster_job.sh >"$WORK/job.log" 2>&1 || rc=$?
  job_report "$WORK/job.log"
  [ "$rc" = 0 ] || die "the job failed (worker1 exit $rc)"
  cleanup
}

pick_engine
configure_podman
if [ $CLEANUP_ONLY = 1 ]; then
  cleanup interrupted
  say "removed the job's containers, network and volume, unfinished builds and untagged images"
  exit 0
fi
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
