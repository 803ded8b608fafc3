"""rdkv.layout and rdkv.pages own the stored segment: nobody else names its tensors, and the page plan of offsets is
what the tensors hold."""
import re
from pathlib import Path

import torch

from rdkv import layout, pages, quant
from rdkv.layout import PackSpec
from rdkv.trizone import pack_layer

ROOT = Path(__file__).resolve().parents[1]
# every name the layout stores a tensor under, as source code would spell it
STORAGE_KEY = re.compile(r"""["'](v_counts|k_perm|k_bits|rope|kc|vc|qwin)["']""")
PAGE_KEY = re.compile(r"""\.t\[["'](pages|k_mean)["']\]""")  # rdkv/pages.py's (a segment's tensors by name)


def test_only_the_layout_names_a_storage_key():
    """Readers go through the accessors: a module that indexed the tensors by name would break silently when the
    layout changes."""
    found = []
    for folder in ("rdkv", "kernels"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".c") or path == ROOT / "rdkv" / "layout.py":  # the owner
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0] if path.suffix == ".py" else line
                if STORAGE_KEY.search(code) or (PAGE_KEY.search(code) and path != ROOT / "rdkv" / "pages.py"):
                    found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "storage keys named outside rdkv/layout.py:\n" + "\n".join(found)


def test_page_plan_matches_what_the_tensors_hold():
    """Unsorted block widths (a stream's blocks in any order), an empty stream and every width: the plan is built
    once, its pages hold each stream's classes, its sections add up to the bytes stored, and the widths read back
    are the ones packed."""
    g = torch.Generator().manual_seed(3)
    B, H, T, D = 2, 3, 80, 64
    spec = PackSpec(v_group=16, k_group=16, k_block=16)
    widths = torch.tensor(quant.WIDTHS)
    vw = widths[torch.randint(0, 5, (B, H, T), generator=g)]
    vw[1, 2] = 0  # a stream that keeps nothing
    kb = widths[torch.randint(0, 5, (B, H, D // 16), generator=g)]
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(B * H)]).view(B, H, D)
    layer = pack_layer(torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g), 0, vw, kb, perm, spec,
                       torch.float16, None, T)
    p = pages.segment_plan(layer)
    assert pages.segment_plan(layer) is p and p.page == 16  # built once; 16 tokens: a page of k_group
    counts = torch.stack([(vw == w).sum(-1) for w in layout.V_CLASSES], -1).view(B * H, 4)
    assert torch.equal(p.counts, counts) and p.counts[5].sum() == 0
    assert torch.equal(p.pages, -(-counts // 16)) and p.total == pages.buffer(layer).numel()
    bits = layout.k_bits(layer).long()
    assert (bits[:, 1:] >= bits[:, :-1]).all()  # stored sorted by width, whatever order the blocks came in
    assert torch.equal(p.chans, torch.stack([(kb == w).sum(-1) for w in quant.WIDTHS], -1).view(B * H, 5) * 16)
    assert torch.equal(layer.k_widths(), kb.repeat_interleave(16, -1).gather(-1, perm.argsort(-1)))
    assert torch.equal(layer.v_widths(), vw)
    assert pages.k_means(layer).numel() == int(p.chans[:, 0].sum())
    # every section of a page starts on 16 bytes, and a page is its K sections, K scales/zeros, V and positions
    assert (p.page_size % 16 == 0).all() and (p.class_base % 16 == 0).all() and (p.v_off % 16 == 0).all()
    assert torch.equal(p.v_off, p.k_meta + 4 * p.chans[:, 1:4].sum(1))
