"""The benchmark (benchmarks/bench.py) runs and prints its table; no timing is asserted.

It lives in the source checkout, not in the package: these tests load it by path.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

import modopt as mo

pytestmark = pytest.mark.slow  # benchmark runs in subprocesses (the slow lane)

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("modopt_benchmark_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it runs
    spec.loader.exec_module(module)
    return module


def test_quick_bench_prints_the_table_with_defaults_and_ignore_rows(bench, capsys, tmp_path):
    out_json = tmp_path / "rows.json"
    assert bench.main(["--quick", "--only", "ClipNorm", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("| model"))
    for col in ("pipeline", "nonfinite", "modopt ms", "torch ms", "modopt/torch", "extra mem modopt", "diff"):
        assert col in header
    rows = json.loads(out_json.read_text())
    wanted = {(p.name, nf) for p in bench.PIPELINES if "ClipNorm" in p.name
              for nf in ["skip (default)"] + (["ignore"] if p.name in bench.IGNORE_ROWS else [])}
    assert {(r["pipeline"], r["nonfinite"]) for r in rows} == wanted
    assert {r["model"] for r in rows} == {"mlp", "transformer"}
    for r in rows:
        assert r["modopt_ms"] > 0 and r["torch_ms"] > 0 and len(r["ratios"]) == 1
    # the default ClipNorm + Adam follows the careful torch loop bit for bit, real backward included
    headline = [r for r in rows if r["pipeline"] == "ClipNorm(1.0), Adam()"]
    assert headline and all(r["diff"] == 0.0 for r in headline)
    # the torch side of every other row computes the same algorithm (up to float32 rounding)
    assert all(r["diff"] < 1e-3 for r in rows)


def test_peers_mode_runs_peers_rows_and_prints_the_docs_table(bench, capsys, tmp_path):
    """`--peers AdaGC --docs`: peers.py's rows through bench.py, bit for bit with the peer, with the four
    count columns on both sides and the table docs/performance.md publishes (its own marker line)."""
    pytest.importorskip("pytorch_optimizer", reason="the peer library (pinned in the dev extra) is the row's reference")
    out_json = tmp_path / "rows.json"
    assert bench.main(["--peers", "AdaGC", "--quick", "--models", "mlp", "--docs", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out_json.read_text())
    assert [(r["model"], r["method"]) for r in rows] == [("mlp", "AdaGC")]
    assert rows[0]["diff"] == 0.0
    for side in ("modopt", "peer"):
        ops, syncs, pbytes, calls = rows[0]["counts"][side]
        assert ops > 0 and syncs >= 0 and pbytes > 0 and calls > 0
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("<!-- bench.py --peers --docs; counts made with"))
    assert lines[at + 1].startswith("| model | method | modopt ms | peer ms | modopt / peer |")
    cells = [c.strip() for c in lines[at + 3].strip("|").split("|")]
    assert cells[:2] == ["mlp", "AdaGC"] and cells[-1] == "0"
    assert cells[6].count(" / ") == 3 and cells[7].count(" / ") == 3
    assert bench.parse_docs_tables(out) == {}  # (not a table the published-counts test reads)
    with pytest.raises(SystemExit):
        bench.main(["--peers", "NoSuchMethod"])


HEAVYBALL_ROW = "AdamW+clip (heavyball)"


def _peers_module():
    sys.path.insert(0, str(SCRIPT.parent))
    import peers

    return peers


def test_heavyball_peer_row_runs_in_quick_mode(bench, capsys, tmp_path):
    """`--peers "AdamW+clip (heavyball)"`: the row runs on both models with the four counts on both sides (the
    peer's ops counted with its compiled helpers run uncompiled) and its `diff` is the eps placement's: not 0
    (real gradients have elements near eps), but small next to the parameters."""
    pytest.importorskip("heavyball", reason="the peer library (the dev extra pins it on Python >= 3.11) is the row's reference")
    out_json = tmp_path / "rows.json"
    assert bench.main(["--peers", HEAVYBALL_ROW, "--quick", "--docs", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out_json.read_text())
    assert [(r["model"], r["method"]) for r in rows] == [("mlp", HEAVYBALL_ROW), ("transformer", HEAVYBALL_ROW)]
    for r in rows:
        assert 0 < r["diff"] < 0.1
        for side in ("modopt", "peer"):
            ops, syncs, pbytes, calls = r["counts"][side]
            assert ops > 0 and syncs >= 0 and pbytes > 0 and calls > 0
    assert "against `heavyball.AdamW(params, gradient_clipping=heavyball.utils.global_l2norm_clip)`" in out


def test_heavyball_row_agrees_with_heavyball_up_to_the_documented_difference():
    """The row's two optimizers, heavyball's defaults on both sides: with every gradient element far from eps
    they agree to float32 rounding over six steps, clipped and not (bias correction and the norm's order of
    summation differ only in rounding); where |g| equals eps, heavyball's `max(sqrt(v_hat), eps)` moves a
    full `lr` and torch's `sqrt(v_hat) + eps` half of it, the one documented difference."""
    pytest.importorskip("heavyball", reason="the peer library (the dev extra pins it on Python >= 3.11) is the row's reference")
    row = next(p for p in _peers_module().PEERS if p.name == HEAVYBALL_ROW)
    lr = 0.0025  # heavyball 3.2.1's default, the row's modopt side
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (16, 64), (16,)]
    init = [torch.randn(s) for s in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]
    opt_ours, opt_theirs = mo.Modular(ours, *row.modopt()), row.peer(theirs)
    for scale in [3.0, 0.5, 1.0, 0.2, 5.0, 0.3]:  # global norms about 3 * scale: clipped, then not, ...
        grads = [scale * torch.randn(s).sign() * (0.5 + torch.rand(s)) / 60 for s in shapes]
        for ps in (ours, theirs):
            for p, g in zip(ps, grads):
                p.grad = g.clone()
        opt_ours.step()
        opt_theirs.step()
        for a, b in zip(ours, theirs):  # within 64 float32 ulps of the parameter plus one of lr (measured: 16)
            assert ((a - b).abs() / (b.abs() + lr)).max().item() < 64 * 2**-23
    moved = max((b - t).abs().max().item() for b, t in zip(theirs, init))
    assert moved > 5 * lr  # (they moved: the check above is not of two idle optimizers)

    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    opt_ours, opt_theirs = mo.Modular([a], *row.modopt()), row.peer([b])
    a.grad, b.grad = torch.tensor([1e-8, -1e-8, 0.5]), torch.tensor([1e-8, -1e-8, 0.5])  # norm 0.5: no clip
    opt_ours.step()
    opt_theirs.step()
    torch.testing.assert_close(b.detach(), torch.tensor([-lr, lr, -lr]), rtol=1e-5, atol=0)
    torch.testing.assert_close(a.detach(), torch.tensor([-lr / 2, lr / 2, -lr]), rtol=1e-5, atol=0)


def test_every_pipeline_is_the_same_algorithm_on_both_sides(bench):
    """Each hand-written torch side follows modopt's defaults (MLP: no rounding-noise gradients)."""
    import argparse

    args = argparse.Namespace(quick=True, steps=3, warmup=1, repeats=1)
    for pipe in bench.PIPELINES:
        row = bench.run_one(pipe, "mlp", None, args)
        assert row.diff < 1e-5, (pipe.name, row.diff)


def test_the_sweep_times_as_many_tensor_steps_at_every_count(bench):
    """Small sweep models get more steps (a step of 8 small tensors is tens of microseconds); the bench
    models and the sweep's large counts keep the asked-for numbers."""
    assert bench.steps_for("mlp", 30, 5) == (5, 30)
    assert bench.steps_for("transformer", 30, 5) == (5, 30)
    assert bench.steps_for("tensors-8", 10, 2) == (128, 640)
    assert bench.steps_for("tensors-64", 10, 2) == (16, 80)
    for n in (512, 2048, 4096):
        assert bench.steps_for(f"tensors-{n}", 10, 2) == (2, 10)
    for n in (3, 8, 64, 100, 300, 511):  # about as many tensor-steps as 10 steps at 512 (less one rounding)
        assert 10 * (bench.SWEEP_EVEN - n) < bench.steps_for(f"tensors-{n}", 10, 2)[1] * n <= 10 * bench.SWEEP_EVEN


def test_the_careful_torch_side_skips_a_nonfinite_step_like_modopt(bench):
    torch.manual_seed(0)
    model, make = bench.build_model("mlp", quick=True)
    for pipe in bench.PIPELINES:
        import copy

        sides = [bench.modopt_side(pipe.modopt, None)(copy.deepcopy(model)), pipe.torch(copy.deepcopy(model), True)]
        for side in sides:
            before = [p.detach().clone() for p in side.params]
            for p in side.params:
                p.grad = torch.full_like(p, float("nan"))
            side.step()
            assert all(torch.equal(a, b) for a, b in zip(before, side.params)), pipe.name


def test_allocation_counter_sees_temporaries_and_frees(bench):
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


def test_a_row_runs_in_a_process_of_its_own(bench):
    """The default (non-quick) run times every row in a fresh process; the row comes back whole."""
    import argparse

    args = argparse.Namespace(quick=True, steps=2, warmup=1, repeats=1, threads=None, device="cpu")
    index = next(i for i, p in enumerate(bench.PIPELINES) if p.name == "ClipNorm(1.0), Adam()")
    row = bench.run_isolated(index, "mlp", None, args)
    assert row.pipeline == "ClipNorm(1.0), Adam()" and row.model == "mlp" and row.nonfinite == "skip (default)"
    assert row.modopt_ms > 0 and row.torch_ms > 0 and row.diff == 0.0


@pytest.mark.parametrize("device,says", [("foo", "Expected one of"), ("cuda", "sees no CUDA device")])
def test_a_bad_device_is_refused_naming_the_flag(bench, capsys, device, says):
    if device == "cuda" and torch.cuda.is_available():  # pragma: no cover - CPU CI
        pytest.skip("this machine has CUDA: --device cuda is valid here")
    with pytest.raises(SystemExit) as e:
        bench.main(["--quick", "--device", device])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"--device '{device}'" in err and says in err


def test_the_host_decision_benchmark_runs_both_paths_and_leaves_the_switch_as_it_was(capsys):
    from modopt.core import hostdata

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "host_decision.py"
    spec = importlib.util.spec_from_file_location("modopt_host_decision_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--tensors", "3", "--steps", "22", "--repeats", "1"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| `")]
    assert len(rows) == 3 and all(float(r.split("|")[5].strip().rstrip("x")) > 0 for r in rows)
    assert hostdata.Host.device_path is False


def test_the_published_python_call_counts_are_the_step_s(tmp_path):
    """docs/performance.md's last row for modopt's default step ("Python calls per step") is what
    benchmarks/call_counts.py counts now: a change that adds Python work to the step shows here.
    (Python 3.11, which CI runs: later versions inline comprehensions, so they count fewer calls.)"""
    import re

    root = Path(__file__).resolve().parents[1]
    rows = re.findall(r"^\| `Modular\(ps, ClipNorm\(1\.0\), Adam\(\)\)`, at \w+ \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$",
                      (root / "docs" / "performance.md").read_text(), flags=re.M)
    assert rows, "the call-count table is not on the page"
    calls, functions, files, hops = map(int, rows[-1])
    spec = importlib.util.spec_from_file_location("modopt_call_counts_under_test", root / "benchmarks" / "call_counts.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    got = module.measure()["modopt"]
    now = (got.calls, len(got.functions), len(got.files), got.hops)
    if sys.version_info[:2] == (3, 11):
        assert now == (calls, functions, files, hops), f"the step now makes {now}; the page says {rows[-1]}"
    else:
        assert got.calls <= calls and len(got.files) <= files


# --------------------------------------------------------------------------- the published counts

#: rows whose counts are quick to make (the MLP and up to 512 small tensors); the transformer's and the
#: 2048- and 4096-tensor rows are checked by the slow test
QUICK_MODELS = ("mlp", "tensors-8", "tensors-64", "tensors-512")


def _published(bench):
    tables = bench.parse_docs_tables((Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text())
    assert {"counts", "sweep"} <= set(tables), f"a generated table is missing from the page: {set(tables)}"
    return tables


def _check_published_counts(bench, quick: bool):
    """Every count column (ops / syncs / bytes / Python calls, each side) of the tables `bench.py --docs`
    wrote into docs/performance.md is what `bench.count_row` counts now: a change that adds an aten op, a
    sync, a byte or a Python call to a published step fails here, and so does a saving the page does not
    show yet (regenerate the tables). The counts depend on the torch version (and the Python calls on
    Python's: 3.12 inlines comprehensions), so they are checked where the table was made."""
    wrong, todo = [], []
    for kind, (made_with, rows) in _published(bench).items():
        torch_made = re.match(r"torch (\S+), Python (\S+)", made_with)
        assert torch_made, made_with
        if torch_made.group(1).split("+")[0] != torch.__version__.split("+")[0]:
            pytest.skip(f"the {kind} table's counts were made with torch {torch_made.group(1)}; this is torch "
                        f"{torch.__version__}, whose kernels and Python may count differently")
        same_python = torch_made.group(2) == f"{sys.version_info[0]}.{sys.version_info[1]}"
        todo += [(kind, cells, same_python) for cells in rows if (bench.row_key(kind, cells)[1] in QUICK_MODELS) == quick]
    assert todo, "no published row was checked"
    for (kind, cells, same_python), got in zip(todo, _counts_in_a_fresh_process([(k, c) for k, c, _ in todo])):
        model = bench.row_key(kind, cells)[1]
        for side, column in zip(("modopt", "torch"), bench.DOCS_COUNTS):
            now, page = bench._counts(got[side]), cells[column]
            if same_python:
                ok = now == page
            else:  # other Pythons make no more calls than 3.11 (they inline comprehensions)
                ok = now.rsplit(" / ", 1)[0] == page.rsplit(" / ", 1)[0] and got[side][3] <= int(page.rsplit(" / ", 1)[1])
            if not ok:
                wrong.append(f"{kind}: {cells['pipeline']} on {model}, {side}: the page says {page}, the step now {now}")
    assert not wrong, "the published counts drifted (rerun `python benchmarks/bench.py --docs` and update " \
                      "docs/performance.md):\n" + "\n".join(wrong)


def _counts_in_a_fresh_process(rows: list[tuple[str, dict]]) -> list[dict]:
    """`bench.count_row` of each published row, made in a new Python process: what a test run imported
    or registered before (dynamo's modules, a global optimizer hook) changes the Python calls counted in
    torch's own files, so the counts are made as `bench.py --counts` makes them, in a process of their own."""
    import json
    import subprocess

    code = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('bench_counts', {str(SCRIPT)!r})\n"
        "m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; spec.loader.exec_module(m)\n"
        "out = []\n"
        "for kind, cells in json.load(sys.stdin):\n"
        "    got = m.count_row(*m.row_key(kind, cells))\n"
        "    out.append({side: list(got[side]) for side in ('modopt', 'torch')})\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], input=json.dumps(rows), capture_output=True,
                          text=True, timeout=1500, cwd=SCRIPT.parents[1])
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_published_counts_are_the_steps_quick_rows(bench):
    _check_published_counts(bench, quick=True)


@pytest.mark.slow
def test_the_published_counts_are_the_steps_large_rows(bench):
    _check_published_counts(bench, quick=False)


def test_the_docs_tables_read_back_as_written(bench):
    """`docs_table` and `parse_docs_tables` agree: every row keeps its pipeline, model and counts."""
    rows = [bench.Row(model=m, pipeline=p.name, nonfinite=nf, modopt_ms=1.0, torch_ms=2.0, ratio=0.5, ratios=[0.5],
                      torch_label="", diff=0.0, extra_modopt=0.0, extra_torch=0.0, state_modopt=0.0,
                      state_torch=0.0, counts={"modopt": [17, 0, 10.04, 44], "torch": [12, 1, 9.96, 123]},
                      versions=bench.versions())
            for p in bench.PIPELINES for m in ("mlp", "transformer", "tensors-64")
            for nf in ("skip (default)", "ignore") if not (m.startswith("tensors-") and nf == "ignore")]
    text = "\n\n".join(bench.docs_table(rows, kind) for kind in ("main", "ignore", "sweep"))
    tables = bench.parse_docs_tables(text)
    assert set(tables) == {"main", "ignore", "sweep"}
    seen = set()
    for kind, (made_with, cells) in tables.items():
        assert made_with == bench.versions()
        for c in cells:
            pipe, model, nf = bench.row_key(kind, c)
            seen.add((pipe.name, model, nf or "skip (default)"))
            assert c[bench.DOCS_COUNTS[0]] == "17 / 0 / 10.0P / 44" and c[bench.DOCS_COUNTS[1]] == "12 / 1 / 10.0P / 123"
    assert seen == {(r.pipeline, r.model, r.nonfinite) for r in rows}


def test_the_earlier_commit_runs_beside_this_one(capsys):
    """benchmarks/against_commit.py imports an earlier modopt under another name next to this one and times
    both; without the git history it says so and exits 0."""
    import modopt
    from modopt.core import hostdata

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "against_commit.py"
    spec = importlib.util.spec_from_file_location("modopt_against_commit_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # an absolute import in the copy is renamed; relative ones and other names are left alone
    src = "from modopt.core import x\nimport modopt\n  from modopt import y\nfrom .core import z\nimport modopt_extra\n"
    renamed = module._ABSOLUTE.sub(lambda m: f"{m.group(1)}{m.group(2)} modopt_old", src)
    assert renamed == "from modopt_old.core import x\nimport modopt_old\n  from modopt_old import y\nfrom .core import z\nimport modopt_extra\n"
    assert module.main(["--tensors", "3", "--steps", "4", "--warmup", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    if out.startswith("skipped:"):
        pytest.skip(out.strip())
    rows = [r for r in out.splitlines() if r.startswith("| `")]
    assert len(rows) == 1 and "imported as modopt_a73d81a" in out
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert all(float(c) > 0 for c in cells[2:5])
    assert "modopt_a73d81a" in sys.modules and sys.modules["modopt"] is modopt  # both, side by side
    assert hostdata.Host.device_path is False
