"""The CLIP an index was built with: where to find it again, and whether another one is it.

meta.json `model` records the build's CLIP: its folder (absolute) and its digest (sha256 of
the files that decide the numbers, engine.clip.load.layout_digest). The folder a query
run loads is, in order:

    1. the one given (an argument, a command's --model-dir);
    2. CLIP_MODEL_DIR;
    3. the caller's default folder, when it exists;
    4. the folder the index records, when it exists and its digest still matches (said in
       one stderr line, as is why a recorded folder is not used);

and otherwise the caller's default (whose loader then says it is missing), or an error.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def recorded_folder(meta: dict | None, model_name: str | None = None) -> tuple[Path | None, str | None]:
    """(the recorded CLIP folder, None) when it exists and its digest matches the index's; else
    (None, why not), or (None, None) when the index records no folder."""
    model = (meta or {}).get("model")
    folder = model.get("dir") if isinstance(model, dict) else None
    if not isinstance(folder, str) or not folder:
        return None, None
    if not os.path.isabs(folder):
        return None, f"the index records a relative CLIP folder ({folder}), not used"
    if not os.path.exists(folder):
        return None, f"the CLIP folder the index records, {folder}, is missing"
    from engine.clip.load import ClipLoadError, find_layout, layout_digest

    try:
        digest = layout_digest(find_layout(folder, model_name))
    except (ClipLoadError, OSError) as e:
        return None, f"the CLIP folder the index records, {folder}, is unusable ({e})"
    if digest != model.get("digest"):
        return None, (f"the CLIP in {folder}, the folder the index records, changed since the build "
                      f"(digest {digest[:12]}, built with {str(model.get('digest'))[:12]})")
    return Path(folder), None


def resolve(given, meta: dict | None, default: Path | None = None, model_name: str | None = None,
            say: Callable[[str], None] | None = None) -> Path:
    """The CLIP folder for a query run on the index whose meta.json is `meta` (the order above).
    ClipLoadError when nothing names one and there is no default."""
    from engine import settings

    if given:
        return Path(given)
    env = settings.clip_model_dir()
    if env:
        return Path(env)
    if default is not None and Path(default).exists():
        return Path(default)
    found, why = recorded_folder(meta, model_name)
    missing = f" and {default} is missing" if default is not None else ""
    if say is not None and found is not None:
        say(f"no CLIP folder given{missing}: using {found}, the one the index records "
            f"(digest {meta['model']['digest'][:12]} matches)")
    elif say is not None and why:
        say(f"no CLIP folder given{missing}; {why}")
    if found is not None:
        return found
    if default is not None:
        return Path(default)
    from engine.clip.load import ClipLoadError

    raise ClipLoadError("no CLIP model folder given: pass one or set CLIP_MODEL_DIR" + (f" ({why})" if why else ""))


def mismatch(meta: dict, info: dict) -> str | None:
    """Why the loaded CLIP (engine.clip.load's `info`) is not the one that built the index, or None."""
    built_with = (meta.get("model") or {}).get("digest")
    if built_with == info["digest"]:
        return None
    return f"the CLIP in {info['dir']} (digest {info['digest'][:12]}) is not the one that built the index " \
           f"({str(built_with)[:12]})"
