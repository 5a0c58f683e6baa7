"""Build-time extras of the CIR index, computed from the finished gallery embeddings.

- `gallery_mean` (always; in meta.json): the image-side mean for modality-gap correction.
- `--mapping pic2word`: the image-to-word mapping (engine.retrieval.pic2word), trained on the
  gallery embeddings, checkpointed in INDEX_DIR/.build/pic2word/ (resumable), stored as
  `pic2word-<build>.safetensors`; config, steps, losses, seed and time in meta.json.
- `--text-bank N` (default the retrieval table's `text_bank_size` with a mapping, else 0): gallery-derived texts, the
  text embeddings of "a photo of *" with the pseudo-words of N seeded gallery rows,
  stored as `text_bank-<build>.f16.npy`: a query bank for the hubness scorers
  (`bank=gallery`) and a text mean for gap correction (`gap:text=bank`).
- `--dba N` (default 0: off): database-side augmentation of the gallery rows
  (engine.retrieval.rescore.dba), stored as `dba-<build>.f16.npy`. A run that asks for DBA with
  other (n, alpha), or from an index without it, computes it at query time (said on stderr).

Each item is written by its option's `extras` hook (engine.retrieval.options: the gap options'
gallery mean, the Pic2Word mapping's files, DBA's rows), asked in the table's order; `MAPPINGS`
(the build's `--mapping` choices) are the trained options. `extras_key` says what the extras
depend on besides the embeddings; a build whose embeddings are up to date but whose extras
differ reuses the committed embeddings.
"""
from __future__ import annotations

import io
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.options import trained
from engine.retrieval.pic2word import Pic2WordConfig

MAPPINGS = ("none", *trained())   # the build's --mapping choices: the trained options (engine.retrieval.options)
TEXT_BANK_DEFAULT = RETRIEVAL.text_bank_size   # gallery-derived texts when a mapping is trained (one text pass)


def _log(msg: str) -> None:
    print(f"[cir_build] {msg}", file=sys.stderr, flush=True)


@dataclass
class ExtrasConfig:
    mapping: str = "none"
    p2w: Pic2WordConfig = field(default_factory=Pic2WordConfig)
    text_bank: int = -1        # -1: TEXT_BANK_DEFAULT with a mapping, else 0
    dba: int = 0
    dba_alpha: float = RETRIEVAL.dba_alpha
    dba_chunk: int = RETRIEVAL.dba_chunk   # 0: one [N, N] matrix (the reference twin)
    p2w_stop_after: int = 0    # stop training (resumably) after this many steps; 0: never

    def bank_size(self) -> int:
        return (TEXT_BANK_DEFAULT if self.mapping != "none" else 0) if self.text_bank < 0 else self.text_bank


def extras_key(cfg: ExtrasConfig, method: dict) -> dict:
    """Everything the extras and the recorded method depend on, besides the gallery embeddings."""
    return {"mapping": cfg.mapping, "pic2word": asdict(cfg.p2w) if cfg.mapping == "pic2word" else None,
            "text_bank": cfg.bank_size(), "dba": [cfg.dba, cfg.dba_alpha] if cfg.dba else None, "method": method}


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


@dataclass
class ExtrasContext:
    """What an option's `extras` hook reads: the build's extras settings, the gallery rows
    (float16 [N, D] as stored, `rows` the same in float32), the towers, the CLIP's digest and the
    build's work folder (checkpoints)."""
    cfg: ExtrasConfig
    emb: np.ndarray
    rows: np.ndarray
    towers: object
    model_digest: str
    work_dir: Path

    @staticmethod
    def log(msg: str) -> None:
        _log(msg)

    @staticmethod
    def npy(arr: np.ndarray) -> bytes:
        return _npy(arr)


def build_extras(cfg: ExtrasConfig, emb: np.ndarray, towers, model_digest: str, work_dir: Path
                 ) -> tuple[dict, dict[str, tuple[str, bytes]]]:
    """(meta.json additions, extra files) for gallery rows emb [N, D] float16: what each option
    (engine.retrieval.options, in the table's order) stores. Raises
    engine.retrieval.pic2word.Stopped when the CIR_P2W_STOP_AFTER_STEPS hook fires."""
    from engine.retrieval.options import OPTIONS

    ctx = ExtrasContext(cfg, emb, np.asarray(emb, np.float32), towers, model_digest, work_dir)
    meta: dict = {}
    files: dict[str, tuple[str, bytes]] = {}
    for cls in OPTIONS.values():
        m, f = cls.extras(ctx)
        meta.update(m)
        files.update(f)
    return meta, files
