"""Build the docs site and take headless-Chromium screenshots of its key pages.

    python docs/screenshots.py [OUT_DIR]       # default /tmp/modopt-screenshots

Needs mkdocs (the `docs` extra) and Debian's `chromium` (`apt-get install -y chromium`).
Excluded from the site in mkdocs.yml; look at the PNGs it writes.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PAGES = {
    "home": "index.html",
    "api": "api/index.html",
    "module-statistical": "modules/statistical/index.html",
    "module-growth": "modules/growth/index.html",
    "cli": "cli/index.html",
    "contributing": "contributing/index.html",
    "howto-compile": "howto/compile/index.html",
    "performance": "performance/index.html",
}


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent
    out = Path(argv[0] if argv else "/tmp/modopt-screenshots")
    out.mkdir(parents=True, exist_ok=True)
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        print("chromium not found: apt-get install -y chromium", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as site:
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", site], cwd=root, check=True)
        for name, page in PAGES.items():
            path = Path(site) / page
            if not path.exists():
                print(f"skipped {name}: {page} not built", file=sys.stderr)
                continue
            png = out / f"{name}.png"
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            "--disable-background-networking", "--disable-component-update", "--no-first-run",
                            "--window-size=1280,2400", f"--screenshot={png}", path.as_uri()],
                           check=True, capture_output=True, timeout=120)
            print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
