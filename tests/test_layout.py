"""rdkv.layout owns the packed segment: nobody else names its tensors, and its plan of offsets is what the tensors hold."""
import re
from pathlib import Path

import torch

from rdkv import layout, quant
from rdkv.layout import PackSpec
from rdkv.trizone import pack_layer

ROOT = Path(__file__).resolve().parents[1]
# every name the layout stores a tensor under, as source code would spell it
STORAGE_KEY = re.compile(r"""["'](v_counts|pos|k_perm|k_bits|rope|kc|vc|qwin|v16|k16|k0\.mean)["']|"""
                         r"""["'][vk]\{?\w*\}?\.(codes|scale|zero)["']""")
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


def test_plan_matches_what_the_tensors_hold():
    """Unsorted block widths (a stream's blocks in any order), empty streams and every width: each stream's blocks
    point at their own pairs, and each width's rows and groups add up to its stored tensors."""
    g = torch.Generator().manual_seed(3)
    B, H, T, D = 2, 3, 50, 64
    spec = PackSpec(v_group=16, k_group=8, k_block=16)
    widths = torch.tensor(quant.WIDTHS)
    vw = widths[torch.randint(0, 5, (B, H, T), generator=g)]
    vw[1, 2] = 0  # a stream that keeps nothing
    kb = widths[torch.randint(0, 5, (B, H, D // 16), generator=g)]
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(B * H)]).view(B, H, D)
    layer = pack_layer(torch.randn(B, H, T, D, generator=g), torch.randn(B, H, T, D, generator=g), 0, vw, kb, perm, spec,
                       torch.float16, None, T)
    p = layout.plan(layer)
    assert layout.plan(layer) is p  # built once
    S, n = B * H, (vw > 0).reshape(B * H, T).sum(1)
    assert torch.equal(p.n, n) and p.n[5] == 0
    bits = layout.k_bits(layer).long()
    assert (bits[:, 1:] >= bits[:, :-1]).all()  # stored sorted by width, whatever order the blocks came in
    assert torch.equal(layer.k_widths(), kb.repeat_interleave(16, -1).gather(-1, perm.argsort(-1)))
    for s in range(S):
        for blk in range(D // 16):  # each block's offsets are its own pair's
            pair = ((p.pair_stream == s) & (p.pair_block == blk)).nonzero().item()
            assert (p.block_row0[s, blk], p.block_group0[s, blk]) == (p.pair_row0[pair], p.pair_group0[pair])
            assert p.pair_width[pair] == bits[s, blk]
        assert p.block_width_start[s].tolist() == [0] + [int((bits[s] <= w).sum()) for w in quant.WIDTHS]
    for w in quant.WIDTHS:
        stored, tok = layout.k_rows(layer, w), p.k_tokens(w)
        pairs = int(p.width_pairs[quant.OPTION[w] + 1] - p.width_pairs[quant.OPTION[w]])
        assert len(stored.values) == (pairs if w == 0 else len(tok.token))
        if stored.scale is not None:
            assert len(stored.scale) == int(-(-n[p.pair_stream[p.pair_width == w]] // spec.k_group).sum())
            assert tok.group.max() < len(stored.scale) if len(tok.group) else True
    for c, w in enumerate(layout.V_CLASSES):
        assert len(layout.v_rows(layer, w).values) == int(p.counts[:, c].sum())
    host = p.host
    assert all(torch.equal(torch.from_numpy(host.__dict__[f]), getattr(p, f).cpu())
               for f in ("n", "pair_row0", "pair_group0", "pair_stream", "pair_width"))
