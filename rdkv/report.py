"""What a compressed cache kept, at which width, and what every byte is spent on."""
from __future__ import annotations

from dataclasses import dataclass

from . import pages, quant
from .layout import COMPONENTS


def layer_components(layer) -> dict[str, int]:
    """Bytes one TriZone layer holds (its folds included), per accounting bucket."""
    comps = dict.fromkeys(COMPONENTS, 0)
    for seg in layer.segments():
        for k, v in pages.component_bytes(seg).items():
            comps[k] += v
    return comps


@dataclass
class Report:
    """Per (layer, sequence, kv head): V tokens and K channels per width; bytes per component."""

    rows: list[dict]
    components: dict[str, int]
    nbytes: int
    fp16_bytes: int
    tokens: int  # prefix tokens (logical positions) per sequence
    method: str | None = None  # what compress ran
    layer_distortion: tuple[float, ...] | None = None  # the solver's modelled distortion per layer (RDKV methods)

    @classmethod
    def of(cls, cache) -> Report:
        rows, comps = [], dict.fromkeys(COMPONENTS, 0)
        for li, layer in enumerate(cache.layers):
            for k, v in layer_components(layer).items():
                comps[k] += v
            vw, kw = layer.v_widths(), layer.k_widths()
            for b in range(layer.batch):
                for h in range(layer.heads):
                    row = {"layer": li, "seq": b, "head": h}
                    row |= {f"v{w}": int((vw[b, h] == w).sum()) for w in quant.WIDTHS}
                    row |= {f"k{w}": int((kw[b, h] == w).sum()) for w in quant.WIDTHS}
                    rows.append(row)
        batch = cache.layers[0].batch
        return cls(rows, comps, cache.nbytes, cache.fp16_bytes, cache.layers[0].prefix_len * batch, cache.method,
                   cache.layer_distortion)

    def distortion_lines(self) -> list[str]:
        """The modelled distortion and the three layers that hold most of it (where the budget bites); none
        for baselines."""
        d = self.layer_distortion
        if not d:
            return []
        top = sorted(range(len(d)), key=lambda i: -d[i])[:3]
        most = "; most in layers " + ", ".join(f"{i} ({d[i] / sum(d):.0%})" for i in top) if sum(d) > 0 else ""
        return [f"modelled distortion: {sum(d):.4g} (solver units){most}"]

    def totals(self) -> dict[str, int]:
        keys = [k for k in self.rows[0] if k[0] in "vk"]
        return {k: sum(r[k] for r in self.rows) for k in keys}

    def __str__(self) -> str:
        tot = self.totals()
        v_all = sum(tot[f"v{w}"] for w in quant.WIDTHS)
        k_all = sum(tot[f"k{w}"] for w in quant.WIDTHS)
        lines = [
            f"TriZoneCache{f' ({self.method})' if self.method else ''}: {self.nbytes:,} B = {self.nbytes / self.fp16_bytes:.4f} of fp16 ({self.fp16_bytes:,} B), "
            f"{self.nbytes / self.tokens:.1f} B per prefix token",
            "V tokens by width:  " + "  ".join(f"{w:>2}b {tot[f'v{w}'] / v_all:6.1%}" for w in quant.WIDTHS)
            + "   (0b = evicted)",
            "K channels by width:" + "  ".join(f"{w:>2}b {tot[f'k{w}'] / k_all:6.1%}" for w in quant.WIDTHS),
            "bytes by component: " + "  ".join(f"{k} {v:,}" for k, v in self.components.items()),
            *self.distortion_lines(),
            "",
            "| layer | seq | head | " + " | ".join(f"V{w}" for w in quant.WIDTHS) + " | "
            + " | ".join(f"K{w}" for w in quant.WIDTHS) + " |",
            "|" + "---|" * (3 + 2 * len(quant.WIDTHS)),
        ]
        for r in self.rows:
            lines.append("| " + " | ".join(str(v) for v in r.values()) + " |")
        return "\n".join(lines)
