//! Bucket geometry: padded shard lengths, shard ranges, and the cutting of a
//! range into chunks of at most `chunk_bytes`. Pure arithmetic; owns no memory.
//!
//! A bucket of `numel` elements is split across D ranks into shards of
//! `shard_len = ceil(numel / D)` elements, rounded up so that a shard spans
//! a whole number of [`ALIGN_BYTES`] in the bucket's dtype (and in the f32
//! accumulator). Shard r covers `[r*shard_len, (r+1)*shard_len)` of the
//! padded bucket of `D*shard_len` elements. Callers may hand the engine a
//! full bucket of either `numel` elements (the tail of the last shards is
//! then implicit padding) or `D*shard_len` elements.

use std::ops::Range;

use odc_kernels::DType;

use crate::{Error, Result};

/// Shards start on this many bytes, in the bucket's dtype and in f32.
pub const ALIGN_BYTES: usize = 64;

/// One bucket as the user declares it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketSpec {
    /// Unique name (an FSDP parameter group, e.g. `"layers.3"`).
    pub name: String,
    /// Elements in the flattened, unpadded bucket.
    pub numel: usize,
    /// Element type of parameters (and, by default, gradients).
    pub dtype: DType,
}

impl BucketSpec {
    /// A bucket named `name` of `numel` elements of `dtype`.
    pub fn new(name: impl Into<String>, numel: usize, dtype: DType) -> BucketSpec {
        BucketSpec {
            name: name.into(),
            numel,
            dtype,
        }
    }

    /// `name numel dtype`, as registration errors print it.
    pub fn describe(&self) -> String {
        format!("{} numel={} dtype={}", self.name, self.numel, self.dtype)
    }
}

/// The geometry of one registered bucket in a world of D ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketLayout {
    spec: BucketSpec,
    world: usize,
    shard_len: usize,
}

impl BucketLayout {
    /// Lays `spec` out over `world` ranks.
    pub fn new(spec: BucketSpec, world: usize) -> Result<BucketLayout> {
        if world == 0 {
            return Err(Error::Config("world must be positive".into()));
        }
        if spec.numel == 0 {
            return Err(Error::layout(
                Some(&spec.name),
                "a bucket must have at least one element",
            ));
        }
        // Elements per ALIGN_BYTES in the narrowest of (dtype, f32).
        let align = ALIGN_BYTES / spec.dtype.size_bytes().min(DType::F32.size_bytes());
        let shard_len = spec.numel.div_ceil(world).div_ceil(align) * align;
        Ok(BucketLayout {
            spec,
            world,
            shard_len,
        })
    }

    /// The bucket as declared.
    pub fn spec(&self) -> &BucketSpec {
        &self.spec
    }

    /// The bucket's name.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// Parameter dtype.
    pub fn dtype(&self) -> DType {
        self.spec.dtype
    }

    /// Unpadded element count.
    pub fn numel(&self) -> usize {
        self.spec.numel
    }

    /// Elements per shard (padded).
    pub fn shard_len(&self) -> usize {
        self.shard_len
    }

    /// Bytes per shard in the parameter dtype.
    pub fn shard_bytes(&self) -> usize {
        self.shard_len * self.spec.dtype.size_bytes()
    }

    /// D · shard_len.
    pub fn padded_len(&self) -> usize {
        self.shard_len * self.world
    }

    /// Element range of shard `rank` in the padded bucket.
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        rank * self.shard_len..(rank + 1) * self.shard_len
    }

    /// Checks that a full-bucket buffer of `elems` elements is acceptable
    /// (either `numel` or `D*shard_len`) and returns its length.
    pub fn check_full_len(&self, elems: usize) -> Result<usize> {
        if elems == self.spec.numel || elems == self.padded_len() {
            Ok(elems)
        } else {
            Err(Error::layout(
                Some(self.name()),
                format!(
                    "buffer holds {elems} elements; expected the full bucket: {} (numel) or {} (padded)",
                    self.spec.numel,
                    self.padded_len()
                ),
            ))
        }
    }

    /// Checks that `elems` elements starting at element `offset` fit the
    /// padded bucket; returns the end.
    pub fn check_range(&self, offset: usize, elems: usize) -> Result<usize> {
        offset
            .checked_add(elems)
            .filter(|&e| e <= self.padded_len())
            .ok_or_else(|| {
                Error::layout(
                    Some(self.name()),
                    format!(
                        "{elems} elements at offset {offset} overrun the padded bucket of {} elements",
                        self.padded_len()
                    ),
                )
            })
    }

    /// The part of shard `rank` covered by `[start, end)` of the bucket, as a
    /// range relative to the shard's first element; empty when they miss.
    pub fn shard_overlap(&self, rank: usize, start: usize, end: usize) -> Range<usize> {
        let shard = self.shard_range(rank);
        let lo = start.max(shard.start);
        let hi = end.min(shard.end);
        if lo >= hi {
            0..0
        } else {
            lo - shard.start..hi - shard.start
        }
    }
}

/// Cuts `range` into consecutive pieces of at most `chunk` elements.
pub fn chunks(range: Range<usize>, chunk: usize) -> impl Iterator<Item = Range<usize>> {
    let chunk = chunk.max(1);
    let end = range.end;
    (range.start..end)
        .step_by(chunk)
        .map(move |s| s..(s + chunk).min(end))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn pads_to_alignment() {
        let l = BucketLayout::new(BucketSpec::new("a", 100, DType::F32), 3).unwrap();
        assert_eq!(l.shard_len(), 48); // ceil(100/3)=34 -> 48 (16 f32 per 64 B)
        assert_eq!(l.shard_range(2), 96..144);
        assert!(l.check_full_len(100).is_ok() && l.check_full_len(144).is_ok());
        assert!(l.check_full_len(101).is_err());
        let l = BucketLayout::new(BucketSpec::new("b", 100, DType::BF16), 2).unwrap();
        assert_eq!(l.shard_len(), 64);
        assert_eq!(l.shard_bytes(), 128);
        assert!(BucketLayout::new(BucketSpec::new("c", 0, DType::F32), 2).is_err());
    }

    #[test]
    fn overlap_is_relative_to_shard() {
        let l = BucketLayout::new(BucketSpec::new("a", 64, DType::F32), 2).unwrap();
        assert_eq!(l.shard_overlap(1, 0, 40), 0..8);
        assert_eq!(l.shard_overlap(0, 40, 64), 0..0);
        assert_eq!(l.shard_overlap(0, 10, 20), 10..20);
    }

    proptest! {
        #[test]
        fn chunks_tile_the_range(start in 0usize..1000, len in 0usize..5000, chunk in 1usize..700) {
            let mut next = start;
            for c in chunks(start..start + len, chunk) {
                prop_assert_eq!(c.start, next);
                prop_assert!(c.len() <= chunk && !c.is_empty());
                next = c.end;
            }
            prop_assert_eq!(next, start + len);
        }

        #[test]
        fn shards_cover_bucket(numel in 1usize..100_000, world in 1usize..9) {
            let l = BucketLayout::new(BucketSpec::new("x", numel, DType::BF16), world).unwrap();
            prop_assert!(l.padded_len() >= numel);
            prop_assert!(l.padded_len() - numel < world * 32 + world);
            prop_assert_eq!(l.shard_bytes() % ALIGN_BYTES, 0);
            prop_assert_eq!((l.shard_len() * 4) % ALIGN_BYTES, 0);
        }
    }
}
