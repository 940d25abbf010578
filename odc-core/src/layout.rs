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
//!
//! A **blocked** layout (ZeRO++-style hybrid sharding, `hybrid-zero`) cuts
//! the bucket into `G · N` blocks of `block_len` elements and gives owner
//! `o` of G the N blocks `o, G + o, 2G + o, …`: block `n · G + o` is local
//! block n of owner o's shard (`shard_len = N · block_len`). With one block
//! per owner it is the contiguous layout above. Blocks are dealt round-robin
//! so that block r of the bucket is rank r's piece when rank r is local
//! rank `o = r mod G` on node `n = r div G`: the 1/D shard FSDP2 gives rank
//! r under full sharding is exactly the piece whose optimizer state it
//! owns, and the node shard of local rank o is made of its node column's
//! pieces.

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
    blocks: usize,
    block_len: usize,
    shard_len: usize,
}

impl BucketLayout {
    /// Lays `spec` out over `world` ranks.
    pub fn new(spec: BucketSpec, world: usize) -> Result<BucketLayout> {
        BucketLayout::blocked(spec, world, 1)
    }

    /// Lays `spec` out over `world` owners in `blocks` blocks each, dealt
    /// round-robin (see the module doc).
    pub fn blocked(spec: BucketSpec, world: usize, blocks: usize) -> Result<BucketLayout> {
        if world == 0 || blocks == 0 {
            return Err(Error::Config("world and blocks must be positive".into()));
        }
        if spec.numel == 0 {
            return Err(Error::layout(
                Some(&spec.name),
                "a bucket must have at least one element",
            ));
        }
        // Elements per ALIGN_BYTES in the narrowest of (dtype, f32).
        let align = ALIGN_BYTES / spec.dtype.size_bytes().min(DType::F32.size_bytes());
        let block_len = spec.numel.div_ceil(world * blocks).div_ceil(align) * align;
        Ok(BucketLayout {
            spec,
            world,
            blocks,
            block_len,
            shard_len: block_len * blocks,
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

    /// Blocks per owner (1 unless blocked).
    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Elements per block (`shard_len` unless blocked).
    pub fn block_len(&self) -> usize {
        self.block_len
    }

    /// Bytes per block in the parameter dtype.
    pub fn block_bytes(&self) -> usize {
        self.block_len * self.spec.dtype.size_bytes()
    }

    /// The bucket element that element `local` of owner `owner`'s shard is.
    pub fn global_of(&self, owner: usize, local: usize) -> usize {
        let (n, within) = (local / self.block_len, local % self.block_len);
        (n * self.world + owner) * self.block_len + within
    }

    /// The owner of bucket element `global` and its element in that shard.
    pub fn owner_of(&self, global: usize) -> (usize, usize) {
        let (block, within) = (global / self.block_len, global % self.block_len);
        (
            block % self.world,
            block / self.world * self.block_len + within,
        )
    }

    /// The end (in shard elements) of the block holding shard element
    /// `local`: a run of shard elements that is contiguous in the bucket
    /// never crosses it.
    pub fn block_end(&self, local: usize) -> usize {
        (local / self.block_len + 1) * self.block_len
    }

    /// Element range of shard `rank` in the padded bucket (one block per
    /// owner only; a blocked layout has [`segments`](Self::segments)).
    pub fn shard_range(&self, rank: usize) -> Range<usize> {
        debug_assert_eq!(self.blocks, 1);
        rank * self.shard_len..(rank + 1) * self.shard_len
    }

    /// Owner `owner`'s shard as runs contiguous in the bucket:
    /// `(first shard element, first bucket element, elements)`.
    pub fn segments(&self, owner: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        (0..self.blocks).map(move |n| {
            (
                n * self.block_len,
                (n * self.world + owner) * self.block_len,
                self.block_len,
            )
        })
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
    ///
    /// Blocked layouts too give one range: the blocks a contiguous part of
    /// the bucket touches are consecutive in the owner's shard, and every
    /// one but the first and the last is covered whole.
    pub fn shard_overlap(&self, rank: usize, start: usize, end: usize) -> Range<usize> {
        let (mut lo, mut hi) = (usize::MAX, 0);
        for (local, global, len) in self.segments(rank) {
            let (a, b) = (start.max(global), end.min(global + len));
            if a < b {
                lo = lo.min(local + a - global);
                hi = hi.max(local + b - global);
            }
        }
        if lo >= hi {
            0..0
        } else {
            lo..hi
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

    #[test]
    fn blocked_deals_blocks_round_robin() {
        // 2 owners x 3 blocks of 16 f32: owner 1 holds blocks 1, 3, 5.
        let l = BucketLayout::blocked(BucketSpec::new("z", 90, DType::F32), 2, 3).unwrap();
        assert_eq!((l.block_len(), l.shard_len(), l.padded_len()), (16, 48, 96));
        let segs: Vec<_> = l.segments(1).collect();
        assert_eq!(segs, vec![(0, 16, 16), (16, 48, 16), (32, 80, 16)]);
        assert_eq!(l.global_of(1, 17), 49);
        assert_eq!(l.owner_of(49), (1, 17));
        assert_eq!(l.block_end(17), 32);
        // Bucket [20, 70) touches owner 1's blocks 1 (from 20) and 3 (whole),
        // owner 0's blocks 2 (whole) and 4 (to 70).
        assert_eq!(l.shard_overlap(1, 20, 70), 4..32);
        assert_eq!(l.shard_overlap(0, 20, 70), 16..38);
    }

    proptest! {
        #[test]
        fn blocked_overlap_is_exact(numel in 1usize..4000, world in 1usize..5, blocks in 1usize..4,
                                    a in 0usize..5000, len in 0usize..5000) {
            let l = BucketLayout::blocked(BucketSpec::new("x", numel, DType::F32), world, blocks).unwrap();
            let (start, end) = (a.min(l.padded_len()), (a + len).min(l.padded_len()));
            for o in 0..world {
                let r = l.shard_overlap(o, start, end);
                let want: Vec<usize> = (0..l.shard_len())
                    .filter(|&x| (start..end).contains(&l.global_of(o, x)))
                    .collect();
                prop_assert_eq!(r.clone().collect::<Vec<_>>(), want);
                for x in r {
                    prop_assert_eq!(l.owner_of(l.global_of(o, x)), (o, x));
                }
            }
        }

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
