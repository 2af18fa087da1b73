"""Output under `--out` never goes through a symbolic link: `modopt run`, `compare` and `sweep` refuse a link
at any file or directory they would write, naming it, before anything is written (`modopt/cli/outfiles.py`)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import yaml

from modopt.cli import main
from modopt.cli.outfiles import open_out, refuse_links
from modopt.cli.run import RUN_FILES
from modopt.config import ConfigError

TINY_TS = {"name": "teacher_student", "options": {"dim": 4, "hidden": 8, "teacher_hidden": 8, "eval_size": 16}}
FLAGS = ["--quiet", "--no-plots"]


def config(path: Path, steps: int = 3, **train) -> Path:
    path.write_text(yaml.safe_dump({
        "name": "ts", "task": TINY_TS,
        "optimizer": {"transforms": [{"type": "ClipNorm", "max_norm": 1.0}, {"type": "SGD", "lr": 0.05}]},
        "train": {"steps": steps, "batch_size": 4, **train},
    }, sort_keys=False))
    return path


def tree(root: Path) -> dict[str, str]:
    """Every path under `root` (not following links) -> a digest of a file, the target of a link, or 'dir'."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                found[rel] = "-> " + os.readlink(p)
            elif p.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return found


class Victims:
    """A file and an empty directory outside `--out` for links to point at."""

    def __init__(self, tmp_path: Path, content: bytes = b"keep me") -> None:
        self.root = tmp_path / "outside"
        self.root.mkdir()
        self.file = self.root / "precious.txt"
        self.content = content
        self.file.write_bytes(content)
        self.dir = self.root / "elsewhere"
        self.dir.mkdir()

    def plant(self, link: Path, to_dir: bool) -> None:
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(self.dir if to_dir else self.file, target_is_directory=to_dir)

    def assert_untouched(self) -> None:
        assert self.file.read_bytes() == self.content
        assert list(self.dir.iterdir()) == []  # nothing created through a directory link
        assert sorted(p.name for p in self.root.iterdir()) == ["elsewhere", "precious.txt"]


def refused(argv: list[str], link: Path, out: Path, victims: Victims, capsys) -> None:
    """`argv` exits 1 with one line naming `link`, and changes nothing under `out` or outside it."""
    before = tree(out)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"modopt {argv[0]}: error: {link}: a symbolic link (to {victims.root}"), err
    assert err.rstrip().endswith("never through a link (remove it, or give another --out); nothing was written")
    assert err.count("\n") == 1 and "Traceback" not in err
    victims.assert_untouched()
    assert tree(out) == before


# --- run ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", RUN_FILES)
def test_run_refuses_a_link_at_each_file_it_writes(tmp_path, capsys, name):
    cfg = config(tmp_path / "exp.yaml")
    victims = Victims(tmp_path)
    out = tmp_path / "run"
    victims.plant(out / name, to_dir=name == "tensorboard")
    refused(["run", str(cfg), "--out", str(out), "--force", *FLAGS], out / name, out, victims, capsys)


@pytest.mark.parametrize("name", [n for n in RUN_FILES if n != "config.yaml"])
def test_resume_refuses_a_link_at_each_file_it_writes(tmp_path, capsys, name):
    """A run directory whose files were replaced by links to elsewhere: the resume writes none of them."""
    cfg = config(tmp_path / "exp.yaml", steps=4, checkpoint_every=2)
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out), "--stop-after", "3", *FLAGS]) == 3
    capsys.readouterr()
    real = out / name
    # the link points at what the file held (a resume reads the same data), or at a file elsewhere
    victims = Victims(tmp_path, real.read_bytes() if real.is_file() else b"keep me")
    if real.is_file():
        real.unlink()
    victims.plant(real, to_dir=name == "tensorboard")
    refused(["run", "--resume", str(out), *FLAGS], out / name, out, victims, capsys)


def test_resume_refuses_a_linked_config_yaml_before_rewriting_it(tmp_path, capsys):
    cfg = config(tmp_path / "exp.yaml", steps=4, checkpoint_every=2)  # (a constant schedule: --steps may change)
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out), "--stop-after", "3", *FLAGS]) == 3
    capsys.readouterr()
    victims = Victims(tmp_path, (out / "config.yaml").read_bytes())  # a config that reads: --steps rewrites it
    (out / "config.yaml").unlink()
    victims.plant(out / "config.yaml", to_dir=False)
    refused(["run", "--resume", str(out), "--steps", "6", *FLAGS], out / "config.yaml", out, victims, capsys)


# --- compare -----------------------------------------------------------------------------------------
COMPARE_LINKS = [
    ("report.html", False), ("compare.json", False), ("compare.md", False), ("compare.png", False),
    ("ts", True), ("ts/seed-0", True), ("ts/seed-1", True), ("ts/seed-1/metrics.jsonl", False),
    ("ts/seed-0/checkpoint.pt", False), ("metrics.jsonl", False), ("tensorboard", True),
]


@pytest.mark.parametrize("rel, to_dir", COMPARE_LINKS)
def test_compare_refuses_a_link_at_each_path_it_writes(tmp_path, capsys, rel, to_dir):
    cfg = config(tmp_path / "exp.yaml")
    victims = Victims(tmp_path)
    out = tmp_path / "cmp"
    victims.plant(out / rel, to_dir)
    refused(["compare", str(cfg), "--seeds", "0", "1", "--out", str(out), *FLAGS], out / rel, out, victims, capsys)


def test_compare_over_a_previous_compare_with_a_planted_link_writes_nothing(tmp_path, capsys):
    """The case reported: a finished compare's directory, one run directory and report.html made links."""
    cfg = config(tmp_path / "exp.yaml")
    out = tmp_path / "cmp"
    argv = ["compare", str(cfg), "--out", str(out), *FLAGS]
    assert main(argv) == 0
    capsys.readouterr()
    victims = Victims(tmp_path)
    shutil.rmtree(out / "ts" / "seed-0")
    victims.plant(out / "ts" / "seed-0", to_dir=True)
    refused(argv, out / "ts" / "seed-0", out, victims, capsys)
    (out / "ts" / "seed-0").unlink()
    (out / "report.html").unlink()
    victims.plant(out / "report.html", to_dir=False)
    refused(argv, out / "report.html", out, victims, capsys)


# --- sweep -------------------------------------------------------------------------------------------
SWEEP_LINKS = [
    ("sweep.json", False), ("sweep.md", False), ("report.html", False), ("sweep-max_norm.png", False),
    ("max_norm=2", True), ("max_norm=0.5/seed-0", True), ("max_norm=2/seed-0/summary.json", False),
    ("max_norm=0.5/seed-0/config.yaml", False),
]


@pytest.mark.parametrize("rel, to_dir", SWEEP_LINKS)
def test_sweep_refuses_a_link_at_each_path_it_writes(tmp_path, capsys, rel, to_dir):
    cfg = config(tmp_path / "exp.yaml")
    victims = Victims(tmp_path)
    out = tmp_path / "sw"
    victims.plant(out / rel, to_dir)
    argv = ["sweep", str(cfg), "--grid", "optimizer.transforms.0.max_norm=0.5,2", "--out", str(out), *FLAGS]
    refused(argv, out / rel, out, victims, capsys)


def test_an_out_that_is_itself_a_link_is_the_users_choice(tmp_path, capsys):
    cfg = config(tmp_path / "exp.yaml")
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real, target_is_directory=True)
    assert main(["run", str(cfg), "--out", str(tmp_path / "alias"), *FLAGS]) == 0
    assert (real / "summary.json").is_file()


# --- the writers themselves --------------------------------------------------------------------------
def test_open_out_never_follows_a_link_that_appears_after_the_check(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    link = tmp_path / "out.json"
    link.symlink_to(victim)
    for mode in ("w", "a", "wb"):
        with pytest.raises(ConfigError, match=rf"^{link}: a symbolic link \(to {victim}\)") as info:
            open_out(link, mode)
        assert "nothing was written" not in str(info.value)  # a late refusal does not claim that
    assert victim.read_text() == "keep me" and link.is_symlink()
    with open_out(tmp_path / "new.jsonl", "a") as f:  # a plain file: opened as open() would
        f.write("é\n")
        assert f.name == str(tmp_path / "new.jsonl")
    assert (tmp_path / "new.jsonl").read_text(encoding="utf-8") == "é\n"


def test_a_plot_or_report_written_through_a_late_link_is_refused(tmp_path, monkeypatch):
    """With the up-front check skipped, each writer still refuses the link at its own file."""
    from modopt.cli.report import Report

    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "report.html").symlink_to(victim)
    with pytest.raises(ConfigError, match="a symbolic link"):
        Report("t").write(tmp_path / "report.html")
    pytest.importorskip("matplotlib")
    from modopt.cli.plots import plot_sweep
    from modopt.cli.stats import interval

    (tmp_path / "sweep-x.png").symlink_to(victim)
    with pytest.raises(ConfigError, match="a symbolic link"):
        plot_sweep(tmp_path / "sweep-x.png", "x", "final loss", {"": [(1.0, interval([1.0]))]})
    assert victim.read_text() == "keep me"


def test_refuse_links_checks_every_directory_between_root_and_the_file(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "a").symlink_to(tmp_path / "real", target_is_directory=True)
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'root' / 'a'}: a symbolic link"):
        refuse_links(tmp_path / "root", ["a/b/c.json"])
    refuse_links(tmp_path / "root", ["x/y/z.json", "b.json"])  # missing paths: nothing to refuse
