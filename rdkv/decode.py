"""One dispatch point for TriZone decode attention.

CUDA tensors go to the fused Triton kernel, CPU tensors to the vectorised torch path
(:mod:`rdkv.cpu_decode`). ``RDKV_BACKEND`` (``triton``, ``torch`` or ``reference``: the pure-torch oracle
both are tested against, :mod:`rdkv.reference`) overrides the choice, e.g. to run the kernel on CPU under
TRITON_INTERPRET=1. With ``triton`` selected every call goes through the kernel: a case it cannot serve raises.
"""
from __future__ import annotations

import os

import torch

from .errors import RDKVError
from . import cpu_decode, reference
from .trizone import TriZoneLayer

BACKENDS = ("triton", "torch", "reference")


def backend(device: torch.device) -> str:
    chosen = os.environ.get("RDKV_BACKEND") or ("triton" if device.type == "cuda" else "torch")
    if chosen not in BACKENDS:
        raise RDKVError(f"RDKV_BACKEND={chosen!r} is not one of {BACKENDS}")
    return chosen


def trizone_decode(query: torch.Tensor, layer: TriZoneLayer, scaling: float, sliding_window: int | None = None,
                   softcap: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """query [B, Hq, L, D] -> out [B, Hq, L, D] over zones A, B and C of ``layer``."""
    chosen = backend(query.device)
    if chosen != "triton":
        path = cpu_decode if chosen == "torch" else reference
        return path.trizone_attention(query, layer, scaling, sliding_window, softcap, mask)
    try:
        from .kernels.trizone_decode import trizone_decode as triton_decode
    except ImportError as e:
        raise RDKVError(f"RDKV_BACKEND=triton but the Triton decode kernel is unavailable: {e}") from e
    return triton_decode(query, layer, scaling, sliding_window, softcap, mask)
