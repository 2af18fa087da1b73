"""An experiment as a Hydra application (`python -m modopt.cli.hydra_app`): a multirun through the joblib launcher.

The sweep is 2 variants x 2 seeds of a tiny teacher-student experiment, run by
`hydra-joblib-launcher` in two worker processes. Every job must write a run
directory into its own Hydra output directory, with the experiment its overrides
name, and train exactly what `modopt run` trains for the same variant and seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from modopt.cli import main
from modopt.cli.hydra_app import experiment_for_job
from modopt.config import ConfigError

pytestmark = pytest.mark.slow  # a Hydra multirun of processes (the slow lane)

CONFIG = """\
name: tiny
task: {name: teacher_student, options: {dim: 4, hidden: 8, teacher_hidden: 4}}
variants:
  noclip:
    transforms: [{type: SGD, lr: 0.05}]
  clipnorm:
    transforms: [{type: ClipNorm, max_norm: 0.5}, {type: SGD, lr: 0.05}]
train: {steps: 6, batch_size: 8, seed: 0, eval_every: 2}
"""


def _hydra(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MPLBACKEND": "Agg", "HYDRA_FULL_ERROR": "0"}
    cmd = [sys.executable, "-m", "modopt.cli.hydra_app", "--config-dir", str(tmp_path / "conf"), "--config-name", "tiny", *args]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "tiny.yaml"
    path.write_text(CONFIG)
    return path


def test_a_2x2_multirun_through_the_joblib_launcher(tmp_path, conf):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    sweep = tmp_path / "sweep"
    r = _hydra(tmp_path, "--multirun", "+variant=noclip,clipnorm", "train.seed=0,1",
               "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in r.stdout + r.stderr  # the jobs went through the joblib launcher
    jobs = {}
    for job in sorted(p for p in sweep.iterdir() if p.is_dir()):
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        jobs[tuple(sorted(overrides))] = job
    assert sorted(jobs) == sorted(
        tuple(sorted([f"+variant={v}", f"train.seed={s}"])) for v in ("noclip", "clipnorm") for s in (0, 1)
    )
    metrics = {}
    for key, job in jobs.items():
        variant = next(o for o in key if o.startswith("+variant=")).split("=")[1]
        seed = int(next(o for o in key if o.startswith("train.seed=")).split("=")[1])
        summary = json.loads((job / "summary.json").read_text())
        assert summary["name"] == f"tiny-{variant}" and summary["steps"] == 6 and summary["run_dir"] == str(job)
        assert summary["final_eval_loss"] is not None
        saved = yaml.safe_load((job / "config.yaml").read_text())
        assert saved["train"]["seed"] == seed and "variants" not in saved
        assert [t["type"] for t in saved["optimizer"]["transforms"]] == (["SGD"] if variant == "noclip" else ["ClipNorm", "SGD"])
        metrics[variant, seed] = (job / "metrics.jsonl").read_bytes()
    assert metrics["noclip", 0] != metrics["noclip", 1]  # the seed reached the task
    # a job trains exactly what `modopt run` trains
    ref = tmp_path / "ref"
    assert main(["run", str(conf), "--variant", "clipnorm", "--seed", "1", "--out", str(ref), "--quiet", "--no-plots"]) == 0
    assert metrics["clipnorm", 1] == (ref / "metrics.jsonl").read_bytes()


def test_a_job_with_an_invalid_field_fails_naming_it(tmp_path, conf):
    r = _hydra(tmp_path, "+variant=noclip", "train.steps=0", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode != 0
    assert "train.steps" in r.stderr and "greater than or equal to 1" in r.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_experiment_for_job_takes_the_app_keys_out():
    data = yaml.safe_load(CONFIG)
    exp, trust = experiment_for_job({**data, "variant": "clipnorm"}, "job")
    assert exp.name == "tiny-clipnorm" and exp.variants is None and trust is False
    assert [type(t).__name__ for t in exp.optimizer.transforms] == ["ClipNorm", "SGD"]
    unnamed = {k: v for k, v in data.items() if k != "name"}
    assert experiment_for_job({**unnamed, "variant": "noclip"}, "job", "from_file")[0].name == "from_file-noclip"
    with pytest.raises(ConfigError, match="unknown variant 'zclip'.*noclip, clipnorm"):
        experiment_for_job({**data, "variant": "zclip"}, "job")
    with pytest.raises(ConfigError, match=r"several variants \(noclip, clipnorm\); choose one with \+variant=NAME.*--multirun \+variant=noclip,clipnorm"):
        experiment_for_job(data, "job")
    with pytest.raises(ConfigError, match="trust_imports must be true or false"):
        experiment_for_job({**data, "variant": "noclip", "trust_imports": "yes"}, "job")
    with pytest.raises(ConfigError, match=r"(?s)job: invalid config.*train\.batch_size: Input should be greater than or equal to 1"):
        experiment_for_job({**data, "variant": "noclip", "train": {"batch_size": -1}}, "job")


def test_without_hydra_the_app_says_what_to_install(monkeypatch, capsys):
    from modopt.cli import hydra_app

    monkeypatch.setitem(sys.modules, "hydra", None)  # `import hydra` now raises ImportError
    with pytest.raises(SystemExit) as e:
        hydra_app.main()
    assert e.value.code == 1
    assert "pip install hydra-core" in capsys.readouterr().err


def test_a_second_job_into_a_finished_run_dir_is_refused_unless_forced(tmp_path, conf):
    run = tmp_path / "run"
    assert _hydra(tmp_path, "+variant=noclip", f"hydra.run.dir={run}").returncode == 0
    first = (run / "summary.json").read_bytes()
    r = _hydra(tmp_path, "+variant=clipnorm", f"hydra.run.dir={run}")
    assert r.returncode != 0 and "already holds a modopt run" in r.stderr and "+force=true" in r.stderr
    assert (run / "summary.json").read_bytes() == first  # the finished run is untouched
    assert _hydra(tmp_path, "+variant=clipnorm", "+force=true", f"hydra.run.dir={run}").returncode == 0
    assert yaml.safe_load((run / "config.yaml").read_text())["name"] == "tiny-clipnorm"
