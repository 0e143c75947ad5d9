"""The set-up step: python -m inference_api.kernels [CACHE_DIR]; the image's: ... --prebuild [FOLDER]."""

import logging
import sys
from pathlib import Path

from . import PREBUILT, load_kernels, prebuild

logging.basicConfig(level="INFO")
args = [a for a in sys.argv[1:] if a != "--prebuild"]
if "--prebuild" in sys.argv[1:]:
    built = prebuild(Path(args[0]) if args else PREBUILT)
    print("prebuilt quantized CPU kernels:", ", ".join(f"{level} ({so.name})" for level, so in built.items()))
else:
    ok = load_kernels(Path(args[0] if args else "model_cache")) is not None
    print("quantized CPU kernels", "ready" if ok else "unavailable")
