"""What an attached model's prefill leaves behind for :func:`rdkv.compress`: per-layer statistics and the
token record, shared by every attention module of the model."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from .dense import AttentionSums


@dataclass
class LayerStats:
    """What one layer's prefill leaves behind for :func:`rdkv.compress`."""

    key: torch.Tensor  # [B, H, Tk, D] the cache's own tensors (a reference, not a copy)
    value: torch.Tensor
    seen: int  # logical length: tokens this layer's cache has seen
    sums: AttentionSums | None  # over every prefill query (only if attached with all_queries=True)
    valid: torch.Tensor  # [B, seen] bool: attended by some query (False = padding)
    window_q: torch.Tensor  # [B, Hq, <=W, D] the last W queries, for the observation-window weights
    scaling: float
    sliding_window: int | None
    softcap: float | None

    @property
    def start(self) -> int:
        """Absolute position of ``key[..., 0, :]`` (sliding-window layers keep only their window)."""
        return self.seen - self.key.shape[-2]


@dataclass
class RDKVState:
    """Per-model state shared by every attention module of an attached model."""

    window: int = 256
    all_queries: bool = False
    layers: dict[int, LayerStats] = field(default_factory=dict)
    ids: torch.Tensor | None = None  # [B, seen] token ids of the prefill (for surprisal)
    hidden: torch.Tensor | None = None  # [B, seen, d_model] final hidden states of the prefill
    recording: bool = False  # the current forward runs on an ordinary cache
    surprisal: torch.Tensor | None = None  # computed from ids/hidden on first use

    @contextmanager
    def kept(self) -> Iterator[None]:
        """Run forwards that re-prefill or extend the record (calibration, diagnostics), then put the
        user's record of their last prefill back, whatever happened."""
        saved = (dict(self.layers), self.ids, self.hidden, self.surprisal)
        try:
            yield
        finally:
            self.layers.clear()
            self.layers.update(saved[0])
            self.ids, self.hidden, self.surprisal = saved[1:]
