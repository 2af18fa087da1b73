"""`modopt compare --seeds`: the t quantile and intervals, paired differences, worst excursion,
the compare.json schema, per-seed runs equal to `modopt run --seed`, and the HTML report."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import statistics
from pathlib import Path

import pytest
import yaml

from modopt.cli import main
from modopt.cli.compare import worst_excursion
from modopt.cli.stats import format_interval, interval, paired, t_quantile

pytestmark = pytest.mark.slow  # end-to-end runs over seeds (the slow lane)

TINY_TS = {"name": "teacher_student", "options": {"dim": 4, "hidden": 8, "teacher_hidden": 8, "eval_size": 64}}


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def tiny_config(path: Path, steps: int = 24, **train) -> Path:
    """Two variants of the teacher-student task, small enough for a test."""
    path.write_text(yaml.safe_dump({
        "name": "ts",
        "task": TINY_TS,
        "variants": {
            "sgd": {"transforms": [{"type": "SGD", "lr": 0.05, "momentum": 0.9}]},
            "clip": {"transforms": [{"type": "ClipNorm", "max_norm": 0.5}, {"type": "SGD", "lr": 0.05, "momentum": 0.9}]},
        },
        "train": {"steps": steps, "batch_size": 8, "eval_every": 1, **train},
    }, sort_keys=False))
    return path


def assert_self_contained(report: Path) -> str:
    """The report fetches nothing: no http(s) or protocol-relative src/href, no script, no stylesheet link."""
    text = report.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text, re.I)
    assert "<script" not in text.lower() and "<link" not in text.lower() and "url(" not in text
    for src in re.findall(r"""src\s*=\s*["']([^"']*)""", text):
        assert src.startswith("data:image/png;base64,"), src[:40]
    return text


# --- the statistics ---------------------------------------------------------------------------
def test_t_quantile_matches_scipy_for_df_1_to_60():
    st = pytest.importorskip("scipy.stats")
    for df in range(1, 61):
        for p in (0.6, 0.9, 0.95, 0.975, 0.995, 0.9995, 0.025):
            assert t_quantile(p, df) == pytest.approx(st.t.ppf(p, df), rel=1e-9, abs=1e-12), (df, p)
    for df in (0.5, 2.5, 200.0, 1e5):  # non-integer and large degrees of freedom too
        assert t_quantile(0.975, df) == pytest.approx(st.t.ppf(0.975, df), rel=1e-9)
    assert t_quantile(0.5, 3) == 0.0
    with pytest.raises(ValueError, match="0 < p < 1"):
        t_quantile(1.0, 3)


def test_interval_of_known_values():
    iv = interval([1, 2, 3, 4, 5])
    # mean 3, sd sqrt(2.5) = 1.581139, half-width t_{0.975,4} * sd / sqrt(5) (t_{0.975,4} = 2.776445 from tables)
    assert iv["n"] == 5 and iv["missing"] == 0 and iv["mean"] == 3.0
    assert iv["sd"] == pytest.approx(math.sqrt(2.5), rel=1e-15)
    assert iv["half_width"] == pytest.approx(2.776445 * 1.581139 / 2.236068, rel=1e-6)
    st = pytest.importorskip("scipy.stats")
    assert iv["half_width"] == pytest.approx(st.t.ppf(0.975, 4) * statistics.stdev([1, 2, 3, 4, 5]) / math.sqrt(5), rel=1e-12)
    assert (iv["low"], iv["high"]) == (pytest.approx(3 - iv["half_width"]), pytest.approx(3 + iv["half_width"]))
    assert iv["status"] == "interval" and format_interval(iv, ".4g") == "3 ± 2.0 (n=5)"


def test_one_value_has_no_interval_and_missing_values_are_counted():
    one = interval([0.25])
    assert one["mean"] == 0.25 and one["half_width"] is None and one["low"] is None and one["sd"] is None
    assert one["status"] == "one" and format_interval(one) == "0.25 (n=1, no interval)"
    none = interval([None, None])
    assert none["mean"] is None and none["n"] == 0 and none["missing"] == 2 and format_interval(none) == "-"
    part = interval([2.0, None, 4.0])
    assert part["n"] == 2 and part["missing"] == 1 and part["mean"] == 3.0
    assert format_interval(part) == "3 (n=2 of 3, too few)"


def test_paired_difference_of_a_known_case():
    # differences 2, 3, 2: mean 7/3, sd sqrt(1/3), sd/sqrt(3) = 1/3; t_{0.975,2} = 4.302653 (tables)
    d = paired([3.0, 5.0, 4.0], [1.0, 2.0, 2.0])
    assert d["n"] == 3 and d["mean"] == pytest.approx(7 / 3, rel=1e-15)
    assert d["half_width"] == pytest.approx(4.302653 / 3, rel=1e-6)
    # pairing removes what the seed does to both: the unpaired means differ by the same 7/3,
    # but the spread of either group alone is wider than that of the differences
    assert interval([3.0, 5.0, 4.0])["half_width"] > d["half_width"]
    # a pair with a missing side is left out; equal differences: no interval (not one of zero width)
    d = paired([3.0, None, 4.0, 6.0], [1.0, 2.0, 2.0, None])
    assert (d["n"], d["missing"], d["mean"], d["sd"], d["half_width"], d["status"]) == (2, 2, 2.0, 0.0, None, "same")
    with pytest.raises(ValueError, match="one baseline value each"):
        paired([1.0], [1.0, 2.0])


def test_below_five_seeds_no_interval_is_printed_and_the_cell_names_n():
    for n in (2, 3, 4):
        iv = interval(list(range(1, n + 1)))
        assert iv["status"] == "too_few" and iv["half_width"] > 0  # computed (in the JSON), not printed
        assert format_interval(iv) == f"{(n + 1) / 2:g} (n={n}, too few)"
    five = interval([1, 2, 3, 4, 5, None])
    assert five["status"] == "interval" and format_interval(five) == "3 ± 2.0 (n=5 of 6)"
    assert interval([None])["status"] == "none" and format_interval(interval([None])) == "-"


def test_a_difference_equal_on_every_seed_is_not_an_interval_of_zero_width():
    # the Muon case: two seeds that each gave 8 spikes fewer than the baseline
    d = paired([2.0, 5.0], [10.0, 13.0])
    assert (d["n"], d["mean"], d["sd"], d["half_width"], d["low"], d["high"], d["status"]) == (2, -8.0, 0.0, None, None, None, "same")
    assert format_interval(d, ".3g", signed=True) == "-8 (same on all 2 seeds)"
    assert format_interval(interval([0.1] * 5)) == "0.1 (same on all 5 seeds)"  # its mean is the value, unrounded
    assert format_interval(interval([0.0, -0.0, 0.0])) == "0 (same on all 3 seeds)"
    # an interval of compare.json's schema 1 (no status) reads the same way
    old = {"n": 2, "missing": 0, "mean": -8.0, "sd": 0.0, "half_width": 0.0, "low": -8.0, "high": -8.0}
    assert format_interval(old, ".3g", signed=True) == "-8 (same on all 2 seeds)"
    assert format_interval({**old, "sd": 1.0, "half_width": 9.0}, ".3g") == "-8 (n=2, too few)"


def test_worst_excursion_on_known_series():
    assert worst_excursion([1, 1, 1, 1, 3, 1, 1], window=3) == (3.0, 4)
    assert worst_excursion([8, 8, 8, 4, 2, 1], window=3) == (0.5, 3)  # always below its median: below 1
    assert worst_excursion([1, 1, 1, 2, None, 1], window=3) == (None, 4)  # non-finite: unbounded
    assert worst_excursion([1, 1, 1], window=3) == (None, None)  # no step has a window behind it


def test_band_is_the_geometric_mean_with_its_t_interval():
    from modopt.cli.plots import _seed_band

    xs, mid, low, high = _seed_band([{1: 1.0, 2: 2.0}, {1: math.e**2, 2: 8.0}, {2: 4.0}])
    assert xs == [1, 2]
    half = t_quantile(0.975, 1) * math.sqrt(2) / math.sqrt(2)  # logs 0 and 2: mean 1, sd sqrt(2), n 2
    assert mid[0] == pytest.approx(math.e) and low[0] == pytest.approx(math.exp(1 - half)) and high[0] == pytest.approx(math.exp(1 + half))
    assert mid[1] == pytest.approx(4.0)  # geometric mean of 2, 8, 4


# --- the command ------------------------------------------------------------------------------
def _cells(table: str, prefix: str) -> list[str]:
    """The metric cells (after the name and seeds columns) of the table rows starting with `prefix`."""
    return [c.strip() for ln in table.splitlines() if ln.startswith(prefix) for c in ln.strip("|").split("|")[2:]]


def test_compare_seeds_end_to_end(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "ts.yaml")
    out = tmp_path / "cmp"
    argv = ["compare", str(cfg), "--seeds", "0", "1", "2", "--baseline", "ts-sgd", "--spike-window", "5",
            "--out", str(out), "--quiet"]
    if not _has_matplotlib():
        argv.append("--no-plots")
    assert main(argv) == 0
    table = capsys.readouterr().out
    words = " ".join(table.split())
    assert "Student-t 95% interval" in words and "Δ final loss" in table and "± n/a" not in table
    # three seeds: every cell says so, and none has an interval
    cells = _cells(table, "| ts-")
    assert len(cells) == 18 and "(n >= 5) that excludes 0" in words
    assert all(re.fullmatch(r"[-+]?[\d.e+-]+ \((n=3, too few|same on all 3 seeds)\)|-", c) for c in cells), cells
    data = json.loads((out / "compare.json").read_text())
    assert data["schema"] == 2 and data["kind"] == "compare" and data["baseline"] == "ts-sgd"
    assert data["interval"] == {"method": "Student-t 95% interval of the mean over seeds", "level": 0.95, "min_seeds": 5}
    assert data["spike"]["window"] == 5
    assert [r["name"] for r in data["runs"]] == ["ts-sgd", "ts-clip"]
    st = pytest.importorskip("scipy.stats")
    for run in data["runs"]:
        assert run["seeds"] == [0, 1, 2] and [s["seed"] for s in run["per_seed"]] == [0, 1, 2]
        variant = run["name"].removeprefix("ts-")
        for s in run["per_seed"]:
            # every seed's values are those of `modopt run --seed S` of the variant
            single = tmp_path / f"single-{variant}-{s['seed']}"
            assert main(["run", str(cfg), "--variant", variant, "--seed", str(s["seed"]), "--out", str(single),
                         "--quiet", "--no-plots"]) == 0
            assert (single / "metrics.jsonl").read_bytes() == (Path(s["run_dir"]) / "metrics.jsonl").read_bytes()
            alone = json.loads((single / "summary.json").read_text())
            for key in ("final_loss", "best_loss", "final_eval_loss", "clipped_pct", "max_grad_norm"):
                assert s[key] == alone[key], key
            # worst excursion, recomputed here from the eval losses (spikes are counted on them: eval every step)
            evals = [json.loads(x)["eval_loss"] for x in (single / "metrics.jsonl").read_text().splitlines()]
            ratios = [evals[t] / statistics.median(evals[t - 5:t]) for t in range(5, len(evals))]
            assert s["worst_excursion"] == pytest.approx(max(ratios), rel=1e-12)
            assert s["worst_excursion_step"] == 1 + 5 + ratios.index(max(ratios))
        fl = [s["final_loss"] for s in run["per_seed"]]
        summ = run["summary"]["final_loss"]
        assert summ["n"] == 3 and summ["mean"] == pytest.approx(statistics.fmean(fl), rel=1e-12)
        assert summ["half_width"] == pytest.approx(st.t.ppf(0.975, 2) * statistics.stdev(fl) / math.sqrt(3), rel=1e-9)
    base, clip = data["runs"]
    assert base["vs_baseline"] is None
    vs = clip["vs_baseline"]
    assert vs["baseline"] == "ts-sgd" and vs["seeds"] == [0, 1, 2]
    diffs = [c["final_eval_loss"] - b["final_eval_loss"] for c, b in zip(clip["per_seed"], base["per_seed"])]
    assert vs["metrics"]["final_eval_loss"]["mean"] == pytest.approx(statistics.fmean(diffs), rel=1e-12)
    assert vs["metrics"]["final_eval_loss"]["half_width"] == pytest.approx(
        st.t.ppf(0.975, 2) * statistics.stdev(diffs) / math.sqrt(3), rel=1e-9)
    assert (out / "compare.md").read_text(encoding="utf-8").startswith(table.strip() + "\n\nProvenance:\n")
    text = assert_self_contained(out / "report.html")
    assert "<table>" in text and "Paired difference" in text
    if _has_matplotlib():
        assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"
        assert "data:image/png;base64," in text


def test_one_seed_says_there_is_no_interval(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "ts.yaml", steps=8)
    out = tmp_path / "cmp"
    assert main(["compare", str(cfg), "--seed", "4", "--out", str(out), "--quiet", "--no-plots"]) == 0
    table = capsys.readouterr().out
    rows = [ln for ln in table.splitlines() if ln.startswith("| ts-")]
    assert len(rows) == 2 and all("(n=1, no interval)" in r and "±" not in r for r in rows)
    assert "(n=1, no interval): one seed" in " ".join(table.split())
    data = json.loads((out / "compare.json").read_text())
    for run in data["runs"]:
        assert run["seeds"] == [4] and (out / run["name"] / "seed-4" / "summary.json").is_file()
        fl = run["summary"]["final_loss"]
        assert fl["n"] == 1 and fl["half_width"] is None and fl["low"] is None
    text = assert_self_contained(out / "report.html")
    assert "turned off with --no-plots" in text


def test_two_seeds_print_no_interval_and_an_equal_difference_says_so(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "ts.yaml", steps=8)  # 8 steps: no loss spike on any seed (window 20)
    out = tmp_path / "cmp"
    assert main(["compare", str(cfg), "--seeds", "0", "1", "--baseline", "ts-sgd", "--out", str(out), "--quiet",
                 "--no-plots"]) == 0
    table = capsys.readouterr().out
    cells = _cells(table, "| ts-")
    assert len(cells) == 18 and not any("±" in c for c in cells)
    assert all(c.endswith(("(n=2, too few)", "(same on all 2 seeds)")) or c == "-" for c in cells), cells
    head, _, row = table.split("\n\n")[1].splitlines()[:3]  # the paired-difference table
    by_column = dict(zip((c.strip() for c in head.split("|")), (c.strip() for c in row.split("|"))))
    assert by_column["Δ loss spikes"] == "+0 (same on all 2 seeds)"  # 0 spikes on both seeds of both runs
    data = json.loads((out / "compare.json").read_text())
    vs = data["runs"][1]["vs_baseline"]["metrics"]
    assert (vs["loss_spikes"]["status"], vs["loss_spikes"]["half_width"], vs["loss_spikes"]["n"]) == ("same", None, 2)
    assert vs["final_loss"]["status"] == "too_few" and vs["final_loss"]["n"] == 2 and vs["final_loss"]["half_width"] > 0
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "+0 (same on all 2 seeds)" in html and "(n=2, too few)" in html and "± 0<" not in html
    assert "± " not in (out / "compare.md").read_text(encoding="utf-8").split("\n\n")[0]


def test_seeds_come_from_the_config_unless_the_command_line_names_them(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "ts.yaml", steps=4, seeds=[5, 6])
    for extra, seeds in (([], [5, 6]), (["--seeds", "7"], [7]), (["--seed", "8"], [8])):
        out = tmp_path / f"cmp{len(extra)}{seeds[0]}"
        assert main(["compare", str(cfg), *extra, "--out", str(out), "--quiet", "--no-plots"]) == 0
        assert [r["seeds"] for r in json.loads((out / "compare.json").read_text())["runs"]] == [seeds, seeds]
        # each run's own config.yaml is a single-seed experiment
        one = yaml.safe_load((out / "ts-sgd" / f"seed-{seeds[-1]}" / "config.yaml").read_text())
        assert one["train"]["seed"] == seeds[-1] and one["train"]["seeds"] is None
    capsys.readouterr()


@pytest.mark.parametrize("extra, message", [
    (["--seed", "1", "--seeds", "2", "3"], "not both"),
    (["--seeds", "1", "2", "1"], "--seeds: 1 given twice"),
    (["--baseline", "ts-sgdd"], "--baseline ts-sgdd: no run is named so (did you mean 'ts-sgd'?); the runs are: ts-sgd, ts-clip"),
])
def test_bad_seed_or_baseline_options_run_nothing(tmp_path, capsys, extra, message):
    cfg = tiny_config(tmp_path / "ts.yaml", steps=4)
    out = tmp_path / "cmp"
    assert main(["compare", str(cfg), *extra, "--out", str(out), "--quiet", "--no-plots"]) == 1
    assert message in capsys.readouterr().err
    assert not out.exists()


def single_config(path: Path, name: str, transforms: list, steps: int = 4) -> Path:
    """One run of the teacher-student task (no variants)."""
    path.write_text(yaml.safe_dump({"name": name, "task": TINY_TS, "optimizer": {"transforms": transforms},
                                    "train": {"steps": steps, "batch_size": 8}}, sort_keys=False))
    return path


def test_baseline_may_be_named_by_the_config_argument_of_a_single_run(tmp_path, capsys):
    sgd = single_config(tmp_path / "plain_sgd.yaml", "plain-sgd", [{"type": "SGD", "lr": 0.05}])
    clip = single_config(tmp_path / "clipped.yaml", "clipped", [{"type": "ClipNorm", "max_norm": 0.5},
                                                                 {"type": "SGD", "lr": 0.05}])
    out = tmp_path / "cmp"
    args = ["compare", str(sgd), str(clip), "--seeds", "0", "1", "--out", str(out), "--quiet", "--no-plots"]
    assert main([*args, "--baseline", str(sgd)]) == 0
    data = json.loads((out / "compare.json").read_text())
    assert data["baseline"] == "plain-sgd"
    assert [r["vs_baseline"] and r["vs_baseline"]["baseline"] for r in data["runs"]] == [None, "plain-sgd"]
    assert "run - plain-sgd" in capsys.readouterr().out
    # a config argument that makes several runs names none of them
    multi = tiny_config(tmp_path / "ts.yaml", steps=4)
    out2 = tmp_path / "cmp2"
    assert main(["compare", str(multi), "--seeds", "0", "--out", str(out2), "--quiet", "--no-plots",
                 "--baseline", str(multi)]) == 1
    assert f"--baseline {multi}: no run is named so" in capsys.readouterr().err
    assert not out2.exists()


def test_train_seeds_are_validated(tmp_path, capsys):
    for seeds, message in (([], "train.seeds"), ([1, 1], "seeds must be distinct"), ([-1], "train.seeds.0")):
        cfg = tiny_config(tmp_path / "ts.yaml", steps=4, seeds=seeds)
        assert main(["validate", str(cfg)]) == 1
        assert message in capsys.readouterr().err


def test_report_without_matplotlib_keeps_the_tables(tmp_path, monkeypatch, capsys):
    import modopt.cli.plots as plots

    monkeypatch.setattr(plots, "_pyplot", lambda: None)
    cfg = tiny_config(tmp_path / "ts.yaml", steps=4)
    out = tmp_path / "cmp"
    assert main(["compare", str(cfg), "--seeds", "0", "1", "--out", str(out), "--quiet"]) == 0
    assert "matplotlib is not installed" in capsys.readouterr().err
    text = assert_self_contained(out / "report.html")
    assert "The plots need matplotlib" in text and "<img" not in text and text.count("<table>") == 2
    assert not (out / "compare.png").exists()


def test_plot_compare_seeds_draws_bands(tmp_path):
    pytest.importorskip("matplotlib")
    from modopt.cli.plots import plot_compare_seeds

    def rows(seed):
        return [{"step": i, "loss": 1.0 / i + 0.01 * seed, "grad_norm": 1.0 + seed, "eval_loss": 0.5 + 0.1 * seed}
                for i in range(1, 80)]

    path = tmp_path / "c.png"
    assert plot_compare_seeds(path, {"a": {0: rows(0), 1: rows(1)}, "b": {0: rows(2), 1: rows(3), 2: rows(4)}}) is None
    assert path.read_bytes()[:4] == b"\x89PNG"
