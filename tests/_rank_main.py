"""Entry point of one rank under tests.mpi_harness: run the body, store the result or the traceback."""
import importlib
import os
import pickle
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


if __name__ == "__main__":
    main()
