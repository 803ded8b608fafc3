"""Which implementation runs rdkv's kernels-or-torch steps (decode, quantize-pack, token weights).

CUDA tensors take the Triton kernels, CPU tensors torch. ``RDKV_BACKEND`` (``triton``, ``torch`` or
``reference``) overrides the choice, e.g. to run the kernels on CPU under TRITON_INTERPRET=1;
``reference`` runs decode through the pure-torch oracle (:mod:`rdkv.reference`) and everything else as
``torch``. With ``triton`` selected every call goes through a kernel: a case it cannot serve raises.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Callable

import torch

from .errors import RDKVError

BACKENDS = ("triton", "torch", "reference")

# The Triton kernel of each step that has one: (module of rdkv.kernels, function). Looked up by name on first use:
# Triton is optional, and the kernels import the modules that dispatch to them.
TRITON_KERNELS = {
    "decode": ("page_decode", "page_decode"),
    "quantize_pack": ("quantize_pack", "quantize_pack"),
    "token_weights": ("token_weights", "attention_sums"),
}


def backend(device: torch.device) -> str:
    chosen = os.environ.get("RDKV_BACKEND") or ("triton" if device.type == "cuda" else "torch")
    if chosen not in BACKENDS:
        raise RDKVError(f"RDKV_BACKEND={chosen!r} is not one of {BACKENDS}")
    return chosen


def triton_kernel(step: str) -> Callable:
    """The Triton kernel of ``step`` (a key of :data:`TRITON_KERNELS`), or an error that says why it cannot run."""
    module, name = TRITON_KERNELS[step]
    try:
        return getattr(importlib.import_module(f"{__package__}.kernels.{module}"), name)
    except ImportError as e:
        raise RDKVError(f"RDKV_BACKEND=triton but the Triton {step} kernel is unavailable: {e}") from e
