"""The compressed chunks' formats (bf16, fp8 e4m3, int8 with f32 block scales) against a NumPy reference.

The reference below is written from the formats' definitions, not from the kernels: per block, ``scale =
amax / qmax`` over the finite magnitudes (0 for an all-zero block, at least the smallest normal f32), codes
from ``x * (1 / scale)`` clamped to the format's range, fp8 by a nearest-even search over every code's value
(and against torch's own ``float8_e4m3fn`` cast), int8 by ``np.rint`` (half to even). Non-finite elements are
carried as NaN codes, as torch's casts carry them into ``float8_e4m3fn``. Error feedback loses nothing over a
run: what was pushed (dequantised) plus the residual still held equals the sum of the gradients, but for the
f32 rounding of each ``grad + residual``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import odc
from odc import _odc

QMAX = {"fp8": np.float32(448.0), "int8": np.float32(127.0)}
TINY = np.float32(np.finfo(np.float32).tiny)


def values(n: int, seed: int, specials: bool = True) -> np.ndarray:
    """Float32 values over many magnitudes, both signs; with NaN, infinities, signed zeros, ties."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 8, n))).astype(np.float32)
    if specials and n > 8:
        picks = rng.choice(n, size=max(1, n // 25), replace=False)
        pool = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, 3.4e38, -2.5], dtype=np.float32)
        x[picks] = pool[rng.integers(0, len(pool), len(picks))]
    return x


# ---- the reference --------------------------------------------------------------------------------------


def fp8_table() -> np.ndarray:
    """The float32 value of every e4m3fn code, from the format's definition (NaN for S.1111.111)."""
    out = np.empty(256, dtype=np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> 3) & 0xF, code & 7
        if code & 0x7F == 0x7F:
            out[code] = np.nan
        elif e == 0:
            out[code] = sign * m * 2.0**-9
        else:
            out[code] = sign * (1 + m / 8) * 2.0 ** (e - 7)
    return out


FP8 = fp8_table()


def fp8_nearest(v: np.ndarray) -> np.ndarray:
    """e4m3fn codes of finite ``|v| <= 448``: the nearest code value, ties to the even code."""
    positive = FP8[:0x7F]  # codes 0..0x7e, increasing
    a = np.abs(v).astype(np.float64)
    hi = np.clip(np.searchsorted(positive, a), 1, 0x7E)
    lo = hi - 1
    d_lo = a - positive[lo]
    d_hi = positive[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    sign = np.signbit(v).astype(np.int64) << 7
    return (code | sign).astype(np.uint8)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (nearest, ties to even); a NaN stays NaN (quiet)."""
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = ((bits >> 16) | 0x40) & 0xFFFF
    return np.where(np.isnan(x), nan, rounded).astype(np.uint16)


def ref_quantise(fmt: str, block: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if fmt == "bf16":
        return bf16_bits(x), np.zeros(0, dtype=np.float32)
    n = len(x)
    codes = np.zeros(n, dtype=np.uint8)
    scales = np.zeros(-(-n // block), dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for b in range(len(scales)):
            xb = x[b * block : (b + 1) * block]
            a = np.abs(xb)
            finite = np.isfinite(xb)
            amax = a[finite].max() if finite.any() else np.float32(0)
            if amax == 0:
                scale, inv = np.float32(0), np.float32(0)
            else:
                scale = max(np.float32(amax / QMAX[fmt]), TINY)
                inv = np.float32(1) / scale
            scales[b] = scale
            q = np.clip(xb * inv, -QMAX[fmt], QMAX[fmt]).astype(np.float32)
            if fmt == "fp8":
                c = np.where(finite, fp8_nearest(np.where(finite, q, 0)), 0x7F | (np.signbit(xb).astype(np.uint8) << 7))
            else:
                c = np.where(finite, np.rint(np.where(finite, q, 0)), -128).astype(np.int8).view(np.uint8)
            codes[b * block : (b + 1) * block] = c
    return codes, scales


def ref_values(fmt: str, block: int, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Dequantised float32: value(code) * scale, one f32 multiply."""
    if fmt == "bf16":
        return (codes.astype(np.uint32) << 16).view(np.float32)
    if fmt == "fp8":
        v = FP8[codes]
    else:
        c = codes.view(np.int8)
        v = np.where(c == -128, np.float32(np.nan), c.astype(np.float32))
    return (v * np.repeat(scales, block)[: len(codes)]).astype(np.float32)


# ---- calling the kernels ----------------------------------------------------------------------------------


def kernel_quantise(fmt: str, block: int, x: np.ndarray, as_torch: bool) -> tuple[np.ndarray, np.ndarray]:
    payload_bytes, nscales = _odc.quant_sizes(fmt, block, len(x))
    payload_dtype = np.uint16 if fmt == "bf16" else np.uint8
    payload = np.zeros(payload_bytes // np.dtype(payload_dtype).itemsize, dtype=payload_dtype)
    scales = np.full(nscales, -1.0, dtype=np.float32)
    if as_torch:
        tp = torch.zeros(len(payload), dtype=torch.bfloat16 if fmt == "bf16" else torch.uint8)
        ts = torch.from_numpy(scales)
        _odc.quantise(fmt, block, torch.from_numpy(x), tp, ts)
        payload = tp.view(torch.int16).numpy().view(np.uint16) if fmt == "bf16" else tp.numpy()
    else:
        _odc.quantise(fmt, block, x, payload, scales)
    return payload, scales


def assert_same_floats(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal bits, or both NaN."""
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    bad = np.flatnonzero(~same)
    assert bad.size == 0, f"{what}: {bad.size} differ, first at {bad[0]}: got {got[bad[0]]!r}, want {want[bad[0]]!r}"


FORMATS = ["bf16", "fp8", "int8"]
LENGTHS = [1, 31, 32, 33, 1000, 4099]


@pytest.mark.parametrize("as_torch", [False, True], ids=["numpy", "torch"])
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_matches_the_numpy_reference(fmt, block, as_torch):
    for n in LENGTHS:
        x = values(n, seed=n + block)
        want_codes, want_scales = ref_quantise(fmt, block, x)
        codes, scales = kernel_quantise(fmt, block, x, as_torch)
        assert np.array_equal(codes, want_codes), (
            f"{fmt}/{block} n={n}: codes differ at {np.flatnonzero(codes != want_codes)[:5]}"
        )
        assert_same_floats(scales, want_scales, f"{fmt}/{block} n={n}: scales")
        want = ref_values(fmt, block, want_codes, want_scales)
        out = np.full(n, 7.0, dtype=np.float32)
        _odc.dequantise(fmt, block, codes, scales, out)
        assert_same_floats(out, want, f"{fmt}/{block} n={n}: dequantise")
        # Into bfloat16: the float32 result rounded once.
        out16 = torch.zeros(n, dtype=torch.bfloat16)
        _odc.dequantise(fmt, block, codes, scales, out16)
        got16 = out16.view(torch.int16).numpy().view(np.uint16)
        nan = np.isnan(want)
        assert np.array_equal(got16[~nan], bf16_bits(want)[~nan]), f"{fmt} n={n}: bf16 out"
        assert np.isnan(out16.float().numpy()[nan]).all(), f"{fmt} n={n}: bf16 NaN"
        # Dequantise-accumulate: acc + factor * (value * scale), each rounded in float32.
        acc = values(n, seed=3, specials=False)
        want_acc = (acc + np.float32(-0.5) * want).astype(np.float32)
        _odc.dequantise_accumulate(fmt, block, codes, scales, acc, -0.5)
        assert_same_floats(acc, want_acc, f"{fmt}/{block} n={n}: dequantise_accumulate")


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_ties_round_to_even(fmt):
    """Values exactly halfway between two codes (the block maximum set to qmax makes the scale 1)."""
    block = 32
    if fmt == "int8":
        ties = np.arange(-126, 127, dtype=np.float32) + np.float32(0.5)
    else:
        finite = FP8[:0x7E]
        ties = ((finite[:-1].astype(np.float64) + finite[1:]) / 2).astype(np.float32)
        ties = np.concatenate([ties, -ties])
    x = np.concatenate([ties, np.zeros(-len(ties) % block, dtype=np.float32)])
    x[::block] = QMAX[fmt]  # every block's maximum: scale 1
    codes, scales = kernel_quantise(fmt, block, x, as_torch=False)
    assert np.all(scales == 1)
    want, _ = ref_quantise(fmt, block, x)
    assert np.array_equal(codes, want), f"differ at {np.flatnonzero(codes != want)[:5]}"
    if fmt == "int8":
        assert codes.view(np.int8)[1:4].tolist() == [int(np.rint(v)) for v in x[1:4]]
    else:
        assert np.array_equal(codes, torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy())


@pytest.mark.torch_versions  # torch's own float8_e4m3fn cast changed between 2.11 and 2.15 (infinities)
@pytest.mark.parametrize("block", [32, 128])
def test_fp8_codes_are_torchs_float8_e4m3fn_cast(block):
    x = values(8192, seed=11)
    codes, scales = kernel_quantise("fp8", block, x, as_torch=False)
    inv = np.where(scales == 0, np.float32(0), np.float32(1) / np.where(scales == 0, 1, scales)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.clip(x * np.repeat(inv, block)[: len(x)], -448, 448).astype(np.float32)
    finite = np.isfinite(x)
    inf = np.isinf(x)
    # Finite values: torch's cast of the clamped, scaled value. NaN: torch's cast of the NaN (NaN, its sign kept).
    src = torch.from_numpy(np.where(finite, q, x))
    want = src.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(codes[~inf], want[~inf]), f"differ at {np.flatnonzero(codes[~inf] != want[~inf])[:5]}"
    # Infinities: NaN with the sign, as torch 2.11's cast (c10's fp8e4m3fn_from_fp32_value) makes them; torch
    # 2.15's cast saturates them to +-448 instead, which would hide an overflow from a loss scaler.
    assert inf.any()
    assert np.array_equal(codes[inf], np.where(np.signbit(x[inf]), 0xFF, 0x7F).astype(np.uint8))
    # And torch reads the codes back as the kernels do.
    back = np.empty(len(x), dtype=np.float32)
    _odc.dequantise("fp8", block, codes, scales, back)
    theirs = (
        torch.from_numpy(codes).view(torch.float8_e4m3fn).float() * torch.from_numpy(np.repeat(scales, block)[: len(x)])
    ).numpy()
    assert_same_floats(back, theirs, "torch's float8_e4m3fn read back")
    # What this torch's own cast makes of infinities: NaN (torch 2.11) or +-448 (saturating, torch 2.15).
    special = torch.tensor([np.inf, -np.inf, np.nan], dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
    assert special.tolist() in ([0x7F, 0xFF, 0x7F], [0x7E, 0xFE, 0x7F])


def test_bf16_is_torchs_cast():
    x = values(5000, seed=4)
    codes, _ = kernel_quantise("bf16", 32, x, as_torch=True)
    theirs = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(x)
    assert np.array_equal(codes[finite], theirs[finite])
    # NaN stays NaN (torch writes its canonical NaN; ODC keeps the sign and top payload bits).
    assert np.all((codes[~finite] & 0x7F80) == 0x7F80) and np.all(codes[~finite] & 0x7F)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_saturation_zero_blocks_and_non_finite(fmt):
    block = 32
    x = np.zeros(4 * block, dtype=np.float32)
    # Block 0: all zeros (with a -0.0). Block 1: the maximum and near-f32-max values saturate to the top code.
    x[1] = -0.0
    x[block : 2 * block] = np.linspace(-3e38, 3.3e38, block, dtype=np.float32)
    # Block 2: finite values with an infinity and a NaN among them: neither enters the scale.
    x[2 * block : 3 * block] = np.arange(block, dtype=np.float32) - 16
    x[2 * block + 3], x[2 * block + 4], x[2 * block + 5] = np.inf, -np.inf, np.nan
    # Block 3: tiny values, whose amax / qmax underflows: the scale is the smallest normal float32.
    x[3 * block : 4 * block] = np.float32(1e-41)
    codes, scales = kernel_quantise(fmt, block, x, as_torch=False)
    top = {"fp8": 0x7E, "int8": 127}[fmt]
    back = np.empty_like(x)
    _odc.dequantise(fmt, block, codes, scales, back)
    # Zero block: scale 0, zero codes (fp8 keeps -0.0's sign), zeros back; nothing divided by zero.
    assert scales[0] == 0
    assert set(codes[:block].tolist()) <= {0, 0x80}
    assert not back[:block].any()
    # Saturation: the block maximum takes the top code, and reads back as the maximum (to f32 rounding).
    assert scales[1] == np.float32(np.float32(3.3e38) / QMAX[fmt])
    assert codes[2 * block - 1] == top
    assert back[2 * block - 1] == np.float32(scales[1] * QMAX[fmt])
    assert abs(back[2 * block - 1] - np.float32(3.3e38)) <= np.spacing(np.float32(3.3e38))
    # Non-finite elements: NaN codes with the sign for fp8 (torch's cast), -128 for int8; the scale comes from
    # the finite values (amax 16); NaN back; the neighbours keep their precision.
    assert scales[2] == np.float32(16) / QMAX[fmt]
    nan_codes = {"fp8": [0x7F, 0xFF, 0x7F], "int8": [0x80, 0x80, 0x80]}[fmt]
    assert codes[2 * block + 3 : 2 * block + 6].tolist() == nan_codes
    assert np.isnan(back[2 * block + 3 : 2 * block + 6]).all()
    finite = np.isfinite(x[2 * block : 3 * block])
    err = np.abs(back[2 * block : 3 * block] - x[2 * block : 3 * block])[finite]
    bound = scales[2] / 2 if fmt == "int8" else np.abs(x[2 * block : 3 * block])[finite] / 16 + scales[2] * 2.0**-10
    assert np.all(err <= bound)
    # Tiny block: the scale floors at the smallest normal float32; values come back within half its step.
    assert scales[3] == TINY
    assert np.all(np.abs(back[3 * block :] - np.float32(1e-41)) <= TINY / 2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_error_feedback_loses_nothing_over_a_run(fmt):
    block, n, steps = 32, 3000, 200
    fb = _odc.ErrorFeedback(fmt, block)
    fb.register(5, n)
    payload_bytes, nscales = _odc.quant_sizes(fmt, block, n)
    payload = torch.zeros(
        payload_bytes // (2 if fmt == "bf16" else 1), dtype=torch.bfloat16 if fmt == "bf16" else torch.uint8
    )
    scales = torch.zeros(nscales, dtype=torch.float32)
    residual = np.zeros(n, dtype=np.float32)
    pushed = np.zeros(n, dtype=np.float64)
    given = np.zeros(n, dtype=np.float64)
    rounding = np.zeros(n, dtype=np.float64)
    rng = np.random.default_rng(0)
    for _ in range(steps):
        g = (rng.standard_normal(n) * np.exp2(rng.integers(-12, 2, n))).astype(np.float32)
        before = residual.copy()
        fb.push(5, 0, torch.from_numpy(g), payload, scales)
        deq = torch.zeros(n, dtype=torch.float32)
        _odc.dequantise(fmt, block, payload, scales, deq)
        pushed += deq.numpy()
        given += g
        # The one f32 rounding a push may lose: grad + residual.
        rounding += (g + before).astype(np.float64) - (g.astype(np.float64) + before)
        fb.residual(5, residual)
    held = pushed + residual
    assert np.allclose(held, given + rounding, rtol=0, atol=1e-12 * max(1.0, np.abs(given).max()))
    # The f32 rounding bound itself: half an ulp of each step's sum, at most.
    assert np.all(np.abs(held - given) <= steps * np.spacing(np.float32(np.abs(given).max() + 1)))
    if fmt != "bf16":
        # Without feedback the same pushes lose far more.
        assert np.abs(residual).max() > 0
        lost_once = np.abs(ref_values(fmt, block, *ref_quantise(fmt, block, g)) - g).max()
        assert np.abs(held - given).max() < lost_once / 10


def test_error_feedback_is_deterministic():
    def run() -> tuple[bytes, bytes]:
        fb = _odc.ErrorFeedback("int8", 32)
        fb.register(0, 100)
        payload, scales = np.zeros(100, dtype=np.int8), np.zeros(4, dtype=np.float32)
        out = b""
        for step in range(30):
            fb.push(0, 0, values(100, step, specials=False), payload, scales)
            out += payload.tobytes() + scales.tobytes()
        res = np.zeros(100, dtype=np.float32)
        fb.residual(0, res)
        return out, res.tobytes()

    assert run() == run()


def test_bad_buffers_and_settings_are_named():
    x = np.ones(64, dtype=np.float32)
    payload, scales = np.zeros(64, dtype=np.uint8), np.zeros(2, dtype=np.float32)
    with pytest.raises(odc.ConfigError, match="unknown compressed format"):
        _odc.quantise("int4", 32, x, payload, scales)
    with pytest.raises(odc.ConfigError, match="block size 33"):
        _odc.quantise("int8", 33, x, payload, scales)
    with pytest.raises(odc.LayoutError, match="src must be float32"):
        _odc.quantise("int8", 32, x.astype(np.float64), payload, scales)
    with pytest.raises(odc.LayoutError, match="payload is 63 bytes"):
        _odc.quantise("int8", 32, x, payload[:63], scales)
    with pytest.raises(odc.LayoutError, match="1 scales given"):
        _odc.quantise("int8", 32, x, payload, scales[:1])
    with pytest.raises(odc.LayoutError, match="not C-contiguous"):
        _odc.quantise("int8", 32, np.ones(128, dtype=np.float32)[::2], payload, scales)
    with pytest.raises(odc.LayoutError, match="not contiguous"):
        _odc.quantise("int8", 32, torch.ones(128)[::2], payload, scales)
    readonly = np.zeros(64, dtype=np.uint8)
    readonly.flags.writeable = False
    with pytest.raises(odc.LayoutError, match="read-only"):
        _odc.quantise("int8", 32, x, readonly, scales)
    with pytest.raises(odc.LayoutError, match="payload must be bfloat16"):
        _odc.quantise("bf16", 32, x, payload, scales[:0])
    with pytest.raises(odc.LayoutError, match=r"pass a CPU torch\.Tensor or a numpy\.ndarray"):
        _odc.quantise("int8", 32, [1.0] * 64, payload, scales)
    with pytest.raises(odc.LayoutError, match="overlap"):
        _odc.dequantise_accumulate("int8", 32, payload, scales, payload.view(np.float32))
    fb = _odc.ErrorFeedback("fp8", 32)
    with pytest.raises(odc.LayoutError, match="not registered"):
        fb.push(1, 0, x, payload, scales)
    fb.register(1, 64)
    with pytest.raises(odc.LayoutError, match="outside bucket 1"):
        fb.push(1, 32, x, payload, scales)
    assert (fb.format, fb.block) == ("fp8", 32)
