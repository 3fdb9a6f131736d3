"""Make ``docs/report.png``: the README's report example, rendered by headless Chromium.

    python docs/make_report_png.py                      # examples/clip.py:build, device=H200
    python docs/make_report_png.py --out /tmp/r.png --target tests/models.py:build --option max_lanes=1

It compiles the model with apollo from this checkout (:func:`apollo_compile.explain`), writes the
HTML page to a temporary directory and screenshots its first 1400 x 1000 pixels, so the picture
is always of what the current code plans. Chromium comes from ``apt-get install -y chromium``;
without it the script stops with that advice.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from apollo_compile.report.cli import explain_target, parse_option  # noqa: E402

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SIZE = (1400, 1000)


def find_chromium() -> str | None:
    """The Chromium binary on PATH, or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(html_path: Path, png_path: Path, size: tuple[int, int] = SIZE) -> None:
    """Render `html_path` in headless Chromium and write its first `size` pixels to `png_path`."""
    chromium = find_chromium()
    if chromium is None:
        raise SystemExit("make_report_png: Chromium is not installed (apt-get install -y chromium)")
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                               f"--screenshot={png_path}", f"--window-size={size[0]},{size[1]}",
                               html_path.resolve().as_uri()], capture_output=True, text=True, timeout=180)
    if proc.returncode != 0 or not png_path.exists():
        raise SystemExit(f"make_report_png: Chromium failed ({proc.returncode}): {proc.stderr[-2000:]}")


def make(target: str, options: Mapping[str, Any], out: Path) -> Path:
    """Explain `target`'s model (``MODULE_PATH:FUNCTION``, as the report command takes it) with
    `options` over the function's own, and screenshot the page to `out`."""
    report = explain_target(target, options)
    with tempfile.TemporaryDirectory() as tmp:
        screenshot(Path(report.save_html(os.path.join(tmp, "report.html"))), out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(REPO / "examples" / "clip.py") + ":build",
                        help="MODULE_PATH:FUNCTION returning (model, example_inputs[, options])")
    parser.add_argument("--option", action="append", type=parse_option, metavar="KEY=VALUE",
                        help="an apollo option (repeatable); default: device=H200, as the README's example")
    parser.add_argument("--out", default=str(REPO / "docs" / "report.png"), help="the PNG to write")
    args = parser.parse_args(argv)
    options = dict(args.option) if args.option else {"device": "H200"}
    print(f"wrote {make(args.target, options, Path(args.out))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
