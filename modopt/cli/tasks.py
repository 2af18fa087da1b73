"""Built-in training tasks for `modopt run`: data generated in process, or files that Python
(`chars`) or scikit-learn (`digits`) already ship; nothing is downloaded.

A task is what `make_task()` returns: a `Task` holding the model, a
function giving the training batch of a step, and the loss. Batches are a pure
function of `(seed, step)`, so a resumed run sees exactly the data an
uninterrupted one would.

User tasks are named by import path (`mypkg.tasks:make_task`); the callable is
called as `make_task(seed=seed, **options)` and must return a `Task`
(or any object with the same attributes). Importing user code runs it, so the
command line allows it only with `--trust-imports`.
"""

from __future__ import annotations

import importlib
import math
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..config import ConfigError


@dataclass
class Task:
    """A training problem.

    * `model`: the `nn.Module` to train (built after `torch.manual_seed(seed)`).
    * `get_batch(step, batch_size)`: the training batch of `step` (1-based);
      must depend only on the seed and its arguments.
    * `loss_fn(model, batch)`: a scalar loss tensor.
    * `eval_fn(model)`: optional, a float tensor: the loss on fixed held-out data.
    """

    model: nn.Module
    get_batch: Callable[[int, int], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    eval_fn: Callable[[nn.Module], torch.Tensor] | None = None
    info: dict[str, Any] = field(default_factory=dict)


def _gen(seed: int, *salt: int) -> torch.Generator:
    """A generator seeded by `seed` and a salt (a stream per purpose and per step)."""
    g = torch.Generator()
    h = seed & 0xFFFFFFFF
    for s in salt:
        h = (h * 1_000_003 + s + 0x9E3779B9) % (2**63 - 1)
    g.manual_seed(h)
    return g


# --- teacher-student regression with heavy-tailed noise ------------------------------
class MLP(nn.Module):
    """A fully connected network: `depth` linear layers (`d_in -> hidden -> ... -> d_out`) with tanh between them."""

    def __init__(self, d_in: int, hidden: int, d_out: int, depth: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = d_in
        for _ in range(depth - 1):
            layers += [nn.Linear(d, hidden), nn.Tanh()]
            d = hidden
        layers.append(nn.Linear(d, d_out))
        self.net: nn.Sequential = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The network's output for the batch `x`."""
        return self.net(x)


def teacher_student(
    seed: int,
    dim: int = 16,
    hidden: int = 64,
    teacher_hidden: int = 32,
    noise_df: float = 1.5,
    noise_scale: float = 0.1,
    eval_size: int = 1024,
) -> Task:
    """Regress a random teacher MLP with a student MLP; targets carry Student-t noise.

    With `noise_df` small (1.5: finite mean, infinite variance) most batches
    are clean and a few hold huge outliers: the gradient norm spikes by orders
    of magnitude, the setting where norm clipping matters. The eval loss is the
    mean squared error against the noise-free teacher on a fixed batch.
    """
    g_teacher = _gen(seed, 1)
    teacher = MLP(dim, teacher_hidden, 1)
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g_teacher) / math.sqrt(max(1, p.shape[-1])))
    teacher.requires_grad_(False)
    model = MLP(dim, hidden, 1)
    def get_batch(step: int, batch_size: int):
        g = _gen(seed, 2, step)
        x = torch.randn(batch_size, dim, generator=g)
        noise = _student_t((batch_size, 1), noise_df, int(torch.randint(0, 2**62, (), generator=g)))
        with torch.no_grad():
            y = teacher(x) + noise_scale * noise
        return x, y

    ge = _gen(seed, 3)
    x_eval = torch.randn(eval_size, dim, generator=ge)
    with torch.no_grad():
        y_eval = teacher(x_eval)

    def loss_fn(m: nn.Module, batch):
        x, y = batch
        return nn.functional.mse_loss(m(x), y)

    def eval_fn(m: nn.Module):
        with torch.no_grad():
            return nn.functional.mse_loss(m(x_eval), y_eval)

    return Task(model, get_batch, loss_fn, eval_fn, {"noise": f"Student-t(df={noise_df}) x {noise_scale}"})


def _student_t(shape: tuple[int, ...], df: float, seed: int) -> torch.Tensor:
    """Student-t samples drawn from a private RNG stream (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.distributions.StudentT(df).sample(shape)


# --- a tiny transformer on a synthetic sequence task -------------------------------------
def _check_transformer_sizes(task: str, d_model: int, nhead: int, layers: int, ff: int) -> None:
    """Refuse sizes `TinyTransformer` cannot be built with, naming the option (torch would assert)."""
    for name, value in (("d_model", d_model), ("nhead", nhead), ("layers", layers), ("ff", ff)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{task} task: {name} must be an integer >= 1, got {value!r}")
    if d_model % nhead:
        raise ConfigError(f"{task} task: d_model ({d_model}) must be divisible by nhead ({nhead})")


class TinyTransformer(nn.Module):
    """Token + position embeddings, a causal `nn.TransformerEncoder`, a linear head."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, nhead: int, layers: int, ff: int):
        super().__init__()
        self.embed: nn.Embedding = nn.Embedding(vocab, d_model)
        self.pos: nn.Parameter = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, nhead, ff, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder: nn.TransformerEncoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm: nn.LayerNorm = nn.LayerNorm(d_model)
        self.head: nn.Linear = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits for every position of `tokens` (batch, length), causally masked."""
        n = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:n]
        h = self.encoder(h, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(h))


def transformer(
    seed: int,
    vocab: int = 16,
    seq_len: int = 24,
    d_model: int = 32,
    nhead: int = 2,
    layers: int = 2,
    ff: int = 64,
    noise: float = 0.0,
    eval_size: int = 256,
) -> Task:
    """Next-token prediction on a copy task with a tiny causal transformer.

    Each sequence is `seq_len // 2` random tokens followed by the same tokens
    again; the loss is the cross-entropy on the predictable second half (the
    first half is noise, not scored). With `noise > 0` each token of the second
    half is replaced by a random one with that probability, so the loss has a
    floor above zero and the gradients stay noisy. Solving it needs an attention head that
    looks back `seq_len // 2` positions, learnt in a sharp transition: at an
    aggressive learning rate training shows loss spikes.
    """
    if seq_len < 4 or seq_len % 2:
        raise ConfigError(f"transformer task: seq_len must be even and >= 4, got {seq_len}")
    _check_transformer_sizes("transformer", d_model, nhead, layers, ff)
    model = TinyTransformer(vocab, seq_len, d_model, nhead, layers, ff)
    half = seq_len // 2

    if not 0.0 <= noise <= 1.0:
        raise ConfigError(f"transformer task: noise must be in [0, 1], got {noise}")

    def sample(g: torch.Generator, n: int) -> torch.Tensor:
        first = torch.randint(0, vocab, (n, half), generator=g)
        second = first.clone()
        if noise > 0:
            flip = torch.rand(n, half, generator=g) < noise
            second = torch.where(flip, torch.randint(0, vocab, (n, half), generator=g), second)
        return torch.cat([first, second], dim=1)

    def get_batch(step: int, batch_size: int):
        return sample(_gen(seed, 2, step), batch_size)

    x_eval = sample(_gen(seed, 3), eval_size)

    def loss_fn(m: nn.Module, seq: torch.Tensor) -> torch.Tensor:
        logits = m(seq[:, :-1])[:, half - 1 :]
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), seq[:, half:].reshape(-1))

    def eval_fn(m: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return loss_fn(m, x_eval)

    return Task(model, get_batch, loss_fn, eval_fn, {"chance_loss": math.log(vocab)})


# --- real text: a character-level language model on the standard library's source ------
#: the text of the `chars` task: pure-Python modules of the standard library that CPython
#: 3.10-3.13 all ship (their text differs a little between versions); read from
#: `sysconfig.get_paths()["stdlib"]`. Whole files are held out for evaluation.
CHARS_TRAIN_FILES = (
    "argparse.py", "bisect.py", "calendar.py", "copy.py", "csv.py", "difflib.py", "fnmatch.py", "fractions.py",
    "glob.py", "heapq.py", "numbers.py", "pprint.py", "queue.py", "sched.py", "shlex.py", "textwrap.py",
)
CHARS_HELDOUT_FILES = ("colorsys.py", "graphlib.py", "reprlib.py", "statistics.py")
#: id 0 is the newline, ids 1-95 the printable ASCII bytes 32-126 (space to `~`), id 96 every
#: other byte (tab, carriage return, each byte of a non-ASCII UTF-8 character)
CHARS_VOCAB = 97
CHARS_OTHER = CHARS_VOCAB - 1


def encode_bytes(data: bytes) -> torch.Tensor:
    """Token ids (int64) of raw bytes in the `chars` vocabulary (`CHARS_VOCAB`)."""
    table = torch.full((256,), CHARS_OTHER, dtype=torch.int64)
    table[10] = 0
    table[32:127] = torch.arange(1, 96)
    if not data:
        return torch.zeros(0, dtype=torch.int64)
    return table[torch.frombuffer(bytearray(data), dtype=torch.uint8).long()]


def decode_ids(ids: Any) -> str:
    """The text of token ids (`CHARS_OTHER` shown as U+FFFD); the inverse of `encode_bytes` on printable ASCII."""
    return "".join("\n" if i == 0 else chr(i + 31) if 0 < i < CHARS_OTHER else "\ufffd" for i in map(int, ids))


def stdlib_text(files: tuple[str, ...]) -> bytes:
    """The concatenated bytes of standard-library `files`; a missing one is a `ConfigError` naming it."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in files:
        path = root / name
        try:
            parts.append(path.read_bytes())
        except OSError as e:
            raise ConfigError(
                f"chars task: cannot read {path} ({e.strerror or type(e).__name__}): the task trains on the "
                "standard library's own source files, and this Python's installation lacks this one"
            ) from None
    return b"".join(parts)


def chars(
    seed: int,
    seq_len: int = 64,
    d_model: int = 64,
    nhead: int = 4,
    layers: int = 2,
    ff: int = 128,
    eval_size: int = 128,
) -> Task:
    """Next-character prediction on the standard library's own source code (real text, no download).

    The training text is `CHARS_TRAIN_FILES` concatenated, the held-out text
    `CHARS_HELDOUT_FILES` (whole files, never trained on). A batch is
    `batch_size` windows of `seq_len + 1` characters at random offsets of the
    training text, drawn from a generator seeded by `(seed, step)`; the loss is
    the mean cross-entropy of predicting characters 2..seq_len+1 of each
    window from the ones before it, with the `TinyTransformer` (causal). The
    eval loss is the same on `eval_size` fixed windows evenly spaced over the
    held-out text (the same for every seed). Chance level is
    `ln(CHARS_VOCAB)` = 4.57; `info["unigram_loss"]` is the entropy of the
    held-out character frequencies, what a model that ignores context gets.
    """
    if seq_len < 2:
        raise ConfigError(f"chars task: seq_len must be >= 2, got {seq_len}")
    if eval_size < 1:
        raise ConfigError(f"chars task: eval_size must be >= 1, got {eval_size}")
    _check_transformer_sizes("chars", d_model, nhead, layers, ff)
    train = encode_bytes(stdlib_text(CHARS_TRAIN_FILES))
    heldout = encode_bytes(stdlib_text(CHARS_HELDOUT_FILES))
    if seq_len >= len(heldout):
        raise ConfigError(f"chars task: seq_len ({seq_len}) must be shorter than the held-out text ({len(heldout)} characters)")
    span = torch.arange(seq_len + 1)
    model = TinyTransformer(CHARS_VOCAB, seq_len, d_model, nhead, layers, ff)

    def get_batch(step: int, batch_size: int) -> torch.Tensor:
        starts = torch.randint(0, len(train) - seq_len, (batch_size,), generator=_gen(seed, 2, step))
        return train[starts[:, None] + span]

    eval_starts = torch.linspace(0, len(heldout) - seq_len - 1, eval_size).long()
    x_eval = heldout[eval_starts[:, None] + span]

    def loss_fn(m: nn.Module, seq: torch.Tensor) -> torch.Tensor:
        logits = m(seq[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, CHARS_VOCAB), seq[:, 1:].reshape(-1))

    def eval_fn(m: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return loss_fn(m, x_eval)

    freq = torch.bincount(heldout, minlength=CHARS_VOCAB).double() / len(heldout)
    unigram = float(-(freq[freq > 0] * freq[freq > 0].log()).sum())
    info = {
        "chance_loss": math.log(CHARS_VOCAB), "unigram_loss": unigram,
        "train_chars": len(train), "heldout_chars": len(heldout), "eval_windows": x_eval,
    }
    return Task(model, get_batch, loss_fn, eval_fn, info)


# --- real images: scikit-learn's bundled handwritten digits (optional extra) -----------
#: image `i` of `load_digits()` (in its order) is a test image when `i % DIGITS_TEST_EVERY == DIGITS_TEST_EVERY - 1`
DIGITS_TEST_EVERY = 5


def _install_hint(package: str, extra: str) -> str:
    """`pip install <package>` and, when modopt is installed as a distribution, its extra by name."""
    try:
        from importlib.metadata import packages_distributions

        dists = packages_distributions().get(__name__.split(".")[0], [])
    except Exception:  # pragma: no cover - metadata unreadable: the generic hint is enough
        dists = []
    hint = f"pip install {package}"
    if dists:
        hint += f' (or the extra: pip install "{dists[0]}[{extra}]")'
    return hint


def load_digits_arrays() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's `load_digits()` as `(x, y)`: 1797 x 64 float32 pixels in [0, 1] (the 0-16 counts / 16), int64 labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError(
            "digits task: needs scikit-learn, which is not installed (its load_digits() data ships with it, "
            f"nothing is downloaded): {_install_hint('scikit-learn', 'digits')}"
        ) from None
    d = load_digits()
    x = torch.as_tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.as_tensor(d.target, dtype=torch.int64)
    return x, y


def digits_split(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and test indices of `n` images: every `DIGITS_TEST_EVERY`-th image (index 4, 9, 14, ...) is a test image."""
    idx = torch.arange(n)
    test = idx % DIGITS_TEST_EVERY == DIGITS_TEST_EVERY - 1
    return idx[~test], idx[test]


def digits(seed: int, hidden: int = 64, depth: int = 2) -> Task:
    """Classify scikit-learn's 8x8 handwritten digits (`load_digits`: 1797 images, 10 classes) with an MLP.

    Pixels are scaled to [0, 1]; the split is fixed (`digits_split`: 1438
    train, 359 test images). A batch is `batch_size` training images drawn with
    replacement by a generator seeded by `(seed, step)`; the loss is the
    cross-entropy. The eval loss is the cross-entropy on the whole test set;
    `info["accuracy"](model)` gives the test accuracy. Chance level is
    `ln(10)` = 2.30. Needs scikit-learn (`pip install scikit-learn`).
    """
    if hidden < 1 or depth < 1:
        raise ConfigError(f"digits task: hidden and depth must be >= 1, got hidden={hidden}, depth={depth}")
    x, y = load_digits_arrays()
    train_idx, test_idx = digits_split(len(y))
    x_train, y_train, x_test, y_test = x[train_idx], y[train_idx], x[test_idx], y[test_idx]
    model = MLP(x.shape[1], hidden, 10, depth)

    def get_batch(step: int, batch_size: int):
        i = torch.randint(0, len(y_train), (batch_size,), generator=_gen(seed, 2, step))
        return x_train[i], y_train[i]

    def loss_fn(m: nn.Module, batch) -> torch.Tensor:
        xb, yb = batch
        return nn.functional.cross_entropy(m(xb), yb)

    def eval_fn(m: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return loss_fn(m, (x_test, y_test))

    def accuracy(m: nn.Module) -> float:
        with torch.no_grad():
            return float((m(x_test).argmax(dim=1) == y_test).double().mean())

    info = {"chance_loss": math.log(10), "train_images": len(train_idx), "test_images": len(test_idx), "accuracy": accuracy}
    return Task(model, get_batch, loss_fn, eval_fn, info)


BUILTIN: dict[str, Callable[..., Task]] = {
    "chars": chars,
    "digits": digits,
    "teacher_student": teacher_student,
    "transformer": transformer,
}


def _did_you_mean(name: str, candidates) -> str:
    from ..core.transform import did_you_mean

    return did_you_mean(name, candidates)


def task_options(fn: Callable[..., Any]) -> tuple[dict[str, Any], bool]:
    """The options a task function takes (`{name: default}`, `seed` excluded) and whether it takes `**kwargs`."""
    import inspect

    sig = inspect.signature(fn)
    opts = {
        n: (None if p.default is inspect.Parameter.empty else p.default)
        for n, p in sig.parameters.items()
        if n != "seed" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    return opts, any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


#: the widest layer, longest sequence, largest vocabulary or held-out set a built-in task is built with: every
#: tensor a task makes then has at most 2**36 elements, far inside torch's 64-bit sizes (past them torch
#: fails with an internal error, not a message about the option). Within them, `check_footprint` refuses a
#: model that cannot fit this machine's memory; the sequence bound keeps the causal mask (seq_len**2 floats)
#: at 1 GiB
WIDTH_MAX = 2**16
LAYERS_MAX = 1024
SEQ_MAX = 2**14
VOCAB_MAX = 2**20
EVAL_MAX = 2**20

#: each built-in task's options: `(kind, low, high)` ("int" or "number", both ends included)
OPTION_RULES: dict[str, dict[str, tuple[str, float, float]]] = {
    "teacher_student": {"dim": ("int", 1, WIDTH_MAX), "hidden": ("int", 1, WIDTH_MAX),
                        "teacher_hidden": ("int", 1, WIDTH_MAX), "noise_df": ("number", 1e-6, 1e6),
                        "noise_scale": ("number", 0.0, 1e6), "eval_size": ("int", 1, EVAL_MAX)},
    "transformer": {"vocab": ("int", 1, VOCAB_MAX), "seq_len": ("int", 4, SEQ_MAX), "d_model": ("int", 1, WIDTH_MAX),
                    "nhead": ("int", 1, WIDTH_MAX), "layers": ("int", 1, LAYERS_MAX), "ff": ("int", 1, WIDTH_MAX),
                    "noise": ("number", 0.0, 1.0), "eval_size": ("int", 1, EVAL_MAX)},
    "chars": {"seq_len": ("int", 2, SEQ_MAX), "d_model": ("int", 1, WIDTH_MAX), "nhead": ("int", 1, WIDTH_MAX),
              "layers": ("int", 1, LAYERS_MAX), "ff": ("int", 1, WIDTH_MAX), "eval_size": ("int", 1, EVAL_MAX)},
    "digits": {"hidden": ("int", 1, WIDTH_MAX), "depth": ("int", 1, LAYERS_MAX)},
}


def check_values(name: str, options: dict[str, Any]) -> None:
    """Refuse a built-in task's option of the wrong type or out of its range (`OPTION_RULES`), naming it."""
    for opt, value in options.items():
        rule = OPTION_RULES.get(name, {}).get(opt)
        if rule is None:
            continue
        kind, lo, hi = rule
        typed = isinstance(value, int) or (kind == "number" and isinstance(value, float) and not math.isnan(value))
        ok = typed and not isinstance(value, bool) and lo <= value <= hi  # (an inf is out of every range)
        if not ok:
            what = f"an integer in {lo}..{hi}" if kind == "int" else f"a number in [{lo:g}, {hi:g}]"
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            raise ConfigError(f"task {name!r}: option {opt!r} must be {what}, got {shown}")


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _mlp_params(d_in: int, hidden: int, d_out: int, depth: int = 2) -> int:
    if depth == 1:
        return d_in * d_out + d_out
    return d_in * hidden + hidden + (depth - 2) * (hidden * hidden + hidden) + hidden * d_out + d_out


def _transformer_params(vocab: int, seq_len: int, d_model: int, layers: int, ff: int) -> int:
    d = d_model
    layer = (3 * d * d + 3 * d) + (d * d + d) + (d * ff + ff) + (ff * d + d) + 4 * d  # attention, feed-forward, 2 norms
    return vocab * d + seq_len * d + layers * layer + 2 * d + d * vocab + vocab


def footprint(name: str, options: dict[str, Any]) -> tuple[int, int]:
    """`(parameters, other bytes)` of a built-in task built with `options` (checked by `check_values`), without
    building it: the trained model's parameter count (float32), and the bytes of everything else it holds
    that grows with the options (a teacher model, the attention mask, held-out data)."""
    known, _ = task_options(BUILTIN[name])
    o = {**known, **options}
    if name == "teacher_student":
        teacher = _mlp_params(o["dim"], o["teacher_hidden"], 1)
        return _mlp_params(o["dim"], o["hidden"], 1), 4 * teacher + 4 * o["eval_size"] * (o["dim"] + 1)
    if name == "digits":
        return _mlp_params(64, o["hidden"], 10, o["depth"]), 0
    vocab = o.get("vocab", CHARS_VOCAB)
    params = _transformer_params(vocab, o["seq_len"], o["d_model"], o["layers"], o["ff"])
    return params, 4 * o["seq_len"] ** 2 + 8 * o["eval_size"] * (o["seq_len"] + 1)  # the causal mask, held-out tokens


def check_footprint(name: str, options: dict[str, Any]) -> None:
    """Refuse a built-in task whose parameters, their gradients and held-out data alone (`footprint`: the
    least any run of it holds) are more than this machine's memory, before anything is allocated."""
    memory = machine_memory()
    if memory is None:
        return
    params, other = footprint(name, options)
    need = 2 * 4 * params + other
    if need > memory:
        given = ", ".join(f"{k}={v!r}" for k, v in options.items()) or "the defaults"
        raise ConfigError(f"task {name!r} ({given}): its {params} parameters, their gradients and its held-out data "
                          f"take {need} bytes, more than this machine's memory ({memory} bytes); make the "
                          "task.options smaller")


def check_options(name: str, fn: Callable[..., Any], options: dict[str, Any]) -> None:
    """Refuse options the task function does not take, naming the ones it does; a built-in task's
    values are checked against their ranges (`check_values`)."""
    try:
        known, any_kw = task_options(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin, a C callable): the call decides
        return
    bad = sorted(set(options) - set(known))
    if bad and not any_kw:
        raise ConfigError(
            f"task {name!r} has no option {bad[0]!r}{_did_you_mean(bad[0], known)}"
            + (f" (nor {', '.join(map(repr, bad[1:]))})" if len(bad) > 1 else "")
            + f"; its options: {', '.join(f'{k}={v!r}' for k, v in known.items()) or 'none'}"
        )
    if fn is BUILTIN.get(name):
        check_values(name, options)


def check_task(name: str, options: dict[str, Any]) -> None:
    """What can be checked without running user code: a built-in name and its options, or an import path's form."""
    if name in BUILTIN:
        check_options(name, BUILTIN[name], options)
        return
    if ":" in name:
        module_name, _, attr = name.partition(":")
        if not module_name or not attr.isidentifier():
            raise ConfigError(f"task {name!r}: an import path is 'package.module:function'")
        return
    raise ConfigError(
        f"unknown task {name!r}{_did_you_mean(name, BUILTIN)}; built-in tasks: {', '.join(sorted(BUILTIN))} "
        "(or an import path 'package.module:function' with --trust-imports)"
    )


def make_task(name: str, options: dict[str, Any], seed: int, trust_imports: bool = False) -> Task:
    """Build the task `name` (a built-in name, or `package.module:function` with `trust_imports`)."""
    check_task(name, options)
    if name in BUILTIN:
        fn = BUILTIN[name]
        check_footprint(name, options)
    elif ":" in name:
        if not trust_imports:
            raise PermissionError(
                f"task {name!r} is an import path: loading it runs that module's code; "
                "pass --trust-imports to allow it"
            )
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"cannot load task {name!r}: {e}") from None
        if not callable(fn):
            raise ConfigError(f"task {name!r} is not callable")
        check_options(name, fn, options)
    else:  # pragma: no cover - check_task refused it
        raise ConfigError(f"unknown task {name!r}")
    try:
        task = fn(seed=seed, **options)
    except TypeError as e:
        raise ConfigError(f"task {name!r}: bad options {sorted(options)}: {e}") from None
    for attr in ("model", "get_batch", "loss_fn"):
        if not hasattr(task, attr):
            raise ConfigError(f"task {name!r} returned {type(task).__name__}, which has no {attr!r} (expected a Task)")
    return task
