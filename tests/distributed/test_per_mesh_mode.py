"""`distributed.per_mesh_mode`, the split of multi-tensor ops per mesh: it splits exactly the ops over several
meshes, each part equal to the op on its tensors alone, and it costs modopt a constant number of Python calls
per torch call it sees, none per tensor (it sees every torch call of a step: `benchmarks/per_mesh_cost.py`).

One process, gloo with world size 1 and two meshes of that one rank (the same tensors; only the mesh objects
differ), in a subprocess so that the test process starts no process group.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from launch import free_port

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"),
]

CODE = textwrap.dedent("""
    import json, os, sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    import modopt
    from modopt.core import distributed

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
    a = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    b = init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    root = os.path.dirname(modopt.__file__) + os.sep
    out = {}

    def modopt_calls(fn):
        n = [0]
        def prof(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.startswith(root):
                n[0] += 1
        sys.setprofile(prof)
        try:
            res = fn()
        finally:
            sys.setprofile(None)
        return n[0], res

    g = torch.Generator().manual_seed(0)
    for n in (4, 64):  # one mesh: no split, and no call per tensor
        ts = [distribute_tensor(torch.randn(3, 2, generator=g), a, [Shard(0)]) for _ in range(n)]
        with distributed.per_mesh_mode():
            calls, res = modopt_calls(lambda: torch._foreach_mul(ts, 2.0))
        out[f"one mesh, {n}"] = [calls, all(torch.equal(r.full_tensor(), 2 * t.full_tensor()) for r, t in zip(res, ts))]
    # three kinds: DTensors of two meshes and a plain tensor, interleaved; an op over lists and per-tensor scalars
    xs = [distribute_tensor(torch.randn(3, 2, generator=g), a, [Shard(0)]),
          distribute_tensor(torch.randn(4, 2, generator=g), b, [Shard(0)]), torch.randn(5, generator=g),
          distribute_tensor(torch.randn(2, 2, generator=g), a, [Shard(0)])]
    ys = [x.clone() for x in xs]
    plain = lambda t: t.full_tensor() if isinstance(t, type(xs[0])) else t
    try:
        torch._foreach_add(xs, ys)
        out["unsplit refused"] = False
    except Exception:
        out["unsplit refused"] = True
    with distributed.per_mesh_mode():
        res = torch._foreach_add(xs, ys, alpha=0.5)
        torch._foreach_mul_(ys, [0.5, 2.0, 3.0, 4.0])
    out["mixed add"] = all(torch.equal(plain(r), plain(x) + 0.5 * plain(x)) for r, x in zip(res, xs))
    out["mixed mul_"] = all(torch.equal(plain(y), plain(x) * s) for y, x, s in zip(ys, xs, [0.5, 2.0, 3.0, 4.0]))
    dist.destroy_process_group()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def measured():
    done = subprocess.run([sys.executable, "-c", CODE, str(free_port())], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_op_over_one_mesh_is_not_split_and_costs_no_call_per_tensor(measured):
    (few, ok_few), (many, ok_many) = measured["one mesh, 4"], measured["one mesh, 64"]
    assert ok_few and ok_many
    assert few == many <= 2, (few, many)  # the mode's own call and its list of meshes, for 4 tensors or 64


def test_an_op_over_several_meshes_runs_per_mesh_equal_to_the_op_on_each(measured):
    assert measured["unsplit refused"]  # (the control: DTensor refuses the op unsplit)
    assert measured["mixed add"] and measured["mixed mul_"]
