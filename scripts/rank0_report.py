"""Turn horovodrun's tagged output into rank 0's report, and every rank's lines into a log file per rank.

    horovodrun -np 2 python examples/train_digits.py 2>&1 | python scripts/rank0_report.py build/train-logs

horovodrun tags each line `[job,rank]<stdout>:` and, where a write does not end a line, puts tags in the
middle of it. Here each rank's lines go untagged to LOG_DIR/rank<r>.log (horovodrun's own lines to
launcher.log), and the terminal gets rank 0's stdout without tags. Lines from rank 0 that start with
`progress ` redraw one status line in place on a terminal and are printed as they come elsewhere. Any
rank's traceback, and horovodrun's own messages, are shown too, so a failing job says why.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

TAG = re.compile(r"\[\d+,(\d+)\]<(stdout|stderr)>:")
PROGRESS = "progress "


class Report:
    def __init__(self, log_dir: Path, out=sys.stdout):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.out = out
        self.tty = out.isatty()
        self.logs: dict[str, object] = {}
        self.in_traceback: set[str] = set()
        self.status = ""  # the progress line drawn in place, not yet ended

    def log(self, who: str, text: str) -> None:
        if who not in self.logs:
            self.logs[who] = open(self.log_dir / f"{who}.log", "w", buffering=1)  # noqa: SIM115 - closed in close()
        self.logs[who].write(text + "\n")

    def show(self, text: str) -> None:
        """A line of the report; on a terminal it takes the place of the progress line drawn last."""
        if self.status:
            text = "\r" + text.ljust(len(self.status))
            self.status = ""
        self.out.write(text + "\n")
        self.out.flush()

    def progress(self, text: str) -> None:
        if not self.tty:
            self.show(text)
            return
        self.out.write("\r" + text.ljust(len(self.status)))
        self.out.flush()
        self.status = text

    def end_status(self) -> None:
        if self.status:
            self.out.write("\n")
            self.status = ""

    def line(self, raw: str) -> None:
        """One line of horovodrun's output, tags and all."""
        parts = TAG.split(raw)
        if len(parts) == 1:  # horovodrun's or mpirun's own words
            self.log("launcher", raw)
            if raw.strip():
                self.show(raw)
            return
        # parts: text before the first tag, then (rank, stream, text) per tag; a tag opens each rank's piece
        for rank, stream, text in zip(parts[1::3], parts[2::3], parts[3::3]):
            who = f"rank{rank}"
            if text or len(parts) == 4:  # an empty piece after a mid-line tag is no line of its own
                plain = text[len(PROGRESS):] if text.startswith(PROGRESS) else text  # the marker is the terminal's
                self.log(who, plain if stream == "stdout" else f"[stderr] {text}")
            if stream == "stderr":
                if text.startswith("Traceback"):
                    self.in_traceback.add(who)
                if who in self.in_traceback:
                    self.show(f"[rank {rank}] {text}")
            elif rank == "0" and (text or len(parts) == 4):
                if text.startswith(PROGRESS):
                    self.progress(text[len(PROGRESS):])
                else:
                    self.show(text)

    def close(self) -> None:
        self.end_status()
        for f in self.logs.values():
            f.close()
        if self.logs:
            files = ", ".join(f"{self.log_dir}/{w}.log" for w in sorted(self.logs))
            self.out.write(f"\nfull output, per rank: {files}\n")


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    report = Report(Path(args[0]))
    try:
        for raw in sys.stdin:
            report.line(raw.rstrip("\n"))
    finally:
        report.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
