"""`modopt report PATH`: what a run, comparison or sweep says it came from (its provenance block), and the
tables of a comparison or sweep rebuilt from its JSON. (Apart from `report.py`, which writes report.html
and which `compare` imports: this reads `compare`'s tables.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any


# --- `modopt report PATH`: what a result says it came from -------------------------------------
#: the JSON result file of each kind of output directory
RESULT_FILES = {"compare": "compare.json", "sweep": "sweep.json", "run": "summary.json"}


def _read_json(path: Path) -> Any:
    """A result file's data; a file that does not read is a `ConfigError` naming it."""
    import json

    from ..config import ConfigError

    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: damaged (not UTF-8 text)") from None
    except ValueError as e:
        raise ConfigError(f"{path}: damaged (not valid JSON: {e})") from None
    except RecursionError:
        raise ConfigError(f"{path}: damaged (nested too deeply to be a result file)") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None


def _block_lines(where: str, data: Any) -> list[str]:
    """The provenance of `data` (a result's JSON) as indented lines, or a line saying it has none."""
    from .provenance import KEY, describe

    block = data.get(KEY) if isinstance(data, dict) else None
    if not isinstance(block, dict):
        return [f"provenance of {where}: none (written by a modopt that did not record one)"]
    return [f"provenance of {where}:"] + [f"  {line}" for line in describe(block)]


def _run_lines(run_dir: Path) -> list[str]:
    """A run directory: the provenance of `summary.json` and of `config.yaml`, and whether the config
    in `config.yaml` is the one the block hashed."""
    from ..config import ConfigError
    from .experiment import read_config
    from .provenance import KEY, config_sha256, from_yaml_comment

    lines: list[str] = []
    summary = run_dir / "summary.json"
    data = _read_json(summary) if summary.is_file() else None
    if data is None:
        lines.append(f"{summary}: missing (the run did not finish)")
    else:
        lines += _block_lines(str(summary), data)
    config = run_dir / "config.yaml"
    if not config.is_file():
        return lines + [f"{config}: missing"]
    try:
        text = config.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{config}: damaged (not UTF-8 text)") from None
    written = from_yaml_comment(text)
    lines += _block_lines(f"{config} (its opening comment)", {KEY: written} if written else None)
    recorded = {b.get("config_sha256") for b in (written, (data or {}).get(KEY) if isinstance(data, dict) else None)
                if isinstance(b, dict) and isinstance(b.get("config_sha256"), str)}
    if recorded:
        try:
            now = config_sha256(read_config(config))
        except (TypeError, ValueError) as e:  # (ConfigError is a ValueError; a YAML date does not hash as JSON)
            return lines + [f"{config}: its config does not read as modopt writes it, so its hash cannot be "
                            f"checked ({e})"]
        same = "matches the recorded hash: it is the config that ran" if now in recorded else (
            "differs from the recorded hash: the file was changed after the run")
        lines.append(f"{config}: its config hashes to {now}, which {same}")
    return lines


def _table_lines(kind: str, path: Path, data: Any) -> list[str]:
    """The tables of a compare or sweep, rebuilt from its JSON with the cells of this modopt."""
    from ..config import ConfigError
    from .compare import METRICS, TABLE, baseline_table, footnote, markdown, summary_cells, summary_table

    try:
        if kind == "compare":
            tables = [summary_table(data["runs"])]
            if data.get("baseline") is not None:
                tables.append(baseline_table(data["runs"], data["baseline"]))
        else:
            head = ["point", "seeds", *(METRICS[k][0] for k in TABLE)]
            tables = [(head, [[p["label"], str(len(p["seeds"])), *summary_cells(p["summary"], TABLE)]
                              for p in data["points"]])]
        return ["", *("\n\n".join(markdown(t) for t in tables).splitlines()), "",
                *footnote(data["spike"], data.get("baseline") if kind == "compare" else None).splitlines()]
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise ConfigError(f"{path}: damaged (not the {kind}.json modopt writes: {type(e).__name__} {e})") from None


def show(target: str | Path) -> str:
    """What `modopt report PATH` prints: the provenance of a run directory, a comparison's or a sweep's
    output directory, or one of their result files, and the tables of a comparison or sweep."""
    from ..config import ConfigError
    from .run import KIND_FILES

    path = Path(target)
    if not path.exists():
        raise ConfigError(f"{path}: no such file or directory")
    if path.is_dir():
        kind = next((k for k, marker in KIND_FILES.items() if k != "run" and (path / marker).is_file()), None)
        if kind is None:
            if not ((path / "summary.json").is_file() or (path / "config.yaml").is_file()):
                raise ConfigError(f"{path}: not an output directory of modopt (no compare.json, sweep.json, "
                                  "summary.json or config.yaml)")
            return "\n".join([f"{path}: a run of `modopt run`", *_run_lines(path)])
        file = path / RESULT_FILES[kind]
    elif path.name == "config.yaml" or path.name == "summary.json":
        return "\n".join([f"{path.parent}: a run of `modopt run`", *_run_lines(path.parent)])
    elif path.suffix == ".json":
        file = path
    else:
        raise ConfigError(f"{path}: not a result file modopt reads (give a run, compare or sweep directory, or its "
                          "summary.json, config.yaml, compare.json or sweep.json)")
    data = _read_json(file)
    kind = data.get("kind") if isinstance(data, dict) else None
    what = f"the output of `modopt {kind}`" if kind in ("compare", "sweep") else "a result file"
    lines = [f"{file.parent if path.is_dir() else file}: {what}", *_block_lines(str(file), data)]
    if kind in ("compare", "sweep"):
        lines += _table_lines(kind, file, data)
    return "\n".join(lines)


def printable(text: str) -> str:
    """`text` with every control character but the newline escaped (a result file's strings reach a terminal)."""
    return "".join(c if c == "\n" or c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
