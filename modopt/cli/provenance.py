"""The provenance block: what made a result file, so that the file can be cited and its run repeated.

`modopt run`, `compare` and `sweep` put the same block, built by `provenance()`,
into every result file they write: `summary.json`, `compare.json` and
`sweep.json` under the key `"provenance"`, `compare.md` and `sweep.md` as a
closing section, `report.html` in its head, and the run's `config.yaml` as a
YAML comment (an experiment refuses unknown keys, and a comment is ignored
when the file is read, so the saved config still runs and validates as it is).

The block: the modopt version and, when modopt is imported from a git
checkout, its commit (read from `.git` directly) and whether tracked files
differ from it (`git status`, bounded by a timeout; null when git cannot say);
the torch and Python versions and the operating system; the devices; the date
in UTC (ISO 8601); the command line (`sys.argv`); and the sha256 of the
canonical JSON (`canonical_json`) of the configuration the command resolved.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

#: the key of the block in the JSON result files
KEY = "provenance"
#: the fields of the block, in order
FIELDS = ("modopt", "commit", "dirty", "torch", "python", "os", "devices", "date", "argv", "config_sha256")
#: the comment line that opens the block in `config.yaml`; the block's YAML follows, each line behind `YAML_PREFIX`
YAML_MARK = "# provenance (written by modopt: a comment, ignored when this file is read)"
YAML_PREFIX = "#   "
#: seconds `git status` may take before the tree's state is left unknown (a slow network drive, a huge tree)
GIT_TIMEOUT_S = 5.0
#: the source checkout modopt is imported from, when it is one (modopt/cli/provenance.py -> the checkout)
CHECKOUT = Path(__file__).resolve().parents[2]

_HEX = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")  # a sha1 or sha256 object name


def canonical_json(data: Any) -> str:
    """The one text of `data` that its hash is taken over: keys sorted, no spaces, UTF-8 as is."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def config_sha256(config: Any) -> str:
    """The sha256 (hex) of `canonical_json(config)`."""
    return hashlib.sha256(canonical_json(config).encode("utf-8")).hexdigest()


# --- the commit --------------------------------------------------------------------------------
def _git_dir(root: Path) -> Path | None:
    """The git directory of the checkout at `root`: `.git`, or where a `.git` file points (a worktree)."""
    dot = root / ".git"
    if dot.is_dir():
        return dot
    if dot.is_file():
        text = dot.read_text(encoding="utf-8", errors="replace").strip()
        if text.startswith("gitdir:"):
            path = Path(text[len("gitdir:"):].strip())
            return path if path.is_absolute() else (root / path).resolve()
    return None


def _read_commit(gitdir: Path) -> str | None:
    """HEAD's commit, read from the files of `gitdir` (a loose ref, `packed-refs` or a detached HEAD)."""
    head = (gitdir / "HEAD").read_text(encoding="utf-8").strip()
    if _HEX.fullmatch(head):
        return head
    if not head.startswith("ref: "):
        return None
    ref = head[len("ref: "):].strip()
    if not ref.startswith("refs/") or ".." in ref.split("/"):
        return None
    common = gitdir
    if (gitdir / "commondir").is_file():  # a linked worktree keeps its branches in the main git directory
        common = (gitdir / (gitdir / "commondir").read_text(encoding="utf-8").strip()).resolve()
    for base in (gitdir, common):
        loose = base / ref
        if loose.is_file():
            sha = loose.read_text(encoding="utf-8").strip()
            return sha if _HEX.fullmatch(sha) else None
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text(encoding="utf-8").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref and _HEX.fullmatch(parts[0]):
                return parts[0]
    return None


def _git(root: Path, *args: str) -> str | None:
    """`git -C root ARGS`'s output, or None when git is missing, fails or takes over `GIT_TIMEOUT_S`.
    It neither takes the index lock nor runs a file-system monitor."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}
    try:
        done = subprocess.run(["git", "-C", str(root), "-c", "core.fsmonitor=false", *args], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              timeout=GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.decode("utf-8", "replace") if done.returncode == 0 else None


def commit(root: Path | None = None) -> tuple[str | None, bool | None]:
    """`(commit, dirty)` of the checkout at `root` (default `CHECKOUT`); `(None, None)` when it is not one.

    The commit is read from `.git` (`git rev-parse HEAD` when the files do not
    say); `dirty` is whether a tracked file differs from it (`git status`;
    untracked files do not count), None when git cannot tell.
    """
    root = CHECKOUT if root is None else root
    gitdir = _git_dir(root)
    if gitdir is None:
        return None, None
    try:
        sha = _read_commit(gitdir)
    except (OSError, UnicodeDecodeError):
        sha = None
    if sha is None:
        text = _git(root, "rev-parse", "HEAD")
        sha = text.strip() if text and _HEX.fullmatch(text.strip()) else None
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return sha, None if status is None else bool(status.strip())


# --- the machine -------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def cpu_name() -> str:
    """The CPU's model name (`/proc/cpuinfo` on Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def devices(used: Iterable[Any] = ()) -> list[str]:
    """One line per device: the CPU (always: it runs the loop) and every other device in `used`
    (torch devices, e.g. those a model's parameters are on); without `used`, the CUDA devices this
    process has already initialised (asking for others would start CUDA just to name them)."""
    import torch

    out = [f"cpu: {cpu_name()} ({cores()} cores available)"]
    kinds = {torch.device(d) for d in used}
    if not kinds and torch.cuda.is_initialized():
        kinds = {torch.device("cuda", i) for i in range(torch.cuda.device_count())}
    for d in sorted((d for d in kinds if d.type != "cpu"), key=str):
        if d.type == "cuda":
            index = d.index if d.index is not None else torch.cuda.current_device()
            out.append(f"cuda:{index}: {torch.cuda.get_device_name(index)} (CUDA {torch.version.cuda})")
        else:
            out.append(str(d))
    return out


# --- the block ---------------------------------------------------------------------------------
def provenance(config: Any = None, *, used: Iterable[Any] = (), argv: list[str] | None = None) -> dict[str, Any]:
    """The provenance block of a result file: `FIELDS`, in order.

    `config`: the configuration the command resolved, as plain JSON data (None:
    `config_sha256` is null); `used`: the devices the work ran on besides the CPU;
    `argv`: the command line (default `sys.argv`).
    """
    import torch

    from .. import __version__

    sha, dirty = commit()
    return {
        "modopt": str(__version__),
        "commit": sha,
        "dirty": dirty,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()} {platform.machine()}".strip(),
        "devices": devices(used),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": list(sys.argv if argv is None else argv),
        "config_sha256": None if config is None else config_sha256(config),
    }


def describe(block: dict[str, Any]) -> list[str]:
    """The block as lines a person reads (the report's head, `modopt report`)."""
    def get(key: str) -> Any:
        return block.get(key) if isinstance(block, dict) else None

    where = "not from a git checkout" if get("commit") is None else f"commit {get('commit')}"
    if get("commit") is not None:
        dirty = get("dirty")
        where += (", with uncommitted changes to tracked files" if dirty is True else ", clean" if dirty is False
                  else ", state unknown")
    argv = get("argv")
    command = shlex.join(map(str, argv)) if isinstance(argv, list) else argv
    devs = get("devices")
    return [
        f"modopt {get('modopt')} ({where})",
        f"torch {get('torch')}, Python {get('python')}, {get('os')}",
        "devices: " + ("; ".join(map(str, devs)) if isinstance(devs, list) else str(devs)),
        f"date: {get('date')} (UTC)",
        f"argv: {command}",
        f"config sha256: {get('config_sha256')}",
    ]


def markdown(block: dict[str, Any]) -> str:
    """The closing section of `compare.md` and `sweep.md`."""
    return "Provenance:\n\n" + "\n".join(f"- {line}" for line in describe(block))


def yaml_comment(block: dict[str, Any]) -> str:
    """The block as the comment that opens `config.yaml` (read back by `from_yaml_comment`)."""
    import yaml

    # (ASCII only: PyYAML escapes every other character, so no line break but "\n" is in the text)
    body = yaml.safe_dump(dict(block), sort_keys=False, allow_unicode=False, width=1 << 16, default_flow_style=None)
    return YAML_MARK + "\n" + "".join(YAML_PREFIX + line + "\n" for line in body.splitlines())


def from_yaml_comment(text: str) -> dict[str, Any] | None:
    """The block of a `config.yaml`'s opening comment, or None when it has none (or it does not read)."""
    import yaml

    from ..core.configfile import load_yaml

    lines = text.splitlines()
    if YAML_MARK not in lines:
        return None
    body = []
    for line in lines[lines.index(YAML_MARK) + 1:]:
        if not line.startswith(YAML_PREFIX):
            break
        body.append(line[len(YAML_PREFIX):])
    try:
        data = load_yaml("\n".join(body))
    except (yaml.YAMLError, ValueError):  # (a hand-edited comment: the file's config is what counts)
        return None
    return data if isinstance(data, dict) else None
