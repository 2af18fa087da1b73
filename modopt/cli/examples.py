"""Example configs shipped with modopt, addressed by name: `modopt run transformer_zclip`.

The configs are the source tree's `examples/configs/*.yaml`. A wheel carries every
one of them as `modopt/examples/<name>.yaml` (the wheel target's `only-include` and
`sources` in `pyproject.toml`); a source checkout and its editable install read them
where they are. `find_config` is the one place a config argument of `run`, `compare` and
`validate` is turned into a file: a path that exists is that file, whatever its
name; otherwise a bare name (no directory, no suffix or `.yaml`/`.yml`) is the
shipped example of that name; anything else stays the path it is (and reading it
reports the missing file).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..config import ConfigError, read_file
from ..core.transform import did_you_mean
from .modules import plain_text

_PACKAGE = Path(__file__).resolve().parents[1]
#: where an installed wheel has the example configs
INSTALLED = _PACKAGE / "examples"
#: where a source checkout (or an editable install of one) has them
CHECKOUT = _PACKAGE.parent / "examples" / "configs"
SUFFIXES = (".yaml", ".yml")


def examples_dir() -> Path | None:
    """The directory of the example configs in this installation (wheel first, then checkout), or None."""
    for folder in (INSTALLED, CHECKOUT):
        if folder.is_dir():
            return folder
    return None


def shipped() -> dict[str, Path]:
    """`{name: file}` for every example config (a file's name is its stem), sorted by name."""
    folder = examples_dir()
    if folder is None:
        return {}
    return {p.stem: p for p in sorted(folder.iterdir()) if p.suffix in SUFFIXES and p.is_file()}


def _as_name(text: str) -> str | None:
    """The example name `text` can stand for (`x` or `x.yaml` -> `x`), or None when it has a directory
    part or another suffix."""
    seps = {"/", os.sep, os.altsep} - {None}
    if not text or any(s in text for s in seps):
        return None
    p = Path(text)
    if p.suffix in SUFFIXES:
        return p.stem
    return text if p.suffix == "" else None


def find_config(path: str | Path) -> Path:
    """The file a config argument means: the path when it exists, else the shipped example of that name.

    An unknown name is a `ConfigError` that lists the shipped names; a path with a
    directory part or another suffix is returned as it is (reading it says it is missing).
    """
    given = Path(path)
    name = _as_name(str(path))
    if given.exists() or name is None:
        return given
    examples = shipped()
    if name in examples:
        return examples[name]
    listed = ", ".join(examples) if examples else "none in this installation"
    raise ConfigError(
        f"{path}: no such file, and no example config is named {name!r}{did_you_mean(name, examples)}; "
        f"the examples (modopt examples): {listed}"
    )


def describe(path: Path) -> str:
    """One line about an example config: the first sentence of its leading comment, else its `name` field."""
    words: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        text = line.strip()
        if not text.startswith("#"):
            break
        words += text.lstrip("#").split()
    comment = " ".join(words)
    if comment:
        sentence = re.match(r"(.*?[.!?])(\s|$)", comment)
        return plain_text(sentence.group(1) if sentence else comment)
    data = read_file(path)
    name = data.get("name") if isinstance(data, dict) else None
    return f"experiment {name!r}" if name else "(no description)"


def format_examples() -> str:
    """What `modopt examples` prints: every shipped example's name and one line about it."""
    examples = shipped()
    if not examples:
        return "no example configs in this installation (a source checkout has them in examples/configs)"
    width = max(len(n) for n in examples)
    lines = [f"{name.ljust(width)}  {describe(path)}" for name, path in examples.items()]
    lines += [
        "",
        "run one: modopt run NAME; compare: modopt compare NAME NAME ...; "
        "its file: modopt examples NAME > my.yaml",
        f"(files in {examples_dir()})",
    ]
    return "\n".join(lines)


def example_text(name: str) -> str:
    """The text of the shipped example `name` (to copy and edit); an unknown name lists the known ones."""
    examples = shipped()
    key = _as_name(name)
    if key not in examples:
        listed = ", ".join(examples) if examples else "none in this installation"
        raise ConfigError(f"no example config is named {name!r}{did_you_mean(key or name, examples)}; the examples: {listed}")
    return examples[key].read_text(encoding="utf-8")
