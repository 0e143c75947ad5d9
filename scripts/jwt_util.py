#!/usr/bin/env python3
"""Make and check the proxy's JSON Web Tokens: ``proxy/jwt_util.py`` (installed as the ``jwt-util`` command), run
from a checkout without installing it."""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from proxy.jwt_util import main

    sys.exit(main())
