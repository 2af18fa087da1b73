"""A damaged run directory is a user error (exit 1, one message naming the file), never a bug (exit 70);
inconsistent command lines are refused; `modopt validate` passes only configs that build and step."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from modopt.cli import main
from modopt.cli.run import dry_step

TINY_TASK = {"name": "transformer", "options": {"vocab": 8, "seq_len": 8, "d_model": 16, "nhead": 2, "layers": 1, "ff": 32, "eval_size": 32}}
FLAGS = ("--quiet", "--no-plots")


def write_config(path: Path, transforms: list[dict], steps: int = 6, defaults: dict | None = None, **train) -> Path:
    optimizer: dict = {"transforms": transforms}
    if defaults:
        optimizer["defaults"] = defaults
    data = {"name": path.stem, "task": TINY_TASK, "optimizer": optimizer,
            "train": {"steps": steps, "batch_size": 8, "seed": 3, **train}}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def digest(run: Path) -> dict[str, str]:
    """Every file of a run directory -> its sha256."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.rglob("*")) if p.is_file()}


def refused(run: Path, argv: list[str], capsys, code: int = 1) -> str:
    """Run the CLI on `run`, check the exit status and that no file of `run` changed; the stderr."""
    before = digest(run)
    assert main(argv) == code
    err = capsys.readouterr().err
    assert digest(run) == before, "a refused command changed the run directory"
    assert "Traceback" not in err and "internal error" not in err
    assert "weights_only" not in err  # never a hint to load a file unsafely
    return err


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> Path:
    """A 6-step run killed after step 5: checkpoints at steps 2 and 4, metrics of steps 1..5."""
    root = tmp_path_factory.mktemp("damaged")
    cfg = write_config(root / "exp.yaml", [{"type": "Adam", "lr": 0.02}], checkpoint_every=2)
    run = root / "run"
    assert main(["run", str(cfg), "--out", str(run), *FLAGS, "--stop-after", "5"]) == 3
    assert torch.load(run / "checkpoint.pt", weights_only=True)["step"] == 4
    return run


@pytest.fixture
def run_dir(interrupted, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(interrupted, run)
    return run


# --- a torn last line is what a kill during a write leaves: dropped, and the resume is bit-exact --------
def test_torn_last_metrics_line_is_dropped_and_the_resume_is_bit_exact(tmp_path, capsys):
    cfg = write_config(tmp_path / "exp.yaml", [{"type": "ClipNorm", "max_norm": 0.5}, {"type": "Adam", "lr": 0.02}],
                       steps=12, checkpoint_every=4, eval_every=3)
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(["run", str(cfg), "--out", str(full), *FLAGS]) == 0
    assert main(["run", str(cfg), "--out", str(cut), *FLAGS, "--stop-after", "6"]) == 3
    capsys.readouterr()
    # killed while writing step 7: half a JSON object, no newline, in both logs
    with open(cut / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 2.07, "lr": 0.0')
    with open(cut / "timing.jsonl", "a") as f:
        f.write('{"step": 7, "ti')
    assert main(["run", "--resume", str(cut), *FLAGS]) == 0
    err = capsys.readouterr().err
    notices = [ln for ln in err.splitlines() if "torn last line" in ln]
    assert len(notices) == 2, err
    assert "metrics.jsonl" in notices[0] and "line 7" in notices[0] and "timing.jsonl" in notices[1]
    assert (cut / "metrics.jsonl").read_bytes() == (full / "metrics.jsonl").read_bytes()
    assert [json.loads(x)["step"] for x in (cut / "timing.jsonl").read_text().splitlines()] == list(range(1, 13))


def test_a_whole_last_row_without_its_newline_is_kept(run_dir, capsys):
    text = (run_dir / "metrics.jsonl").read_text()
    (run_dir / "metrics.jsonl").write_text(text.rstrip("\n"))  # row 5 complete, newline lost
    assert main(["run", "--resume", str(run_dir), *FLAGS]) == 0
    assert "torn" not in capsys.readouterr().err
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == list(range(1, 7))


# --- every other damage: exit 1, the file named, nothing changed ---------------------------------------
class Evil:
    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _checkpoint(run: Path) -> dict:
    return torch.load(run / "checkpoint.pt", weights_only=True)


def _save(run: Path, obj) -> None:
    torch.save(obj, run / "checkpoint.pt")


def _edit(run: Path, **changes) -> None:
    ck = _checkpoint(run)
    for k, v in changes.items():
        if v is KeyError:
            del ck[k]
        else:
            ck[k] = v
    _save(run, ck)


def _not_torch_zip(run: Path) -> None:
    with zipfile.ZipFile(run / "checkpoint.pt", "w") as z:
        z.writestr("notes.txt", "not a checkpoint")


def _truncate(run: Path) -> None:
    data = (run / "checkpoint.pt").read_bytes()
    (run / "checkpoint.pt").write_bytes(data[: len(data) // 2])


def _tear_line(name: str, index: int):
    def tamper(run: Path) -> None:
        lines = (run / name).read_text().splitlines(keepends=True)
        lines[index] = lines[index][:20] + "\n"
        (run / name).write_text("".join(lines))
    return tamper


def _write(name: str, data: bytes):
    return lambda run: (run / name).write_bytes(data)


def _edit_row(index: int, **changes):
    def tamper(run: Path) -> None:
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        rows[index].update(changes)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tamper


def _checkpoint_a_directory(run: Path) -> None:
    (run / "checkpoint.pt").unlink()
    (run / "checkpoint.pt").mkdir()


CHECKPOINT_DAMAGE = {
    "a directory": (_checkpoint_a_directory, "not a file"),
    "empty": (_write("checkpoint.pt", b""), "empty"),
    "random bytes": (_write("checkpoint.pt", bytes(range(256)) * 3), "not a torch checkpoint"),
    "text": (_write("checkpoint.pt", b"step: 4\nmodel: none\n"), "not a torch checkpoint"),
    "zip not torch": (_not_torch_zip, "not a readable torch checkpoint"),
    "truncated": (_truncate, "truncated"),
    "a list": (lambda run: _save(run, [1, 2, 3]), "holds a list"),
    "no model": (lambda run: _edit(run, model=KeyError), "no 'model' entry"),
    "no optimizer": (lambda run: _edit(run, optimizer=KeyError), "no 'optimizer' entry"),
    "no rng": (lambda run: _edit(run, rng=KeyError), "no 'rng' entry"),
    "no step": (lambda run: _edit(run, step=KeyError), "no 'step' entry"),
    "step a string": (lambda run: _edit(run, step="4"), "'step' is '4'"),
    "step negative": (lambda run: _edit(run, step=-1), "'step' is -1"),
    "step past the config": (lambda run: _edit(run, step=100), "at step 100, past the 6 steps"),
    "model an int": (lambda run: _edit(run, model=3), "'model' is not a state dict"),
    "model of another task": (lambda run: _edit(run, model={"w": torch.zeros(2)}), "its model does not fit"),
    "optimizer a list": (lambda run: _edit(run, optimizer=[1]), "'optimizer' is list"),
    "optimizer empty": (lambda run: _edit(run, optimizer={}), "its optimizer state does not fit"),
    "rng float": (lambda run: _edit(run, rng=torch.zeros(4)), "'rng' is not a torch RNG state"),
    "rng short": (lambda run: _edit(run, rng=torch.zeros(4, dtype=torch.uint8)), "'rng' is not a torch RNG state"),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_DAMAGE))
def test_a_damaged_checkpoint_is_refused_naming_it(run_dir, capsys, case):
    tamper, expected = CHECKPOINT_DAMAGE[case]
    tamper(run_dir)
    err = refused(run_dir, ["run", "--resume", str(run_dir), *FLAGS], capsys)
    assert len(err.strip().splitlines()) == 1, err
    assert str(run_dir / "checkpoint.pt") in err and expected in err, err


def test_a_malicious_pickle_is_refused_never_run_and_no_unsafe_hint(run_dir, tmp_path, capsys):
    marker = tmp_path / "pwned"
    _save(run_dir, {**_checkpoint(run_dir), "extra": Evil(marker)})
    err = refused(run_dir, ["run", "--resume", str(run_dir), *FLAGS], capsys)
    assert str(run_dir / "checkpoint.pt") in err and "refused" in err and "system" in err, err
    assert "weights_only=False" not in err and "arbitrary code" not in err
    assert not marker.exists()


RUN_FILE_DAMAGE = {
    "metrics torn in the middle": (_tear_line("metrics.jsonl", 1), "metrics.jsonl, line 2: damaged (not valid JSON)"),
    "metrics row without loss": (_write("metrics.jsonl", b'{"step": 1}\n'), "metrics.jsonl, line 1: damaged (no 'loss')"),
    "metrics eval_loss a word": (_edit_row(2, eval_loss="low"), "metrics.jsonl, line 3: damaged ('eval_loss' is 'low', not a number"),
    "metrics clipped a number": (_edit_row(0, clipped=1), "metrics.jsonl, line 1: damaged ('clipped' is 1, not true or false)"),
    "metrics not utf-8": (_write("metrics.jsonl", b"\xff\xfe{}\n"), "metrics.jsonl, line 1: damaged (not UTF-8 text)"),
    "metrics short": (lambda run: (run / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text().split("\n", 1)[1]),
                      "metrics.jsonl: damaged (3 rows up to the checkpoint's step 4, which needs steps 1..4)"),
    "metrics out of order": (lambda run: (run / "metrics.jsonl").write_text(
        "".join(sorted((run / "metrics.jsonl").read_text().splitlines(keepends=True), key=lambda ln: -json.loads(ln)["step"]))),
        "metrics.jsonl: damaged (its rows out of order"),
    "metrics missing": (lambda run: (run / "metrics.jsonl").unlink(), "metrics.jsonl: missing"),
    "timing torn in the middle": (_tear_line("timing.jsonl", 0), "timing.jsonl, line 1: damaged"),
    "config not utf-8": (_write("config.yaml", b"\xff\xfe\x00name: x\n"), "config.yaml"),
    "config empty": (_write("config.yaml", b""), "config.yaml: damaged (empty)"),
    "config bad yaml": (_write("config.yaml", b"name: [\n"), "invalid YAML"),
    "config a list": (_write("config.yaml", b"- 1\n"), "must be a mapping"),
}


@pytest.mark.parametrize("case", list(RUN_FILE_DAMAGE))
def test_damaged_logs_and_config_are_refused_naming_the_file(run_dir, capsys, case):
    tamper, expected = RUN_FILE_DAMAGE[case]
    tamper(run_dir)
    err = refused(run_dir, ["run", "--resume", str(run_dir), *FLAGS], capsys)
    assert expected in err, err
    assert str(run_dir) in err
    assert "resuming" not in err  # nothing was resumed


# --- inconsistent requests ---------------------------------------------------------------------------
def test_resume_refuses_to_shorten_a_run(run_dir, capsys):
    for steps in ("3", "4"):  # below, and at, the checkpoint's step 4
        err = refused(run_dir, ["run", "--resume", str(run_dir), "--steps", steps, *FLAGS], capsys)
        assert f"--steps {steps}" in err and "checkpoint.pt is at step 4" in err, err
    # above the checkpoint the run continues, and config.yaml says so
    assert main(["run", "--resume", str(run_dir), "--steps", "5", *FLAGS]) == 0
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["steps"] == 5
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 5


def test_a_refused_resume_does_not_rewrite_config_yaml_first(run_dir, capsys):
    (run_dir / "checkpoint.pt").write_bytes(b"")
    err = refused(run_dir, ["run", "--resume", str(run_dir), "--steps", "9", *FLAGS], capsys)
    assert "checkpoint.pt" in err


def test_resume_refuses_another_seed_variant_or_force(run_dir, capsys):
    err = refused(run_dir, ["run", "--resume", str(run_dir), "--seed", "4", *FLAGS], capsys)
    assert "--seed 4" in err and "seed 3" in err
    for flag in (["--variant", "a"], ["--force"]):
        err = refused(run_dir, ["run", "--resume", str(run_dir), *flag, *FLAGS], capsys)
        assert f"drop {flag[0]}" in err
    assert main(["run", "--resume", str(run_dir), "--seed", "3", *FLAGS]) == 0  # its own seed is fine


def test_resume_refuses_to_change_the_length_of_a_scheduled_run(tmp_path, capsys):
    cfg = write_config(tmp_path / "cos.yaml", [{"type": "SGD", "lr": 0.05}], steps=8, checkpoint_every=4,
                       schedule={"kind": "cosine", "warmup_steps": 2})
    run = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(run), *FLAGS, "--stop-after", "5"]) == 3
    err = refused(run, ["run", "--resume", str(run), "--steps", "12", *FLAGS], capsys)
    assert "--steps 12" in err and "cosine" in err and "8 steps" in err


@pytest.mark.parametrize("argv, option", [
    (["run", "--seed", "99999999999999999999999"], "--seed"),
    (["run", "--seed", "18446744073709551616"], "--seed"),
    (["run", "--seed", "-1"], "--seed"),
    (["run", "--steps", "99999999999999999999999"], "--steps"),
    (["run", "--steps", "0"], "--steps"),
    (["run", "--steps", "-5"], "--steps"),
    (["run", "--stop-after", "0"], "--stop-after"),
    (["compare", "x.yaml", "--spike-window", "0"], "--spike-window"),
    (["compare", "x.yaml", "--spike-factor", "nan"], "--spike-factor"),
    (["compare", "x.yaml", "--spike-min-rise", "-1"], "--spike-min-rise"),
    (["compare", "x.yaml", "--seed", "99999999999999999999999"], "--seed"),
    (["schema", "--indent", "99999999999999999999"], "--indent"),
])
def test_out_of_range_integers_are_usage_errors(run_dir, capsys, argv, option):
    if argv[0] == "run":  # (--stop-after: should a value be accepted, the run stops instead of running on)
        argv = [*argv, "--resume", str(run_dir), *FLAGS, *(["--stop-after", "5"] if option != "--stop-after" else [])]
    err = refused(run_dir, argv, capsys, code=2)
    assert f"argument {option}" in err and "out of range" in err, err


def test_seed_in_range_is_accepted_and_past_64_bits_in_a_config_is_a_user_error(tmp_path, capsys):
    cfg = write_config(tmp_path / "exp.yaml", [{"type": "SGD", "lr": 0.1}], steps=2)
    assert main(["run", str(cfg), "--out", str(tmp_path / "r"), "--seed", str(2**64 - 1), *FLAGS]) == 0
    assert yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["train"]["seed"] == 2**64 - 1
    capsys.readouterr()
    data = yaml.safe_load(cfg.read_text())
    data["train"]["seed"] = 10**23
    cfg.write_text(yaml.safe_dump(data))
    assert main(["validate", str(cfg)]) == 1
    assert main(["run", str(cfg), "--out", str(tmp_path / "r2"), *FLAGS]) == 1
    err = capsys.readouterr().err
    assert err.count("train.seed") == 2 and "Traceback" not in err
    assert not (tmp_path / "r2").exists()


# --- validate builds and steps what run builds and steps ----------------------------------------------
PICKY = '''
import torch

class Picky(torch.optim.Optimizer):
    """Checks its `mode` only when it steps (its constructor takes anything)."""

    def __init__(self, params, lr=0.1, mode="plain"):
        super().__init__(params, {"lr": lr, "mode": mode})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            if group["mode"] not in ("plain", "sign"):
                raise ValueError(f"mode must be 'plain' or 'sign', got {group['mode']!r}")
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad if group["mode"] == "plain" else p.grad.sign(), alpha=-group["lr"])
'''


@pytest.mark.parametrize("name, transforms, defaults, trust, expected", [
    ("abstract", [{"type": "TorchOptimizer", "cls": "torch.optim.Optimizer"}], None, False, "defaults"),
    ("lr_word", [{"type": "SGD"}], {"lr": "fast"}, False, "lr"),
    ("lr_word_adam", [{"type": "Adam"}], {"lr": "fast"}, False, "lr"),
    ("closure", [{"type": "TorchOptimizer", "cls": "torch.optim.LBFGS"}], None, False, "closure"),  # its step needs one
    ("first_step", [{"type": "TorchOptimizer", "cls": "picky_opt_mod.Picky", "kwargs": {"mode": "sgin"}}], None, True,
     "mode must be 'plain' or 'sign'"),
])
def test_validate_refuses_what_run_refuses(tmp_path, monkeypatch, capsys, name, transforms, defaults, trust, expected):
    (tmp_path / "picky_opt_mod.py").write_text(textwrap.dedent(PICKY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("MODOPT_DEBUG", raising=False)
    cfg = write_config(tmp_path / f"{name}.yaml", transforms, steps=2, defaults=defaults)
    extra = ["--trust-imports"] if trust else []
    assert main(["validate", str(cfg), *extra]) == 1
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err
    out = tmp_path / "run"
    assert main(["run", str(cfg), "--out", str(out), *FLAGS, *extra]) == 1
    assert expected in capsys.readouterr().err
    assert not out.exists()


def test_validate_passes_what_runs(tmp_path, monkeypatch, capsys):
    (tmp_path / "picky_opt_mod.py").write_text(textwrap.dedent(PICKY))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = write_config(tmp_path / "ok.yaml", [{"type": "TorchOptimizer", "cls": "picky_opt_mod.Picky", "kwargs": {"mode": "sign"}}],
                       steps=2)
    assert main(["validate", str(cfg), "--trust-imports"]) == 0
    assert main(["run", str(cfg), "--out", str(tmp_path / "r"), *FLAGS, "--trust-imports"]) == 0
    assert "valid experiment config" in capsys.readouterr().out


def test_dry_step_uses_no_data_and_leaves_the_rng_alone():
    import modopt as mo

    model = torch.nn.Linear(3, 2)
    named = list(model.named_parameters())
    weights = [p.detach().clone() for _, p in named]
    rng = torch.get_rng_state()
    # Adam's multi-tensor kernel cannot step shape-only tensors (Tensor.item()): the check stops there, silently
    dry_step(mo.PipelineConfig(transforms=[mo.ClipNorm(max_norm=1.0), mo.Adam(lr=0.1)]), named)
    dry_step(mo.PipelineConfig(transforms=[mo.ZClip(), mo.SGD(lr=0.1, momentum=0.9)]), named)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(w, p) for w, (_, p) in zip(weights, named)) and all(p.grad is None for _, p in named)
