import torch
from hypothesis import given, settings, strategies as st

from rdkv import quant


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from(quant.PACKED), rows=st.integers(1, 9), bytes_=st.integers(1, 12), seed=st.integers(0, 99))
def test_pack_unpack_round_trip(bits, rows, bytes_, seed):
    g = torch.Generator().manual_seed(seed)
    n = bytes_ * 8 // bits
    codes = torch.randint(0, 1 << bits, (rows, n), generator=g, dtype=torch.uint8)
    packed = quant.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, bytes_)
    assert torch.equal(quant.unpack(packed, bits), codes)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from(quant.PACKED), group=st.sampled_from([4, 16, 64]), scale=st.floats(1e-3, 1e3),
       seed=st.integers(0, 99))
def test_quantize_error_is_half_a_step(bits, group, scale, seed):
    x = torch.randn(7, group, generator=torch.Generator().manual_seed(seed)) * scale
    codes, s, z = quant.quantize(x, bits)
    err = (quant.dequantize(codes, s, z) - x).abs()
    # half a quantization step, plus fp16 rounding of the zero point and of the scale, the latter
    # amplified by up to 2^b - 1 levels (relative 2^-11 when normal, absolute 2^-24 when subnormal)
    step, levels = s.float().unsqueeze(-1), (1 << bits) - 1
    bound = step / 2 + z.float().abs().unsqueeze(-1) * 2**-11 + levels * (step * 2**-11 + 2**-24) + 1e-7
    assert (err <= bound).all()


def test_constant_groups_and_outliers_are_exact_where_they_can_be():
    x = torch.full((3, 8), 0.3)
    x[1] = -7.25
    x[2, 0] = 1e4  # a huge outlier next to small values
    codes, s, z = quant.quantize(x, 2)
    y = quant.dequantize(codes, s, z)
    assert torch.equal(y[0], torch.full((8,), float(torch.tensor(0.3).half())))
    assert torch.equal(y[1], x[1])
    assert abs(y[2, 0] - 1e4) < 10 and (y[2, 1:] - 0.3).abs().max() < 1e-3  # 2-bit: small values sit on the zero


def test_row_bytes_match_packed_tensors():
    x = torch.randn(5, 64)
    for bits in quant.PACKED:
        codes, s, z = quant.quantize(x.view(5, 2, 32), bits)
        held = quant.pack(codes.flatten(-2), bits).numel() + 2 * s.numel() + 2 * z.numel()
        assert held == 5 * quant.row_bytes(bits, 64, 32)
    assert quant.row_bytes(16, 64, 32) == 128 and quant.row_bytes(0, 64, 32) == 0
