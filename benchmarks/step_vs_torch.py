"""Paired, interleaved timing of ``opt.step()`` after a real backward, modopt with defaults against
the careful torch user: ``n = clip_grad_norm_(ps, 1.0, foreach=True); if n.isfinite(): adam_fused.step()``.

usage: python benchmarks/step_vs_torch.py [steps=50] [variant=clip] [models=mlp,tf]

variants: ``clip`` = ``Modular(ps, ClipNorm(1.0), Adam())`` (defaults, nonfinite="skip");
``ignore`` = the same with ``nonfinite="ignore"``; ``nofold`` = ``ClipValue(1e30)`` between
them (blocks the deferred scale: bit for bit torch); ``mission`` = ``ClipNormByEMA(), Normalize(), Adam()``.
Prints the median step times and the median of the per-step ratios modopt/torch (the two
alternate which goes first); a shared machine makes single figures rough.
"""
import sys, time, copy, statistics
import torch, torch.nn as nn
import modopt as mo

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 50
variant = sys.argv[2] if len(sys.argv) > 2 else "clip"

def mlp():
    return nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 1024), nn.GELU(),
                         nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 512))

class TF(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(4096, 256)
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(256)
        self.head = nn.Linear(256, 16)
    def forward(self, x):
        return self.head(self.norm(self.enc(self.emb(x))))

def batches(kind):
    g = torch.Generator().manual_seed(1)
    if kind == "mlp":
        return lambda: (torch.randn(64, 1024, generator=g),)
    return lambda: (torch.randint(0, 4096, (8, 64), generator=g),)

for kind in (sys.argv[3].split(",") if len(sys.argv) > 3 else ("mlp", "tf")):
    m1 = mlp() if kind == "mlp" else TF()
    m2 = copy.deepcopy(m1)
    ps1, ps2 = list(m1.parameters()), list(m2.parameters())
    n = sum(p.numel() for p in ps1)
    if variant == "mission":
        opt = mo.Modular(ps1, mo.ClipNormByEMA(), mo.Normalize(), mo.Adam())
    elif variant == "nofold":
        opt = mo.Modular(ps1, mo.ClipNorm(1.0), mo.ClipValue(1e30), mo.Adam())
    elif variant == "clip":
        opt = mo.Modular(ps1, mo.ClipNorm(1.0), mo.Adam())
    else:
        opt = mo.Modular(ps1, mo.ClipNorm(1.0), mo.Adam(), nonfinite="ignore")
    adam = torch.optim.Adam(ps2, fused=True)
    make = batches(kind)
    def iter_mo(x):
        opt.zero_grad(); m1(*x).square().mean().backward()
        t = time.perf_counter(); opt.step(); return time.perf_counter() - t
    def iter_t(x):
        adam.zero_grad(); m2(*x).square().mean().backward()
        t = time.perf_counter()
        nrm = torch.nn.utils.clip_grad_norm_(ps2, 1.0, foreach=True)
        if nrm.isfinite():
            adam.step()
        return time.perf_counter() - t
    for _ in range(5):
        x = make(); iter_mo(x); iter_t(x)
    ratios, a, b = [], [], []
    for i in range(steps):
        x = make()
        if i % 2:
            tm = iter_mo(x); tt = iter_t(x)
        else:
            tt = iter_t(x); tm = iter_mo(x)
        ratios.append(tm / tt); a.append(tm); b.append(tt)
    diff = max((p1 - p2).abs().max().item() for p1, p2 in zip(ps1, ps2))
    print(f"{kind}: {n/1e6:.2f}M params, {len(ps1)} tensors, {variant}: step modopt {statistics.median(a)*1e3:.2f} ms, "
          f"torch {statistics.median(b)*1e3:.2f} ms, median paired ratio {statistics.median(ratios):.3f} "
          f"(max param diff {diff:.2e})")
