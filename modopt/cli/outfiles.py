"""The files and directories that `modopt run`, `compare` and `sweep` write under `--out`: never through a link.

A symbolic link already at a path the command writes (a file, a run
directory, any directory between `--out` and the file) would take the write
elsewhere: over the file it points to, or into a directory outside `--out`.
Each command lists the paths it will write and `refuse_links` refuses the first
link among them, naming it, before anything is written. Every writer then opens
its file with `open_out` (`O_NOFOLLOW`), so a link that appears later is refused
at the write instead of followed. `--out` itself may be a link: it is the
directory the user named.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import IO, Any, Iterable

from ..config import ConfigError

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def _link_error(path: Path, written: bool) -> ConfigError:
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    done = "" if written else "; nothing was written"
    return ConfigError(f"{path}: a symbolic link{target} where modopt writes its output; output goes only into "
                       f"plain files and directories under --out, never through a link (remove it, or give "
                       f"another --out){done}")


def refuse_links(root: Path, paths: Iterable[str | Path]) -> None:
    """Refuse (a `ConfigError` naming it) a symbolic link at `root / p` for any of `paths`, or at any
    directory between `root` and it. `root` itself is not checked. Missing paths are fine."""
    root = Path(root)
    seen: set[Path] = set()
    for rel in paths:
        here = root
        for part in Path(rel).parts:
            here = here / part
            if here in seen:
                continue
            seen.add(here)
            if here.is_symlink():
                raise _link_error(here, written=False)
            if not here.is_dir():
                break  # (nothing exists below a missing path or a file)


def open_out(path: Path, mode: str = "w", encoding: str | None = "utf-8") -> IO[Any]:
    """`open(path, mode)` for writing ("w", "a", "wb"), without following a link at `path`: a link
    there is a `ConfigError` naming it, and what it points to is left alone."""
    if not _NOFOLLOW and Path(path).is_symlink():  # (a system without O_NOFOLLOW)
        raise _link_error(Path(path), written=True)
    try:
        return open(path, mode, encoding=None if "b" in mode else encoding,
                    opener=lambda name, flags: os.open(name, flags | _NOFOLLOW, 0o666))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link_error(Path(path), written=True) from None
        raise


def write_text(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` through `open_out`."""
    with open_out(path, "w") as f:
        f.write(text)
