"""Step guards (issue 56 item 4): `SkipNorm`, Megatron-LM's absolute gradient-norm threshold, and the
consecutive-skip limit (`max_consecutive_skips`, modopt/core/skip_limit.py).

Both decide on the device with no host sync (counted with `checks.Syncs`, which runs the steps on the
device path), leave every state bit for bit as it was on a skipped step, and agree across ranks
(tests/distributed/test_guards_fsdp.py: 2 gloo processes under FSDP2)."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
import yaml

import modopt as mo
from checks import Syncs, needs_the_host, same, saved
from modopt.cli import main as cli_main
from modopt.core import hostdata
from modopt.core.skip_limit import SkipLimitError
from modopt.spec import stability as spec

KEY = "0:SkipNorm"


def params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=g, dtype=torch.float64).to(dtype)),
            torch.nn.Parameter(torch.randn(5, generator=g, dtype=torch.float64).to(dtype))]


def grads_of(ps, seed, scale=1.0, nan=False):
    g = torch.Generator().manual_seed(1000 + seed)
    out = [torch.randn(p.shape, generator=g, dtype=torch.float64).mul(scale).to(p.dtype) for p in ps]
    if nan:
        out[1][2] = float("nan")
    return out


def set_grads(ps, gs):
    for p, g in zip(ps, gs):
        p.grad = g.clone()


def norm64(gs):
    return math.sqrt(math.fsum(float(g.double().square().sum()) for g in gs))


# --- SkipNorm ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", [False, True], ids=["device", "host"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_skip_norm_matches_spec(dtype, host):
    """Step by step against `modopt.spec.stability.skip_norm` (float64): the decision, the telemetry and
    whether the parameters move, for thresholds on both sides of the norm (0.1% away) and NaN steps, where
    the device decides and where the host does (a transform that needs it in front)."""
    ps = params(dtype=dtype)
    head = [needs_the_host()] if host else []
    for k in range(24):
        gs = grads_of(ps, k, scale=[0.5, 1.0, 3.0][k % 3], nan=k % 7 == 5)
        n = norm64(gs)
        tau = n * [0.5, 0.999, 1.001, 2.0][k % 4] if math.isfinite(n) else 1.0
        opt = mo.Modular(ps, *head, mo.SkipNorm(tau), mo.SGD(lr=0.1))
        assert opt._skip_on_device is not host
        set_grads(ps, gs)
        before = [p.detach().clone() for p in ps]
        opt.step()
        want = spec.skip_norm(gs, tau)
        nonfinite = not math.isfinite(n)
        key = f"{len(head)}:SkipNorm"
        assert bool(opt.stats["skipped"]) == want and int(opt.stats["skipped_steps"]) == int(want), k
        if not host or not nonfinite:  # (the host's non-finite skip runs no transform: no telemetry)
            assert bool(opt.stats[f"{key}.skip"]) == (want and not nonfinite), k
        if not nonfinite:
            assert float(opt.stats[f"{key}.norm"]) == pytest.approx(n, rel=1e-6), k
        moved = not all(torch.equal(a, p) for a, p in zip(before, ps))
        assert moved == (not want), k


@pytest.mark.parametrize("tau", [0.1, 0.30000000000000004, 1 / 3, 0.7, 1e-3, 12.34])
def test_skip_norm_compares_the_threshold_exactly_as_megatron_does(tau):
    """Megatron-LM skips when `grad_norm > threshold`, the float32 norm read as a Python float (float64).
    Gradients whose float32 norm is the float32 nearest to `tau` and its neighbours: SkipNorm decides as
    that rule does, where comparing in float32 (`tau` rounded to float32 first) would not, for a `tau`
    that float32 cannot hold."""
    near = torch.tensor(tau, dtype=torch.float32)
    for n32 in (torch.nextafter(near, torch.tensor(0.0)), near, torch.nextafter(near, torch.tensor(1e9))):
        p = torch.nn.Parameter(torch.zeros(1))
        opt = mo.Modular([p], mo.SkipNorm(tau), mo.SGD(lr=1.0))
        p.grad = n32.reshape(1).clone()  # one element: its norm is itself, exactly
        opt.step()
        megatron = float(opt.stats[f"{KEY}.norm"]) > tau  # (the norm the step measured, as Megatron reads it)
        assert float(opt.stats[f"{KEY}.norm"]) == float(n32)
        assert bool(opt.stats["skipped"]) == megatron == (float(n32) > tau), (tau, float(n32))


def test_a_skipped_step_keeps_every_state_bit_for_bit_with_no_sync():
    """SkipNorm in front of stateful transforms: a step above the threshold leaves the parameters and every
    saved value as they were, with no host sync (counted), counted in skipped_steps; the run then ends
    where the same run without that step ends, bit for bit."""
    def run(with_spike):
        ps = params()
        opt = mo.Modular(ps, mo.SkipNorm(5.0), mo.ClipNormByEMA(beta=0.9), mo.AdamW(lr=1e-2), max_consecutive_skips=4)
        syncs = Syncs()
        for k in range(8):
            if with_spike and k == 4:
                set_grads(ps, grads_of(ps, 99, scale=10.0))
                before = saved(opt, ps)
                with syncs:
                    opt.step()
                assert bool(opt.stats[f"{KEY}.skip"]) and bool(opt.stats["skipped"])
                assert int(opt.stats["consecutive_skips"]) == 1
                same(before, saved(opt, ps))
            set_grads(ps, grads_of(ps, k))
            with syncs:
                opt.step()
            assert not bool(opt.stats["skipped"]) and int(opt.stats["consecutive_skips"]) == 0
        assert syncs.n == 0, f"{syncs.n} host syncs"
        return saved(opt, ps), int(opt.stats["skipped_steps"])

    (a, skipped_a), (b, skipped_b) = run(True), run(False)
    same(a, b)
    assert (skipped_a, skipped_b) == (1, 0)


@pytest.mark.parametrize("make", [lambda: mo.SkipNorm(1.0), lambda: mo.SkipStep(window=4, min_steps=3, watch="norm")],
                         ids=["SkipNorm", "SkipStep"])
def test_a_step_the_host_skips_is_counted_in_skipped_steps(make):
    """Where the host decides (a transform that needs it, or nonfinite='raise'), a step a skip transform
    stops is counted in skipped_steps and `skipped`, as where the device decides (it was not: 0)."""
    for head, nonfinite in [([needs_the_host()], "skip"), ([], "raise"), ([], "ignore")]:
        p = torch.nn.Parameter(torch.zeros(2))
        opt = mo.Modular([p], *head, make(), mo.SGD(lr=1.0), nonfinite=nonfinite)
        assert not (opt._skip_on_device and nonfinite == "skip")  # (the host decides)
        for g in ([0.3, 0.4], [0.3, 0.4], [0.3, 0.4], [30.0, 40.0]):  # the last: norm 50, a spike for both
            p.grad = torch.tensor(g)
            opt.step()
        assert p.tolist() == pytest.approx([-0.9, -1.2])
        assert bool(opt.stats["skipped"]) and int(opt.stats["skipped_steps"]) == 1, (head, nonfinite)


def test_skip_norm_goes_first_at_the_top_level():
    """As SkipStep: after a transform that keeps state, inside Masked, or attached to a torch optimizer it
    is refused when built, naming why."""
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="SkipNorm comes after 0:ClipNormByEMA, which keep state"):
        mo.Modular([p], mo.ClipNormByEMA(), mo.SkipNorm(1.0), mo.Adam())
    with pytest.raises(ValueError, match="must be at the top level"):
        mo.Modular([p], mo.Masked(mo.SkipNorm(1.0), where=mo.Select(min_ndim=1)), mo.Adam())
    with pytest.raises(ValueError, match="cannot be attached"):
        mo.attach(torch.optim.SGD([p], lr=0.1), mo.SkipNorm(1.0))
    mo.Modular([p], mo.ClipValue(10.0), mo.SkipNorm(1.0), mo.SkipStep(), mo.Adam())  # stateless before: fine
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="max_norm"):
            mo.SkipNorm(bad)


# --- the consecutive-skip limit ---------------------------------------------------------------------------
#: a step's gradients: "ok", "nan" (skipped for non-finite gradients) or "big" (norm above SkipNorm's 5)
STEP = {"ok": dict(scale=1.0), "nan": dict(nan=True), "big": dict(scale=10.0)}


def limited(n=3, dtype=torch.float32):
    ps = params(dtype=dtype)
    return ps, mo.Modular(ps, mo.SkipNorm(5.0), mo.Adam(lr=1e-2), max_consecutive_skips=n)


def feed(ps, opt, kinds, syncs=None):
    """Step through `kinds`; the index of the call that raised `SkipLimitError` and the error (or None)."""
    for k, kind in enumerate(kinds):
        set_grads(ps, grads_of(ps, k, **STEP[kind]))
        try:
            if syncs is None:
                opt.step()
            else:
                with syncs:
                    opt.step()
        except SkipLimitError as e:
            return k, e
    return None, None


def test_on_the_cpu_the_nth_skip_in_a_row_raises_and_n_minus_one_then_a_good_step_does_not():
    """N = 3: two skips, a good step, two skips, a good step go on; the third skip in a row raises in its
    own call, naming N and each cause; the parameters are as the last good step left them."""
    ps, opt = limited(3)
    at, e = feed(ps, opt, ["big", "nan", "ok", "nan", "big", "ok", "big", "nan"])
    assert (at, e) == (None, None)
    assert int(opt.stats["consecutive_skips"]) == 2
    good = [p.detach().clone() for p in ps]
    at, e = feed(ps, opt, ["big"])
    assert at == 0 and isinstance(e, FloatingPointError)
    assert (e.limit, e.skipped, e.nonfinite, e.by_rule) == (3, 3, 1, 2)
    msg = str(e)
    assert "3 steps in a row were skipped (max_consecutive_skips=3)" in msg
    assert "1 for a non-finite gradient norm" in msg and "2 by 0:SkipNorm" in msg and "the last of them" in msg
    assert all(torch.equal(a, p) for a, p in zip(good, ps))


def test_on_the_device_path_the_next_call_raises_before_changing_anything_with_no_sync():
    """What a GPU runs: no host sync in any step (counted); N - 1 skips then a good step go on; after N
    skips the count is read by the next call, which raises before it changes anything (its own gradients
    are good), so the state is the one the Nth skip left."""
    ps, opt = limited(3)
    syncs = Syncs()
    at, _ = feed(ps, opt, ["ok", "big", "nan", "ok", "big", "nan", "big"], syncs)
    assert at is None  # (the third skip in a row: on the device path, not read yet)
    before = saved(opt, ps)
    at, e = feed(ps, opt, ["ok"], syncs)
    assert at == 0 and (e.limit, e.skipped, e.nonfinite, e.by_rule) == (3, 3, 1, 2)
    assert "read at the start of the next opt.step(), which changed nothing" in str(e)
    same(before, saved(opt, ps))
    assert syncs.n == 0, f"{syncs.n} host syncs"


def test_check_reads_the_count_of_the_last_step():
    """After the last step (the CLI's end of a run), `check()` raises once the run of skips reached N, on
    the device path too (the step itself leaves the count to the next call there)."""
    ps, opt = limited(2)
    with hostdata.device_path():
        feed(ps, opt, ["ok", "big"])
        opt.skip_limit.check()  # one skip: goes on
        feed(ps, opt, ["nan"])
        with pytest.raises(SkipLimitError, match=r"2 steps in a row"):
            opt.skip_limit.check()


def test_a_limit_of_one_raises_at_the_first_skip_and_none_never():
    ps, opt = limited(1)
    assert feed(ps, opt, ["ok", "ok", "nan"])[0] == 2
    ps = params()
    opt = mo.Modular(ps, mo.SkipNorm(5.0), mo.Adam(lr=1e-2))  # no limit: skips for ever, as before
    assert opt.skip_limit is None and feed(ps, opt, ["nan", "big"] * 10) == (None, None)
    assert int(opt.stats["skipped_steps"]) == 20 and "consecutive_skips" not in opt.stats


def test_the_limit_counts_non_finite_skips_without_a_skip_transform():
    """With no skip transform, non-finite steps alone (the default policy) reach the limit."""
    ps = params()
    opt = mo.Modular(ps, mo.Adam(lr=1e-2), max_consecutive_skips=2)
    at, e = feed(ps, opt, ["ok", "nan", "ok", "nan", "nan"])
    assert at == 4 and (e.nonfinite, e.by_rule) == (2, 0) and "by " not in str(e).split(";")[0]


def test_the_limit_survives_pickle_and_deepcopy():
    """A pickled or deep-copied optimizer carries the count (not the host's pinned copy): the copy raises
    where the original does, on the CPU and on the device path."""
    for path in (False, True):
        ps, opt = limited(3)
        with hostdata.device_path() if path else _nothing():
            feed(ps, opt, ["big", "nan"])
            for clone in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
                assert int(clone.stats["consecutive_skips"]) == 2
                cps = [p for g in clone.param_groups for p in g["params"]]
                at, e = feed(cps, clone, ["big", "ok"])
                assert at == (1 if path else 0) and e.skipped == 3, path


def test_a_checkpoint_carries_the_run_of_skips_and_the_resumed_run_stops_where_the_original_does(tmp_path):
    """Two skips in a row, saved (torch.save, weights_only=True) and loaded into a fresh optimizer: the next
    skip is the third in a row there too, on the CPU and on the device path. A checkpoint saved after a step
    that went ahead carries a run of 0, and a count that cannot be one is refused naming the field, with the
    optimizer left as it was."""
    for path in (False, True):
        ps, opt = limited(3)
        with hostdata.device_path() if path else _nothing():
            feed(ps, opt, ["ok", "big", "nan"])
            torch.save(opt.state_dict(), tmp_path / "sd.pt")
            sd = torch.load(tmp_path / "sd.pt", weights_only=True)
            assert sd["modopt"]["consecutive_skips"].tolist() == [2, 1, 1]
            ps2, opt2 = limited(3)
            with torch.no_grad():
                for a, b in zip(ps2, ps):
                    a.copy_(b)
            opt2.load_state_dict(sd)
            at, e = feed(ps2, opt2, ["big", "ok"])
            assert at == (1 if path else 0) and (e.skipped, e.nonfinite, e.by_rule) == (3, 1, 2), path
    ps, opt = limited(3)
    feed(ps, opt, ["big", "ok"])
    run = opt.state_dict()["modopt"].get("consecutive_skips")  # (after a step that went ahead: no run)
    assert run is None or run.tolist() == [0, 0, 0]
    ps, opt = limited(3)
    feed(ps, opt, ["big", "nan"])
    sd = opt.state_dict()
    for bad in (torch.tensor([2, 1, 2]), torch.tensor([2.0, 1.0, 1.0]), torch.tensor([-1, 0, -1]), torch.tensor(2)):
        sd["modopt"]["consecutive_skips"] = bad
        ps2, opt2 = limited(3)
        feed(ps2, opt2, ["big"])
        with pytest.raises(ValueError, match="consecutive_skips"):
            opt2.load_state_dict(sd)
        assert int(opt2.stats["consecutive_skips"]) == 1 and opt2.skip_limit.counts.tolist() == [1, 0, 1]


def _nothing():
    import contextlib

    return contextlib.nullcontext()


# --- the config field and the CLI ---------------------------------------------------------------------
def test_the_config_field_round_trips_and_builds_the_limit(tmp_path):
    cfg = mo.PipelineConfig(transforms=[mo.SkipNorm(2.0), mo.Adam()], max_consecutive_skips=7)
    assert "max_consecutive_skips=7" in repr(cfg)
    for suffix in ("yaml", "json", "toml"):
        back = mo.load_config(cfg.save(tmp_path / f"c.{suffix}"))
        assert back == cfg and back.max_consecutive_skips == 7
    opt = mo.Modular.from_config(params(), cfg)
    assert opt.skip_limit.limit == 7 and opt.config == cfg and opt.skip_limit.rules == ("0:SkipNorm",)
    assert mo.Modular(params(), config=cfg.to_dict()).skip_limit.limit == 7
    assert mo.Modular(params(), config=cfg, max_consecutive_skips=2).skip_limit.limit == 2  # the keyword wins
    plain = mo.PipelineConfig(transforms=[mo.Adam()])
    assert "max_consecutive_skips" not in plain.to_dict() and mo.Modular(params(), config=plain).skip_limit is None
    assert "max_consecutive_skips" in mo.config_schema()["properties"]


@pytest.mark.parametrize("bad", [0, -3, True, "5", 2.5, 2**62])
def test_a_bad_limit_is_refused_naming_the_field(bad):
    with pytest.raises(mo.ConfigError, match="max_consecutive_skips"):
        mo.load_config({"transforms": [{"type": "Adam"}], "max_consecutive_skips": bad})
    with pytest.raises(ValueError, match="max_consecutive_skips"):
        mo.Modular(params(), mo.Adam(), max_consecutive_skips=bad)


def test_the_cli_stops_a_run_that_only_skips_with_exit_4(tmp_path, capsys, monkeypatch):
    """A threshold below every norm skips every step: with `max_consecutive_skips: 3` the run stops at its
    third step with the exit status of a stop the config asked for (4), one line and no traceback; the
    same config without the field trains to the end (exit 0) having skipped every step."""
    monkeypatch.delenv("MODOPT_DEBUG", raising=False)
    task = {"name": "transformer", "options": {"vocab": 8, "seq_len": 8, "d_model": 16, "nhead": 2, "layers": 1,
                                               "ff": 32, "eval_size": 32}}
    data = {"name": "guards", "task": task,
            "optimizer": {"transforms": [{"type": "SkipNorm", "max_norm": 1e-9}, {"type": "Adam", "lr": 0.01}],
                          "max_consecutive_skips": 3},
            "train": {"steps": 8, "batch_size": 8, "seed": 3}}
    cfg = tmp_path / "guards.yaml"
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    assert cli_main(["run", str(cfg), "--out", str(tmp_path / "a"), "--quiet", "--no-plots"]) == 4
    err = capsys.readouterr().err
    assert "training stopped: 3 steps in a row were skipped (max_consecutive_skips=3)" in err
    assert "3 by 0:SkipNorm" in err and "Traceback" not in err
    del data["optimizer"]["max_consecutive_skips"]
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    assert cli_main(["run", str(cfg), "--out", str(tmp_path / "b"), "--quiet", "--no-plots"]) == 0


@pytest.mark.compile
def test_compiled_steps_keep_the_count_on_the_device_and_check_reads_it():
    """`mo.compile_step` (one graph, fullgraph): SkipNorm skips in the graph, the count runs in it, no
    host part is traced; `check()` after the steps raises once the run reached N."""
    ps, opt = limited(3)
    step = mo.compile_step(opt)
    for k, kind in enumerate(["ok", "ok", "big", "ok", "big", "big"]):
        set_grads(ps, grads_of(ps, k, **STEP[kind]))
        step()
        assert bool(opt.stats["skipped"]) == (kind == "big") and bool(opt.stats[f"{KEY}.skip"]) == (kind == "big")
    assert int(opt.stats["consecutive_skips"]) == 2 and int(opt.stats["skipped_steps"]) == 3
    opt.skip_limit.check()
    set_grads(ps, grads_of(ps, 9, **STEP["big"]))
    step()
    with pytest.raises(SkipLimitError, match="3 steps in a row"):
        opt.skip_limit.check()
