"""CLIP's two towers on one device: uint8 pixels or strings in, L2-normalised float32 [B, D] out.

Precision: `fp32` is the reference; on CUDA the default is `fp16` autocast (matmuls in
FP16, LayerNorm/softmax kept in FP32 by autocast itself). `CLIP_PRECISION` overrides,
`fp32` is the off switch.

Text trimming (fast path, `CLIP_TEXT_TRIM=0` turns it off): prompts are ~10-20 tokens
of a 77-token context. The text tower is causal and pools at the eot token, so the
positions after the batch's last eot cannot change the result: the trimmed forward runs
only the first L positions. Its reference twin is open_clip's own `encode_text`.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from engine import settings
from engine.clip.spec import ClipSpec
from engine.presets.retrieval import RETRIEVAL

PRECISIONS = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
MAX_CHARS = 20_000      # longer texts are cut before cleaning (ftfy and the word split are linear in it)
MAX_WORD_CHARS = 200    # longer words are cut before BPE, which is quadratic in a word's length


def default_device() -> str:
    """`CLIP_DEVICE`, else cuda when available, else cpu."""
    return settings.clip_device() or ("cuda" if torch.cuda.is_available() else "cpu")


def default_precision(device: str) -> str:
    """`CLIP_PRECISION`, else fp16 autocast on CUDA and fp32 on CPU."""
    return settings.clip_precision() or ("fp16" if device.startswith("cuda") else "fp32")


class ClipTowers:
    """Image tower (normalisation folded in) and text tower (CLIP BPE tokenizer) of one model."""

    def __init__(self, model: torch.nn.Module, spec: ClipSpec, device: str | None = None,
                 precision: str | None = None, trim_text: bool | None = None):
        from open_clip.tokenizer import SimpleTokenizer

        self.device = torch.device(device or default_device())
        self.precision = precision or default_precision(str(self.device))
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        self.spec = spec
        self.model = model.to(self.device).eval()
        s = spec.image
        self.mean = torch.tensor(s.mean, dtype=torch.float32, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(s.std, dtype=torch.float32, device=self.device).view(1, 3, 1, 1)
        self.tokenizer = SimpleTokenizer(context_length=spec.context_length)
        self.trim_text = settings.clip_text_trim() if trim_text is None else trim_text
        self._trim_ok = self._can_trim(model)

    @staticmethod
    def _can_trim(model) -> str | None:
        """None if the trimmed text forward is exact for `model`, else why not."""
        from open_clip.model import CLIP

        if type(model) is not CLIP:
            return f"{type(model).__name__} is not open_clip's plain CLIP"
        if getattr(model, "text_pool_type", None) != "argmax":
            return f"text pooling {getattr(model, 'text_pool_type', None)!r} is not argmax"
        if getattr(model, "attn_mask", None) is None:
            return "the text tower is not causal"
        return None

    def _autocast(self):
        dtype = PRECISIONS[self.precision]
        return torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None)

    @torch.inference_mode()
    def encode_images(self, batch) -> torch.Tensor:
        """[B, S, S, 3] uint8 (numpy or torch, any device) -> [B, D] float32 unit rows on the tower's device."""
        x = torch.as_tensor(batch).to(self.device, non_blocking=True)
        # [B, S, S, 3] uint8 -> [B, 3, S, S] float in [0, 1], then CLIP's mean/std (ToTensor + Normalize)
        x = (x.permute(0, 3, 1, 2).float().div(255.0) - self.mean) / self.std
        with self._autocast():
            out = self.model.encode_image(x)
        return F.normalize(out.float(), dim=-1)

    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, list[bool]]:
        """([B, context_length] int64 tokens, truncated flags): open_clip's tokenizer rule
        (sot + BPE + eot; too long -> cut, last token eot), also saying which were cut."""
        tok, ctx = self.tokenizer, self.spec.context_length
        out = torch.zeros(len(texts), ctx, dtype=torch.long)
        cut = []
        for i, text in enumerate(texts):
            body, capped = encode_capped(tok, text, ctx)
            ids = [tok.sot_token_id] + body + [tok.eot_token_id]
            cut.append(len(ids) > ctx or capped)
            if len(ids) > ctx:
                ids = ids[:ctx]
                ids[-1] = tok.eot_token_id
            out[i, : len(ids)] = torch.tensor(ids)
        return out, cut

    @torch.inference_mode()
    def encode_tokens(self, tokens: torch.Tensor, trim: bool | None = None) -> torch.Tensor:
        """[B, context_length] int64 -> [B, D] float32 unit rows on the tower's device."""
        trim = self.trim_text if trim is None else trim
        if trim and self._trim_ok is not None:
            _say_once(f"[engine] text trimming off: {self._trim_ok}")
            trim = False
        tokens = tokens.to(self.device)
        with self._autocast():
            out = self._encode_trimmed(tokens) if trim else self.model.encode_text(tokens)
        return F.normalize(out.float(), dim=-1)

    def _encode_trimmed(self, tokens: torch.Tensor) -> torch.Tensor:
        """open_clip CLIP.encode_text on the first L positions (L = last eot + 1 in the batch)."""
        return text_forward(self.model, tokens, trim=True)

    def encode_texts(self, texts: list[str], batch_size: int = RETRIEVAL.text_batch) -> torch.Tensor:
        """Strings -> [B, D] float32 unit rows (batched through the text tower)."""
        if not texts:
            return torch.zeros(0, self.spec.embed_dim, device=self.device)
        parts = [self.encode_tokens(self.tokenize(texts[i:i + batch_size])[0])
                 for i in range(0, len(texts), batch_size)]
        return torch.cat(parts)


def encode_capped(tok, text: str, words: int) -> tuple[list[int], bool]:
    """open_clip's `SimpleTokenizer.encode(text)` in bounded time: (BPE ids, whether anything was cut).

    The same steps (clean, split with the tokenizer's pattern, BPE per word), on at most
    `words` pre-BPE words, each at most MAX_WORD_CHARS characters: every word yields at
    least one token, so words past the context never reach it, and BPE's quadratic cost
    stays small. Texts within those bounds give exactly `tok.encode(text)`.
    """
    capped = len(text) > MAX_CHARS
    clean = tok.clean_fn(text[:MAX_CHARS] if capped else text)
    ids: list[int] = []
    for n, m in enumerate(tok.pat.finditer(clean)):
        if n == words:
            capped = True
            break
        word = m.group()
        if len(word) > MAX_WORD_CHARS:
            word, capped = word[:MAX_WORD_CHARS], True
        word = "".join(tok.byte_encoder[b] for b in word.encode("utf-8"))
        ids.extend(tok.encoder[t] for t in tok.bpe(word).split(" "))
    return ids, capped


_said: set[str] = set()


def _say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        print(msg, file=sys.stderr)


def text_forward(m, tokens: torch.Tensor, trim: bool = True, slot: torch.Tensor | None = None,
                 embeds: torch.Tensor | None = None) -> torch.Tensor:
    """open_clip CLIP.encode_text, unnormalised, in the tower's dtype: tokens [B, ctx] -> [B, D].

    trim: run only the first L positions (L = last eot + 1 in the batch; causal attention makes
    the rest irrelevant). slot [B] + embeds [B, W]: replace the token embedding at that
    position (a learned pseudo-word, see engine.clip.inject).
    """
    eot = tokens.argmax(dim=-1)                                        # [B] eot has the highest id
    n = int(eot.max()) + 1 if trim else tokens.shape[1]
    cast = m.transformer.get_cast_dtype()
    x = m.token_embedding(tokens[:, :n]).to(cast)                      # [B, L, W]
    if slot is not None:
        here = (torch.arange(n, device=tokens.device) == slot.unsqueeze(1)).unsqueeze(-1)  # [B, L, 1]
        x = torch.where(here, embeds.to(cast).unsqueeze(1), x)         # the pseudo-word at its slot
    x = x + m.positional_embedding[:n].to(cast)
    x = m.transformer(x, attn_mask=m.attn_mask[:n, :n])
    x = m.ln_final(x)
    x = x[torch.arange(x.shape[0], device=x.device), eot]             # [B, W] at the eot token
    if m.text_projection is not None:
        x = m.text_projection(x) if isinstance(m.text_projection, torch.nn.Linear) else x @ m.text_projection
    return x
