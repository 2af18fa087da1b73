"""Worker of the recipe test: ``python recipe_worker.py SHARDED PORT OUT`` runs examples/distributed_2d.py's 2x2
mesh training (4 gloo ranks, FSDP2 x tensor parallel, Muon + AdamW) for ``STEPS`` steps with
``Muon(sharded=SHARDED, ns_dtype="float32")``; rank 0 saves its results to OUT."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import distributed_2d as recipe  # noqa: E402

STEPS = 3
NS_DTYPE = "float32"  # bfloat16 rounds the two runs' slightly different inputs apart: float32 compares to rounding

if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sharded, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    recipe.run_2d(STEPS, sharded, NS_DTYPE, port=port, out=out)
