"""Keys before the rotary embedding (KVQuant's pre-RoPE quantization).

RoPE rotates channel pairs (c, c + D/2) by position-dependent angles, so a channel's post-RoPE values
mix two pre-RoPE channels with a phase that changes token by token; per-channel outlier structure is
cleaner before it. The ``prerope`` option un-rotates the cached keys, allocates and packs them in that
space, stores the layer's rotary frequencies (:func:`rdkv.layout.rope_table`: inv_freq, then the attention scaling, float32,
counted in ``nbytes``) and rotates the dequantized keys back at their positions on every decode step: the
torch path rotates the keys (:func:`rotate`), the Triton kernel rotates each channel block inside its dots
(``rdkv.kernels.device.page_decode._rope_dot``).
"""
from __future__ import annotations

import torch

from .errors import RDKVError

# transformers model types whose attention applies RoPE as x * cos + rotate_half(x) * sin over the whole head
ROTATE_HALF = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text", "smollm3")


def rope_table(model: torch.nn.Module, layer_idx: int, head_dim: int, positions: torch.Tensor) -> torch.Tensor:
    """[D/2 + 1] float32: layer ``layer_idx``'s inverse frequencies and attention scaling.

    Checked against the model's own rotary module at ``positions``: RoPE variants whose angles are not
    position x inv_freq (dynamic or sequence-dependent scaling) are refused rather than silently wrong.
    """
    config = model.config.get_text_config()
    if config.model_type not in ROTATE_HALF:
        raise RDKVError(f"prerope supports rotate-half RoPE models ({', '.join(ROTATE_HALF)}), not "
                        f"{config.model_type!r}: compress without prerope")
    rot = getattr(model.get_decoder(), "rotary_emb", None)
    if rot is None:
        raise RDKVError(f"{type(model).__name__} has no decoder.rotary_emb: compress without prerope")
    layer_types = getattr(config, "layer_types", None)
    kind = layer_types[layer_idx] if layer_types and hasattr(rot, f"{layer_types[layer_idx]}_inv_freq") else None
    inv = getattr(rot, f"{kind}_inv_freq" if kind else "inv_freq").float()
    scale = float(getattr(rot, f"{kind}_attention_scaling" if kind else "attention_scaling"))
    if 2 * inv.numel() != head_dim:
        raise RDKVError(f"prerope needs RoPE over the whole head ({head_dim} channels), this model rotates "
                        f"{2 * inv.numel()}: compress without prerope")
    table = torch.cat([inv, inv.new_tensor([scale])])
    x = torch.zeros(1, device=inv.device)
    args = (kind,) if kind else ()
    cos, sin = rot(x, positions.view(1, -1).to(inv.device), *args)
    mine_cos, mine_sin = _cos_sin(positions.to(inv.device), table)
    if not (torch.allclose(cos[0].float(), mine_cos, atol=1e-4) and torch.allclose(sin[0].float(), mine_sin, atol=1e-4)):
        raise RDKVError(f"layer {layer_idx}: the model's RoPE is not position x inv_freq (a dynamic or "
                        "sequence-dependent variant); compress without prerope")
    return table


def rope_bytes(head_dim: int) -> int:
    """Bytes of one layer's stored RoPE table."""
    return 4 * (head_dim // 2 + 1)


def _cos_sin(pos: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    angles = pos.float().unsqueeze(-1) * table[:-1]
    emb = torch.cat([angles, angles], -1)
    return emb.cos() * table[-1], emb.sin() * table[-1]


def rotate(k: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Apply (or undo) RoPE on k [..., N, D] at positions ``pos`` [..., N] (broadcastable), float32.

    The inverse divides out the attention scaling, so ``rotate(rotate(k, p, t, True), p, t) == k``.
    """
    cos, sin = _cos_sin(pos, table)
    half = k.shape[-1] // 2
    turned = torch.cat([-k[..., half:], k[..., :half]], -1)  # rotate_half
    if inverse:
        return (k * cos - turned * sin) / table[-1] ** 2
    return k * cos + turned * sin


def pair_mean(q2: torch.Tensor) -> torch.Tensor:
    """Per-channel query energy seen by pre-RoPE channels: over positions a rotated query spreads the
    energy of the pair (c, c + D/2) evenly over both."""
    return (q2 + q2.roll(q2.shape[-1] // 2, -1)) / 2
