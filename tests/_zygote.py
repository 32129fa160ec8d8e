"""A warm start for the ranks of tests.mpi_harness: a process that has imported what every rank imports (torch,
Horovod, hvd_terngrad) and forks a rank for each stub that connects.

Why: the suite runs a few hundred real multi-rank jobs, and each rank used to spend about 1.2 s of CPU importing
torch before its first line of test, on a machine of 2 cores; that was most of `make test`'s time. The ranks are
still real processes under a real mpirun (or horovodrun); only the imports are shared, as a fork server shares
them.

How a rank starts (tests._rank_main, when HVDTG_ZYGOTE names this server's socket):
- the stub that mpirun started connects and sends its argv, environment and working folder, and its standard
  input, output and error (SCM_RIGHTS);
- the server forks a monitor for it, and the monitor forks the rank: the rank takes the stub's environment,
  folder and descriptors, and runs tests._rank_main as `__main__`, so that it exits as a fresh interpreter
  would (atexit handlers, Horovod's shutdown);
- the monitor sends the stub the rank's pid (the stub passes on the signals mpirun sends it) and then its exit
  status (the stub exits with it, or dies of the same signal). If the stub dies first (SIGKILL from mpirun),
  the monitor kills the rank, so that no rank outlives its job.

What a fresh interpreter has that a fork would not, kept:
- its own hash seed: the harness runs one server per rank index, each with its own seed, so that the ranks of
  a job iterate sets and dicts of strings in different orders, as fresh processes do (a rank-dependent order
  is a bug this suite must be able to see);
- its own `random` state, re-seeded in each rank;
- a fork that is safe: the server serves only while it is one thread without a CUDA context (it exits
  otherwise, and the ranks start fresh);
- what is read from the environment at import (OMP_NUM_THREADS is read when torch loads): a stub whose
  variables of that kind (STARTUP_ENV) differ from the server's is refused and starts as before.
"""
from __future__ import annotations

import array
import atexit
import contextlib
import ctypes
import importlib
import os
import pickle
import random
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import traceback

PRELOAD = ("numpy", "torch", "torch.distributed", "horovod.torch", "hvd_terngrad", "hvd_terngrad.ddp")
STARTUP_ENV = ("OMP_", "OPENBLAS_", "MKL_", "KMP_", "GOMP_", "PYTHON", "LD_", "TORCH_", "MALLOC_", "GLIBC_",
               "HVD_TERNGRAD_")
REFUSED = -1  # the pid sent to a stub that must start as before
FORKED = False  # True in a rank this server forked (tests read it: tests/test_harness.py)
SLOTS = 4  # servers, one per rank index modulo SLOTS: each its own hash seed (the module docstring)


def slot_path(base: str, rank: int) -> str:
    """The socket of the server that forks ranks of index `rank`."""
    return f"{base}.{rank % SLOTS}"


def startup_env(env: dict) -> dict:
    """The variables a process reads while it imports, which a forked rank cannot change."""
    return {k: v for k, v in env.items() if k.startswith(STARTUP_ENV)}


def send_msg(sock: socket.socket, obj, fds: tuple[int, ...] = ()) -> None:
    data = pickle.dumps(obj)
    head = struct.pack("!I", len(data))
    if fds:
        sock.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(head)
    sock.sendall(data)


def recv_msg(sock: socket.socket, nfds: int = 0):
    """(the object, the descriptors that came with it), or None on a closed connection."""
    fds = array.array("i")
    head, ancdata, _, _ = sock.recvmsg(4, socket.CMSG_LEN(nfds * fds.itemsize) if nfds else 0)
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    if 0 < len(head) < 4:
        head += _recv_exact(sock, 4 - len(head)) or b""
    data = _recv_exact(sock, struct.unpack("!I", head)[0]) if len(head) == 4 else None
    return None if data is None else (pickle.loads(data), list(fds))


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def serve(path: str) -> None:
    for name in PRELOAD:
        with contextlib.suppress(ImportError):  # a venv without Horovod: its ranks import less
            importlib.import_module(name)
    torch = sys.modules.get("torch")
    if len(os.listdir("/proc/self/task")) > 1 or (torch is not None and torch.cuda.is_initialized()):
        sys.exit("tests._zygote: the imports started a thread or a CUDA context, after which a fork is not safe")
    own_env = startup_env(dict(os.environ))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):  # left by a server killed while it started
        os.unlink(path + ".tmp")
    server.bind(path + ".tmp")
    server.listen(64)
    os.rename(path + ".tmp", path)  # the harness waits for the socket's final name: ready
    parent = os.getppid()
    while os.getppid() == parent:  # the pytest process that started it is alive
        ready, _, _ = select.select([server], [], [], 1.0)
        while True:  # reap the monitors that have finished
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not ready:
            continue
        conn, _ = server.accept()
        if os.fork() == 0:
            server.close()
            _monitor(conn, own_env)  # never returns
        conn.close()


def _monitor(conn: socket.socket, own_env: dict) -> None:
    """One stub's rank (the module docstring). Neither the monitor nor its rank ever returns to the server's
    loop: each ends with os._exit, whatever it meets."""
    rank: list[int] = []
    try:
        _watch(conn, own_env, rank)
    finally:
        for pid in rank:  # a rank not yet reaped: the monitor met an error (a stub gone while it was told)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        os._exit(1)


def _watch(conn: socket.socket, own_env: dict, rank: list[int]) -> None:
    """Fork the stub's rank (its pid into `rank` until it is reaped), pass the stub its pid and then its exit
    status; kill it if the stub goes first."""
    got = recv_msg(conn, 3)
    if got is None or len(got[1]) != 3:
        os._exit(1)
    (argv, env, cwd, executable), fds = got
    if executable != sys.executable or startup_env(env) != own_env:
        send_msg(conn, REFUSED)
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _die_with_parent()
        _become_rank(argv, env, cwd, fds)
    rank.append(pid)
    for fd in fds:
        os.close(fd)
    send_msg(conn, pid)
    pidfd = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([pidfd, conn], [], [])
        if pidfd in ready:
            status = os.waitpid(pid, 0)[1]
            rank.clear()
            send_msg(conn, status)
            os._exit(0)
        if not conn.recv(1):  # the stub is gone: so is its rank (the finally of _monitor)
            return


def _die_with_parent() -> None:
    """The kernel kills this process when its monitor ends, however it ends (PR_SET_PDEATHSIG)."""
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the monitor ended before the request
        os._exit(1)


def _become_rank(argv: list[str], env: dict, cwd: str, fds: list[int]) -> None:
    """Turn this forked process into the stub's rank, run it, and end it as an interpreter ends: non-daemon
    threads joined, atexit handlers run (Horovod shuts down), the output flushed. What is left out is the
    teardown of the modules, which takes 0.6 s with torch loaded and which no rank relies on
    (multiprocessing's forked children leave it out too)."""
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update({k: v for k, v in env.items() if k != "HVDTG_ZYGOTE"})  # the rank runs itself
    random.seed()
    sys.argv = list(argv)
    importlib.import_module("tests._zygote").FORKED = True  # this file runs as __main__ in the server
    code = 0
    try:
        runpy.run_module("tests._rank_main", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1])
