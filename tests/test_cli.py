"""The modopt command: determinism, resume, validation errors, schema, modules, compare."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import modopt as mo
from modopt.cli import main
from modopt.cli.run import count_spikes

TINY_TASK = {"name": "transformer", "options": {"vocab": 8, "seq_len": 8, "d_model": 16, "nhead": 2, "layers": 1, "ff": 32, "eval_size": 32}}


def write_config(path: Path, transforms: list[dict], steps: int = 24, **train) -> Path:
    import yaml

    data = {
        "name": path.stem,
        "task": TINY_TASK,
        "optimizer": {"transforms": transforms},
        "train": {"steps": steps, "batch_size": 8, "seed": 3, **train},
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def clip_transforms() -> list[dict]:
    clip = {"type": "ZClip", "warmup_steps": 5} if "ZClip" in mo.available() else {"type": "ClipNorm", "max_norm": 0.5}
    return [clip, {"type": "Adam", "lr": 0.02}]


def run_cli(*args: str) -> int:
    return main([*args])


def test_run_writes_run_directory_and_is_deterministic(tmp_path, capsys):
    cfg = write_config(tmp_path / "exp.yaml", clip_transforms(), eval_every=8)
    a, b = tmp_path / "a", tmp_path / "b"
    assert run_cli("run", str(cfg), "--out", str(a), "--quiet", "--no-plots") == 0
    assert run_cli("run", str(cfg), "--out", str(b), "--quiet", "--no-plots") == 0
    ma, mb = (a / "metrics.jsonl").read_bytes(), (b / "metrics.jsonl").read_bytes()
    assert ma == mb
    rows = [json.loads(x) for x in ma.decode().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 25))
    for key in ("loss", "lr", "grad_norm", "post_clip_norm", "clip_scale", "clipped", "skipped"):
        assert key in rows[0], key
    assert "time_s" not in rows[0]
    assert sum("eval_loss" in r for r in rows) == 3
    for r in rows:
        assert r["post_clip_norm"] <= r["grad_norm"] * (1 + 1e-6)
    summary = json.loads((a / "summary.json").read_text())
    assert summary["steps"] == 24 and summary["time_per_step_ms"] > 0
    assert {"config.yaml", "timing.jsonl", "checkpoint.pt"} <= {p.name for p in a.iterdir()}
    # the resolved config re-validates and rebuilds the same pipeline
    assert run_cli("validate", str(a / "config.yaml")) == 0
    assert mo.load_config(a / "config.yaml") == mo.load_config(cfg)
    out = capsys.readouterr().out
    assert "final loss" in out


def test_resume_after_interruption_equals_uninterrupted_run(tmp_path):
    cfg = write_config(tmp_path / "exp.yaml", clip_transforms(), steps=30, checkpoint_every=10, eval_every=5)
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert run_cli("run", str(cfg), "--out", str(full), "--quiet", "--no-plots") == 0
    # killed after step 17: the checkpoint is from step 10, steps 11..17 are logged but lost
    assert run_cli("run", str(cfg), "--out", str(cut), "--quiet", "--no-plots", "--stop-after", "17") == 3
    assert len((cut / "metrics.jsonl").read_text().splitlines()) == 17
    assert not (cut / "summary.json").exists()
    assert run_cli("run", "--resume", str(cut), "--quiet", "--no-plots") == 0
    assert (cut / "metrics.jsonl").read_bytes() == (full / "metrics.jsonl").read_bytes()
    sf, sc = (json.loads((d / "summary.json").read_text()) for d in (full, cut))
    for key in ("final_loss", "best_loss", "final_eval_loss", "loss_spikes", "clipped_pct"):
        assert sf[key] == sc[key], key


def test_resume_can_extend_a_finished_run(tmp_path):
    cfg = write_config(tmp_path / "exp.yaml", [{"type": "ClipNorm", "max_norm": 1.0}, {"type": "SGD", "lr": 0.05, "momentum": 0.9}], steps=20)
    full, short = tmp_path / "full", tmp_path / "short"
    assert run_cli("run", str(cfg), "--out", str(full), "--quiet", "--no-plots") == 0
    assert run_cli("run", str(cfg), "--out", str(short), "--steps", "12", "--quiet", "--no-plots") == 0
    assert run_cli("run", "--resume", str(short), "--steps", "20", "--quiet", "--no-plots") == 0
    # the extended run equals the full one (no schedule, so lr does not depend on the total);
    # only the end-of-run evaluation at step 12 of the short run differs
    rows = lambda d: [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    rs, rf = rows(short), rows(full)
    assert "eval_loss" in rs[11] and "eval_loss" not in rf[11]
    del rs[11]["eval_loss"]
    assert rs == rf


def test_the_progress_line_shows_a_dash_until_a_loss_is_read(tmp_path, capsys):
    """The loss comes back with the telemetry (every `output.read_every` steps): before the first
    read-back the line shows a dash, after it the last loss read and its step, never a made-up nan."""
    import yaml

    cfg = write_config(tmp_path / "exp.yaml", clip_transforms(), steps=60)
    cfg.write_text(yaml.safe_dump({**yaml.safe_load(cfg.read_text()), "output": {"read_every": 20}}, sort_keys=False))
    assert run_cli("run", str(cfg), "--out", str(tmp_path / "r"), "--no-plots") == 0
    lines = [ln for ln in capsys.readouterr().err.splitlines() if " it/s " in ln]
    assert len(lines) == 10, lines  # not a terminal: a line per 10%
    losses = [ln.split(" loss ", 1)[1].split(" it/s")[0].rsplit(" ", 1)[0] for ln in lines]
    assert losses[0] == "-"  # step 6: nothing read yet
    assert losses[3].endswith("(step 20)") and float(losses[3].split()[0]) > 0  # step 24
    assert float(losses[-1]) > 0  # step 60 reads back (the last step): this step's loss
    assert not any("nan" in x for x in losses)


def test_the_progress_line_shows_what_was_read():
    import io
    import math

    from modopt.cli.run import Progress

    out = io.StringIO()
    bar = Progress(100, 0, "exp", stream=out)
    bar.update(10, None)
    bar.update(20, math.nan, 20)  # a real NaN loss
    bar.update(30, 1.5, 20)
    bar.update(40, math.inf, 40)
    shown = [ln.split(" loss ", 1)[1].split(" it/s")[0] for ln in out.getvalue().splitlines()]
    assert [x.rsplit(" ", 1)[0] for x in shown] == ["-", "nan", "1.5000 (step 20)", "inf"]


def test_every_subcommand_says_what_it_does_and_the_docs_list_it():
    import argparse

    from modopt.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    # `bench` hands its arguments to benchmarks/bench.py, whose own --help describes it
    assert [n for n, p in subs.choices.items() if not p.description and n != "bench"] == []
    synopsis = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text().split("```")[1]
    assert [n for n in subs.choices if f"modopt {n}" not in synopsis] == []


def test_compare_and_sweep_run_one_at_a_time_by_default():
    from modopt.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["compare", "a.yaml"]).jobs == 1
    assert parser.parse_args(["sweep", "a.yaml", "--grid", "train.steps=1,2"]).jobs == 1


def test_run_refuses_non_empty_out_without_force(tmp_path, capsys):
    cfg = write_config(tmp_path / "exp.yaml", [{"type": "SGD", "lr": 0.1}], steps=3)
    out = tmp_path / "r"
    assert run_cli("run", str(cfg), "--out", str(out), "--quiet", "--no-plots") == 0
    assert run_cli("run", str(cfg), "--out", str(out), "--quiet", "--no-plots") == 1
    assert "--force" in capsys.readouterr().err
    assert run_cli("run", str(cfg), "--out", str(out), "--quiet", "--no-plots", "--force") == 0


def test_run_writes_plots(tmp_path):
    cfg = write_config(tmp_path / "exp.yaml", clip_transforms(), steps=8)
    out = tmp_path / "r"
    assert run_cli("run", str(cfg), "--out", str(out), "--quiet") == 0
    for name in ("loss.png", "grad_norm.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_teacher_student_task_and_schedule(tmp_path):
    import yaml

    cfg = tmp_path / "ts.yaml"
    cfg.write_text(yaml.safe_dump({
        "task": {"name": "teacher_student", "options": {"dim": 4, "hidden": 8, "eval_size": 16}},
        "optimizer": {"transforms": [{"type": "ClipNorm", "max_norm": 1.0}, {"type": "SGD", "lr": 0.1}]},
        "train": {"steps": 10, "batch_size": 4, "eval_every": 1, "schedule": {"kind": "cosine", "warmup_steps": 2}},
    }))
    out = tmp_path / "r"
    assert run_cli("run", str(cfg), "--out", str(out), "--quiet", "--no-plots") == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["lr"] == pytest.approx(0.05) and rows[1]["lr"] == pytest.approx(0.1)
    assert rows[-1]["lr"] < 0.1
    assert json.loads((out / "summary.json").read_text())["spike_series"] == "eval_loss"


USER_TASK = '''
import torch
from modopt.cli.tasks import Task

def make_task(seed, width=3):
    model = torch.nn.Linear(width, 1)
    def get_batch(step, batch_size):
        g = torch.Generator().manual_seed(seed * 1000 + step)
        return torch.randn(batch_size, width, generator=g)
    return Task(model, get_batch, lambda m, x: m(x).pow(2).mean())
'''


def test_user_task_needs_trust_imports(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_tasks_mod.py").write_text(USER_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    import yaml

    cfg = tmp_path / "user.yaml"
    cfg.write_text(yaml.safe_dump({
        "task": {"name": "my_tasks_mod:make_task", "options": {"width": 5}},
        "optimizer": {"transforms": [{"type": "SGD", "lr": 0.1}]},
        "train": {"steps": 5, "batch_size": 4},
    }))
    assert run_cli("run", str(cfg), "--out", str(tmp_path / "r1"), "--quiet", "--no-plots") == 1
    assert "--trust-imports" in capsys.readouterr().err
    assert run_cli("run", str(cfg), "--out", str(tmp_path / "r2"), "--quiet", "--no-plots", "--trust-imports") == 0


@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("typo.yaml", """
            optimizer:
              transforms:
                - {type: ClipNorm, max_norm: 1.0, scpoe: global}
                - {type: Adam}
         """, ["optimizer.transforms.0.scpoe", "typo.yaml"]),
        ("negative.yaml", """
            optimizer:
              transforms:
                - {type: ClipNorm, max_norm: -1.0}
                - {type: Adam}
         """, ["optimizer.transforms.0.max_norm", "greater than 0"]),
        ("broken.yaml", """
            optimizer:
              transforms:
                - {type: ClipNorm, max_norm: 1.0
                - {type: Adam}
         """, ["broken.yaml", "line 4"]),
        ("train.yaml", """
            optimizer: {transforms: [{type: Adam}]}
            train: {stpes: 10}
         """, ["train.stpes"]),
        ("unknown.yaml", """
            optimizer: {transforms: [{type: ClipNrom, max_norm: 1}]}
         """, ["ClipNrom", "optimizer.transforms.0"]),
        ("both.json", '{"optimizer": {"transforms": [{"type": "Adam"}]}, "variants": {"a": {"transforms": [{"type": "SGD", "lr": 1}]}}}',
         ["not both"]),
    ],
)
def test_validate_errors_name_field_or_line(tmp_path, capsys, name, text, expected):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    assert run_cli("validate", str(path)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for piece in expected:
        assert piece in err, (piece, err)


def test_validate_ok_and_console_script_has_no_traceback(tmp_path):
    good = write_config(tmp_path / "good.yaml", clip_transforms())
    r = subprocess.run([sys.executable, "-m", "modopt.cli", "validate", str(good)], capture_output=True, text=True)
    assert r.returncode == 0 and "valid experiment config" in r.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text('transforms = [{type = "ClipNorm", max_norm = -1.0}, {type = "SGD", lr = 0.1}]\n')
    r = subprocess.run([sys.executable, "-m", "modopt.cli", "validate", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1
    assert "transforms.0.max_norm" in r.stderr and "Traceback" not in r.stderr


def test_schema_is_valid_json(capsys):
    assert run_cli("schema") == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"optimizer", "variants", "task", "train", "output"} <= set(schema["properties"])
    assert set(mo.available()) <= set(schema["$defs"])
    assert run_cli("schema", "--pipeline") == 0
    pipe = json.loads(capsys.readouterr().out)
    assert pipe == json.loads(json.dumps(mo.config_schema()))


def test_schema_accepts_example_with_jsonschema(capsys):
    import jsonschema  # part of the dev extra
    assert run_cli("schema") == 0
    schema = json.loads(capsys.readouterr().out)
    jsonschema.validate({"optimizer": {"transforms": [{"type": "ClipNorm", "max_norm": 1.0}, {"type": "Adam"}]}}, schema)


def test_modules_lists_every_registered_transform(capsys):
    assert run_cli("modules") == 0
    out = capsys.readouterr().out
    listed = {line.split(":")[0].split(" ")[0] for line in out.splitlines() if line and not line.startswith(" ")}
    assert listed == set(mo.available())
    assert "max_norm: float (required; > 0)" in out
    assert "``" not in out and ":class:" not in out and ":func:" not in out  # no reST in the terminal
    assert run_cli("modules", "--json") == 0
    mods = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in mods] == mo.available()
    clip = next(m for m in mods if m["name"] == "ClipNorm")
    assert {f["name"]: f["default"] for f in clip["fields"]}["scope"] == "global"
    assert all(m["description"] for m in mods)


def test_compare_prints_table_and_writes_plot(tmp_path, capsys):
    import yaml

    a = write_config(tmp_path / "fixed.yaml", [{"type": "ClipNorm", "max_norm": 0.5}, {"type": "Adam", "lr": 0.02}], steps=12)
    v = tmp_path / "variants.yaml"
    v.write_text(yaml.safe_dump({
        "name": "v", "task": TINY_TASK, "train": {"steps": 12, "batch_size": 8},
        "variants": {"none": {"transforms": [{"type": "Adam", "lr": 0.02}]}, "clip": {"transforms": clip_transforms()}},
    }))
    out = tmp_path / "cmp"
    argv = ["compare", str(a), str(v), "--out", str(out), "--quiet"]
    if not _has_matplotlib():
        argv.append("--no-plots")
    assert run_cli(*argv) == 0
    captured = capsys.readouterr()
    table = captured.out
    wrote = [ln for ln in captured.err.splitlines() if ln.startswith("modopt compare: wrote ")]
    assert wrote and str(out / "compare.md") in wrote[0] and str(out / "compare.json") in wrote[0]
    assert (str(out / "compare.png") in wrote[0]) == _has_matplotlib()
    lines = [ln for ln in table.strip().splitlines() if ln.startswith("|")]  # the table, without its footnote
    assert lines[0].startswith("| run") and "loss spikes" in lines[0] and "% clipped" in lines[0] and "ms/step" in lines[0]
    assert len(lines) == 2 + 3
    assert {"fixed", "v-none", "v-clip"} <= {ln.split("|")[1].strip() for ln in lines[2:]}
    assert (out / "compare.md").read_text().startswith(table.strip() + "\n\nProvenance:\n")  # the table, then its provenance
    assert len(json.loads((out / "compare.json").read_text())["runs"]) == 3
    if _has_matplotlib():
        assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG"


def test_run_with_variants_needs_variant(tmp_path, capsys):
    import yaml

    v = tmp_path / "variants.yaml"
    v.write_text(yaml.safe_dump({
        "task": TINY_TASK, "train": {"steps": 3, "batch_size": 4},
        "variants": {"a": {"transforms": [{"type": "SGD", "lr": 0.1}]}, "b": {"transforms": [{"type": "Adam"}]}},
    }))
    assert run_cli("run", str(v), "--out", str(tmp_path / "r"), "--quiet") == 1
    assert "--variant" in capsys.readouterr().err
    assert run_cli("run", str(v), "--variant", "b", "--out", str(tmp_path / "r"), "--quiet", "--no-plots") == 0


def test_bench_runs_the_checkouts_script(capsys):
    from modopt import cli

    assert cli.BENCH_SCRIPT.is_file()
    assert run_cli("bench", "--quick", "--only", "ZClip", "--models", "mlp", "--no-ignore-rows") == 0
    out = capsys.readouterr().out
    assert "| mlp " in out and "ZClip(), AdamW()" in out


def test_bench_outside_a_checkout_says_where_the_benchmark_is(monkeypatch, tmp_path, capsys):
    from modopt import cli

    monkeypatch.setattr(cli, "BENCH_SCRIPT", tmp_path / "missing" / "bench.py")
    assert run_cli("bench", "--quick") == 1
    assert "python benchmarks/bench.py" in capsys.readouterr().err


def test_count_spikes_definition():
    flat = [1.0] * 30
    assert count_spikes(flat) == []
    spiky = [1.0] * 25 + [2.0, 2.5, 1.0] + [1.0] * 10 + [1.4] + [1.0] * 5 + [float("nan") and None]
    # 2.0 > 1.5 x median 1.0 and rises by >= 0.1: one spike covering steps 25-26; 1.4 is not a spike; None (non-finite) is
    assert count_spikes(spiky) == [25, 44]


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_validate_bare_pipeline_names_the_fields_as_written(tmp_path, capsys):
    cfg = tmp_path / "pipe.yaml"
    cfg.write_text("transforms:\n  - {type: ClipNorm, max_norm: -1}\n  - {type: Adam, lrr: 0.1}\n")
    assert run_cli("validate", str(cfg)) != 0
    err = capsys.readouterr().err
    assert "transforms.0.max_norm" in err and "transforms.1.lrr" in err
    assert "optimizer.transforms" not in err  # the file has no 'optimizer' key: don't name one


# --- validate knows everything run knows; a failed start leaves nothing (issue 10) -------------
def _exp_file(tmp_path: Path, name: str, task: dict, transforms: list[dict] | None = None, **extra) -> Path:
    import yaml

    data = {"name": name, "task": task, "optimizer": {"transforms": transforms or [{"type": "Adam"}]},
            "train": {"steps": 4, "batch_size": 4}, **extra}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("task, expected", [
    ({"name": "transfomer"}, ["task.name", "unknown task 'transfomer'", "did you mean 'transformer'", "teacher_student"]),
    ({"name": "transformer", "options": {"seq_lne": 8}}, ["task 'transformer' has no option 'seq_lne'", "did you mean 'seq_len'", "vocab=16"]),
    ({"name": "transformer", "options": {"seq_len": 7}}, ["seq_len must be even"]),  # only building the task finds it
    ({"name": "teacher_student", "options": {"dim": 4, "noise": 1}}, ["has no option 'noise'", "noise_df"]),
])
def test_validate_rejects_bad_task_names_and_options(tmp_path, capsys, task, expected):
    path = _exp_file(tmp_path, "bad_task", task)
    assert run_cli("validate", str(path)) == 1
    err = capsys.readouterr().err
    for piece in expected:
        assert piece in err, (piece, err)
    # run refuses it the same way, and leaves no run directory behind
    out = tmp_path / "run"
    assert run_cli("run", str(path), "--out", str(out), "--quiet", "--no-plots") == 1
    assert expected[-1] in capsys.readouterr().err
    assert not out.exists()


def test_validate_builds_the_optimizer_like_run(tmp_path, capsys):
    path = _exp_file(tmp_path, "bad_group", {**TINY_TASK}, [{"type": "SGD", "lr": 0.1}])
    import yaml

    data = yaml.safe_load(path.read_text())
    data["optimizer"]["defaults"] = {"betas": [0.9, 0.99]}  # no transform exposes betas: an error at build time
    path.write_text(yaml.safe_dump(data))
    assert run_cli("validate", str(path)) == 1
    err = capsys.readouterr().err
    assert "optimizer" in err and "betas" in err
    out = tmp_path / "run"
    assert run_cli("run", str(path), "--out", str(out), "--quiet", "--no-plots") == 1
    assert not out.exists()


def test_config_errors_suggest_the_name_meant(tmp_path, capsys):
    path = tmp_path / "typos.yaml"
    path.write_text(textwrap.dedent("""
        optimizer:
          transforms:
            - {type: ClipNrom, max_norm: 1.0}
            - {type: ClipNorm, max_nrom: 1.0}
            - {type: HistClip, criterion: {kind: ema, r_thrsh: 2.0}}
            - {type: Adam}
        train: {stpes: 3}
    """))
    assert run_cli("validate", str(path)) == 1
    err = capsys.readouterr().err
    for piece in [
        "optimizer.transforms.0: unknown transform type 'ClipNrom' (did you mean 'ClipNorm'?)",
        "optimizer.transforms.1.max_nrom: unknown field 'max_nrom' (did you mean 'max_norm'?); ClipNorm takes: max_norm, ord",
        "r_thrsh' (did you mean 'r_thresh'?); EMACriterion takes",
        "train.stpes: unknown field 'stpes' (did you mean 'steps'?)",
    ]:
        assert piece in err, (piece, err)


def test_failed_start_leaves_no_run_directory_and_rerun_works(tmp_path, monkeypatch, capsys):
    (tmp_path / "failing_tasks_mod.py").write_text(USER_TASK + textwrap.dedent('''

        def broken(seed, width=3):
            raise ValueError("this task cannot be built")

        def crashes(seed, width=3):
            task = make_task(seed, width)
            def loss_fn(m, x):
                raise RuntimeError("loss blew up")
            task.loss_fn = loss_fn
            return task
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "run"
    for fn, msg in (("broken", "cannot be built"), ("crashes", "loss blew up")):
        path = _exp_file(tmp_path, fn, {"name": f"failing_tasks_mod:{fn}"}, [{"type": "SGD", "lr": 0.1}])
        if fn == "broken":
            assert run_cli("run", str(path), "--out", str(out), "--quiet", "--no-plots", "--trust-imports") == 1
            assert msg in capsys.readouterr().err
        else:  # fails in the first step, before any checkpoint: the files it wrote are removed
            # (a crash in the user's task code is not a config error: exit 70 with its traceback)
            assert run_cli("run", str(path), "--out", str(out), "--quiet", "--no-plots", "--trust-imports") == 70
            assert msg in capsys.readouterr().err
        assert not out.exists()
    # the same --out then runs without --force
    good = _exp_file(tmp_path, "good", {"name": "failing_tasks_mod:make_task"}, [{"type": "SGD", "lr": 0.1}])
    assert run_cli("run", str(good), "--out", str(out), "--quiet", "--no-plots", "--trust-imports") == 0
    assert (out / "checkpoint.pt").exists()


def test_existing_directory_is_kept_when_a_forced_start_fails(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    path = _exp_file(tmp_path, "bad_value", {"name": "transformer", "options": {"seq_len": 7}})
    assert run_cli("run", str(path), "--out", str(out), "--quiet", "--no-plots", "--force") == 1
    assert (out / "notes.txt").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == ["notes.txt"]
# --- the terminal summary, `modules NAME`, error reporting, the schedule ----------------------
def test_summary_spike_list_is_never_cut_silently():
    from modopt.cli import _format_summary

    base = {"run_dir": "r", "steps": 100, "final_loss": 0.1, "final_loss_window": 5, "best_loss": 0.05,
            "clipped_pct": 1.0, "skipped_steps": 0, "time_per_step_ms": 1.0}
    few = _format_summary({**base, "loss_spikes": 3, "spike_steps": [21, 40, 77], "spike_series": "loss"})
    assert "loss spikes:  3 (counted on the train loss) at steps 21, 40, 77" in few and "..." not in few
    many = _format_summary({**base, "loss_spikes": 14, "spike_steps": list(range(30, 44)), "spike_series": "eval_loss"})
    line = next(ln for ln in many.splitlines() if ln.startswith("loss spikes"))
    assert "counted on the eval loss" in line
    assert "39, ... (+4 more" in line and "40" not in line.split("...")[0]


def test_modules_filters_by_name_with_ranges(capsys):
    assert run_cli("modules", "clipnorm", "Adam") == 0
    out = capsys.readouterr().out
    heads = [ln.split(":")[0].split(" ")[0] for ln in out.splitlines() if ln and not ln.startswith(" ")]
    assert heads == ["ClipNorm", "Adam"]
    assert "max_norm: float (required; > 0)" in out
    assert run_cli("modules", "ZClip", "--json") == 0
    (z,) = json.loads(capsys.readouterr().out)
    assert {f["name"]: f["range"] for f in z["fields"]}["alpha"] == "0.0 <= x < 1.0"


def test_modules_unknown_name_suggests_the_closest(capsys):
    assert run_cli("modules", "ClipNrom") == 1
    err = capsys.readouterr().err
    assert "no transform named 'ClipNrom'" in err and "did you mean ClipNorm" in err


def test_format_range():
    from modopt.cli.modules import format_range

    assert format_range({"gt": 0}) == "> 0"
    assert format_range({"ge": 0.0, "lt": 1.0}) == "0.0 <= x < 1.0"
    assert format_range({"le": 5}) == "<= 5"
    assert format_range({}) == ""


def test_internal_error_is_reported_as_a_bug_with_traceback(monkeypatch, capsys):
    import modopt.cli.modules as modules

    def broken(names=None):
        raise ValueError("an internal bug")

    monkeypatch.setattr(modules, "describe_modules", broken)
    monkeypatch.delenv("MODOPT_DEBUG", raising=False)
    assert run_cli("modules") == 70
    err = capsys.readouterr().err
    assert "Traceback" in err and "internal error: ValueError: an internal bug" in err and "bug" in err
    monkeypatch.setenv("MODOPT_DEBUG", "1")
    with pytest.raises(ValueError, match="an internal bug"):
        run_cli("modules")


def test_user_errors_are_one_line_without_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MODOPT_DEBUG", raising=False)
    assert run_cli("validate", str(tmp_path / "missing.yaml")) == 1
    cfg = tmp_path / "bad_task.yaml"
    write_config(cfg, [{"type": "SGD", "lr": 0.1}], steps=2)
    text = cfg.read_text().replace("seq_len: 8", "seq_len: 7")
    cfg.write_text(text)
    assert run_cli("run", str(cfg), "--out", str(tmp_path / "r"), "--quiet", "--no-plots") == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "seq_len" in err


def _schedule_reference(kind: str, warmup: int, min_factor: float, s: int, total: int) -> float:
    """The schedule's definition (docs/cli.md), written out independently of torch."""
    import math

    if warmup and s <= warmup:
        return s / warmup
    if kind == "constant":
        return 1.0
    t = min(1.0, (s - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * t)) if kind == "cosine" else 1 - t
    return min_factor + (1 - min_factor) * shape


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup", [0, 1, 3, 12])
@pytest.mark.parametrize("min_factor", [0.0, 0.25])
def test_schedule_built_from_torch_schedulers_matches_its_definition(kind, warmup, min_factor):
    import warnings

    import torch

    from modopt.cli.experiment import Schedule

    total = 12
    sc = Schedule(kind=kind, warmup_steps=warmup, min_factor=min_factor)
    p = torch.nn.Parameter(torch.zeros(2))
    opt = mo.Modular([p], mo.SGD(lr=0.3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no scheduler-order warnings
        sched = sc.build(opt, total)
        assert (sched is None) == (kind == "constant" and warmup <= 1)
        if sched is not None:
            assert type(sched).__module__ == "torch.optim.lr_scheduler"
        for s in range(1, total + 1):
            want = 0.3 * _schedule_reference(kind, warmup, min_factor, s, total)
            assert opt.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12, abs=1e-15), s
            p.grad = torch.ones(2)
            opt.step()
            if sched is not None:
                sched.step()


def test_resume_with_a_schedule_equals_uninterrupted_run(tmp_path):
    cfg = write_config(tmp_path / "exp.yaml", [{"type": "SGD", "lr": 0.05, "momentum": 0.9}], steps=20, checkpoint_every=5,
                       schedule={"kind": "cosine", "warmup_steps": 4, "min_factor": 0.1})
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert run_cli("run", str(cfg), "--out", str(full), "--quiet", "--no-plots") == 0
    assert run_cli("run", str(cfg), "--out", str(cut), "--quiet", "--no-plots", "--stop-after", "13") == 3
    assert run_cli("run", "--resume", str(cut), "--quiet", "--no-plots") == 0
    assert (cut / "metrics.jsonl").read_bytes() == (full / "metrics.jsonl").read_bytes()


def test_plots_mark_spikes_and_take_the_pipeline(tmp_path):
    pytest.importorskip("matplotlib")
    from modopt.cli.plots import plot_compare, plot_run, smooth

    metrics = [{"step": i, "loss": 1.0 if i != 30 else 9.0, "grad_norm": 1.0, "post_clip_norm": 0.5,
                "clipped": i % 7 == 0, "skipped": False, **({"eval_loss": 0.9} if i % 10 == 0 else {})}
               for i in range(1, 61)]
    summary = {"spike_steps": [30], "spike_series": "loss"}
    assert plot_run(tmp_path, metrics, "t", pipeline="ClipNorm -> Adam", summary=summary) is None
    assert plot_compare(tmp_path / "c.png", {"a": metrics, "b": metrics}, labels={"a": "A", "b": "B"}) is None
    for f in ("loss.png", "grad_norm.png", "c.png"):
        assert (tmp_path / f).read_bytes()[:4] == b"\x89PNG"
    sm = smooth([1.0, None, 100.0, 1.0, 1.0], 3)
    assert sm[1] == pytest.approx(10.0) and sm[0] == pytest.approx(1.0) and sm[3] == pytest.approx(100 ** (1 / 3))


@pytest.mark.parametrize("name", ["/abs/dir", "../../x", "/../../x", "a/b", "a\\b", "..", ".", "", "x" * 121, "tab\there"])
def test_names_that_would_become_paths_are_refused(tmp_path, capsys, name):
    import yaml

    for data in ({"name": name, "optimizer": {"transforms": [{"type": "SGD", "lr": 0.1}]}},
                 {"name": "ok", "variants": {name: {"transforms": [{"type": "SGD", "lr": 0.1}]}}}):
        cfg = tmp_path / "exp.yaml"
        cfg.write_text(yaml.safe_dump(data))
        assert run_cli("validate", str(cfg)) == 1
        err = capsys.readouterr().err
        assert "one plain name" in err and "Traceback" not in err, err
        out = tmp_path / "out"
        assert run_cli("compare", str(cfg), "--out", str(out), "--quiet", "--no-plots") == 1
        assert not out.exists()  # refused before anything was written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp.yaml"]


def test_compare_and_sweep_refuse_another_commands_output(tmp_path, capsys):
    cfg = write_config(tmp_path / "exp.yaml", [{"type": "SGD", "lr": 0.1}], steps=3)
    run_dir = tmp_path / "r"
    assert run_cli("run", str(cfg), "--out", str(run_dir), "--quiet", "--no-plots") == 0
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert "checkpoint.pt" in before
    assert run_cli("compare", str(cfg), "--out", str(run_dir), "--quiet", "--no-plots") == 1
    assert "holds the output of `modopt run`" in capsys.readouterr().err
    assert run_cli("sweep", str(cfg), "--out", str(run_dir), "--grid", "train.steps=2", "--quiet", "--no-plots") == 1
    assert "holds the output of `modopt run`" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before  # nothing removed or added


def test_an_out_that_cannot_be_a_directory_is_refused_naming_it(tmp_path, capsys):
    """`--out` under a file: run, compare and sweep each say which directory they cannot create, without a
    traceback, and write nothing."""
    cfg = write_config(tmp_path / "exp.yaml", [{"type": "SGD", "lr": 0.1}], steps=3)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    out = blocker / "r"
    for cmd in (["run", str(cfg)], ["compare", str(cfg)], ["sweep", str(cfg), "--grid", "train.steps=2"]):
        assert run_cli(*cmd, "--out", str(out), "--quiet", "--no-plots") == 1
        err = capsys.readouterr().err
        assert f"{out}: cannot create the output directory (Not a directory)" in err, (cmd, err)
        assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "exp.yaml"]
    assert blocker.read_text() == "not a directory"


def test_a_checkpoint_tmp_link_placed_in_the_run_dir_is_not_followed(tmp_path):
    cfg = write_config(tmp_path / "exp.yaml", [{"type": "SGD", "lr": 0.1}], steps=3)
    out = tmp_path / "r"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (out / "checkpoint.tmp").symlink_to(victim)
    assert run_cli("run", str(cfg), "--out", str(out), "--quiet", "--no-plots", "--force") == 0
    assert victim.read_text() == "keep me"
    assert (out / "checkpoint.pt").is_file() and not (out / "checkpoint.tmp").exists()


def test_training_stopped_by_the_config_is_exit_4_and_a_refused_write_exit_1(tmp_path, capsys, monkeypatch):
    import errno

    import yaml

    monkeypatch.delenv("MODOPT_DEBUG", raising=False)
    cfg = write_config(tmp_path / "exp.yaml", [{"type": "SGD", "lr": 1e30}], steps=6)
    data = yaml.safe_load(cfg.read_text())
    data["optimizer"]["nonfinite"] = "raise"
    cfg.write_text(yaml.safe_dump(data))
    assert run_cli("run", str(cfg), "--out", str(tmp_path / "r"), "--quiet", "--no-plots") == 4
    err = capsys.readouterr().err
    assert "training stopped: non-finite gradient" in err and "Traceback" not in err

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "r2" / "checkpoint.tmp"))

    monkeypatch.setattr("modopt.cli.run._atomic_save", full)
    ok = write_config(tmp_path / "ok.yaml", [{"type": "SGD", "lr": 0.1}], steps=3)
    assert run_cli("run", str(ok), "--out", str(tmp_path / "r2"), "--quiet", "--no-plots") == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and "system refused" in err and "Traceback" not in err


def test_a_rewind_guard_that_gives_up_is_exit_4(tmp_path, capsys, monkeypatch):
    import yaml

    monkeypatch.delenv("MODOPT_DEBUG", raising=False)
    cfg = write_config(tmp_path / "exp.yaml", [{"type": "SGD", "lr": 1e30}], steps=12)
    data = yaml.safe_load(cfg.read_text())
    data["train"]["rewind"] = {"every": 2, "max_tries": 1, "loss_z": None}  # a non-finite loss triggers
    cfg.write_text(yaml.safe_dump(data))
    assert run_cli("run", str(cfg), "--out", str(tmp_path / "r"), "--quiet", "--no-plots") == 4
    err = capsys.readouterr().err
    assert "training stopped: " in err and "Traceback" not in err


def test_resume_after_editing_read_every_continues_as_the_uninterrupted_run(tmp_path):
    import yaml

    cfg = write_config(tmp_path / "exp.yaml", [{"type": "ClipNorm", "max_norm": 0.5}, {"type": "Adam", "lr": 0.01}], steps=8)
    data = yaml.safe_load(cfg.read_text())
    data["train"]["checkpoint_every"] = 2
    data["output"] = {**data.get("output", {}), "read_every": 2}
    cfg.write_text(yaml.safe_dump(data))
    assert run_cli("run", str(cfg), "--out", str(tmp_path / "whole"), "--quiet", "--no-plots") == 0
    cut = tmp_path / "cut"
    assert run_cli("run", str(cfg), "--out", str(cut), "--quiet", "--no-plots", "--stop-after", "4") == 3
    saved = yaml.safe_load((cut / "config.yaml").read_text())
    saved["output"]["read_every"] = 3  # a history of another capacity in the checkpoint
    (cut / "config.yaml").write_text(yaml.safe_dump(saved))
    assert run_cli("run", "--resume", str(cut), "--quiet", "--no-plots") == 0

    def rows(d):
        return [{k: v for k, v in json.loads(line).items() if k != "time"} for line in (d / "metrics.jsonl").read_text().splitlines()]

    assert rows(cut) == rows(tmp_path / "whole")


def test_a_config_asking_for_more_memory_than_the_machine_has_is_a_user_error(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MODOPT_DEBUG", raising=False)
    cfg = write_config(tmp_path / "exp.yaml", [{"type": "SGD", "lr": 0.1}], steps=2, batch_size=10**13)
    # the gate: the batch alone (10**13 x 64 bytes) is more than the machine's memory, refused before the run
    assert run_cli("run", str(cfg), "--out", str(tmp_path / "r"), "--quiet", "--no-plots") == 1
    err = capsys.readouterr().err
    assert "train.batch_size: 10000000000000 examples" in err and "more than this machine's memory" in err
    assert "Traceback" not in err and not (tmp_path / "r").exists()
    # where the system does not say how much memory there is, the allocation the machine refuses is exit 1 too
    monkeypatch.setattr("modopt.cli.run.machine_memory", lambda: None)
    assert run_cli("run", str(cfg), "--out", str(tmp_path / "r"), "--quiet", "--no-plots") == 1
    err = capsys.readouterr().err
    assert "out of memory" in err and "train.batch_size" in err and "Traceback" not in err
    assert not (tmp_path / "r").exists()  # a failed start leaves no run directory


def test_a_reader_that_goes_away_stops_the_command_quietly():
    # `modopt modules | head`: the pipe's read end is closed before the command writes, so its first write
    # fails (EPIPE); it ends as a program killed by SIGPIPE would, with no traceback and no "internal error"
    proc = subprocess.Popen([sys.executable, "-m", "modopt.cli", "modules"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""
