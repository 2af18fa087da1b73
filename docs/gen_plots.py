"""Generate the behaviour plots of the module-family pages (docs/img/<family>.png).

Each plot feeds the same spiky gradient stream through a few transforms of the
family and draws the norm of what comes out against the norm that went in.
The stream: 150 steps of an 8-element gradient in a random direction whose
norm drifts slowly around 1 with log-normal noise, plus spikes (x6 to x30) at a
few steps. Every transform is followed by ``LR(1.0)``, so the parameter change
of a step is exactly the transform's output.

    python docs/gen_plots.py            # writes docs/img/*.png (small PNGs, committed)
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import modopt as mo  # noqa: E402

OUT = Path(__file__).resolve().parent / "img"
STEPS = 150
SPIKES = {40: 8.0, 41: 6.0, 75: 30.0, 110: 12.0, 130: 20.0}


def stream() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = []
    for t in range(STEPS):
        d = torch.randn(8, generator=g, dtype=torch.float64)
        d /= d.norm()
        norm = (1.0 + 0.3 * math.sin(t / 25)) * math.exp(0.15 * float(torch.randn((), generator=g)))
        out.append(d * norm * SPIKES.get(t, 1.0))
    return out


def response(transforms: list[mo.Transform], grads: list[torch.Tensor]) -> list[float]:
    """Norm of the parameter change per step for ``transforms + [LR(1)]`` (or the optimizer as given)."""
    p = torch.nn.Parameter(torch.zeros(8, dtype=torch.float64))
    chain = transforms if transforms and isinstance(transforms[-1], mo.roles.Optimizer) else [*transforms, mo.LR(1.0)]
    opt = mo.Modular([p], *chain)
    out = []
    for g in grads:
        before = p.detach().clone()
        p.grad = g.clone()
        opt.step()
        out.append(float((before - p.detach()).norm()))
    return out


def has(*names: str) -> bool:
    return all(n in mo.available() for n in names)


def families() -> dict[str, list[tuple[str, list]]]:
    fam: dict[str, list[tuple[str, list]]] = {
        "clipping": [
            ("ClipNorm(max_norm=1.5)", [mo.ClipNorm(1.5)]),
            ("ClipNorm(max_norm=3)", [mo.ClipNorm(3.0)]),
            ("ClipValue(0.5)", [mo.ClipValue(0.5)]),
        ],
        "normalization": [
            ("Normalize()", [mo.Normalize()]),
            ("Centralize(scope='global')", [mo.Centralize(scope="global")]),
        ],
        "optimizers": [
            ("SGD(lr=1)", [mo.SGD(lr=1.0)]),
            ("SGD(lr=1, momentum=0.9)", [mo.SGD(lr=1.0, momentum=0.9)]),
            ("Adam(lr=1)", [mo.Adam(lr=1.0)]),
        ],
    }
    if has("ClipNormByEMA", "NormalizeByEMA", "ClipValueByEMA"):
        fam["ema"] = [
            ("ClipNormByEMA()", [mo.ClipNormByEMA()]),
            ("NormalizeByEMA(beta=0.9)", [mo.NormalizeByEMA(beta=0.9)]),
        ]
    if has("ClipNormGrowth"):
        fam["growth"] = [("ClipNormGrowth(mul=1.5)", [mo.ClipNormGrowth()]), ("ClipNormGrowth(mul=3)", [mo.ClipNormGrowth(mul=3.0)])]
    if has("ZClip", "AutoClip", "HistClip"):
        fam["statistical"] = [
            ("ZClip(max_grad_norm=None, warmup_steps=20)", [mo.ZClip(max_grad_norm=None, warmup_steps=20)]),
            ("AutoClip(percentile=10)", [mo.AutoClip(percentile=10)]),
            ("HistClip(EMACriterion(), warmup_steps=20, warmup_max_norm=None)",
             [mo.HistClip(mo.EMACriterion(), warmup_steps=20, warmup_max_norm=None)]),
        ]
    if has("ClipValueByPercentile"):
        fam["percentile"] = [("ClipValueByPercentile(90)", [mo.ClipValueByPercentile(90)]),
                             ("ClipValueByPercentile(50)", [mo.ClipValueByPercentile(50)])]
    return fam


def orthogonal() -> None:
    """docs/img/orthogonal.png: where Newton-Schulz puts each singular value (the orthogonal family's
    transforms act on matrices, not on the norm of a stream)."""
    from modopt.spec import orthogonal as spec
    from modopt.transforms.orthogonal import newton_schulz

    s = torch.logspace(-4, 0, 2000, dtype=torch.float64)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.axhspan(*spec.BAND, color="0.92", label=f"[{spec.BAND[0]:.2f}, {spec.BAND[1]:.2f}]")
    for k in range(1, 6):
        ax.plot(s, spec.scalar_map(s, steps=k), lw=1.0, label=f"{k} step{'s' if k > 1 else ''} (float64)")
    # the runtime's default (bfloat16) on a 128x128 matrix with known singular vectors: u_i^T O v_i
    g = torch.Generator().manual_seed(0)
    q1, _ = torch.linalg.qr(torch.randn(128, 128, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(128, 128, generator=g, dtype=torch.float64))
    sv = torch.logspace(0, -4, 128, dtype=torch.float64)
    x = (q1 * sv) @ q2.T
    o = newton_schulz(x.float(), [spec.NS_COEFFICIENTS] * 5, 1e-7, torch.bfloat16).double()
    ax.scatter(sv / sv.norm(), ((q1.T @ o) * q2.T).sum(1), s=6, color="k", zorder=3,
               label="5 steps, bfloat16 (runtime)")
    ax.axvline(spec.BAND_FROM, color="0.5", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("singular value of x / ||x||_F")
    ax.set_ylabel("after Newton-Schulz")
    ax.set_title("orthogonal: torch's coefficients (3.4445, -4.775, 2.0315); the polar factor is 1", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", frameon=False)
    fig.tight_layout()
    path = OUT / "orthogonal.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")


def main() -> None:
    OUT.mkdir(exist_ok=True)
    orthogonal()
    grads = stream()
    inp = [float(g.norm()) for g in grads]
    for family, curves in families().items():
        fig, ax = plt.subplots(figsize=(7, 3.2 + 0.18 * (len(curves) + 1)))
        ax.plot(inp, color="0.6", lw=1.0, label="input gradient norm")
        for label, ts in curves:
            ax.plot(response(ts, grads), lw=1.1, label=label)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("L2 norm")
        ax.set_title(f"{family}: output norm on a spiky gradient stream", fontsize=10)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1, frameon=False)  # below the axes, off the lines
        fig.tight_layout()
        path = OUT / f"{family}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
