"""`modopt validate` runs `modopt run`'s gate: a config it passes builds and starts, and one that `run` cannot do
is refused by both with exit 1 and one line naming the field (never exit 70, "a bug in modopt")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from modopt.cli import main
from modopt.cli import tasks as T
from modopt.config import ConfigError

TS = {"name": "teacher_student", "options": {"dim": 4, "hidden": 8, "teacher_hidden": 8, "eval_size": 16}}


def config(path: Path, transforms: list[dict] | None = None, task: dict | None = None, **train) -> Path:
    path.write_text(yaml.safe_dump({
        "name": "exp", "task": task or TS,
        "optimizer": {"transforms": transforms or [{"type": "Adam", "lr": 0.01}]},
        "train": {"steps": 2, "batch_size": 4, **train},
    }, sort_keys=False))
    return path


def refused_by_both(cfg: Path, out: Path, capsys, *words: str, lines: int = 1) -> str:
    """validate and run both exit 1 with `lines` lines (a field that does not validate: the file's line,
    then the field's) holding `words`; run writes nothing."""
    assert main(["validate", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"modopt validate: error: {cfg}: ") and err.count("\n") == lines, err
    assert all(w in err for w in words), err
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--no-plots"]) == 1
    run_err = capsys.readouterr().err
    assert run_err.startswith("modopt run: error: ") and run_err.count("\n") == lines, run_err
    assert all(w in run_err for w in words), run_err
    assert "internal error" not in err + run_err and "Traceback" not in err + run_err
    assert not out.exists()
    return err


# --- the reported cases --------------------------------------------------------------------------------
@pytest.mark.parametrize("transforms, train, words", [
    (None, {"batch_size": 4611686018427387904}, ("train.batch_size: 4611686018427387904 examples",)),
    ([{"type": "ClipNormByEMA", "eps": 1e300}, {"type": "Adam", "lr": 0.01}], {}, ("ClipNormByEMA.eps", "1e+300")),
    ([{"type": "ZClip", "max_grad_norm": 1e300}, {"type": "Adam", "lr": 0.01}], {}, ("ZClip.max_grad_norm", "1e+300")),
], ids=["batch_size", "ClipNormByEMA.eps", "ZClip.max_grad_norm"])
def test_what_validates_runs_or_is_refused_by_both_with_exit_1(tmp_path, capsys, transforms, train, words):
    cfg = config(tmp_path / "exp.yaml", transforms, **train)
    refused_by_both(cfg, tmp_path / "run", capsys, *words)


# --- the batch -----------------------------------------------------------------------------------------
def test_a_batch_larger_than_memory_is_refused_naming_the_field_and_what_fits(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("modopt.cli.run.machine_memory", lambda: 10_000)
    per = 4 * (4 + 1)  # the teacher-student batch of one: x (dim 4) and y, float32
    ok = config(tmp_path / "ok.yaml", batch_size=10_000 // per)
    assert main(["validate", str(ok)]) == 0
    capsys.readouterr()
    cfg = config(tmp_path / "exp.yaml", batch_size=10_000 // per + 1)
    refused_by_both(cfg, tmp_path / "run", capsys, f"train.batch_size: {10_000 // per + 1} examples of the "
                    f"teacher_student task take {(10_000 // per + 1) * per} bytes ({per} per example) for the batch "
                    f"alone, more than this machine's memory (10000 bytes); at most {10_000 // per} fit")


def test_the_batch_probe_leaves_the_global_rng_as_it_was():
    from modopt.cli.run import check_batch

    task = T.make_task("teacher_student", dict(TS["options"]), 0)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    check_batch(task, "teacher_student", 8)
    assert torch.equal(torch.get_rng_state(), before)


# --- the built-in tasks' options -----------------------------------------------------------------------
@pytest.mark.parametrize("task, option, shown", [
    ({"name": "teacher_student", "options": {"eval_size": 4611686018427387904}}, "'eval_size' must be an integer in 1..1048576", "4611686018427387904"),
    ({"name": "teacher_student", "options": {"dim": 2**62}}, "'dim' must be an integer in 1..65536", "4611686018427387904"),
    ({"name": "teacher_student", "options": {"noise_df": -1}}, "'noise_df' must be a number in [1e-06, 1e+06]", "-1"),
    ({"name": "teacher_student", "options": {"dim": "abc"}}, "'dim' must be an integer in 1..65536", "'abc'"),
    ({"name": "transformer", "options": {"seq_len": 2**62}}, "'seq_len' must be an integer in 4..16384", "4611686018427387904"),
    ({"name": "transformer", "options": {"d_model": 2**62, "nhead": 1}}, "'d_model' must be an integer in 1..65536", "4611686018427387904"),
    ({"name": "transformer", "options": {"vocab": 0}}, "'vocab' must be an integer in 1..1048576", "0"),
    ({"name": "transformer", "options": {"layers": True}}, "'layers' must be an integer in 1..1024", "True"),
    ({"name": "transformer", "options": {"noise": float("nan")}}, "'noise' must be a number in [0, 1]", "nan"),
    ({"name": "digits", "options": {"depth": 0}}, "'depth' must be an integer in 1..1024", "0"),
    ({"name": "chars", "options": {"eval_size": 0}}, "'eval_size' must be an integer in 1..1048576", "0"),
])
def test_a_task_option_out_of_its_range_is_refused_naming_it(tmp_path, capsys, task, option, shown):
    cfg = config(tmp_path / "exp.yaml", task=task)
    refused_by_both(cfg, tmp_path / "run", capsys, f"  task: task '{task['name']}': option {option}, got {shown}\n",
                    lines=2)


def test_every_builtin_option_has_a_rule_that_its_default_meets():
    for name, fn in T.BUILTIN.items():
        defaults, _ = T.task_options(fn)
        assert set(T.OPTION_RULES[name]) == set(defaults), name
        T.check_values(name, defaults)


@pytest.mark.parametrize("name, options", [
    ("teacher_student", {"dim": 5, "hidden": 7, "teacher_hidden": 3, "eval_size": 11}),
    ("transformer", {"vocab": 9, "seq_len": 10, "d_model": 12, "nhead": 3, "layers": 3, "ff": 13, "eval_size": 7}),
    ("chars", {"seq_len": 10, "d_model": 12, "nhead": 3, "layers": 2, "ff": 13, "eval_size": 7}),
    ("digits", {"hidden": 9, "depth": 3}),
    ("digits", {"depth": 1}),
])
def test_the_footprint_counts_the_parameters_the_task_builds(name, options):
    if name == "digits":
        pytest.importorskip("sklearn")
    task = T.make_task(name, options, 0)
    assert T.footprint(name, options)[0] == sum(p.numel() for p in task.model.parameters())


def test_a_model_larger_than_memory_is_refused_before_it_is_allocated(tmp_path, capsys, monkeypatch):
    built = []
    monkeypatch.setattr(T, "MLP", lambda *a: built.append(a))  # (never reached: nothing is allocated)
    monkeypatch.setattr(T, "machine_memory", lambda: 10**9)
    opts = {"dim": 65536, "hidden": 4096}
    cfg = config(tmp_path / "exp.yaml", task={"name": "teacher_student", "options": opts})
    params = T.footprint("teacher_student", opts)[0]
    refused_by_both(cfg, tmp_path / "run", capsys, f"task 'teacher_student' (dim=65536, hidden=4096): its {params} "
                    "parameters, their gradients and its held-out data take", "more than this machine's memory "
                    "(1000000000 bytes)")
    assert built == []


def test_threads_past_the_bound_are_refused_at_validation(tmp_path, capsys):
    cfg = config(tmp_path / "exp.yaml", threads=2**31 - 1)
    assert main(["validate", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "train.threads: Input should be less than or equal to 1024" in err and "libgomp" not in err


def test_check_values_names_the_option_and_shortens_a_huge_value():
    with pytest.raises(ConfigError, match=r"^task 'transformer': option 'noise' must be a number in \[0, 1\], got 1000.{33}\.\.\.$"):
        T.check_values("transformer", {"noise": 10**400})
