"""Which implementation runs rdkv's kernels-or-torch steps (decode, quantize-pack, token weights).

CUDA tensors take the Triton kernels, CPU tensors torch. ``RDKV_BACKEND`` (``triton``, ``torch`` or
``reference``) overrides the choice, e.g. to run the kernels on CPU under TRITON_INTERPRET=1;
``reference`` runs decode through the pure-torch oracle (:mod:`rdkv.reference`) and everything else as
``torch``. With ``triton`` selected every call goes through a kernel: a case it cannot serve raises.
"""
from __future__ import annotations

import os

import torch

from .errors import RDKVError

BACKENDS = ("triton", "torch", "reference")


def backend(device: torch.device) -> str:
    chosen = os.environ.get("RDKV_BACKEND") or ("triton" if device.type == "cuda" else "torch")
    if chosen not in BACKENDS:
        raise RDKVError(f"RDKV_BACKEND={chosen!r} is not one of {BACKENDS}")
    return chosen
