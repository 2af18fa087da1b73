"""The step computes what it computed before the core was rewritten.

`tests/data/trajectories.pt` holds the parameters after each of 12 steps of 27 pipelines in
float32, float64 and bfloat16, recorded by `tests/data/make_trajectories.py` on main before
the rewrite (see that file). Every pipeline must reproduce them bit for bit, except the ones
that put a clip before `Normalize`: there the clip's scale used to be folded into the
normalization's factor, and now each transform writes its own result, so their last bits may
move (the normalization undoes any positive scale, so they agree to rounding). A pipeline whose
math the one-D rule changed (`make_trajectories.SINCE_ONE_D_RULE`, which says why) reproduces
instead the recording, made before the rule, of the pipeline it now equals; its own recording stays
in the file as what the code computed before.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "data"))
import make_trajectories as mt  # noqa: E402

from modopt.core import kernels  # noqa: E402

RECORDED = torch.load(Path(__file__).parent / "data" / "trajectories.pt", weights_only=True)


def _torchs_own(dtype):
    """`ClipNorm+Adam`'s trajectory computed by torch alone (`clip_grad_norm_` + fused `Adam`, which modopt's
    step equals bit for bit): the arithmetic of this machine, with nothing of modopt's in it."""
    m = mt.model(dtype)
    adam = torch.optim.Adam(m.parameters(), fused=True)
    g = torch.Generator().manual_seed(1)
    rows = []
    for step in range(mt.STEPS):  # the batches and spikes of mt.trajectory
        x = torch.randn(16, 8, generator=g).to(dtype)
        y = torch.randn(16, 3, generator=g).to(dtype)
        m.zero_grad()
        ((m(x) - y).pow(2).mean() * (20.0 if step in (5, 9) else 1.0)).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=True)
        adam.step()
        rows.append(torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()]))
    return torch.stack(rows)


#: whether this machine's arithmetic is the recording's: a CPU of another vector width (AVX-512 FP16 against
#: the recording's) sums the matmuls in another order, and then torch alone does not reproduce it either
SAME_ARITHMETIC = torch.equal(_torchs_own(torch.float32), RECORDED["ClipNorm+Adam/float32"])


@pytest.mark.parametrize("dtype", mt.DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("name", list(mt.pipelines()))
def test_pipeline_reproduces_its_recorded_trajectory(name, dtype, monkeypatch):
    # The recording was made on torch 2.13, whose CPU fused SGD is wrong in half precision, so SGD wrote
    # bfloat16 with the foreach kernel (kernels.KERNEL_BUGS). A torch without that bug picks the fused
    # kernel, which rounds bfloat16 differently: keep the recording's kernel choice on every torch.
    monkeypatch.setattr(kernels, "KNOWN_BAD", kernels.KNOWN_BAD | {("sgd", "cpu", torch.bfloat16)})
    if not SAME_ARITHMETIC:
        pytest.skip("this CPU's arithmetic is not the recording's: torch's own clip_grad_norm_ + fused Adam does not "
                    "reproduce the recorded ClipNorm+Adam trajectory here (another vector width)")
    # (a pipeline the one-D rule changed reproduces the recording of the pipeline it now equals)
    want = RECORDED[f"{mt.SINCE_ONE_D_RULE.get(name, name)}/{str(dtype).split('.')[-1]}"]
    got = torch.stack(mt.trajectory(name, dtype))
    assert got.dtype == want.dtype and got.shape == want.shape
    if name in mt.CLIP_BEFORE_NORMALIZE or name in mt.ROUTED_WRITES:
        tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    else:
        bad = (got != want).any(dim=1).nonzero().flatten().tolist()
        assert not bad, f"{name} ({dtype}) differs from the recorded trajectory from step {bad[0] + 1} on"


def test_the_recording_covers_every_pipeline_and_dtype():
    assert len(RECORDED) == len(mt.pipelines()) * len(mt.DTYPES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=lambda d: str(d).split(".")[-1])
def test_the_routed_pipeline_is_torchs_own_optimizers_bit_for_bit(dtype):
    """`Masked-routing` (ClipNorm, SGD on the first layer, Adam on the second), whose recording predates
    the rule that every routed branch writes with its own kernel: it equals `clip_grad_norm_` over all
    parameters, then `torch.optim.SGD(fused=True)` and `torch.optim.Adam(fused=True)` on their layers.
    (bfloat16 is left to the recording's tolerance above: from the first clipped step on, modopt's clip
    and `clip_grad_norm_` round the bfloat16 gradients differently.)"""
    got = torch.stack(mt.trajectory("Masked-routing", dtype))
    m = mt.model(dtype)
    first, second = list(m[0].parameters()), list(m[2].parameters())
    sgd = torch.optim.SGD(first, lr=0.1, fused=True)
    adam = torch.optim.Adam(second, fused=True)
    g = torch.Generator().manual_seed(1)
    rows = []
    for step in range(mt.STEPS):  # the batches and spikes of mt.trajectory
        x = torch.randn(16, 8, generator=g).to(dtype)
        y = torch.randn(16, 3, generator=g).to(dtype)
        scale = 20.0 if step in (5, 9) else 1.0
        m.zero_grad()
        ((m(x) - y).pow(2).mean() * scale).backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0, foreach=True)
        sgd.step()
        adam.step()
        rows.append(torch.cat([p.detach().reshape(-1).clone() for p in m.parameters()]))
    assert torch.equal(got, torch.stack(rows))
