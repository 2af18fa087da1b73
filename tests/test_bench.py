"""The benchmark script runs (``--quick``) and prints its table; no timing is asserted."""

from __future__ import annotations

import json

import torch

import modopt as mo
from modopt import bench


def test_quick_bench_prints_the_table(capsys, tmp_path):
    out_json = tmp_path / "rows.json"
    assert bench.main(["--quick", "--steps", "2", "--warmup", "1", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| model"))
    for col in ("pipeline", "modopt ms", "torch ms", "ratio", "extra mem modopt", "extra mem torch"):
        assert col in header
    rows = json.loads(out_json.read_text())
    names = {r["pipeline"] for r in rows}
    registered = set(mo.available())
    for case in bench.cases():
        if set(case.needs) <= registered:
            assert case.name in names
            assert case.name in out
        else:
            assert f"skipped {case.name}" in out
    for r in rows:
        assert r["modopt_ms"] > 0 and r["torch_ms"] > 0 and r["ratio"] > 0
        assert r["agree"] < 1e-3  # the hand-written torch code computes the same algorithm


def test_allocation_counter_sees_temporaries_and_frees():
    counter = bench.AllocationCounter()
    x = torch.ones(1000)
    with counter:
        y = x * 2  # 4000 bytes, alive
        z = torch.ones(250)  # 1000 bytes, freed below
        del z
        x.add_(1)  # in place: nothing new
        w = y + 1  # 4000 more; z's storage is gone by now, so the peak is y + w
    assert counter.peak == 8000
    assert counter.current == 8000
    del w, y
