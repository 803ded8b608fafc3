"""The pure pieces of scripts/eval_mechanisms.py on small random tensors (no real model).

The script's conclusions rest on two facts these tests pin down: the axis helper quantizes along
the axis it claims (so "per-channel" really shares a scale across tokens), and a key outlier
channel is what makes per-token key quantization lose at the score.
"""
import sys
from pathlib import Path

import torch
from conftest import tiny_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import eval_mechanisms as mech


def test_axis_groups_share_one_range():
    x = torch.randn(2, 40, 16)
    per_token = mech.fake_quant(x, 2, "token", 8)
    per_channel = mech.fake_quant(x, 2, "channel", 16)  # 40 tokens: groups of 16, 16 and a partial 8
    # 2 bits: at most 4 levels in each group, along the axis the group runs
    assert all(per_token[h, t, g * 8 : g * 8 + 8].unique().numel() <= 4
               for h in range(2) for t in range(40) for g in range(2))
    assert all(per_channel[h, a:b, c].unique().numel() <= 4
               for h in range(2) for c in range(16) for a, b in ((0, 16), (16, 32), (32, 40)))
    # the extremes of every group are kept (asymmetric min/max quantization, up to fp16 rounding)
    torch.testing.assert_close(per_channel[:, 32:].amax(1), x[:, 32:].amax(1), atol=1e-2, rtol=1e-3)
    kept = mech.with_window(x, 2, "channel", 16, window=5)
    assert torch.equal(kept[:, -5:], x[:, -5:]) and not torch.equal(kept[:, :-5], x[:, :-5])


def test_outlier_channel_favours_per_channel_keys_at_the_score():
    torch.manual_seed(0)
    k = torch.randn(1, 64, 32)
    k[..., 3] += 20.0  # a key outlier channel, as in real decoders
    layer = mech.Layer(q=torch.randn(2, 64, 32), k=k, v=torch.randn(1, 64, 32), scaling=32**-0.5)
    ok = layer.allowed()
    scores = layer.logits(k) * ok
    out = layer.attend(k, layer.v)
    tok = mech.key_errors(layer, mech.fake_quant(k, 2, "token", 32), scores, out)
    chan = mech.key_errors(layer, mech.fake_quant(k, 2, "channel", 32), scores, out)
    assert chan["score err"] * 5 < tok["score err"]
    assert chan["output err"] < tok["output err"]


def test_sparse_attention_favours_per_token_values_at_the_output():
    torch.manual_seed(0)
    layer = mech.Layer(q=torch.randn(1, 32, 16), k=torch.randn(1, 32, 16), v=torch.randn(1, 32, 16), scaling=0.25)
    layer.v[:, 0] *= 30.0  # a heavy "sink" value row inflates every per-channel group it sits in
    probs = torch.zeros(1, 32, 32)
    probs[..., 1] = 1.0  # all attention on one ordinary token
    tok = mech.value_errors(layer, mech.fake_quant(layer.v, 2, "token", 16), probs)
    chan = mech.value_errors(layer, mech.fake_quant(layer.v, 2, "channel", 32), probs)
    assert tok["output err"] * 5 < chan["output err"]


def test_capture_rebuilds_the_models_attention():
    model = tiny_llama()
    cap = mech.capture(model)
    cap.on = True
    model(torch.arange(1, 25)[None])
    assert sorted(cap.layers) == [0, 1]
    for layer in cap.layers.values():
        assert layer.q.shape == (4, 24, 32) and layer.k.shape == (2, 24, 32)
        torch.testing.assert_close(layer.attend(layer.k, layer.v), layer.out, atol=1e-5, rtol=1e-4)
    windowed = mech.Layer(q=torch.randn(1, 6, 4), k=torch.randn(1, 6, 4), v=torch.randn(1, 6, 4), scaling=0.5, window=2)
    assert windowed.allowed().sum(1).tolist() == [1, 2, 2, 2, 2, 2]
