"""Benchmark modopt pipelines against hand-written torch (thin wrapper of ``modopt.bench``).

    python benchmarks/run.py            # full run (~5M-param MLP and a 300-tensor model)
    python benchmarks/run.py --quick    # smoke run (CI)

See docs/performance.md for the method and the latest results.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from modopt.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
