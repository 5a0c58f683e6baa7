"""The decoder tables, with no imports: engine.settings checks ENGINE_DECODER against them
without importing any decoder (engine.decoders re-exports them)."""
from __future__ import annotations

# name -> module
DECODERS: dict[str, str] = {
    "pil": "engine.decoders.pil",
    "dali-cpu": "engine.decoders.dali",
    "dali-gpu": "engine.decoders.dali",
    "nvjpeg": "engine.decoders.nvjpeg",
}
# what to try when a decoder cannot start: GPU decoders first, the PIL reference last
FALLBACK = {"dali-gpu": "nvjpeg", "nvjpeg": "pil", "dali-cpu": "pil"}
# what each decoder needs to start: (modules to import, needs a CUDA device)
NEEDS = {"pil": ((), False), "dali-cpu": (("nvidia.dali",), False), "dali-gpu": (("nvidia.dali",), True),
         "nvjpeg": (("torchvision.io",), True)}
