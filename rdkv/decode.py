"""One dispatch point for TriZone decode attention (:mod:`rdkv.backend` picks the path).

CUDA tensors go to the fused Triton kernel (:mod:`rdkv.kernels.page_decode`), CPU tensors to the C products over
the pages (:mod:`rdkv.cpu_decode`); ``RDKV_BACKEND=reference`` selects the pure-torch oracle
both are tested against (:mod:`rdkv.reference`). After the step, a layer under a fold policy folds its zone C (:mod:`rdkv.fold`).
"""
from __future__ import annotations

import torch

from . import cpu_decode, reference
from .backend import backend, triton_kernel
from .fold import observe
from .layout import rotate_v
from .trizone import TriZoneLayer


def trizone_decode(query: torch.Tensor, layer: TriZoneLayer, scaling: float, sliding_window: int | None = None,
                   softcap: float | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """query [B, Hq, L, D] -> out [B, Hq, L, D] over zones A, B and C of ``layer``."""
    chosen = backend(query.device)
    if chosen == "triton":
        out = triton_kernel("decode")(query, layer, scaling, sliding_window, softcap, mask)
    else:
        # the torch paths run many small ops: inference mode drops their autograd bookkeeping (measured with the
        # K-scale folding in docs/benchmarks.md); the output is cloned back to an ordinary tensor, which the model
        # may change in place
        free = not torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        with torch.inference_mode(free):
            out = (cpu_decode if chosen == "torch" else reference).trizone_attention(
                query, layer, scaling, sliding_window, softcap, mask)
        if free:
            out = out.clone()
    if layer.spec.v_rotate:  # every zone holds V rotated: so is the output
        out = rotate_v(out)
    if layer.fold is not None:
        observe(layer, query, scaling, softcap)
    return out
