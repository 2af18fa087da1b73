"""Plots a paper can use: legends that tell variants apart, a seed band that cannot stretch a log axis,
interval bars only where the tables print an interval, `--format png|svg|pdf` and `--dpi`."""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import pytest
import yaml

from modopt.cli import main
from modopt.cli.stats import interval
from test_compare_seeds import TINY_TS, tiny_config

pytest.importorskip("matplotlib")

QUIET = ["--quiet"]
MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-"}


def _is(fmt: str, data: bytes) -> bool:
    """Whether `data` is a file of `fmt` by its first bytes (an SVG: XML whose root is <svg>)."""
    if fmt == "svg":
        return data.lstrip().startswith(b"<?xml") and b"<svg" in data[:2000]
    return data.startswith(MAGIC[fmt])


def _png_dpi(data: bytes) -> float:
    """The resolution a PNG records in its pHYs chunk (pixels per metre, as dots per inch)."""
    pos = 8
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"pHYs":
            x, y, unit = struct.unpack(">IIB", data[pos + 8:pos + 17])
            assert unit == 1 and x == y
            return x * 0.0254
        pos += 12 + length
    raise AssertionError("no pHYs chunk")


@pytest.fixture
def figures(monkeypatch):
    """Every figure the plots save, with its file name: `[(name, fig)]` (saved as usual)."""
    import modopt.cli.plots as plots

    seen = []
    original = plots._save

    def save(plt, fig, path, dpi):
        seen.append((Path(path).name, fig))
        fig.canvas.draw()  # (legend and limits as written)
        original(plt, fig, path, dpi)

    monkeypatch.setattr(plots, "_save", save)
    return seen


def _legend_texts(fig) -> list[str]:
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    return [t.get_text() for leg in legends for t in leg.get_texts()]


# --- legends ---------------------------------------------------------------------------------------
def test_muon_recipe_legend_entries_tell_every_variant_apart(tmp_path, capsys, figures):
    """The Muon recipe example: three variants whose outer transforms are all `Masked -> Masked`, two
    that differ in one field of QKClip only. Each legend entry, even without the run's name, differs."""
    out = tmp_path / "cmp"
    assert main(["compare", "muon_recipe_compare", "--steps", "2", "--seed", "0", "--out", str(out), *QUIET]) == 0
    capsys.readouterr()
    [fig] = [f for name, f in figures if name.startswith("compare.")]
    texts = [t.replace("\n", " ") for t in _legend_texts(fig)]
    names = [r["name"] for r in json.loads((out / "compare.json").read_text())["runs"]]
    assert len(texts) == len(names) == 5
    described = [t.split(": ", 1)[1] for t in texts]  # what the entry says beside the run's name
    assert len(set(described)) == 5, described
    assert not any(d.startswith("Masked -> Masked") for d in described), described
    assert any("QKClip.logits=rewritten" in d for d in described), described


def test_runs_whose_pipelines_read_the_same_are_told_apart_by_their_fields():
    from modopt.cli.plots import describe_pipeline, legend_labels

    def adam(lr):
        return {"transforms": [{"type": "ClipNorm", "max_norm": 1.0}, {"type": "Adam", "lr": lr}]}

    labels = legend_labels({"a": adam(0.1), "b": adam(0.01), "c": {"transforms": [{"type": "SGD", "lr": 0.1}]}})
    assert labels == {"a": "a: ClipNorm -> Adam [Adam.lr=0.1]", "b": "b: ClipNorm -> Adam [Adam.lr=0.01]", "c": "c: SGD"}
    nested = {"transforms": [{"type": "Masked", "where": {}, "transforms": [{"type": "Muon"}, {"type": "LR"}]}]}
    assert describe_pipeline(nested) == "Masked(Muon -> LR)"


# --- the band on a log axis ------------------------------------------------------------------------
def _seeds(logs: list[float], steps: int = 12) -> dict[int, list[dict]]:
    """One run over len(logs) seeds: seed k's loss and grad norm are e**logs[k] at every step."""
    return {k: [{"step": i, "loss": math.exp(v), "grad_norm": math.exp(v)} for i in range(1, steps + 1)]
            for k, v in enumerate(logs)}


def _axes_and_bands(fig):
    """`[(ylim, [band y values])]` per panel."""
    out = []
    for ax in fig.axes:
        ys = [y for coll in ax.collections for path in coll.get_paths() for _, y in path.vertices]
        out.append((ax.get_ylim(), ys))
    return out


def test_five_seed_band_is_clipped_to_the_range_of_the_curves(tmp_path, figures):
    from modopt.cli.plots import plot_compare_seeds

    # four seeds at 1, one at e**10: the interval of the mean of the logs reaches e**-3.5 below every seed
    assert plot_compare_seeds(tmp_path / "c.png", {"r": _seeds([0, 0, 0, 0, 10])}) is None
    [(_, fig)] = figures
    for (lo, hi), band in _axes_and_bands(fig):
        assert band, "five seeds get a band"
        assert 0.3 < lo < 1.0 and math.exp(10) < hi < 3 * math.exp(10), (lo, hi)  # the curves, a margin
        assert lo <= min(band) and max(band) <= hi
    assert "clipped at the axes" in fig.axes[0].get_title()


def test_two_seeds_draw_each_seed_not_a_band_and_keep_the_axis_to_the_data(tmp_path, figures):
    from modopt.cli.plots import plot_compare_seeds

    # two seeds a factor e apart: a t interval with 1 degree of freedom spans e**-8 .. e**9
    assert plot_compare_seeds(tmp_path / "c.png", {"r": _seeds([0, 1]), "s": _seeds([0.5, 0.6])}) is None
    [(_, fig)] = figures
    for ax, ((lo, hi), band) in zip(fig.axes, _axes_and_bands(fig)):
        assert not band
        assert 0.5 < lo < 1.0 and math.e < hi < 2 * math.e, (lo, hi)
        assert len(ax.lines) == 2 + 4  # a mean per run, and each of the four seeds faint
    assert "too few for an interval" in fig.axes[0].get_title()


def test_sweep_bars_only_where_the_tables_print_an_interval(tmp_path, figures):
    from modopt.cli.plots import plot_sweep

    few = [(v, interval([v, v + 1.0])) for v in (1.0, 2.0)]  # two seeds: "too few"
    many = [(v, interval([v, v + 1.0, v, v + 0.5, v + 0.2])) for v in (1.0, 2.0)]
    plot_sweep(tmp_path / "few.png", "x", "final loss", {"": few})
    plot_sweep(tmp_path / "many.png", "x", "final loss", {"": many})
    (_, f_few), (_, f_many) = figures
    assert not any(c.has_yerr for c in f_few.axes[0].containers)
    assert "too few for an interval" in f_few.axes[0].get_title()
    assert all(c.has_yerr for c in f_many.axes[0].containers)


# --- formats and dpi -------------------------------------------------------------------------------
def _tiny_run_config(path: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "name": "t", "task": TINY_TS,
        "optimizer": {"transforms": [{"type": "SGD", "lr": 0.05}]},
        "train": {"steps": 3, "batch_size": 8, "eval_every": 3, "checkpoint_every": 3},
    }, sort_keys=False))
    return path


@pytest.mark.parametrize("fmt", ["png", "svg", "pdf"])
def test_run_writes_its_plots_in_the_format_asked(tmp_path, capsys, fmt):
    out = tmp_path / "run"
    assert main(["run", str(_tiny_run_config(tmp_path / "t.yaml")), "--out", str(out), "--format", fmt,
                 "--dpi", "120", *QUIET]) == 0
    capsys.readouterr()
    for name in ("loss", "grad_norm"):
        assert _is(fmt, (out / f"{name}.{fmt}").read_bytes())
    assert not any((out / f"loss.{other}").exists() for other in ("png", "svg", "pdf") if other != fmt)
    if fmt == "png":
        assert _png_dpi((out / "loss.png").read_bytes()) == pytest.approx(120, abs=0.5)


def test_default_dpi_is_a_print_resolution(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", str(_tiny_run_config(tmp_path / "t.yaml")), "--out", str(out), *QUIET]) == 0
    capsys.readouterr()
    assert _png_dpi((out / "loss.png").read_bytes()) == pytest.approx(200, abs=0.5)


@pytest.mark.parametrize("fmt", ["svg", "pdf"])
def test_compare_and_its_runs_write_the_format_asked_and_record_it(tmp_path, capsys, fmt):
    out = tmp_path / "cmp"
    cfg = tiny_config(tmp_path / "ts.yaml", steps=3)
    assert main(["compare", str(cfg), "--seeds", "0", "1", "--out", str(out), "--format", fmt, "--dpi", "150",
                 *QUIET]) == 0
    assert f"compare.{fmt}" in capsys.readouterr().err
    assert _is(fmt, (out / f"compare.{fmt}").read_bytes()) and not (out / "compare.png").exists()
    assert _is(fmt, (out / "ts-sgd" / "seed-1" / f"loss.{fmt}").read_bytes())
    assert json.loads((out / "compare.json").read_text())["plots"] == {"format": fmt, "dpi": 150}
    report = (out / "report.html").read_text()
    if fmt == "svg":
        assert report.count("data:image/svg+xml;base64,") == 1
    else:  # a browser shows no PDF inline: the report links the file beside it
        assert '<a href="compare.pdf">' in report and "<img" not in report


def test_sweep_writes_the_format_asked(tmp_path, capsys):
    out = tmp_path / "sw"
    cfg = tiny_config(tmp_path / "ts.yaml", steps=3)
    assert main(["sweep", str(cfg), "--variant", "clip", "--grid", "optimizer.transforms.0.max_norm=0.5,1",
                 "--seeds", "0", "1", "--out", str(out), "--format", "svg", *QUIET]) == 0
    capsys.readouterr()
    assert _is("svg", (out / "sweep-max_norm.svg").read_bytes()) and not (out / "sweep-max_norm.png").exists()
    assert json.loads((out / "sweep.json").read_text())["plots"] == {"format": "svg", "dpi": 200}


@pytest.mark.parametrize("argv, code, message", [
    (["--dpi", "20"], 2, "argument --dpi: 20 is out of range: must be 50..600"),
    (["--dpi", "601"], 2, "argument --dpi: 601 is out of range: must be 50..600"),
    (["--format", "jpg"], 2, "argument --format: invalid choice: 'jpg'"),
    (["--no-plots", "--dpi", "300"], 1, "--dpi: no plots are written with --no-plots"),
])
def test_bad_format_or_dpi_is_refused_before_anything_runs(tmp_path, capsys, argv, code, message):
    out = tmp_path / "run"
    assert main(["run", str(_tiny_run_config(tmp_path / "t.yaml")), "--out", str(out), *argv, *QUIET]) == code
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_check_format_names_the_bad_value():
    from modopt.cli.plots import check_format

    with pytest.raises(ValueError, match=re.escape("plot format 'gif': not one of png, svg, pdf")):
        check_format("gif", 200)
    with pytest.raises(ValueError, match=re.escape("plot dpi 10: must be an integer 50..600")):
        check_format("png", 10)
