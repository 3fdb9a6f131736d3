"""``python -m apollo_compile report MODULE_PATH:FUNCTION --out report.html``: see :mod:`apollo_compile.report.cli`."""

from __future__ import annotations

import sys

from .report.cli import main

if __name__ == "__main__":
    sys.exit(main())
