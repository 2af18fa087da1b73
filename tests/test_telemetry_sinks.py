"""Every telemetry sink writes what the history read back, and each is read back here with the
reader of its own format: JSON lines and CSV (stdlib), TensorBoard event files
(tensorboard's EventAccumulator), a W&B offline run file (its records), Lightning's CSVLogger file
and the HF Trainer's log_history; and `modopt run --` `output.tensorboard`."""

from __future__ import annotations

import csv
import glob
import json
import math
import struct
import time

import pytest
import torch

import modopt as mo
from modopt.telemetry import CsvSink, History, JsonlSink, TensorBoardSink, tag


def make_rows(sinks=(), steps=6, nan_at=3):
    """Steps of a small model with a spike and a non-finite step; the history read back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    opt = mo.Modular(model.named_parameters(), mo.ClipNorm(0.5), mo.Adam(lr=1e-2))
    h = History.attach(opt, capacity=8, every=2, module_depth=1, sinks=sinks)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        opt.zero_grad()
        loss = model(torch.randn(5, 4, generator=g) * (20 if i == 1 else 1)).pow(2).mean()
        loss.backward()
        if i == nan_at:
            model[0].weight.grad[0, 0] = float("nan")
        h.note(loss=loss.detach())
        opt.step()
    h.close()
    return h.read()


def same_value(got, want) -> bool:
    return (math.isnan(want) and (got is None or math.isnan(got))) or got == want


def test_jsonl_and_csv_sinks_write_every_row(tmp_path):
    rows = make_rows([JsonlSink(tmp_path / "t.jsonl"), CsvSink(tmp_path / "t.csv")])
    assert rows[3]["skipped"] == 1.0 and math.isnan(rows[3]["grad_norm"])  # there is a NaN to write
    back = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [b["step"] for b in back] == [1, 2, 3, 4, 5, 6]
    for b, r in zip(back, rows):
        assert b.keys() == r.keys() and all(same_value(b[k], r[k]) for k in r)
    assert back[3]["grad_norm"] is None  # NaN is JSON null
    with (tmp_path / "t.csv").open(newline="") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 6
    for t, r in zip(table, rows):
        assert int(t["step"]) == r["step"] and all(same_value(float(t[k]), r[k]) for k in r if k != "step")


def test_csv_sink_widens_its_header_for_a_new_column(tmp_path):
    sink = CsvSink(tmp_path / "t.csv")
    sink.write([{"step": 1, "a": 1.0}])
    sink.write([{"step": 2, "a": 2.0, "b": 3.0}])
    with (tmp_path / "t.csv").open(newline="") as f:
        assert list(csv.reader(f)) == [["step", "a", "b"], ["1", "1.0", ""], ["2", "2.0", "3.0"]]
    (tmp_path / "other.csv").write_text("x,y\n1,2\n")
    with pytest.raises(ValueError, match="other.csv exists and is not a telemetry CSV"):
        CsvSink(tmp_path / "other.csv")


def read_tensorboard(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def test_tensorboard_sink_writes_every_value_as_a_scalar(tmp_path):
    rows = make_rows([TensorBoardSink(tmp_path / "tb")])
    got = read_tensorboard(tmp_path / "tb")
    want = {tag(k) for r in rows for k in r if k != "step"}
    assert set(got) == want and "modopt/module_norm/0" in want and "modopt/0:ClipNorm/scale" in want
    for k in {k for r in rows for k in r} - {"step"}:
        series = [(r["step"], r[k]) for r in rows if k in r]
        assert [s for s, _ in got[tag(k)]] == [s for s, _ in series]
        for (_, v), (_, w) in zip(got[tag(k)], series):  # TensorBoard keeps float32
            assert (math.isnan(v) and math.isnan(w)) or v == pytest.approx(w, rel=1e-6)
    with pytest.raises(TypeError, match="give log_dir or writer"):
        TensorBoardSink()


def wandb_records(path):
    """The records of a W&B run file (`run-<id>.wandb`): a 7-byte header (`:W&B`, a magic, a version),
    then LevelDB's log format (32 KiB blocks of records: crc32c, length, type; type 1 a whole
    record, 2/3/4 its first/middle/last part), each record a protobuf `wandb.proto.Record`."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, part = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            pos += left
            continue
        part += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(part)
            part = b""
            yield rec


@pytest.mark.slow
def test_wandb_sink_logs_every_row_in_an_offline_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from modopt.telemetry import WandbSink

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="modopt-test", dir=str(tmp_path))
    try:
        rows = make_rows([WandbSink(run)])
    finally:
        run.finish()
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    for _ in range(300):  # W&B's writer process finishes the file after finish() returns: wait for its exit record
        kinds = [rec.WhichOneof("record_type") for rec in wandb_records(path)]
        if "exit" in kinds:
            break
        time.sleep(0.1)
    logged = []
    for rec in wandb_records(path):
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            logged.append({k: v for k, v in items.items() if not k.startswith("_")})  # (W&B's own _step, ...)
    assert len(logged) == len(rows), kinds
    for got, r in zip(logged, rows):
        assert got[tag("step")] == r["step"]
        assert set(got) == {tag(k) for k in r}
        for k in r:
            v = got[tag(k)]
            assert (math.isnan(r[k]) and (v is None or v == "NaN" or (isinstance(v, float) and math.isnan(v)))) \
                or v == r[k], (k, v, r[k])


def test_lightning_callback_writes_into_the_trainers_loggers(tmp_path):
    L = pytest.importorskip("lightning")
    from lightning.pytorch.loggers import CSVLogger

    from modopt.telemetry import LightningTelemetry

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))

        def training_step(self, batch, _):
            (x,) = batch
            return self.net(x).pow(2).mean()

        def configure_optimizers(self):
            return mo.Modular(self.net.named_parameters(), mo.ClipNorm(0.5), mo.Adam(lr=1e-2))

    data = torch.utils.data.TensorDataset(torch.randn(40, 4, generator=torch.Generator().manual_seed(0)))
    cb = LightningTelemetry(capacity=8, every=4, module_depth=2)
    trainer = L.Trainer(max_steps=10, accelerator="cpu", logger=CSVLogger(str(tmp_path)), enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[cb])
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=4))
    rows = cb.history.read()
    assert [r["step"] for r in rows] == list(range(3, 11))
    (path,) = glob.glob(str(tmp_path / "lightning_logs" / "version_*" / "metrics.csv"))
    with open(path, newline="") as f:
        table = [r for r in csv.DictReader(f) if r.get(tag("grad_norm"))]
    by_step = {int(t["step"]): t for t in table}
    assert sorted(by_step) == list(range(1, 11))
    for r in rows:
        t = by_step[r["step"]]
        assert "modopt/module_norm/net.0" in t
        for k, v in r.items():
            if k != "step":
                assert float(t[tag(k)]) == pytest.approx(v, rel=1e-6), k


@pytest.mark.slow
def test_hf_callback_puts_the_rows_in_the_trainers_log_history(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from modopt.telemetry import HFTelemetry

    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.mse_loss(self.net(x).squeeze(-1), labels)}

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(48, 4, generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.x[i].sum()}

    torch.manual_seed(0)
    cb = HFTelemetry(capacity=8, every=3, module_depth=2)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=7, per_device_train_batch_size=8, max_grad_norm=0.0,
                             save_strategy="no", logging_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=Regressor(), args=args, train_dataset=Data(), callbacks=[cb],
                      optimizer_cls_and_kwargs=(mo.Modular, {"transforms": [mo.ZClip(warmup_steps=2), mo.AdamW(lr=1e-2)]}))
    trainer.train()
    rows = cb.history.read()
    logged = [e for e in trainer.state.log_history if tag("grad_norm") in e]
    assert [e["step"] for e in logged] == [r["step"] for r in rows] == list(range(1, 8))
    for e, r in zip(logged, rows):
        assert e == {**{tag(k): v for k, v in r.items() if k != "step"}, "step": r["step"]}
    assert "modopt/module_norm/net.0" in logged[0] and "modopt/0:ZClip/norm" in logged[0]


# --- modopt run: output.tensorboard and metrics.jsonl from the history (item 4) -------------------


def write_run_config(path, **output):
    from test_cli import write_config, clip_transforms

    import yaml

    write_config(path, clip_transforms(), steps=30, checkpoint_every=10, eval_every=5)
    data = yaml.safe_load(path.read_text())
    data["output"] = output
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_modopt_run_writes_tensorboard_from_the_history_and_resumes_it(tmp_path):
    from modopt.cli import main

    cfg = write_run_config(tmp_path / "exp.yaml", tensorboard=True, read_every=4)
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert main(["run", str(cfg), "--out", str(full), "--quiet", "--no-plots"]) == 0
    assert main(["run", str(cfg), "--out", str(cut), "--quiet", "--no-plots", "--stop-after", "17"]) == 3
    assert main(["run", "--resume", str(cut), "--quiet", "--no-plots"]) == 0
    assert (cut / "metrics.jsonl").read_bytes() == (full / "metrics.jsonl").read_bytes()
    metrics = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    tb_full, tb_cut = read_tensorboard(full / "tensorboard"), read_tensorboard(cut / "tensorboard")
    assert tb_cut == tb_full  # steps 11..17 written twice by the cut run are purged on resume
    for key in ("loss", "lr", "grad_norm", "post_clip_norm", "clip_scale", "eval_loss"):
        want = [(m["step"], m[key]) for m in metrics if key in m]
        got = tb_full[tag(key)]
        assert [s for s, _ in got] == [s for s, _ in want], key
        assert all(v == pytest.approx(w, rel=1e-6) for (_, v), (_, w) in zip(got, want)), key
    assert tag("0:ZClip/norm") in tb_full and len(tb_full[tag("0:ZClip/norm")]) == 30


def test_modopt_run_metrics_do_not_depend_on_the_read_cadence(tmp_path):
    from modopt.cli import main

    a = write_run_config(tmp_path / "a.yaml", read_every=1)
    b = write_run_config(tmp_path / "b.yaml", read_every=7)
    assert main(["run", str(a), "--out", str(tmp_path / "ra"), "--quiet", "--no-plots"]) == 0
    assert main(["run", str(b), "--out", str(tmp_path / "rb"), "--quiet", "--no-plots"]) == 0
    assert (tmp_path / "ra" / "metrics.jsonl").read_bytes() == (tmp_path / "rb" / "metrics.jsonl").read_bytes()
    assert not (tmp_path / "ra" / "tensorboard").exists()  # off by default


def test_modopt_run_with_tensorboard_on_and_not_installed_is_a_config_error(tmp_path, monkeypatch, capsys):
    import sys

    from modopt.cli import main

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` raises ImportError
    cfg = write_run_config(tmp_path / "exp.yaml", tensorboard=True)
    assert main(["run", str(cfg), "--out", str(tmp_path / "r"), "--quiet", "--no-plots"]) == 1
    assert "output.tensorboard is true, and the tensorboard package is not installed" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
