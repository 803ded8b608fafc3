"""The one interface every method implements: widths for each held layer of a recorded prefill."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import ClassVar, NamedTuple

import torch

from ..errors import RDKVError
from ..records import LayerStats, Record
from ..layout import PackSpec


class HeldLayer(NamedTuple):
    """One layer's held cache as it is priced and packed: what a future query can still see (positions
    ``start`` to ``stats.seen - 1``), keys un-rotated when the method packs them pre-RoPE (``rope`` is then
    the layer's rotary table, stored with the packed keys)."""

    stats: LayerStats
    k: torch.Tensor  # [B, H, T, D] in the cache's dtype (float32 when un-rotated pre-RoPE)
    v: torch.Tensor
    start: int
    present: torch.Tensor  # [B, H, T] bool: False at padding
    rope: torch.Tensor | None


class Allocation(NamedTuple):
    """What a method chose for every layer: option indices (:data:`rdkv.quant.OPTION`) per V token [B, H, T]
    and per K block [B, H, D/k_block], the K channel order the blocks follow [B, H, D], and the modelled
    distortion per layer (RDKV methods; None for baselines)."""

    v: list[torch.Tensor]
    k: list[torch.Tensor]
    perm: list[torch.Tensor]
    layer_distortion: tuple[float, ...] | None = None


def identity_perm(layers: list[HeldLayer]) -> list[torch.Tensor]:
    return [torch.arange(h.k.shape[-1], device=h.k.device).expand(*h.k.shape[:2], -1) for h in layers]


@dataclass(frozen=True)
class Method:
    """A way to choose each cache unit's width. Subclasses are frozen dataclasses whose fields are the
    method's documented options; two methods with equal fields allocate alike (``name`` is a label only).

    ``allocate`` gets the record (its statistics and surprisal), every held layer, each sequence's fp16 bytes
    and the byte budget as a fraction of them (None only for ``fixed_rate`` methods, which set their own
    size). It must return an :class:`Allocation` whose packed bytes fit ``budget x fp16``, or raise
    :class:`rdkv.solvers.mckp.Infeasible`.
    """

    name: str = field(default="", compare=False)
    spec: PackSpec = field(default_factory=PackSpec)
    fixed_rate: ClassVar[bool] = False  # its size is its own: compress needs no budget
    prerope: ClassVar[bool] = False  # keys packed before RoPE (an RDKV option)

    @property
    def all_queries(self) -> bool:
        """Whether it weighs by every prefill query (then ``rdkv.record(model, all_queries=True)``)."""
        return False

    def options(self) -> dict[str, tuple[str | None, str]]:
        """Keyword options :meth:`with_options` takes: name -> (field holding a part or None, field name)."""
        spec = {f.name: ("spec", f.name) for f in fields(PackSpec)}
        return {**{f.name: (None, f.name) for f in fields(self) if f.name != "name"}, **spec}

    def with_options(self, **options) -> Method:
        """A copy with keyword options applied (``compress(rec, b, method=m, **options)``)."""
        paths = self.options()
        unknown = sorted(set(options) - set(paths))
        if unknown:
            raise RDKVError(f"unknown option(s) {unknown} for {self.name or type(self).__name__}; it takes "
                            f"{sorted(paths)}")
        parts: dict[str, dict] = {}
        top = {}
        for key, value in options.items():
            part, name = paths[key]
            if part is None:
                top[name] = value
            else:
                parts.setdefault(part, {})[name] = value
        try:
            m = replace(self, **top)  # a whole part (spec=PackSpec(...)) first, then single fields of parts
            return replace(m, **{p: replace(getattr(m, p), **kw) for p, kw in parts.items()})
        except TypeError as e:  # a value of the wrong kind for a field's check
            raise RDKVError(f"bad option value for {self.name or type(self).__name__}: {e}") from e

    def for_record(self, rec: Record) -> Method:
        """The method as it runs on ``rec`` (an RDKV method fills in its query window); raises when the record
        lacks what the method needs."""
        return self

    def allocate(self, rec: Record, layers: list[HeldLayer], fp16: list[int], budget: float | None) -> Allocation:
        raise NotImplementedError
