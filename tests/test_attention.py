"""modopt/attention.py: what `mo.AttentionLogits` lets in. `record` checks its arguments before it records
anything; each query or key row is watched by one layer of one provider (two would clip its head twice)."""

from __future__ import annotations

import pytest
import torch

import modopt as mo
from checks import Syncs
from modopt.attention import _ATTR, mha_max_logits


def _mha(seed=0, scale=3.0):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    with torch.no_grad():
        m.in_proj_weight.mul_(scale)
    return m


def _x(seed=1):
    return torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(seed))


# --- record: the arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("value, error, match", [
    (torch.zeros(2, dtype=torch.complex64), TypeError, r"real floating-point tensor, got dtype torch.complex64"),
    (torch.zeros(2, dtype=torch.bool), TypeError, r"real floating-point tensor, got dtype torch.bool"),
    (torch.zeros(2, dtype=torch.int64), TypeError, r"real floating-point tensor, got dtype torch.int64"),
    (torch.zeros(2, 1), ValueError, r"shape \[2\] \(one max per head\), got \[2, 1\]"),
    (torch.zeros(4), ValueError, r"shape \[2\] \(one max per head\), got \[4\]"),
    (torch.tensor(3.0), ValueError, r"got \[\]"),
    (1.0, TypeError, r"tensor of shape \[2\] \(the layer's heads\), got float 1.0"),
    ("x", TypeError, r"got str 'x'"),
    (None, TypeError, r"got NoneType None"),
])
def test_record_refuses_what_is_not_a_real_floating_tensor_of_one_max_per_head(keep, value, error, match):
    """Before anything is recorded: the running maxima and the kept inputs stay as they were."""
    w = torch.nn.Parameter(torch.randn(4, 4))
    stats = mo.AttentionLogits(keep_inputs=keep)
    stats.watch("layer", 2, query=(w, 0, 2), key=(w, 2, 4), logits_fn=(lambda x: x) if keep else None)
    x = torch.ones(3)
    stats.record("layer", torch.tensor([1.0, 2.0]), inputs=(x,))
    before = stats.max_logits()["layer"].clone()
    with pytest.raises(error, match=r"AttentionLogits.record\('layer'\): max_logits must .*"
                       + match + r".*nothing was recorded"):
        stats.record("layer", value, inputs=(x,))
    assert torch.equal(stats.max_logits()["layer"], before) and stats.kept_inputs() == {"layer": int(keep)}


@pytest.mark.parametrize("name", ["nope", 3, None])
def test_record_refuses_a_layer_it_does_not_watch_naming_the_watched_ones(name):
    w = torch.nn.Parameter(torch.randn(4, 4))
    stats = mo.AttentionLogits()
    stats.watch("a", 2, query=(w, 0, 2), key=(w, 2, 4))
    with pytest.raises(ValueError, match=rf"record\({name!r}\): no watched layer has this name; the watched layers "
                                         r"are \['a'\] \(nothing was recorded\)"):
        stats.record(name, torch.zeros(2))
    assert torch.isneginf(stats.max_logits()["a"]).all()


def test_record_takes_any_real_floating_dtype_and_checks_without_a_sync():
    w = torch.nn.Parameter(torch.randn(4, 4))
    stats = mo.AttentionLogits()
    stats.watch("a", 2, query=(w, 0, 2), key=(w, 2, 4))
    with Syncs() as s:
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            stats.record("a", torch.tensor([1.0, -2.0], dtype=dtype))
    assert s.n == 0 and stats.max_logits()["a"].tolist() == [1.0, -2.0]


# --- one watcher per row --------------------------------------------------------------------------------
def test_a_second_provider_on_the_same_attention_is_refused_and_the_heads_are_clipped_once():
    """Two providers attached to one model used to clip every head twice (tau = 1: max logit 0.0065 after
    the clip). The second attach is refused naming the layer, hooks nothing and registers nothing; the step
    then clips once: the same inputs give each head min(S, tau)."""
    m = _mha()
    first = mo.AttentionLogits.attach(m)
    hooks = dict(m._forward_hooks)
    with pytest.raises(ValueError, match=r"'attention'.*watched already.*the layer of another AttentionLogits "
                                         r"provider 'attention'.*clip those heads twice.*nothing was watched"):
        mo.AttentionLogits.attach(m)
    assert dict(m._forward_hooks) == hooks
    assert [e.name for e in getattr(m.in_proj_weight, _ATTR)] == ["attention"]
    assert getattr(m.in_proj_weight, _ATTR)[0] is first.layers["attention"]
    opt = mo.Modular(m.parameters(), mo.SGD(lr=0.0), mo.QKClip(1.0))
    x = _x()
    m(x, x, x)[0].sum().backward()
    before = mha_max_logits(m, x, x).detach()
    opt.step()
    assert (before > 1.0).all()
    torch.testing.assert_close(mha_max_logits(m, x, x).detach(), before.clamp_max(1.0), rtol=1e-5, atol=1e-6)


def test_attach_watches_every_attention_of_the_model_or_none():
    """A model of two attention layers whose second is watched already (by another provider): attach
    refuses it, and the first is left unwatched and unhooked (the given provider as it was)."""
    model = torch.nn.ModuleDict({"a": _mha(0), "b": _mha(1)})
    other = mo.AttentionLogits()
    other.watch_mha("b", model["b"])
    stats = mo.AttentionLogits()
    w = torch.nn.Parameter(torch.randn(4, 4))
    stats.watch("mine", 2, query=(w, 0, 2), key=(w, 2, 4))
    with pytest.raises(ValueError, match=r"AttentionLogits.watch\('b'\).*another AttentionLogits provider 'b'"):
        mo.AttentionLogits.attach(model, stats)
    assert list(stats.layers) == ["mine"] and len(stats._handles) == 0
    assert not model["a"]._forward_hooks and not getattr(model["a"].in_proj_weight, _ATTR, [])
    assert [e.name for e in getattr(model["b"].in_proj_weight, _ATTR)] == ["b"]


def test_watch_refuses_rows_of_one_of_its_own_layers_and_allows_disjoint_rows_of_one_tensor():
    w = torch.nn.Parameter(torch.randn(8, 4))
    stats = mo.AttentionLogits()
    stats.watch("one", 2, query=(w, 0, 2), key=(w, 2, 4))
    stats.watch("two", 2, query=(w, 4, 6), key=(w, 6, 8))  # the same tensor, other rows: two layers, fine
    with pytest.raises(ValueError, match=r"watch\('three'\): rows 2:6 .*watched already, rows 2:4 by this "
                                         r"provider's layer 'one'"):
        stats.watch("three", 2, query=(w, 2, 6), key=(w, 6, 8))
    assert list(stats.layers) == ["one", "two"]
    assert [e.name for e in getattr(w, _ATTR)] == ["one", "two"]
    stats.detach()
    again = mo.AttentionLogits()
    again.watch("three", 2, query=(w, 2, 6), key=(w, 6, 8))  # detached: the rows are free again
    assert [e.name for e in getattr(w, _ATTR)] == ["three"]
