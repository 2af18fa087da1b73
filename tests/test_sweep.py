"""`modopt sweep`: the grid, parallel runs equal to `modopt run`, resume, refusals before anything runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from modopt.cli import main
from modopt.config import ConfigError
from modopt.cli.sweep import parse_grid, parse_value, set_path
from test_compare_seeds import TINY_TS, _has_matplotlib, assert_self_contained

pytestmark = pytest.mark.slow  # end-to-end sweeps of the command (the slow lane)

MAX_NORM = "optimizer.transforms.0.max_norm"


def tiny_config(path: Path, steps: int = 16) -> Path:
    path.write_text(yaml.safe_dump({
        "name": "ts",
        "task": TINY_TS,
        "optimizer": {"transforms": [{"type": "ClipNorm", "max_norm": 1.0}, {"type": "SGD", "lr": 0.05, "momentum": 0.9}]},
        "train": {"steps": steps, "batch_size": 8, "eval_every": 1},
    }, sort_keys=False))
    return path


def _counts(err: str) -> tuple[int, int]:
    """(to run, reused) from the sweep's plan line."""
    m = re.search(r"(\d+) to run, (\d+) finished already \(reused\)", err)
    assert m, err
    return int(m.group(1)), int(m.group(2))


def test_values_are_yaml_scalars():
    assert [parse_value(t) for t in ("0.5", "2", "1e-3", "-2E+2", "null", "true", "cosine")] == [0.5, 2, 1e-3, -200.0, None, True, "cosine"]
    for bad in ("[1", "{a: 1}"):
        with pytest.raises(ValueError, match="not a YAML scalar"):
            parse_value(bad)
    assert parse_grid([f"{MAX_NORM}=0.5, 2", "train.schedule.kind=constant,cosine"]) == [
        (MAX_NORM, [0.5, 2], ["0.5", "2"]), ("train.schedule.kind", ["constant", "cosine"], ["constant", "cosine"])]


@pytest.mark.parametrize("spec, message", [
    ("max_norm", "expected PATH=V1,V2"),
    (f"{MAX_NORM}=0.5,,1", "an empty value"),
    (f"{MAX_NORM}=1,1.0", "a value is given twice"),
    ("train.seed=1,2", "cannot be swept (the seeds are --seeds)"),
    ("variants.a.transforms.0.lr=1", "cannot be swept (choose one variant with --variant"),
])
def test_bad_grid_options(spec, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_grid([spec])


def test_set_path_names_what_is_wrong():
    data = {"optimizer": {"transforms": [{"type": "ClipNorm", "max_norm": 1.0}]}, "train": {"steps": 3}}
    set_path(data, MAX_NORM, 0.25)
    set_path(data, "optimizer.transforms.0.eps", 0.0)  # a field left at its default: a new key
    assert data["optimizer"]["transforms"][0] == {"type": "ClipNorm", "max_norm": 0.25, "eps": 0.0}
    for path, message in (
        ("optimizer.transforms.1.max_norm", "optimizer.transforms is a list of 1; '1' is not an index 0..0"),
        ("optimizer.transfroms.0.max_norm", "optimizer has no 'transfroms' (did you mean 'transforms'?)"),
        ("optimizer.transforms.0.max_norm.x", "optimizer.transforms.0.max_norm is a value (0.25)"),
        ("trian", "the experiment has no 'trian' (did you mean 'train'?)"),
    ):
        with pytest.raises(ConfigError, match=re.escape(f"--grid {path}: {message}")):
            set_path(data, path, 1)


@pytest.mark.parametrize("grid, message", [
    ("optimizer.transforms.5.max_norm=1,2", "--grid optimizer.transforms.5.max_norm: optimizer.transforms is a list of 2"),
    (f"{MAX_NORM}=0.5,-1", f"--grid {MAX_NORM}=-1: invalid config (1 error)\n  {MAX_NORM}: Input should be greater than 0"),
    ("optimizer.transforms.0.max_nrom=1", "optimizer.transforms.0.max_nrom: unknown field 'max_nrom' (did you mean 'max_norm'?)"),
    ("task.options.dimm=3", "task 'teacher_student' has no option 'dimm'"),
])
def test_an_invalid_grid_is_refused_before_anything_runs(tmp_path, capsys, grid, message):
    cfg = tiny_config(tmp_path / "ts.yaml")
    out = tmp_path / "sweep"
    assert main(["sweep", str(cfg), "--grid", "optimizer.transforms.1.lr=0.01,0.1", "--grid", grid, "--out", str(out), "--quiet"]) == 1
    assert message in capsys.readouterr().err
    assert not out.exists()  # no run directory, no output at all


def test_sweep_runs_the_grid_in_parallel_and_resumes(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "ts.yaml")
    out = tmp_path / "sweep"
    argv = ["sweep", str(cfg), "--grid", f"{MAX_NORM}=0.5,2", "--seeds", "0", "1", "--spike-window", "5",
            "--out", str(out), "--quiet"]
    if not _has_matplotlib():
        argv.append("--no-plots")
    assert main([*argv, "--jobs", "2"]) == 0
    cap = capsys.readouterr()
    assert _counts(cap.err) == (4, 0) and "4 runs in 2 worker processes" in cap.err
    data = json.loads((out / "sweep.json").read_text())
    assert data["schema"] == 2 and data["kind"] == "sweep" and data["metric"] == "final_loss"
    assert data["grid"] == [{"path": MAX_NORM, "values": [0.5, 2]}] and data["seeds"] == [0, 1]
    assert [p["values"] for p in data["points"]] == [{MAX_NORM: 0.5}, {MAX_NORM: 2}]
    for point in data["points"]:
        assert [s["seed"] for s in point["per_seed"]] == [0, 1] and point["summary"]["final_loss"]["n"] == 2
        for s in point["per_seed"]:
            run = Path(s["run_dir"])
            saved = yaml.safe_load((run / "config.yaml").read_text())
            assert saved["optimizer"]["transforms"][0]["max_norm"] == point["values"][MAX_NORM]
            assert saved["train"]["seed"] == s["seed"]
    # a worker's run is `modopt run` of its config.yaml, bit for bit
    run = Path(data["points"][1]["per_seed"][1]["run_dir"])
    assert main(["run", str(run / "config.yaml"), "--out", str(tmp_path / "again"), "--quiet", "--no-plots"]) == 0
    assert (tmp_path / "again" / "metrics.jsonl").read_bytes() == (run / "metrics.jsonl").read_bytes()
    table = cap.out.splitlines()
    assert table[0].split("|")[1].strip() == "max_norm" and len([ln for ln in table if ln.startswith("| ")]) == 3
    text = assert_self_contained(out / "report.html")
    if _has_matplotlib():
        assert (out / "sweep-max_norm.png").read_bytes()[:4] == b"\x89PNG" and text.count("data:image/png") == 1

    # the same sweep again: nothing runs
    summaries = sorted(out.glob("*/seed-*/summary.json"))
    assert len(summaries) == 4
    mtimes = [p.stat().st_mtime_ns for p in summaries]
    capsys.readouterr()
    assert main([*argv, "--jobs", "1"]) == 0
    assert _counts(capsys.readouterr().err) == (0, 4)
    assert [p.stat().st_mtime_ns for p in summaries] == mtimes
    assert json.loads((out / "sweep.json").read_text())["points"] == data["points"]

    # a run cut short (no summary.json) runs again; a new value runs; the rest is reused
    partial = summaries[0].parent
    summaries[0].unlink()
    argv[argv.index(f"{MAX_NORM}=0.5,2")] = f"{MAX_NORM}=0.5,2,4"
    assert main([*argv, "--jobs", "1"]) == 0
    assert _counts(capsys.readouterr().err) == (3, 3)
    assert (partial / "summary.json").is_file()
    assert [p["values"][MAX_NORM] for p in json.loads((out / "sweep.json").read_text())["points"]] == [0.5, 2, 4]


def test_two_fields_make_a_product_and_a_plot_each(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "ts.yaml", steps=6)
    out = tmp_path / "sweep"
    assert main(["sweep", str(cfg), "--grid", f"{MAX_NORM}=0.5,2", "--grid", "optimizer.transforms.1.lr=0.01,0.1",
                 "--metric", "final_eval_loss", "--jobs", "1", "--out", str(out), "--quiet"]) == 0
    cap = capsys.readouterr()
    data = json.loads((out / "sweep.json").read_text())
    assert [tuple(p["values"].values()) for p in data["points"]] == [(0.5, 0.01), (0.5, 0.1), (2, 0.01), (2, 0.1)]
    assert {p.name for p in out.iterdir() if p.is_dir()} == {"max_norm=0.5,lr=0.01", "max_norm=0.5,lr=0.1",
                                                            "max_norm=2,lr=0.01", "max_norm=2,lr=0.1"}
    rows = [ln for ln in cap.out.splitlines() if ln.startswith("| ")]
    assert len(rows) == 5 and all("(n=1, no interval)" in r and "±" not in r for r in rows[1:])  # one seed (train.seed)
    if _has_matplotlib():
        for field in ("max_norm", "lr"):
            assert (out / f"sweep-{field}.png").read_bytes()[:4] == b"\x89PNG"


def test_an_unknown_metric_runs_nothing(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "ts.yaml")
    out = tmp_path / "sweep"
    assert main(["sweep", str(cfg), "--grid", f"{MAX_NORM}=1", "--metric", "final_los", "--out", str(out)]) == 1
    assert "--metric final_los: not a metric; one of final_loss" in capsys.readouterr().err
    assert not out.exists()


def test_grid_point_names_stay_plain_names_whatever_the_values():
    from modopt.cli.experiment import NAME_MAX, check_name
    from modopt.cli.sweep import _point_name

    for label in ("max_norm=0.5", "path=/data/x,lr=0.1", "a\\\\b=1", "k=" + "9" * 300):
        name = _point_name("exp", label)
        assert check_name(name, "the name") == name and len(name) <= NAME_MAX
    assert _point_name("exp", "max_norm=0.5") == "exp[max_norm=0.5]"
    assert _point_name("e" * NAME_MAX, "lr=0.1") != _point_name("e" * NAME_MAX, "lr=0.2")


def test_a_grid_past_the_run_bound_is_refused_before_any_point_is_checked(tmp_path, capsys, monkeypatch):
    """100 x 100 values: refused at once, naming the size and the bound, with nothing checked or written."""
    from modopt.cli.sweep import MAX_RUNS

    cfg = tiny_config(tmp_path / "ts.yaml")
    out = tmp_path / "sweep"
    checked = []
    monkeypatch.setattr("modopt.cli.sweep.check_experiment", lambda *a, **k: checked.append(a))
    monkeypatch.setattr("modopt.cli.sweep.run_jobs", lambda jobs, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    lrs = ",".join(f"{0.001 * (k + 1):g}" for k in range(100))
    norms = ",".join(str(k + 1) for k in range(100))
    argv = ["sweep", str(cfg), "--grid", f"optimizer.transforms.1.lr={lrs}", "--grid", f"{MAX_NORM}={norms}",
            "--out", str(out), "--quiet", "--no-plots"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err == (f"modopt sweep: error: --grid: 100 x 100 = 10000 grid points x 1 seed = 10000 runs, more than the "
                   f"{MAX_RUNS} a sweep runs without --max-runs; nothing was checked, run or written (narrow the grid, "
                   "or pass --max-runs 10000 to run them all)\n")
    assert checked == [] and not out.exists()
    # the seeds count: 10 values x 3 seeds against a bound of 20
    assert main(["sweep", str(cfg), "--grid", f"{MAX_NORM}={','.join(map(str, range(1, 11)))}", "--seeds", "0", "1", "2",
                 "--max-runs", "20", "--out", str(out), "--quiet", "--no-plots"]) == 1
    assert "--grid: 10 grid points x 3 seeds = 30 runs, more than the 20" in capsys.readouterr().err
    assert checked == [] and not out.exists()
    # --max-runs raises the bound: the grid is checked (the check stubbed out here stops nothing)
    assert main(["sweep", str(cfg), "--grid", f"{MAX_NORM}={','.join(map(str, range(1, 11)))}", "--seeds", "0", "1", "2",
                 "--max-runs", "30", "--out", str(out), "--quiet", "--no-plots"]) == 130
    assert len(checked) == 10
    assert main(["sweep", str(cfg), "--grid", f"{MAX_NORM}=1", "--max-runs", "0"]) == 2  # a usage error
