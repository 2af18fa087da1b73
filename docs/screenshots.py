"""Build the docs site and take headless-Chromium screenshots of its key pages.

    python docs/screenshots.py [OUT_DIR]       # default /tmp/modopt-screenshots

Needs mkdocs (the `docs` extra) and Debian's `chromium` (`apt-get install -y chromium`). The
browser gets no network (every host name fails to resolve), so the pictures show the site as it
reads offline. Excluded from the site in mkdocs.yml; look at the PNGs it writes (they are not
committed).
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
    "api-zclip": "transforms/ZClip/index.html",
    "api-masked": "transforms/Masked/index.html",
    "all-transforms": "modules/index.html",
    "module-statistical": "modules/statistical/index.html",
    "module-growth": "modules/growth/index.html",
    "cli": "cli/index.html",
    "contributing": "contributing/index.html",
    "howto-compile": "howto/compile/index.html",
    "performance": "performance/index.html",
}
#: the browser window: a laptop's width, and tall enough to show a page's first screens
WIDTH, HEIGHT = 1400, 2400


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
                            # no network: what does not load from the built folder is missing from the picture
                            "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
                            f"--window-size={WIDTH},{HEIGHT}", f"--screenshot={png}", path.as_uri()],
                           check=True, capture_output=True, timeout=120)
            print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
