"""CLIP's text tower with one token's embedding replaced: the pseudo-word of Pic2Word.

open_clip's `CLIP.encode_text` is: token embedding [B, L, W] + positional embedding ->
causal transformer (attn_mask) -> ln_final -> the row at the eot token (the highest id
in each sequence: `text_pool_type == "argmax"`) -> text projection. `encode_with_slot`
runs exactly that, except that row `slot[b]` of sequence b is `embeds[b]` instead of the
embedding of its token (the `*` placeholder), and it is differentiable in `embeds`.

Fast path: like engine.clip.towers it runs only the first L positions (L = the batch's
last eot + 1; the mask is causal and pooling is at the eot, so later positions cannot
change the result). `trim=False` runs all context_length positions (the reference twin);
with `embeds` equal to the placeholder's own embedding both equal `encode_text`.
"""
from __future__ import annotations

import torch


def placeholder_id(tokenizer, placeholder: str = "*") -> int:
    """The single BPE id of the placeholder word (CLIP BPE: '*' -> one token)."""
    ids = tokenizer.encode(placeholder)
    if len(ids) != 1:
        raise ValueError(f"placeholder {placeholder!r} is {len(ids)} tokens, expected 1")
    return ids[0]


def check_injectable(model) -> None:
    """Raise ValueError unless `model` is open_clip's plain CLIP with a causal, argmax-pooled text tower."""
    from open_clip.model import CLIP

    if type(model) is not CLIP:
        raise ValueError(f"token injection needs open_clip's plain CLIP, got {type(model).__name__}")
    if getattr(model, "text_pool_type", None) != "argmax" or getattr(model, "attn_mask", None) is None:
        raise ValueError("token injection needs a causal text tower pooled at the eot token (argmax)")


def slots_of(tokens: torch.Tensor, token_id: int) -> torch.Tensor:
    """[B] position of the first `token_id` in each row of tokens [B, L]; ValueError if a row has none."""
    hit = tokens == token_id
    if not bool(hit.any(dim=1).all()):
        raise ValueError("a prompt has no placeholder token")
    return hit.int().argmax(dim=1)


def encode_with_slot(model, tokens: torch.Tensor, slot: torch.Tensor, embeds: torch.Tensor,
                     trim: bool = True) -> torch.Tensor:
    """Text features [B, D] (unnormalised, the tower's dtype) of tokens [B, ctx] int64 with the
    token embedding at position slot [B] replaced by embeds [B, W]."""
    from engine.clip.towers import text_forward

    return text_forward(model, tokens, trim=trim, slot=slot, embeds=embeds)
