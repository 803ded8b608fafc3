"""What a prefill leaves behind for :func:`rdkv.compress`: per-layer statistics and the token record.

A :class:`Record` is filled inside ``with rdkv.record(model) as rec:`` (:func:`rdkv.attention.record`), or by a
prefill of an installed model, which keeps it with the cache it returns (:func:`rdkv.install`); afterwards
nothing the model does changes it, so one record can be compressed any number of times.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .dense import AttentionSums
from .errors import NotRecorded, RDKVError


@dataclass
class LayerStats:
    """What one layer's prefill leaves behind for :func:`rdkv.compress`."""

    key: torch.Tensor  # [B, H, Tk, D] the cache's own tensors (a reference, not a copy)
    value: torch.Tensor
    seen: int  # logical length: tokens this layer's cache has seen
    sums: AttentionSums | None  # over every prefill query (only if recorded with all_queries=True)
    valid: torch.Tensor  # [B, seen] bool: attended by some query (False = padding)
    window_q: torch.Tensor  # [B, Hq, <=W, D] the last W queries, for the observation-window weights
    scaling: float
    sliding_window: int | None
    softcap: float | None
    # sums of the context repeated after the prefill over the keys held (rdkv.reconstruct), once computed
    recon: AttentionSums | None = None

    @property
    def start(self) -> int:
        """Absolute position of ``key[..., 0, :]`` (sliding-window layers keep only their window)."""
        return self.seen - self.key.shape[-2]


@dataclass(eq=False)
class Record:
    """One prefill of ``model`` as rdkv saw it: each layer's cache and weight statistics, the token ids and
    the final hidden states (from which each token's surprisal is computed once, on first use)."""

    model: torch.nn.Module
    window: int = 256  # the last ``window`` queries of every layer are kept (observation-window weights)
    all_queries: bool = False  # attention sums over every prefill query were streamed (the paper's weights)
    layers: dict[int, LayerStats] = field(default_factory=dict)
    ids: torch.Tensor | None = None  # [B, seen] token ids of the prefill
    hidden: torch.Tensor | None = None  # [B, seen, d_model] final hidden states of the prefill
    closed: bool = False  # the ``with`` block has ended: the record no longer changes
    # lives no longer than the cache it records (rdkv.install's record of every prefill): may hold views of its storage
    shares_cache: bool = False
    # called with a layer's index once its statistics are in ``layers`` (rdkv.prefill packs and frees it there)
    on_layer: Callable[[int], None] | None = field(default=None, repr=False)
    _surprisal: torch.Tensor | None = field(default=None, repr=False)
    _versions: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)
    _head: tuple | None = field(default=None, repr=False)

    def close(self) -> None:
        """Stop recording; remember the cache tensors' versions and the output head's state, so an in-place change
        of either is caught when compress reads them."""
        self.closed = True
        self._versions = {i: (st.key._version, st.value._version) for i, st in self.layers.items()}
        self._head = self._head_state()

    def _head_state(self) -> tuple | None:
        head = self.model.get_output_embeddings()
        w = getattr(head, "weight", None)
        return None if w is None else (w.data_ptr(), w._version, w.dtype, w.device, tuple(w.shape))

    def check(self) -> None:
        """Raise unless the record is complete and its cache tensors are as the prefill left them."""
        if not self.closed:
            raise NotRecorded("the record is still open: compress after the `with rdkv.record(model) as rec:` block")
        n_layers = getattr(self.model.config.get_text_config(), "num_hidden_layers", len(self.layers))
        if not self.layers:
            raise NotRecorded("the record saw no prefill: run model(input_ids, use_cache=True) inside "
                              "`with rdkv.record(model) as rec:`")
        if sorted(self.layers) != list(range(n_layers)):
            raise NotRecorded(f"the record covers layers {sorted(self.layers)} of {n_layers}: record a full forward")
        for i, st in self.layers.items():
            if (st.key._version, st.value._version) != self._versions[i]:
                raise RDKVError(f"layer {i}: the cache the record refers to was changed in place after the prefill "
                                "(a static cache?): record the prefill into a DynamicCache, or record it again")

    def surprisal(self, chunk: int = 64) -> torch.Tensor:
        """-log p(x_t | x_<t) of every prefill token [B, T] (the first token gets the mean), from the
        recorded final hidden states through the model's output head, ``chunk`` positions at a time."""
        if self._surprisal is not None:
            return self._surprisal
        if self._head_state() != self._head:
            raise RDKVError("the model's output head changed after the prefill (its weights, dtype or device), and the "
                            "surprisal prior is computed from it: compress before changing the model, or prefill again")
        head, ids, h = self.model.get_output_embeddings(), self.ids, self.hidden
        if h is None or ids is None or head is None or h.shape[1] != ids.shape[1]:
            raise RDKVError("no token record for this prefill (it needs input_ids, not inputs_embeds, and a model "
                            "with a final norm and an output head): prefill with input_ids or pass surprisal=0")
        out = torch.zeros(ids.shape, device=h.device)
        for a in range(0, ids.shape[1] - 1, chunk):
            b = min(a + chunk, ids.shape[1] - 1)
            logp = head(h[:, a:b]).float().log_softmax(-1)
            out[:, a + 1 : b + 1] = -logp.gather(-1, ids[:, a + 1 : b + 1, None]).squeeze(-1)
        out[:, 0] = out[:, 1:].mean(1) if ids.shape[1] > 1 else 0.0
        self._surprisal = out
        return out
