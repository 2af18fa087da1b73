"""benchmarks/expert_counts.py: the step's aten op count does not grow with the number of expert tensors (the
claim docs/howto/distributed.md states with its measured table), and the step needs no host sync."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import expert_counts  # noqa: E402


def test_the_op_count_is_the_same_for_8_and_64_experts_and_for_a_stack():
    few, many = expert_counts.rows(8, 4), expert_counts.rows(64, 4)
    for a, b in zip(few, many):
        assert (a["layout"], a["side"]) == (b["layout"], b["side"])
        assert a["ops"] == b["ops"], (a, b)
    modopt = [r for r in many if r["side"].startswith("modopt")]
    assert {r["ops"] for r in modopt} == {modopt[0]["ops"]}  # E tensors cost what one stack costs
    assert all(r["syncs"] == 0 for r in modopt)


def test_the_published_table_is_what_the_script_measures():
    doc = (ROOT / "docs" / "howto" / "distributed.md").read_text()
    rows = expert_counts.rows(64, 4)
    ops = {(r["layout"], r["side"].split()[0]): r["ops"] for r in rows}
    assert f"| 2048 tensors | modopt `ClipNorm(1.0), AdamW()` | 2048 | {ops['tensors', 'modopt']} | 0 |" in doc
    assert (f"| 2048 tensors | torch `clip_grad_norm_(foreach=True)` + `AdamW(fused=True)` | 2048 | "
            f"{ops['tensors', 'torch']} | 0 |") in doc
