"""Run a test body as N real processes under mpirun or horovodrun and collect each rank's result.

    from tests.mpi_harness import run_ranks
    results = run_ranks("tests.test_x:body", np=2, timeout=60, args=(...))

The body is a top-level function `body(*args)`; it runs in every rank and its return value (picklable)
comes back in rank order. When any rank raises, run_ranks raises RankFailure with that rank's traceback
and stderr. When the job outlives `timeout` seconds, the whole process group is killed and run_ranks
raises RankTimeout, so a hung collective fails the test instead of hanging CI.

The ranks start warm: each is forked by a server that has already imported torch, Horovod and hvd_terngrad
(tests._zygote), one server per rank index, started on first use. A job's ranks are still separate
processes under a real mpirun. HVDTG_TEST_ZYGOTE=0 starts every rank fresh instead.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


class RankFailure(AssertionError):
    pass


class RankTimeout(AssertionError):
    pass


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now, for a job's rendezvous (its rank 0 binds it moments later):
    jobs side by side (pytest's workers) never meet on one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def launcher_cmd(np: int, launcher: str) -> list[str]:
    root_flags = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    if launcher == "mpirun":
        return ["mpirun", *root_flags, "--oversubscribe", "--bind-to", "none", "-np", str(np),
                "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", "HVD_TERNGRAD_THREADS", "-x", "PATH"]
    if launcher == "horovodrun":
        mpi_args = " ".join([*root_flags, "--oversubscribe", "--bind-to", "none"])
        return [str(BIN / "horovodrun"), "-np", str(np), "--mpi", f"--mpi-args={mpi_args}"]
    raise ValueError(f"unknown launcher {launcher!r}; allowed: mpirun, horovodrun")


def job_env(np: int, env: dict | None = None) -> dict:
    """The environment of a job's ranks: this process's, the harness's settings, the warm servers'
    socket (tests._zygote) where they are up, and `env` last."""
    full_env = dict(os.environ)
    full_env.update({"PYTHONPATH": f"{ROOT}{os.pathsep}{full_env.get('PYTHONPATH', '')}",
                     "OMP_NUM_THREADS": "1", "HVD_TERNGRAD_THREADS": "1",
                     "PATH": f"{BIN}{os.pathsep}{full_env.get('PATH', '')}",
                     "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
                     # two pytest workers run two jobs at once on few cores: a rank that busy-polls MPI
                     # while it waits takes the core its peer needs (4x slower steps, measured)
                     "OMPI_MCA_mpi_yield_when_idle": "1"})
    base = _warm.base(np, dict(full_env))
    if base:
        full_env["HVDTG_ZYGOTE"] = base
    full_env.update(env or {})
    return full_env


def run_ranks(target: str, np: int, timeout: float = 60.0, args: tuple = (), launcher: str = "mpirun",
              env: dict | None = None) -> list:
    work = Path(tempfile.mkdtemp(prefix="hvdtg-ranks-"))
    try:
        (work / "spec.pkl").write_bytes(pickle.dumps({"target": target, "args": args}))
        full_env = job_env(np, env)
        cmd = [*launcher_cmd(np, launcher), sys.executable, "-m", "tests._rank_main", str(work)]
        t0 = time.monotonic()
        with open(work / "launcher.log", "wb") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill(proc, work)
                raise RankTimeout(
                    f"{target} on {np} ranks did not finish within {timeout:.0f} s; killed the job.\n"
                    + _report(work, np)) from None
        elapsed = time.monotonic() - t0
        results = []
        for r in range(np):
            err = work / f"rank{r}.error"
            if err.exists():
                raise RankFailure(f"{target}: rank {r} of {np} failed:\n{err.read_text()}\n" + _report(work, np))
            res = work / f"rank{r}.result"
            if not res.exists():
                raise RankFailure(f"{target}: rank {r} of {np} returned no result (launcher exit {rc}, "
                                  f"{elapsed:.1f} s)\n" + _report(work, np))
            results.append(pickle.loads(res.read_bytes()))
        if rc != 0:
            raise RankFailure(f"{target}: launcher exited {rc} although every rank returned\n" + _report(work, np))
        return results
    finally:
        shutil.rmtree(work, ignore_errors=True)


class _WarmServers:
    """This process's warm servers (tests._zygote), one per rank index, started on first use."""

    __slots__ = ("procs", "folder", "env", "failed")

    def __init__(self):
        self.procs: dict[int, subprocess.Popen] = {}  # rank index -> its server
        self.folder: str | None = None  # the folder of their sockets, made on first use
        self.env: dict[str, str] = {}  # the variables read at start (tests._zygote.startup_env) they started with
        self.failed = False  # a server exited before it was ready: the ranks of this process start fresh

    def base(self, np: int, env: dict) -> str | None:
        """The base of the sockets of servers for ranks 0..np-1, started where missing and waited for; None
        where HVDTG_TEST_ZYGOTE=0 or a server did not come up (ranks then start fresh)."""
        from tests._zygote import SLOTS, slot_path, startup_env

        if self.failed or os.environ.get("HVDTG_TEST_ZYGOTE", "1") == "0":
            return None
        if self.folder is None:
            self.folder = tempfile.mkdtemp(prefix="hvdtg-z-")
            atexit.register(self.stop, remove=True)
        base = os.path.join(self.folder, "s")
        wanted = startup_env(env)
        if wanted != self.env:  # a rank forked from these could not take this environment: anew
            self.stop()
            self.env = wanted
        for slot in range(min(np, SLOTS)):
            if slot not in self.procs or self.procs[slot].poll() is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(slot_path(base, slot))
                self.procs[slot] = subprocess.Popen(
                    [sys.executable, "-m", "tests._zygote", slot_path(base, slot)], cwd=ROOT, env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        for slot in range(min(np, SLOTS)):
            while not os.path.exists(slot_path(base, slot)):
                if self.procs[slot].poll() is not None or time.monotonic() > deadline:
                    self.failed = True
                    return None
                time.sleep(0.05)
        return base

    def stop(self, remove: bool = False) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()
        self.procs.clear()
        if remove and self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)


_warm = _WarmServers()


def run_ranks_failing(target: str, np: int, within: float, args: tuple = (), timeout: float = 90.0) -> str:
    """Run a body that must fail: the RankFailure's report, asserting the job ended within `within` seconds."""
    t0 = time.monotonic()
    try:
        run_ranks(target, np=np, timeout=timeout, args=args)
    except RankFailure as exc:
        elapsed = time.monotonic() - t0
        assert elapsed < within, f"{target} failed only after {elapsed:.0f} s (bound {within:.0f} s)"
        return str(exc)
    raise AssertionError(f"{target} on {np} ranks finished although it should have failed")


def start_transports_late(seconds: float) -> None:
    """In a rank body: this rank starts each pipeline group's transport `seconds` late, so that its peers meet
    whatever the group carries (an error, say) before it has sent the rest of the step."""
    from hvd_terngrad.pipeline import Pipeline

    send = Pipeline.send

    def late(self, g):
        time.sleep(seconds)
        return send(self, g)

    Pipeline.send = late


def _kill(proc: subprocess.Popen, work: Path) -> None:
    pids = []
    for f in work.glob("rank*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(f.read_text()))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        try:
            proc.wait(timeout=3)
            if sig == signal.SIGTERM:
                time.sleep(0.2)
        except subprocess.TimeoutExpired:
            continue


def _report(work: Path, np: int) -> str:
    parts = [f"--- launcher ---\n{_tail(work / 'launcher.log', 1500)}"]
    for r in range(np):
        parts.append(f"--- rank {r} stderr ---\n{_tail(work / f'rank{r}.stderr')}")
    return "\n".join(parts)
