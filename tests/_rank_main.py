"""Entry point of one rank under tests.mpi_harness: run the body, store the result or the traceback.

Where HVDTG_ZYGOTE names a warm server's socket (tests._zygote), this process is only the stub that mpirun
started: a process forked from the server, with the imports done, runs the rank, and the stub passes signals on
to it and exits as it did."""
import contextlib
import importlib
import os
import pickle
import signal
import sys
import traceback
from pathlib import Path


def _rank() -> int:
    for var in ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "PMI_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    raise RuntimeError("no rank in the environment: run under mpirun or horovodrun")


def main() -> None:
    work = Path(sys.argv[1])
    rank = _rank()
    (work / f"rank{rank}.pid").write_text(str(os.getpid()))
    out = open(work / f"rank{rank}.stderr", "w", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(out.fileno(), 2)
    os.dup2(out.fileno(), 1)
    sys.stdout = sys.stderr = out
    spec = pickle.loads((work / "spec.pkl").read_bytes())
    try:
        mod_name, fn_name = spec["target"].split(":")
        fn = getattr(importlib.import_module(mod_name), fn_name)
        result = fn(*spec["args"])
        (work / f"rank{rank}.result").write_bytes(pickle.dumps(result))
    except BaseException:
        (work / f"rank{rank}.error").write_text(traceback.format_exc())
        out.flush()
        # Leave at once: peers blocked in a collective would otherwise wait for this rank forever.
        os._exit(1)
    out.flush()


def _through_zygote(base: str) -> None:
    """Run this rank in a process forked by the warm server of this rank's index, and end as it ended; return
    where the server refuses (tests._zygote.startup_env) or is not there, to start as before."""
    import socket

    from tests._zygote import REFUSED, recv_msg, send_msg, slot_path

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(slot_path(base, _rank()))
        send_msg(conn, (sys.argv, dict(os.environ), os.getcwd(), sys.executable), fds=(0, 1, 2))
        got = recv_msg(conn)
    except OSError:  # no server (stopped, or it failed to start), or it went before it forked: as before
        return
    if got is None or got[0] == REFUSED:
        return
    pid = got[0]

    def pass_on(signum, _frame):  # what mpirun sends its process (SIGTERM on an abort) goes to the rank
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT):
        signal.signal(sig, pass_on)
    got = recv_msg(conn)
    status = got[0] if got is not None else 1 << 8
    if os.WIFSIGNALED(status):  # die of the rank's signal, so that mpirun reports it as the rank's
        sig = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set, and needs no setting
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


if __name__ == "__main__":
    if os.environ.get("HVDTG_ZYGOTE"):  # the stub (a rank forked by the server does not see it)
        _through_zygote(os.environ["HVDTG_ZYGOTE"])
    main()
