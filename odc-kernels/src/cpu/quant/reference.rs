//! The portable kernels, one block at a time, written for clarity: the
//! definition the AVX2 path of [`super`] is tested against (and what the
//! portable path of the dispatched entry points computes).

use super::{amax_scalar, block_scale, decode, encode, Spec};
use crate::{Element, Result};

/// [`super::quantise`], scalar.
pub fn quantise(spec: Spec, src: &[f32], payload: &mut [u8], scales: &mut [f32]) -> Result<()> {
    spec.check("quantise", src.len(), payload.len(), scales.len())?;
    let Some(qmax) = spec.format.qmax() else {
        let out = super::bf16_view_mut("quantise", payload)?;
        for (o, &x) in out.iter_mut().zip(src) {
            *o = crate::cpu::reference::f32_to_bf16(x);
        }
        return Ok(());
    };
    for ((x, codes), s) in src
        .chunks(spec.block)
        .zip(payload.chunks_mut(spec.block))
        .zip(scales.iter_mut())
    {
        let (scale, inv) = block_scale(amax_scalar(x), qmax);
        *s = scale;
        for (c, &v) in codes.iter_mut().zip(x) {
            *c = encode(spec.format, v, inv);
        }
    }
    Ok(())
}

/// [`super::dequantise`], scalar.
pub fn dequantise<D: Element>(
    spec: Spec,
    payload: &[u8],
    scales: &[f32],
    dst: &mut [D],
) -> Result<()> {
    spec.check("dequantise", dst.len(), payload.len(), scales.len())?;
    if !spec.format.scaled() {
        let codes = super::bf16_view("dequantise", payload)?;
        return crate::cpu::reference::cast(codes, dst);
    }
    for ((codes, d), &scale) in payload
        .chunks(spec.block)
        .zip(dst.chunks_mut(spec.block))
        .zip(scales)
    {
        for (o, &c) in d.iter_mut().zip(codes) {
            *o = crate::cpu::reference::from_f32(decode(spec.format, c) * scale);
        }
    }
    Ok(())
}

/// [`super::dequantise_accumulate`], scalar.
pub fn dequantise_accumulate(
    spec: Spec,
    payload: &[u8],
    scales: &[f32],
    acc: &mut [f32],
    factor: f32,
) -> Result<()> {
    spec.check(
        "dequantise_accumulate",
        acc.len(),
        payload.len(),
        scales.len(),
    )?;
    if !spec.format.scaled() {
        let codes = super::bf16_view("dequantise_accumulate", payload)?;
        return crate::cpu::reference::accumulate(acc, codes, factor);
    }
    for ((codes, a), &scale) in payload
        .chunks(spec.block)
        .zip(acc.chunks_mut(spec.block))
        .zip(scales)
    {
        for (o, &c) in a.iter_mut().zip(codes) {
            *o += factor * (decode(spec.format, c) * scale);
        }
    }
    Ok(())
}
