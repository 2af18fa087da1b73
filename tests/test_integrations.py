"""Frameworks people train with: HF Trainer, accelerate, Hydra/OmegaConf, Lightning (callback recipe).

The how-to pages' code runs here as written (every ```python block of a page, in order), and the
tests check what the pages claim. The frameworks are `dev` dependencies, so none of this is skipped.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

import modopt as mo

pytestmark = pytest.mark.slow  # trains through HF Trainer, accelerate, Lightning (the slow lane)

DOCS = Path(__file__).resolve().parent.parent / "docs" / "howto"


def run_page(name: str, tmp_path: Path, monkeypatch) -> tuple[dict, str]:
    """Execute the page's python blocks in one namespace (cwd = tmp_path); return it and what it printed."""
    text = (DOCS / name).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"{name} has no python block"
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "__doc_page__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile("\n".join(blocks), str(DOCS / name), "exec"), ns)
    return ns, out.getvalue()


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def train(model, opt, n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        x = torch.randn(7, 5, generator=g) * (1 + 3 * (i % 3 == 2))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def same_params(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# --- Modular's keywords and the empty pipeline --------------------------------------------------


def test_modular_takes_the_pipeline_by_keyword():
    ref_m = make_model()
    train(ref_m, mo.Modular(ref_m.parameters(), mo.ZClip(warmup_steps=2), mo.AdamW(lr=1e-2), nonfinite="zero"))
    cfg = {"transforms": [{"type": "ZClip", "warmup_steps": 2}, {"type": "AdamW", "lr": 1e-2}], "nonfinite": "zero"}
    builds = [
        lambda ps: mo.Modular(ps, transforms=[mo.ZClip(warmup_steps=2), mo.AdamW(lr=1e-2)], nonfinite="zero"),
        lambda ps: mo.Modular(ps, transforms=cfg["transforms"], nonfinite="zero"),
        lambda ps: mo.Modular(params=ps, config=cfg),
        lambda ps: mo.Modular(ps, config=mo.PipelineConfig.from_dict(cfg)),
    ]
    for build in builds:
        m = make_model()
        opt = build(m.parameters())
        assert opt.config.nonfinite == "zero"
        train(m, opt)
        assert same_params(m, ref_m)
    # keyword group defaults override the config's defaults and transform values
    opt = mo.Modular(make_model().parameters(), config={**cfg, "defaults": {"lr": 0.5}}, lr=0.25)
    assert opt.param_groups[0]["lr"] == 0.25


def test_modular_refuses_an_empty_or_doubly_given_pipeline():
    ps = list(make_model().parameters())
    for build in (lambda: mo.Modular(ps), lambda: mo.Modular(ps, transforms=[]), lambda: mo.Modular(ps, lr=0.1)):
        with pytest.raises((ValueError, TypeError), match=r"at least one transform.*mo\.AdamW"):
            build()
    with pytest.raises(TypeError, match="one way"):
        mo.Modular(ps, mo.SGD(lr=0.1), transforms=[mo.SGD(lr=0.1)])
    with pytest.raises(TypeError, match="one way"):
        mo.Modular(ps, transforms=[mo.SGD(lr=0.1)], config={"transforms": [{"type": "SGD"}]})
    with pytest.raises(TypeError, match="list of transforms"):
        mo.Modular(ps, transforms=mo.SGD(lr=0.1))


# --- OmegaConf / Hydra --------------------------------------------------------------------------


def test_from_config_and_load_config_take_dicts_and_dictconfigs():
    from omegaconf import OmegaConf

    data = {"train": {"lr": 0.02}, "optimizer": {"transforms": [{"type": "ClipNorm", "max_norm": 0.5},
                                                                 {"type": "Adam", "lr": "${train.lr}"}]}}
    dc = OmegaConf.create(data)
    expected = mo.PipelineConfig(transforms=[mo.ClipNorm(0.5), mo.Adam(lr=0.02)])
    assert mo.load_config(dc) == expected                 # an experiment: its optimizer entry, resolved
    assert mo.load_config(dc.optimizer) == expected
    assert mo.load_config(OmegaConf.to_container(dc, resolve=True)) == expected   # a plain dict
    assert mo.load_config(expected) is expected
    ref = make_model()
    train(ref, expected.build(ref.parameters()))
    for cfg in (dc.optimizer, OmegaConf.to_container(dc.optimizer, resolve=True)):
        m = make_model()
        opt = mo.Modular.from_config(m.parameters(), cfg)
        assert opt.param_groups[0]["lr"] == 0.02
        train(m, opt)
        assert same_params(m, ref)
    # errors name the field, through ConfigError, never a half-built optimizer
    bad = OmegaConf.create({"x": "big", "optimizer": {"transforms": [{"type": "ClipNorm", "max_norm": "${x}"}]}})
    with pytest.raises(mo.ConfigError, match=r"<DictConfig>: invalid config.*\n  transforms\.0\.max_norm"):
        mo.Modular.from_config(make_model().parameters(), bad.optimizer)
    with pytest.raises(mo.ConfigError, match=r"<dict>: invalid config.*\n  transforms\.0"):
        mo.load_config({"transforms": [{"type": "Nope"}]})
    with pytest.raises(mo.ConfigError, match="expected a file path, a mapping"):
        mo.load_config(3)


def test_hydra_instantiate_styles_build_the_same_optimizer():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({
        "train": {"lr": 0.01},
        "per_transform": {"_target_": "modopt.Modular", "_partial_": True, "lr": "${train.lr}", "transforms": [
            {"_target_": "modopt.Chain", "_args_": [{"_target_": "modopt.ClipNorm", "max_norm": 0.5},
                                                    {"type": "Normalize"}]},
            {"_target_": "modopt.Adam", "lr": 0.5, "betas": [0.8, 0.99]}]},
        "own": {"_target_": "modopt.Modular", "_partial_": True, "config": {"transforms": [
            {"type": "Chain", "transforms": [{"type": "ClipNorm", "max_norm": 0.5}, {"type": "Normalize"}]},
            {"type": "Adam", "lr": "${train.lr}", "betas": [0.8, 0.99]}]}},
    })
    ref = make_model()
    train(ref, mo.Modular(ref.parameters(), mo.Chain(mo.ClipNorm(0.5), mo.Normalize()),
                          mo.Adam(lr=0.01, betas=(0.8, 0.99))))
    for key in ("per_transform", "own"):
        m = make_model()
        opt = instantiate(cfg[key])(params=m.parameters())
        assert opt.param_groups[0]["lr"] == 0.01
        train(m, opt)
        assert same_params(m, ref), key
    with pytest.raises(Exception, match="max_norm"):
        instantiate({"_target_": "modopt.ClipNorm", "max_norm": -1.0})


def test_hydra_page_runs(tmp_path, monkeypatch):
    ns, out = run_page("hydra.md", tmp_path, monkeypatch)
    assert out.split() == ["0.003", "True", "True"]
    assert (tmp_path / "pipeline.yaml").exists()
    assert mo.load_config(tmp_path / "pipeline.yaml") == ns["pipeline"]
    assert ns["pipeline"].transforms[1].lr == 0.003


# --- HF Trainer ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_hf_trainer_page_runs_and_resumes_exactly(tmp_path, monkeypatch):
    ns, out = run_page("hf-trainer.md", tmp_path, monkeypatch)
    assert "resumed exactly: True" in out
    full, resumed = ns["full"], ns["resumed"]
    inner = getattr(full.optimizer, "optimizer", full.optimizer)
    assert isinstance(inner, mo.Modular) and "0:ZClip" in inner.state_dict()["modopt"]["transforms"]
    assert same_params(full.model, resumed.model)
    # the optimizer checkpoint is what makes it exact: without optimizer.pt the run differs
    ck = Path(ns["out_dir"]) / "checkpoint-3"
    no_opt = tmp_path / "checkpoint-3-no-opt"
    shutil.copytree(ck, no_opt)
    os.remove(no_opt / "optimizer.pt")
    other = ns["make_trainer"](str(tmp_path / "other"))
    other.train(resume_from_checkpoint=str(no_opt))
    assert not same_params(full.model, other.model)


# --- accelerate ----------------------------------------------------------------------------------


def test_accelerate_page_runs(tmp_path, monkeypatch):
    ns, out = run_page("accelerate.md", tmp_path, monkeypatch)
    assert out.splitlines() == ["resumed exactly: True", "True True"]
    assert bool(ns["opt"].optimizer.stats["skipped"]) and int(ns["opt"].optimizer.stats["skipped_steps"]) == 1
    # without the hook accelerate does not see modopt's skip, and its scheduler steps
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model, opt, sched = acc.prepare(*ns["make"]())
    lr = opt.param_groups[0]["lr"]
    for _ in range(2):
        opt.zero_grad()
        acc.backward(model(torch.full((2, 8), float("nan"))).sum())
        opt.step()
        sched.step()
        assert bool(opt.optimizer.stats["skipped"]) and not acc.optimizer_step_was_skipped
    assert opt.param_groups[0]["lr"] != lr


# --- Lightning -----------------------------------------------------------------------------------


def test_lightning_page_runs(tmp_path, monkeypatch):
    ns, out = run_page("lightning.md", tmp_path, monkeypatch)
    assert "resumed exactly: True" in out
    logged = ns["logged"]
    assert {"modopt/skipped", "modopt/nonfinite"} <= set(logged), sorted(logged)
    assert float(logged["modopt/skipped"]) == 0.0


# --- torch.compile -------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
def test_compile_page_runs(tmp_path, monkeypatch):
    torch._dynamo.reset()
    ns, out = run_page("compile.md", tmp_path, monkeypatch)
    assert out.splitlines() == [
        "zeroed: 1",
        "['0:ClipNorm.clipped', '0:ClipNorm.norm', '0:ClipNorm.scale', 'nonfinite', 'skipped', 'skipped_steps', 'zeroed']",
        "finite: True",
        "skipped: True unchanged: True",
        "torch.float64 0",  # compile_step with mo.tensor_hyperparams: the lr a float64 tensor, no step skipped
    ]
    opt, skip_opt = ns["opt"], ns["skip_opt"]
    assert int(opt.stats["skipped_steps"]) == 0 and int(skip_opt.stats["skipped_steps"]) == 1
    # decided on the device, the skipped first step left the state at its initial values (zeros, step 0)
    assert all(not bool(v.any()) for st in skip_opt.state.values() for v in st.values())
