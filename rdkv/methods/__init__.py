"""Every method is an allocation: widths per V token and per K block, fed to the same packer.

So bytes are counted one way (what the TriZone tensors hold) and decode is shared. Each method is a frozen
dataclass behind one interface (:class:`Method`): :class:`RDKV` (:mod:`.rate_distortion`), the quantization
baselines :class:`Uniform` and :class:`KIVI` (:mod:`.quantization`) and the eviction baselines
:class:`StreamingLLM`, :class:`SnapKV`, :class:`AdaKV` and :class:`KeyNorm` (:mod:`.eviction`).
:data:`METHODS` names the configurations the package recommends; pass a name or an object as
``rdkv.compress(rec, budget, method=...)``.
"""
from __future__ import annotations

from .base import Allocation, HeldLayer, Method
from .eviction import AdaKV, KeyNorm, SnapKV, StreamingLLM
from .quantization import KIVI, Uniform
from .rate_distortion import RDKV, Eviction, Prior, Solve, Weights
from ..errors import RDKVError

AUTO = "auto"  # compress's default: the RDKV configuration for the model's attention layout (:func:`resolve`)
METHODS: dict[str, Method] = {
    "rdkv": RDKV(),
    # the question is in the prompt (query-aware): weigh what its window asked for, SnapKV-style pooled and
    # reaching the 15 tokens after each weighed one (an answer reads on past the token the question attends to:
    # a needle's later digits), and keep no reserve for later questions (docs/experiments.md, 2026-12-02); on
    # sliding-window layers hold the window's last 128 tokens, the question, with 2-bit keys where that takes at
    # most half the bytes (docs/experiments.md, 2026-12-08: Gemma 3 at 16k and 2.5%, 73% of the full cache -> 123%)
    "rdkv-aware": RDKV("rdkv-aware", weights=Weights(pool=7, pool_forward=15), prior=Prior(surprisal=0.0),
                       eviction=Eviction(window_end=128)),
    # models that mix sliding-window and global layers: all 256 recorded queries on global layers, window weights
    # per query that can see each token, sliding-layer tokens priced by how long a 512-token decode keeps them
    # visible (docs/experiments.md: on Gemma 3 at 10%, every needle the full cache answers, both protocols)
    "rdkv-hybrid": RDKV("rdkv-hybrid", weights=Weights(window=256, window_sliding=64, visible=1.0, horizon=512)),
    # a document compressed once and asked later, at 10% of the bytes or less: the context repeated after the
    # prefill weighs each token by the largest attention one repetition query pays it (KVzip's score), with a
    # quarter of each layer's weight from the prefill's window, and the budget is split across layers by one
    # ranking of those peaks; no reserve. It costs a second pass over the context (docs/experiments.md, 2026-12-07)
    "rdkv-reconstruct": RDKV("rdkv-reconstruct", weights=Weights(form="reconstruct", score="max", blend=0.25),
                             prior=Prior(surprisal=0.0), solve=Solve(split="peak")),
    # the RDKV paper's form: every prefill query, w * sigma * 2^-b, no reserve, nothing protected
    "rdkv-paper": RDKV("rdkv-paper", weights=Weights(form="all"), prior=Prior(surprisal=0.0),
                       eviction=Eviction(sinks=0, recent=0), distortion="paper"),
    "int8": Uniform("int8", bits=8),
    "int4": Uniform("int4", bits=4),
    "kivi4": KIVI("kivi4", bits=4),
    "kivi2": KIVI("kivi2", bits=2),
    "streaming": StreamingLLM("streaming"),
    "snapkv": SnapKV("snapkv"),
    "adakv": AdaKV("adakv"),
    "knorm": KeyNorm("knorm"),
}
NAMES = (AUTO, *METHODS)


def named(method: str | Method) -> Method:
    """The method a name stands for (``auto`` excepted: it depends on the model, :func:`resolve`)."""
    if isinstance(method, Method):
        return method
    if method not in METHODS:
        raise RDKVError(f"unknown method {method!r}; choose one of {', '.join(NAMES)}, or pass a method object "
                        "(rdkv.methods.RDKV(...), rdkv.methods.SnapKV(window=32), ...)")
    return METHODS[method]


def resolve(model, method: str | Method, options: dict, recorded_window: int = 256) -> Method:
    """The method a compress call runs, with its keyword ``options`` applied. ``"auto"`` is ``rdkv-hybrid`` on
    models that mix sliding-window and global layers (``layer_types`` in the config, as Gemma 3 has: there it
    was the one configuration that met both goals of docs/experiments.md, where plain ``rdkv`` raised prose
    perplexity 5.7% at 25%), else ``rdkv``; its query windows are capped at what the record kept."""
    if isinstance(method, str) and method == AUTO:
        kinds = set(getattr(model.config.get_text_config(), "layer_types", None) or ())
        base = METHODS["rdkv-hybrid" if {"sliding_attention", "full_attention"} <= kinds else "rdkv"]
        w = base.weights
        method = base.with_options(window=min(w.window, recorded_window) if w.window else None,
                                   window_sliding=min(w.window_sliding, recorded_window) if w.window_sliding else None)
    method = named(method)
    return method.with_options(**options) if options else method


__all__ = ["AUTO", "METHODS", "NAMES", "Allocation", "HeldLayer", "Method", "RDKV", "Weights", "Prior", "Eviction",
           "Solve", "Uniform", "KIVI", "StreamingLLM", "SnapKV", "AdaKV", "KeyNorm", "named", "resolve"]
