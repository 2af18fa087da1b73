"""The provenance block of every result file (`modopt run`, `compare`, `sweep`) and `modopt report`."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import modopt
from modopt.cli import main
from test_compare_seeds import tiny_config

pytestmark = pytest.mark.slow  # end-to-end runs of every command (the slow lane)

FIELDS = ["modopt", "commit", "dirty", "torch", "python", "os", "devices", "date", "argv", "config_sha256"]
DATE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")
ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--quiet", "--no-plots"]


def sha256_of(data) -> str:
    """The hash the block states: over the canonical JSON (sorted keys, no spaces) of the resolved config."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()


def git_head() -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def check_block(block: dict, config=None) -> None:
    """Every field, with the values of this process and machine."""
    assert list(block) == FIELDS
    assert block["modopt"] == modopt.__version__ and block["torch"] == str(torch.__version__)
    assert block["python"] == ".".join(map(str, sys.version_info[:3]))
    assert DATE.fullmatch(block["date"]) and block["argv"] == sys.argv
    assert block["devices"][0].startswith("cpu: ") and "cores available" in block["devices"][0]
    head = git_head()
    if head is not None and (ROOT / ".git").exists():  # run from this checkout: its commit
        assert block["commit"] == head and block["dirty"] in (True, False)
    if config is not None:
        assert block["config_sha256"] == sha256_of(config)


def yaml_block(path: Path) -> dict:
    """The block of config.yaml's opening comment, read the way a person would: strip the comment marks."""
    lines = path.read_text().splitlines()
    assert lines[0].startswith("# provenance")
    body = []
    for ln in lines[1:]:
        if not ln.startswith("#"):
            break
        body.append(ln[4:])
    return yaml.safe_load("\n".join(body))


# --- the block ----------------------------------------------------------------------------------
def test_the_commit_is_read_from_the_git_files_and_a_worktree_follows_its_gitdir(tmp_path, monkeypatch):
    from modopt.cli import provenance as pv

    calls = []
    monkeypatch.setattr(pv, "_git", lambda root, *args: calls.append(args))  # git "fails": no subprocess answers
    sha, other = "a" * 40, "b" * 40
    repo = tmp_path / "repo"
    (repo / ".git" / "refs" / "heads").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".git" / "packed-refs").write_text(f"# pack-refs with: peeled\n{other} refs/heads/dev\n{sha} refs/heads/main\n")
    assert pv.commit(repo) == (sha, None)  # from packed-refs; the tree's state unknown without git
    (repo / ".git" / "refs" / "heads" / "main").write_text(other + "\n")
    assert pv.commit(repo) == (other, None)  # a loose ref wins over packed-refs, as in git
    wt_git = repo / ".git" / "worktrees" / "wt"
    wt_git.mkdir(parents=True)
    (wt_git / "HEAD").write_text(f"{sha}\n")  # a detached HEAD
    (wt_git / "commondir").write_text("../..\n")
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt" / ".git").write_text(f"gitdir: {wt_git}\n")
    assert pv.commit(tmp_path / "wt") == (sha, None)
    (wt_git / "HEAD").write_text("ref: refs/heads/main\n")  # the branch lives in the main git directory
    assert pv.commit(tmp_path / "wt") == (other, None)
    assert [c[0] for c in calls] == ["status"] * 4  # git only for the tree's state, never for the commit
    assert pv.commit(tmp_path) == (None, None)  # not a checkout: nothing asked


def test_the_block_has_every_field_and_hashes_the_canonical_json():
    from modopt.cli.provenance import canonical_json, provenance

    config = {"b": [1, 2.5, None], "a": {"ü": "x"}}
    assert canonical_json(config) == '{"a":{"ü":"x"},"b":[1,2.5,null]}'
    block = provenance(config)
    check_block(block, config)
    assert provenance(None)["config_sha256"] is None
    assert provenance(config, argv=["modopt", "run"])["argv"] == ["modopt", "run"]


# --- modopt run -----------------------------------------------------------------------------------
def test_a_run_records_its_provenance_and_its_saved_config_still_runs_and_validates(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "ts.yaml", steps=6)
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--variant", "clip", "--out", str(run), *FLAGS]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())  # a comment: the data is the experiment alone
    assert "provenance" not in saved and saved["name"] == "ts-clip"
    summary = json.loads((run / "summary.json").read_text())
    check_block(summary["provenance"], saved)
    check_block(yaml_block(run / "config.yaml"), saved)
    # the saved config is accepted as it is: validate, and a run of it gives the same metrics
    assert main(["validate", str(run / "config.yaml")]) == 0
    again = tmp_path / "again"
    assert main(["run", str(run / "config.yaml"), "--out", str(again), *FLAGS]) == 0
    assert (again / "metrics.jsonl").read_bytes() == (run / "metrics.jsonl").read_bytes()
    assert yaml_block(again / "config.yaml")["config_sha256"] == summary["provenance"]["config_sha256"]
    # a resume that changes the length writes config.yaml again, with the new config's hash
    assert main(["run", "--resume", str(run), "--steps", "8", *FLAGS]) == 0
    longer = yaml.safe_load((run / "config.yaml").read_text())
    assert longer["train"]["steps"] == 8
    check_block(yaml_block(run / "config.yaml"), longer)
    check_block(json.loads((run / "summary.json").read_text())["provenance"], longer)
    capsys.readouterr()


def test_a_command_line_with_line_breaks_stays_inside_the_comment(tmp_path, monkeypatch, capsys):
    cfg = tiny_config(tmp_path / "ts.yaml", steps=3)
    argv = ["modopt", "run", "x\ny: 1", "z\u2028w: 2", "\x85v: 3", "é"]
    monkeypatch.setattr(sys, "argv", argv)
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--variant", "sgd", "--out", str(run), *FLAGS]) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert set(saved) == {"name", "task", "optimizer", "train", "output"}
    assert yaml_block(run / "config.yaml")["argv"] == argv
    assert main(["validate", str(run / "config.yaml")]) == 0
    capsys.readouterr()


# --- compare and sweep ----------------------------------------------------------------------------
def test_compare_writes_the_block_into_each_result_file(tmp_path, capsys):
    from modopt.cli.experiment import load_experiment

    cfg = tiny_config(tmp_path / "ts.yaml", steps=4)
    out = tmp_path / "cmp"
    assert main(["compare", str(cfg), "--seeds", "0", "1", "--out", str(out), *FLAGS]) == 0
    data = json.loads((out / "compare.json").read_text())
    exp = load_experiment(cfg)
    resolved = {"runs": {f"ts-{v}": exp.select(v).to_dict() for v in ("sgd", "clip")},
                "seeds": {"ts-sgd": [0, 1], "ts-clip": [0, 1]}, "baseline": None,
                "spike": {"window": 20, "factor": 1.5, "min_rise": 0.1}}
    block = data["provenance"]
    check_block(block, resolved)
    md = (out / "compare.md").read_text(encoding="utf-8")
    html = (out / "report.html").read_text(encoding="utf-8")
    for text in (md, html):
        assert f"commit {block['commit']}" in text or "not from a git checkout" in text
        for value in (block["modopt"], block["torch"], block["date"], block["config_sha256"], block["devices"][0]):
            assert value in text, value
    for name in ("ts-sgd", "ts-clip"):
        for seed in (0, 1):
            run = out / name / f"seed-{seed}"
            config = yaml.safe_load((run / "config.yaml").read_text())
            check_block(json.loads((run / "summary.json").read_text())["provenance"], config)
            check_block(yaml_block(run / "config.yaml"), config)
    capsys.readouterr()


def test_sweep_writes_the_block_into_each_result_file(tmp_path, capsys):
    from modopt.cli.experiment import load_experiment

    cfg = tiny_config(tmp_path / "ts.yaml", steps=4)
    out = tmp_path / "sweep"
    assert main(["sweep", str(cfg), "--variant", "sgd", "--grid", "optimizer.transforms.0.lr=0.01,0.1",
                 "--out", str(out), *FLAGS]) == 0
    data = json.loads((out / "sweep.json").read_text())
    resolved = {"experiment": load_experiment(cfg).select("sgd").to_dict(),
                "grid": [{"path": "optimizer.transforms.0.lr", "values": [0.01, 0.1]}], "seeds": [0],
                "metric": "final_loss", "spike": {"window": 20, "factor": 1.5, "min_rise": 0.1}}
    block = data["provenance"]
    check_block(block, resolved)
    for name in ("sweep.md", "report.html"):
        text = (out / name).read_text(encoding="utf-8")
        assert block["config_sha256"] in text and block["date"] in text and block["torch"] in text
    for point in data["points"]:
        run = Path(point["per_seed"][0]["run_dir"])
        config = yaml.safe_load((run / "config.yaml").read_text())
        check_block(json.loads((run / "summary.json").read_text())["provenance"], config)
    capsys.readouterr()


# --- modopt report ----------------------------------------------------------------------------------
def test_report_shows_the_block_of_a_run_and_checks_its_config(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "ts.yaml", steps=3)
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--variant", "sgd", "--out", str(run), *FLAGS]) == 0
    block = json.loads((run / "summary.json").read_text())["provenance"]
    capsys.readouterr()
    for target in (run, run / "summary.json", run / "config.yaml"):
        assert main(["report", str(target)]) == 0
        shown = capsys.readouterr().out
        assert f"provenance of {run / 'summary.json'}:" in shown and f"provenance of {run / 'config.yaml'}" in shown
        for value in (block["modopt"], block["torch"], block["python"], block["date"], block["devices"][0],
                      block["config_sha256"], " ".join(block["argv"][1:])):
            assert value in shown, value
        assert "matches the recorded hash: it is the config that ran" in shown
    # the config edited after the run: the hash says so
    text = (run / "config.yaml").read_text()
    (run / "config.yaml").write_text(text.replace("lr: 0.05", "lr: 0.5"))
    assert main(["report", str(run)]) == 0
    assert "differs from the recorded hash: the file was changed after the run" in capsys.readouterr().out


def test_report_shows_the_block_and_tables_of_a_compare_and_a_sweep(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "ts.yaml", steps=3)
    cmp, sweep = tmp_path / "cmp", tmp_path / "sweep"
    assert main(["compare", str(cfg), "--seeds", "0", "1", "--baseline", "ts-sgd", "--out", str(cmp), *FLAGS]) == 0
    assert main(["sweep", str(cfg), "--variant", "sgd", "--grid", "optimizer.transforms.0.lr=0.01,0.1",
                 "--out", str(sweep), *FLAGS]) == 0
    capsys.readouterr()
    for out, name, rows in ((cmp, "compare.json", ("| ts-sgd", "| ts-clip")), (sweep, "sweep.json", ("| lr=0.01", "| lr=0.1"))):
        block = json.loads((out / name).read_text())["provenance"]
        for target in (out, out / name):
            assert main(["report", str(target)]) == 0
            shown = capsys.readouterr().out
            assert f"provenance of {out / name}:" in shown and block["config_sha256"] in shown and block["date"] in shown
            assert all(any(ln.startswith(r) for ln in shown.splitlines()) for r in rows), shown
            assert "(n=2, too few)" in shown if name == "compare.json" else "(n=1, no interval)" in shown


def test_report_refuses_what_is_not_a_result_and_changes_nothing(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "ts.yaml", steps=3)
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--variant", "sgd", "--out", str(run), *FLAGS]) == 0
    (run / "summary.json").write_text('{"steps": 3')  # torn
    (tmp_path / "empty").mkdir()
    (tmp_path / "old.json").write_text('{"kind": "compare", "schema": 1}')
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    before = {p: p.read_bytes() for p in run.iterdir() if p.is_file()}
    capsys.readouterr()
    for target, message in ((run, f"{run / 'summary.json'}: damaged (not valid JSON"),
                            (tmp_path / "nothing", "no such file or directory"),
                            (tmp_path / "empty", "not an output directory of modopt"),
                            (tmp_path / "old.json", "damaged (not the compare.json modopt writes"),
                            (run / "metrics.jsonl", "not a result file modopt reads"),
                            (tmp_path / "deep.json", "damaged (nested too deeply")):
        assert main(["report", str(target)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"modopt report: error: {target}") and message in err and err.count("\n") == 1, err
    assert {p: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    # a file written before provenance was recorded: shown as such, not refused
    (tmp_path / "older.json").write_text(json.dumps({"kind": "run", "steps": 3}))
    assert main(["report", str(tmp_path / "older.json")]) == 0
    assert "none (written by a modopt that did not record one)" in capsys.readouterr().out


def test_report_escapes_control_characters_from_the_files(tmp_path, capsys):
    cfg = tiny_config(tmp_path / "ts.yaml", steps=3)
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--variant", "sgd", "--out", str(run), *FLAGS]) == 0
    data = json.loads((run / "summary.json").read_text())
    data["provenance"]["argv"] = ["modopt", "\x1b]0;pwned\x07", "\x1b[2J"]
    (run / "summary.json").write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    shown = capsys.readouterr().out
    assert "\x1b" not in shown and "\x07" not in shown and "\\x1b]0;pwned\\x07" in shown


def test_devices_name_the_cpu_and_each_other_device_used():
    from modopt.cli.provenance import cpu_name, devices

    assert devices() == devices([torch.device("cpu")]) == [f"cpu: {cpu_name()} ({len(os.sched_getaffinity(0))} cores available)"]
    assert devices([torch.device("cpu"), torch.device("meta")])[1:] == ["meta"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_device_is_named_with_its_cuda_version():
    from modopt.cli.provenance import devices

    name = torch.cuda.get_device_name(0)
    assert devices([torch.device("cuda", 0)])[1:] == [f"cuda:0: {name} (CUDA {torch.version.cuda})"]


def test_without_a_checkout_there_is_no_commit(tmp_path, monkeypatch):
    from modopt.cli import provenance as pv

    monkeypatch.setattr(pv, "CHECKOUT", tmp_path)
    block = pv.provenance({"a": 1})
    assert (block["commit"], block["dirty"]) == (None, None)
    assert pv.describe(block)[0] == f"modopt {modopt.__version__} (not from a git checkout)"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_changed_tracked_file_marks_the_tree_dirty(tmp_path):
    from modopt.cli.provenance import commit

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "a.txt").write_text("a\n")
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (repo / "untracked.txt").write_text("not counted\n")
    assert commit(repo) == (head, False)
    (repo / "a.txt").write_text("b\n")
    assert commit(repo) == (head, True)
