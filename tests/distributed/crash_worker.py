"""A 2-rank job for tests/distributed/test_launch.py, failing the way the mode names: in `abort-once` rank 1
aborts (SIGABRT, as a native crash does) on the job's first run only, in `abort` on every run; in `raise`
every rank raises a Python error."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _rank_main(rank: int, mode: str, out: str) -> None:
    runs = Path(out + ".runs")
    if rank == 1:
        first = not runs.exists()
        with runs.open("a") as f:
            f.write("run\n")
        if mode == "abort" or (mode == "abort-once" and first):
            os.abort()
    if mode == "raise":  # (on every rank: whichever fails first is the one torch reports)
        raise ValueError("the job's own error")
    if rank == 0:
        Path(out).write_text("done")


def main(argv: list[str]) -> None:
    mode, port, out = argv[0], int(argv[1]), argv[2]
    from launch import spawn_ranks

    spawn_ranks(2, port, _rank_main, mode, out)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main(sys.argv[1:])
