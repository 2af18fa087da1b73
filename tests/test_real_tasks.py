"""The built-in tasks on real data: `chars` (the standard library's source) and `digits` (scikit-learn's).

What is checked: the fixed file list exists on this Python, the vocabulary is the documented
one, batches are a function of (seed, step) only and are windows of the training text, the
held-out text is not the training text, the split of the digits, both tasks learn well below
chance in a short `modopt run` of their example config, and the errors for a trimmed Python and
a missing scikit-learn.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from modopt.cli import main
from modopt.cli import tasks
from modopt.config import ConfigError

pytestmark = pytest.mark.slow  # trains on real data (the slow lane)

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _ids_bytes(ids: torch.Tensor) -> bytes:
    """Token ids as bytes (every id is < 256), so a window can be searched for in a text with `bytes.find`."""
    return bytes(ids.tolist())


# --- chars: the data -------------------------------------------------------------------------
def test_chars_file_list_exists_on_this_python_and_is_split_by_file():
    files = tasks.CHARS_TRAIN_FILES + tasks.CHARS_HELDOUT_FILES
    missing = [f for f in files if not (STDLIB / f).is_file()]
    assert missing == []
    assert not set(tasks.CHARS_TRAIN_FILES) & set(tasks.CHARS_HELDOUT_FILES)
    assert 10 <= len(files) <= 25


def test_chars_vocabulary_is_newline_printable_ascii_and_other():
    assert tasks.CHARS_VOCAB == 97
    printable = bytes(range(32, 127))
    ids = tasks.encode_bytes(b"\n" + printable + b"\t\r" + "é".encode())
    assert ids.tolist() == [0] + [b - 31 for b in printable] + [96, 96, 96, 96]  # é is two UTF-8 bytes
    assert tasks.decode_ids(tasks.encode_bytes(b"def f(x):\n    return x ~ 1\n")) == "def f(x):\n    return x ~ 1\n"
    assert tasks.encode_bytes(b"").shape == (0,)


def test_chars_batches_are_a_function_of_seed_and_step_and_windows_of_the_training_text():
    a, b = tasks.make_task("chars", {}, seed=0), tasks.make_task("chars", {}, seed=0)
    other_seed = tasks.make_task("chars", {}, seed=1)
    x = a.get_batch(7, 8)
    assert x.shape == (8, 65) and x.dtype == torch.int64
    assert torch.equal(x, b.get_batch(7, 8))
    assert torch.equal(a.get_batch(3, 8), b.get_batch(3, 8))  # asking out of order changes nothing
    assert not torch.equal(x, a.get_batch(8, 8))
    assert not torch.equal(x, other_seed.get_batch(7, 8))
    train = _ids_bytes(tasks.encode_bytes(tasks.stdlib_text(tasks.CHARS_TRAIN_FILES)))
    assert all(train.find(_ids_bytes(row)) >= 0 for row in x)


def test_chars_eval_windows_come_from_the_held_out_files_only():
    task = tasks.make_task("chars", {}, seed=0)
    windows = task.info["eval_windows"]
    assert torch.equal(windows, tasks.make_task("chars", {}, seed=5).info["eval_windows"])  # the same for every seed
    heldout = _ids_bytes(tasks.encode_bytes(tasks.stdlib_text(tasks.CHARS_HELDOUT_FILES)))
    train = _ids_bytes(tasks.encode_bytes(tasks.stdlib_text(tasks.CHARS_TRAIN_FILES)))
    assert windows.shape == (128, 65)
    assert all(heldout.find(_ids_bytes(w)) >= 0 for w in windows)
    # 65-character windows of other files: a few lines of boilerplate may recur, the text does not
    seen_in_train = sum(train.find(_ids_bytes(w)) >= 0 for w in windows)
    assert seen_in_train <= len(windows) // 10
    assert task.info["heldout_chars"] == len(heldout) and task.info["train_chars"] == len(train)


def test_chars_unigram_loss_is_the_entropy_of_the_held_out_characters():
    task = tasks.make_task("chars", {}, seed=0)
    heldout = tasks.encode_bytes(tasks.stdlib_text(tasks.CHARS_HELDOUT_FILES)).tolist()
    n = len(heldout)
    counts = {c: heldout.count(c) for c in set(heldout)}
    entropy = -sum(k / n * math.log(k / n) for k in counts.values())
    assert task.info["unigram_loss"] == pytest.approx(entropy, rel=1e-12)
    assert task.info["chance_loss"] == math.log(97)


def test_a_trimmed_python_is_an_error_naming_the_missing_file(tmp_path, monkeypatch, capsys):
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in tasks.CHARS_TRAIN_FILES + tasks.CHARS_HELDOUT_FILES:
        if name != "graphlib.py":
            shutil.copy(STDLIB / name, lib / name)
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(lib)})
    with pytest.raises(ConfigError, match=r"chars task: cannot read .*graphlib\.py"):
        tasks.make_task("chars", {}, seed=0)
    assert main(["validate", str(CONFIGS / "chars_clipping.yaml")]) == 1
    assert "graphlib.py" in capsys.readouterr().err


@pytest.mark.parametrize("name, options, message", [
    ("chars", {"d_model": 30, "nhead": 4}, r"chars task: d_model \(30\) must be divisible by nhead \(4\)"),
    ("chars", {"layers": 0}, r"task 'chars': option 'layers' must be an integer in 1\.\.1024, got 0"),
    ("chars", {"seq_len": 10**6}, r"task 'chars': option 'seq_len' must be an integer in 2\.\.16384, got 1000000"),
    ("chars", {"eval_size": 0}, r"task 'chars': option 'eval_size' must be an integer in 1\.\.1048576, got 0"),
    ("transformer", {"d_model": 30, "nhead": 4}, r"transformer task: d_model \(30\) must be divisible by nhead \(4\)"),
    ("digits", {"hidden": 0}, r"task 'digits': option 'hidden' must be an integer in 1\.\.65536, got 0"),
])
def test_bad_sizes_are_errors_naming_the_option(name, options, message):
    if name == "digits":
        pytest.importorskip("sklearn")
    with pytest.raises(ConfigError, match=message):
        tasks.make_task(name, options, seed=0)


# --- digits: the data ------------------------------------------------------------------------
def test_digits_split_is_every_fifth_image_and_disjoint():
    train, test = tasks.digits_split(1797)
    assert len(train) == 1438 and len(test) == 359
    assert test[:3].tolist() == [4, 9, 14] and all(i % 5 == 4 for i in test.tolist())
    assert sorted(train.tolist() + test.tolist()) == list(range(1797))


def test_digits_data_and_batches():
    pytest.importorskip("sklearn")
    x, y = tasks.load_digits_arrays()
    assert x.shape == (1797, 64) and y.shape == (1797,)
    assert float(x.min()) == 0.0 and float(x.max()) == 1.0 and sorted(set(y.tolist())) == list(range(10))
    a, b = tasks.make_task("digits", {}, seed=0), tasks.make_task("digits", {}, seed=0)
    (xa, ya), (xb, yb) = a.get_batch(4, 16), b.get_batch(4, 16)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(xa, a.get_batch(5, 16)[0])
    assert not torch.equal(xa, tasks.make_task("digits", {}, seed=1).get_batch(4, 16)[0])
    train_idx, _ = tasks.digits_split(len(y))
    train_rows = {tuple(r) for r in x[train_idx].tolist()}
    assert all(tuple(r) in train_rows for r in xa.tolist())  # batches come from the training images


def test_missing_scikit_learn_is_an_error_saying_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # `import sklearn...` now raises ImportError
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(ConfigError, match=r"digits task: needs scikit-learn.*pip install scikit-learn"):
        tasks.make_task("digits", {}, seed=0)
    assert main(["validate", str(CONFIGS / "digits_clipping.yaml")]) == 1
    err = capsys.readouterr().err
    assert "pip install scikit-learn" in err and "Traceback" not in err


# --- both learn: a short `modopt run` of the example configs ----------------------------------
def _run(tmp_path: Path, config: str, variant: str, steps: int) -> dict:
    out = tmp_path / variant
    args = ["run", str(CONFIGS / config), "--variant", variant, "--steps", str(steps), "--out", str(out), "--quiet", "--no-plots"]
    assert main(args) == 0
    return json.loads((out / "summary.json").read_text())


def test_chars_learns_well_below_chance_and_below_the_unigram_loss(tmp_path):
    s = _run(tmp_path, "chars_clipping.yaml", "zclip", 150)
    info = tasks.make_task("chars", {}, seed=0).info
    assert s["final_eval_loss"] < 0.8 * math.log(tasks.CHARS_VOCAB)
    assert s["final_eval_loss"] < info["unigram_loss"] - 0.3  # it uses context, not only character frequencies


def test_digits_learns_well_below_chance(tmp_path):
    pytest.importorskip("sklearn")
    s = _run(tmp_path, "digits_clipping.yaml", "clipnorm", 150)
    assert s["final_eval_loss"] < 0.5 * math.log(10)
    task = tasks.make_task("digits", {"hidden": 64, "depth": 2}, seed=0)
    task.model.load_state_dict(torch.load(tmp_path / "clipnorm" / "checkpoint.pt", weights_only=True)["model"])
    assert task.info["accuracy"](task.model) > 0.85
    assert task.eval_fn(task.model).item() == pytest.approx(s["final_eval_loss"], rel=1e-6)
