//! Error feedback: the pusher's quantisation residual, per bucket.
//!
//! A compressed push loses `t - dequantise(quantise(t))`. Error feedback
//! keeps that residual on the pusher and adds it to the next push of the
//! same elements, so over a run nothing is lost: the sum of everything
//! pushed (dequantised) plus the residual still held equals the sum of the
//! uncompressed gradients, up to the f32 rounding of each `grad + residual`
//! (the subtraction `t - dequantised` is exact: the dequantised value is 0
//! or within a factor of two of `t`).
//!
//! Deterministic: a push is a pure function of the gradient, the residual
//! and the [`Spec`]. A non-finite element is pushed as NaN (see the formats'
//! NaN rule in [`super`]) and leaves a zero residual, so one overflowed step
//! (a loss scaler's skipped step) does not poison later pushes.
//!
//! This type owns residual memory only; which bytes go to which owner is the
//! caller's business.

use std::collections::BTreeMap;

use super::{dequantise_accumulate_on, quantise_on, split_chunk_mut, Spec};
use crate::cpu::Level;
use crate::{Error, Result};

/// Quantisation residuals of one pusher, one f32 buffer per bucket.
#[derive(Debug, Clone)]
pub struct ErrorFeedback {
    spec: Spec,
    residuals: BTreeMap<usize, Vec<f32>>,
}

impl ErrorFeedback {
    /// No buckets yet; every push uses `spec`.
    pub fn new(spec: Spec) -> ErrorFeedback {
        ErrorFeedback {
            spec,
            residuals: BTreeMap::new(),
        }
    }

    /// The format pushes use.
    pub fn spec(&self) -> Spec {
        self.spec
    }

    /// Gives `bucket` a zero residual of `numel` elements; registering it
    /// again with the same `numel` keeps its residual.
    ///
    /// Errors: [`Error::InvalidArgument`] if `bucket` has another size.
    pub fn register(&mut self, bucket: usize, numel: usize) -> Result<()> {
        let held = self
            .residuals
            .entry(bucket)
            .or_insert_with(|| vec![0.0; numel]);
        if held.len() != numel {
            return Err(Error::InvalidArgument {
                op: "ErrorFeedback::register",
                detail: format!(
                    "bucket {bucket} holds a residual of {} elements, registered again with {numel}",
                    held.len()
                ),
            });
        }
        Ok(())
    }

    /// The residual of `bucket`, if registered.
    pub fn residual(&self, bucket: usize) -> Option<&[f32]> {
        self.residuals.get(&bucket).map(Vec::as_slice)
    }

    /// Zeroes every residual (e.g. when the run's membership changes).
    pub fn clear(&mut self) {
        for r in self.residuals.values_mut() {
            r.fill(0.0);
        }
    }

    /// [`ErrorFeedback::push`] into one chunk buffer laid out as
    /// [`super::quantise_chunk`] writes it (scales, then payload).
    ///
    /// Errors: as [`ErrorFeedback::push`], and as
    /// [`super::quantise_chunk`] for a chunk of the wrong size or
    /// alignment (the residual is then unchanged).
    pub fn push_chunk(
        &mut self,
        bucket: usize,
        offset: usize,
        grad: &[f32],
        chunk: &mut [u8],
    ) -> Result<()> {
        let (scales, payload) =
            split_chunk_mut("ErrorFeedback::push_chunk", self.spec, grad.len(), chunk)?;
        self.push(bucket, offset, grad, payload, scales)
    }

    /// Quantises `grad + residual` for elements `offset..offset +
    /// grad.len()` of `bucket` into `payload` and `scales` (sized as for
    /// [`super::quantise`]), and keeps `(grad + residual) - dequantised` as
    /// the new residual.
    ///
    /// Errors: [`Error::InvalidArgument`] for an unregistered bucket, a range
    /// outside it, or wrongly sized `payload` / `scales` (the residual is
    /// then unchanged).
    pub fn push(
        &mut self,
        bucket: usize,
        offset: usize,
        grad: &[f32],
        payload: &mut [u8],
        scales: &mut [f32],
    ) -> Result<()> {
        const OP: &str = "ErrorFeedback::push";
        let spec = self.spec;
        let residual = self.held_mut(OP, bucket, offset, grad.len())?;
        feedback_step(OP, spec, residual, grad, payload, scales)
    }

    /// The first half of a push split in two, for a sum that may be
    /// quantised again before it is consumed (hybrid sharding's cross-node
    /// sum, finished again before the accumulators are cleared: an elastic
    /// rerun, several minibatches per step): adds the residual of elements
    /// `offset..offset + acc.len()` of `bucket` into `acc` and zeroes it.
    /// Quantising `acc` (plain [`super::quantise_chunk`], as often as it
    /// changes) and then [`settle_chunk`](Self::settle_chunk) on what was
    /// quantised last give the codes and the residual one
    /// [`push`](Self::push) of the final `acc` would, bit for bit; a push
    /// would instead carry the first quantisation's error into the second
    /// and lose the residual it started from.
    ///
    /// Errors: as [`ErrorFeedback::push`] for the bucket and range (`acc`
    /// and the residual are then unchanged).
    pub fn fold(&mut self, bucket: usize, offset: usize, acc: &mut [f32]) -> Result<()> {
        let residual = self.held_mut("ErrorFeedback::fold", bucket, offset, acc.len())?;
        // acc + 1.0 · residual: the sum a push forms (f32 addition
        // commutes), and the residual now lives in `acc`.
        Level::current().accumulate(acc, residual, 1.0);
        residual.fill(0.0);
        Ok(())
    }

    /// The second half (see [`fold`](Self::fold)): once the sum is
    /// consumed, keeps `sent - dequantised` as the residual of elements
    /// `offset..offset + sent.len()` of `bucket`, where `sent` is what was
    /// quantised (the accumulators, the residual folded in) into `chunk`
    /// (laid out as [`super::quantise_chunk`] writes it), zero where that is
    /// not finite.
    ///
    /// Errors: as [`ErrorFeedback::push_chunk`] (the residual is then
    /// unchanged).
    pub fn settle_chunk(
        &mut self,
        bucket: usize,
        offset: usize,
        sent: &[f32],
        chunk: &[u8],
    ) -> Result<()> {
        const OP: &str = "ErrorFeedback::settle_chunk";
        let spec = self.spec;
        let (scales, payload) = super::split_chunk_op(OP, spec, sent.len(), chunk)?;
        let residual = self.held_mut(OP, bucket, offset, sent.len())?;
        residual.copy_from_slice(sent);
        settle(Level::current(), spec, payload, scales, residual)
    }

    /// The residual of elements `offset..offset + n` of `bucket`.
    fn held_mut(
        &mut self,
        op: &'static str,
        bucket: usize,
        offset: usize,
        n: usize,
    ) -> Result<&mut [f32]> {
        let Some(held) = self.residuals.get_mut(&bucket) else {
            return Err(Error::InvalidArgument {
                op,
                detail: format!("bucket {bucket} is not registered"),
            });
        };
        let len = held.len();
        offset
            .checked_add(n)
            .and_then(|end| held.get_mut(offset..end))
            .ok_or_else(|| Error::InvalidArgument {
                op,
                detail: format!(
                    "elements {offset}..{offset}+{n} are outside bucket {bucket} ({len} elements)"
                ),
            })
    }
}

/// One error-feedback push on caller-held residual memory (what
/// [`ErrorFeedback::push`] does to its own): quantises `grad + residual`
/// into `payload` and `scales` and leaves `(grad + residual) - dequantised`
/// in `residual` (zero where that is not finite).
///
/// Errors: [`Error::InvalidArgument`] for `residual` and `grad` of
/// different lengths or wrongly sized `payload` / `scales` (the residual is
/// then unchanged).
pub fn feedback_quantise(
    spec: Spec,
    residual: &mut [f32],
    grad: &[f32],
    payload: &mut [u8],
    scales: &mut [f32],
) -> Result<()> {
    const OP: &str = "feedback_quantise";
    if residual.len() != grad.len() {
        return Err(Error::InvalidArgument {
            op: OP,
            detail: format!(
                "a residual of {} elements for a gradient of {}",
                residual.len(),
                grad.len()
            ),
        });
    }
    feedback_step(OP, spec, residual, grad, payload, scales)
}

/// [`feedback_quantise`] into one chunk buffer laid out as
/// [`super::quantise_chunk`] writes it (scales, then payload).
pub fn feedback_quantise_chunk(
    spec: Spec,
    residual: &mut [f32],
    grad: &[f32],
    chunk: &mut [u8],
) -> Result<()> {
    let (scales, payload) = split_chunk_mut("feedback_quantise_chunk", spec, grad.len(), chunk)?;
    feedback_quantise(spec, residual, grad, payload, scales)
}

/// Elements a push's three passes (add, quantise, subtract) cover before
/// moving on, rounded up to whole blocks: 16 KiB of residual, so the
/// second and third pass read it from cache.
const TILE: usize = 4096;

/// The push's arithmetic on a residual of `grad`'s length, tile by tile
/// (whole blocks each: every element and block sees the same operations as
/// over the whole length at once).
fn feedback_step(
    op: &'static str,
    spec: Spec,
    residual: &mut [f32],
    grad: &[f32],
    payload: &mut [u8],
    scales: &mut [f32],
) -> Result<()> {
    spec.check(op, grad.len(), payload.len(), scales.len())?;
    let level = Level::current();
    let (n, tile, width) = (
        grad.len(),
        TILE.div_ceil(spec.block()) * spec.block(),
        spec.format().code_bytes(),
    );
    for start in (0..n).step_by(tile) {
        let end = (start + tile).min(n);
        let (r, p, s) = (
            &mut residual[start..end],
            &mut payload[start * width..end * width],
            &mut scales[spec.scales(start)..spec.scales(end)],
        );
        // t = grad + residual, held in the residual buffer.
        level.accumulate(r, &grad[start..end], 1.0);
        quantise_on(level, spec, r, p, s)?;
        settle(level, spec, p, s, r)?;
    }
    Ok(())
}

/// `t` (in `residual`) becomes `t + (-1) · dequantised = t - dequantised`,
/// zero where that is not finite.
fn settle(
    level: Level,
    spec: Spec,
    payload: &[u8],
    scales: &[f32],
    residual: &mut [f32],
) -> Result<()> {
    dequantise_accumulate_on(level, spec, payload, scales, residual, -1.0)?;
    for r in residual.iter_mut() {
        if !r.is_finite() {
            *r = 0.0;
        }
    }
    Ok(())
}
