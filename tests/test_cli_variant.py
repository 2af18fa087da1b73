"""`--variant NAME ...` of `modopt compare` and `modopt sweep`, and the closest option for an unknown one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from modopt.cli import main
from test_compare_seeds import TINY_TS

QUIET = ["--quiet", "--no-plots"]


def three_variants(path: Path, steps: int = 2) -> Path:
    sgd = {"type": "SGD", "lr": 0.05}
    path.write_text(yaml.safe_dump({
        "name": "ts", "task": TINY_TS,
        "variants": {"sgd": {"transforms": [sgd]},
                     "clip": {"transforms": [{"type": "ClipNorm", "max_norm": 0.5}, sgd]},
                     "zclip": {"transforms": [{"type": "ZClip", "max_grad_norm": None}, sgd]}},
        "train": {"steps": steps, "batch_size": 8, "eval_every": steps, "checkpoint_every": steps},
    }, sort_keys=False))
    return path


def _runs(out: Path) -> list[str]:
    return [r["name"] for r in json.loads((out / "compare.json").read_text())["runs"]]


# --- compare ---------------------------------------------------------------------------------------
def test_compare_runs_only_the_named_variants(tmp_path, capsys):
    cfg = three_variants(tmp_path / "ts.yaml")
    out = tmp_path / "cmp"
    # a variant's name or its run's name as the tables show it; in the config's order
    assert main(["compare", str(cfg), "--variant", "zclip", "ts-sgd", "--seed", "0", "--out", str(out), *QUIET]) == 0
    capsys.readouterr()
    assert _runs(out) == ["ts-sgd", "ts-zclip"]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["ts-sgd", "ts-zclip"]


@pytest.mark.parametrize("names, message", [
    (["sgd", "zclp"], "--variant zclp: no such variant (did you mean 'zclip'?); the variants are: sgd, clip, zclip"),
    (["sgd", "sgd"], "--variant: sgd given twice; name each variant once"),
])
def test_compare_refuses_an_unknown_variant_before_anything_runs(tmp_path, capsys, names, message):
    cfg = three_variants(tmp_path / "ts.yaml")
    out = tmp_path / "cmp"
    assert main(["compare", str(cfg), "--variant", *names, "--seed", "0", "--out", str(out), *QUIET]) == 1
    err = capsys.readouterr().err
    assert err == f"modopt compare: error: {message}\n"
    assert not out.exists()


def test_compare_variant_of_a_config_without_variants_is_refused(tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "transformer_noclip", "--variant", "a", "--out", str(out), *QUIET]) == 1
    assert "transformer_noclip has no variants (an optimizer of its own); drop --variant" in capsys.readouterr().err
    assert not out.exists()


def test_compare_variant_of_several_configs(tmp_path, capsys):
    """Each name must be a variant of some config; a config with variants must have one of them."""
    a = three_variants(tmp_path / "a.yaml")
    b = tmp_path / "b.yaml"
    b.write_text(a.read_text().replace("name: ts", "name: other").replace("zclip:", "adagc:")
                 .replace("type: ZClip", "type: AdaGC").replace("max_grad_norm: null", "beta: 0.98"))
    out = tmp_path / "cmp"
    assert main(["compare", str(a), str(b), "--variant", "clip", "--seed", "0", "--out", str(out), *QUIET]) == 0
    capsys.readouterr()
    assert _runs(out) == ["ts-clip", "other-clip"]
    assert main(["compare", str(a), str(b), "--variant", "zclip", "--seed", "0", "--out", str(tmp_path / "x"),
                 *QUIET]) == 1
    assert f"--variant: {b} has none of the variants named (zclip); its variants are: sgd, clip, adagc" in (
        capsys.readouterr().err)


# --- sweep -----------------------------------------------------------------------------------------
def test_sweep_runs_the_grid_for_each_named_variant(tmp_path, capsys):
    cfg = three_variants(tmp_path / "ts.yaml")
    out = tmp_path / "sw"
    assert main(["sweep", str(cfg), "--variant", "sgd", "clip", "--grid", "train.batch_size=4,8", "--seed", "0",
                 "--out", str(out), *QUIET]) == 0
    table = capsys.readouterr().out
    data = json.loads((out / "sweep.json").read_text())
    assert data["variants"] == ["sgd", "clip"] and data["variant"] is None
    assert [(p["variant"], p["label"]) for p in data["points"]] == [
        ("sgd", "variant=sgd,batch_size=4"), ("sgd", "variant=sgd,batch_size=8"),
        ("clip", "variant=clip,batch_size=4"), ("clip", "variant=clip,batch_size=8")]
    assert table.splitlines()[0].split("|")[1].strip() == "variant"
    assert (out / "variant=clip,batch_size=8" / "seed-0" / "summary.json").is_file()


def test_sweep_of_one_variant_keeps_its_layout(tmp_path, capsys):
    cfg = three_variants(tmp_path / "ts.yaml")
    out = tmp_path / "sw"
    assert main(["sweep", str(cfg), "--variant", "clip", "--grid", "optimizer.transforms.0.max_norm=0.5,1",
                 "--seed", "0", "--out", str(out), *QUIET]) == 0
    capsys.readouterr()
    data = json.loads((out / "sweep.json").read_text())
    assert data["variant"] == "clip" and data["variants"] == ["clip"]
    assert [p["label"] for p in data["points"]] == ["max_norm=0.5", "max_norm=1"]


def test_sweep_refuses_an_unknown_variant_before_anything_runs(tmp_path, capsys):
    cfg = three_variants(tmp_path / "ts.yaml")
    out = tmp_path / "sw"
    assert main(["sweep", str(cfg), "--variant", "sgd", "clipp", "--grid", "train.batch_size=4", "--out", str(out),
                 *QUIET]) == 1
    err = capsys.readouterr().err
    assert err == ("modopt sweep: error: --variant clipp: no such variant (did you mean 'clip'?); "
                   "the variants are: sgd, clip, zclip\n")
    assert not out.exists()


# --- an unknown option -----------------------------------------------------------------------------
@pytest.mark.parametrize("command, argv, hint", [
    ("compare", ["compare", "ts.yaml", "--varaint", "sgd"], "(--varaint: did you mean --variant?)"),
    ("sweep", ["sweep", "ts.yaml", "--grid", "a=1", "--sede", "3"], "(--sede: did you mean --seed?)"),
    ("run", ["run", "ts.yaml", "--dip", "300"], "(--dip: did you mean --dpi?)"),
    ("compare", ["compare", "ts.yaml", "--no-plts"], "(--no-plts: did you mean --no-plots?)"),
])
def test_an_unknown_option_gets_the_command_usage_and_the_closest_option(tmp_path, capsys, command, argv, hint):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: modopt {command} "), err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"modopt {command}: error: unrecognized arguments: ") and last.endswith(hint), last


def test_an_unknown_word_with_nothing_close_gets_the_usage_alone(capsys):
    assert main(["run", "a.yaml", "--zzzzzzzz"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: modopt run ")
    assert err.strip().splitlines()[-1] == "modopt run: error: unrecognized arguments: --zzzzzzzz"
