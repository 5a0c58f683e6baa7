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

`extras_key` says what the extras depend on besides the embeddings; a build whose
embeddings are up to date but whose extras differ reuses the committed embeddings.
"""
from __future__ import annotations

import hashlib
import io
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.pic2word import Pic2WordConfig

MAPPINGS = ("none", "pic2word")
TEXT_BANK_DEFAULT = RETRIEVAL.text_bank_size   # gallery-derived texts when a mapping is trained (one text pass)
P2W_DIR = "pic2word"       # checkpoint folder under INDEX_DIR/.build


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


def build_extras(cfg: ExtrasConfig, emb: np.ndarray, towers, model_digest: str, work_dir: Path
                 ) -> tuple[dict, dict[str, tuple[str, bytes]]]:
    """(meta.json additions, extra files) for gallery rows emb [N, D] float16.
    Raises engine.retrieval.pic2word.Stopped when the CIR_P2W_STOP_AFTER_STEPS hook fires."""
    import torch

    meta: dict = {}
    files: dict[str, tuple[str, bytes]] = {}
    x = np.asarray(emb, np.float32)
    meta["gallery_mean"] = [float(v) for v in x.mean(0)] if len(x) else []     # [D]
    if cfg.mapping == "pic2word":
        from safetensors.torch import save as save_safetensors

        from engine.retrieval import pic2word

        if len(x) < 2:
            raise ValueError("pic2word needs at least 2 gallery images (InfoNCE needs negatives)")
        key = {"embeddings_sha256": hashlib.sha256(np.ascontiguousarray(emb, np.float16).tobytes()).hexdigest(),
               "model_digest": model_digest, "device": towers.device.type, "precision": towers.precision}
        stop = cfg.p2w_stop_after
        _log(f"pic2word: training the mapping on {len(x)} gallery embeddings "
             f"({cfg.p2w.total_steps(len(x))} steps, batch {min(cfg.p2w.batch_size, len(x))}, seed {cfg.p2w.seed})")
        res = pic2word.train(towers, emb, cfg.p2w, work_dir / P2W_DIR, key, stop, log=_log)
        _log(f"pic2word: {res.steps} steps in {res.seconds:.1f} s, loss {res.first_loss:.3f} -> {res.final_loss:.3f} "
             f"(means of the first and last {res.loss_window} of the run's {res.steps} steps)")
        files["pic2word"] = (".safetensors", save_safetensors(res.state))
        mapping = pic2word.load_mapping(res.state, {"mapping": _mapping_shape(towers, cfg.p2w)})
        meta["pic2word"] = {"mapping": _mapping_shape(towers, cfg.p2w), "config": asdict(cfg.p2w),
                            "train_prompt": pic2word.TRAIN_PROMPT, "steps": res.steps,
                            "total_steps": res.total_steps, "final_loss": res.final_loss,
                            "first_loss": res.first_loss, "loss_window": res.loss_window,
                            "loss_curve": res.curve, "seed": cfg.p2w.seed,
                            "resumed_from_step": res.resumed_from, "stopped_early": res.stopped,
                            "train_s": res.seconds, "data": "gallery image embeddings only"}
        n_bank = min(cfg.bank_size(), len(x))
        if n_bank:
            rows = np.sort(np.random.default_rng(cfg.p2w.seed).choice(len(x), n_bank, replace=False))
            bank = pic2word.encode_prompts(towers, mapping, torch.from_numpy(x[rows]),
                                           [pic2word.TRAIN_PROMPT] * n_bank)
            files["text_bank"] = (".f16.npy", _npy(bank.cpu().numpy().astype(np.float16)))
            meta["text_bank"] = {"count": n_bank, "seed": cfg.p2w.seed,
                                 "source": f"pic2word {pic2word.TRAIN_PROMPT!r} of {n_bank} seeded gallery rows",
                                 "rows": rows.tolist()}   # each text's own gallery row: masked in bank statistics
    elif cfg.bank_size():
        _log("no text bank: gallery-derived texts need a mapping (--mapping pic2word)")
    if cfg.dba:
        from engine.retrieval.rescore import dba

        g = torch.from_numpy(x).to(towers.device)
        rows = dba(g, cfg.dba, cfg.dba_alpha, cfg.dba_chunk)
        files["dba"] = (".f16.npy", _npy(rows.cpu().numpy().astype(np.float16)))
        meta["dba"] = {"n": cfg.dba, "alpha": cfg.dba_alpha}
    return meta, files


def _mapping_shape(towers, p2w: Pic2WordConfig) -> dict:
    """What engine.retrieval.pic2word.load_mapping needs to rebuild the mapping's modules."""
    return {"embed_dim": towers.spec.embed_dim, "token_width": towers.model.token_embedding.weight.shape[1],
            "hidden": p2w.hidden, "layers": p2w.layers, "dropout": p2w.dropout}
