//! The hand-off of a client's **own slice** of a push to its own server
//! daemon, in the same process, without a copy through a landing slot.
//!
//! A push of bucket b covers every owner's shard, this rank's included.
//! Copying this rank's part into its own landing slot only to add it from
//! there costs a pass over the data, so the client posts a descriptor of
//! where the slice lies in its own buffer and the server adds straight from
//! it. The server stays the only writer of accumulators; it adds the slice
//! in chunks, fused with the peers' chunks for the same range when they
//! arrive (one pass over the accumulator instead of two).
//!
//! The client's buffer is borrowed only for the duration of
//! `scatter_accumulate`, so the client either waits until the server
//! reports the post [`done`](OwnPush::is_done) or [revokes](OwnPush::revoke)
//! it; after either, the server never touches the buffer again. Every read
//! of the buffer happens under a **claim** tagged with the post's
//! generation: the server claims (`FREE → BUSY`), reads one chunk and
//! unclaims; a revoke swaps `FREE → REVOKED`, waiting out a claim in
//! progress. A stale server (one that still holds an older generation)
//! cannot claim a newer post, because the generation is part of the word.
//!
//! This module is plain atomics (from [`crate::sync`]) so that the claim
//! protocol is model-checked under loom.

use crate::sync::{yield_now, AtomicU32, AtomicU64, AtomicUsize, Ordering};

const FREE: u64 = 0;
const BUSY: u64 = 1;
const REVOKED: u64 = 2;

fn tag(gen: u64, state: u64) -> u64 {
    (gen << 2) | state
}

/// Where a client's own slice lies and how to add it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct OwnSlice {
    /// Bucket index.
    pub(crate) bucket: usize,
    /// First element, relative to this rank's shard.
    pub(crate) offset: usize,
    /// Elements.
    pub(crate) len: usize,
    /// Address of the first element in the client's buffer.
    pub(crate) addr: usize,
    /// Element type code ([`odc_kernels::DType::as_u8`]).
    pub(crate) dtype: u8,
    /// Factor applied while accumulating.
    pub(crate) scale: f32,
}

/// The one hand-off word set of a rank (pushes serialize on the engine's
/// push lock, so at most one post is live).
#[derive(Debug, Default)]
pub(crate) struct OwnPush {
    posted: AtomicU64,
    done: AtomicU64,
    claim: AtomicU64,
    bucket: AtomicUsize,
    offset: AtomicUsize,
    len: AtomicUsize,
    addr: AtomicUsize,
    dtype: AtomicU32,
    scale: AtomicU32,
}

impl OwnPush {
    /// A hand-off with nothing posted.
    pub(crate) fn new() -> OwnPush {
        OwnPush::default()
    }

    /// Client: posts `slice` as generation `gen` (greater than every earlier
    /// one, and only after the earlier one is done or revoked).
    pub(crate) fn post(&self, gen: u64, slice: OwnSlice) {
        self.bucket.store(slice.bucket, Ordering::Relaxed);
        self.offset.store(slice.offset, Ordering::Relaxed);
        self.len.store(slice.len, Ordering::Relaxed);
        self.addr.store(slice.addr, Ordering::Relaxed);
        self.dtype.store(u32::from(slice.dtype), Ordering::Relaxed);
        self.scale.store(slice.scale.to_bits(), Ordering::Relaxed);
        self.claim.store(tag(gen, FREE), Ordering::Relaxed);
        self.posted.store(gen, Ordering::Release);
    }

    /// Client: whether the server has added all of post `gen` (acquire: the
    /// server's reads of the buffer happen before).
    pub(crate) fn is_done(&self, gen: u64) -> bool {
        self.done.load(Ordering::Acquire) >= gen
    }

    /// Client: withdraws post `gen`. On return the server neither reads the
    /// buffer now nor will later; it waits out a chunk being read.
    pub(crate) fn revoke(&self, gen: u64) {
        loop {
            match self.claim.compare_exchange(
                tag(gen, FREE),
                tag(gen, REVOKED),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return,
                Err(w) if w == tag(gen, BUSY) => yield_now(),
                // Revoked already, or a different generation: nothing of
                // `gen` can be claimed any more.
                Err(_) => return,
            }
        }
    }

    /// Server: the newest post, if it is newer than `seen`. The slice may be
    /// torn if the client reposts meanwhile; then its claim fails.
    pub(crate) fn take(&self, seen: u64) -> Option<(u64, OwnSlice)> {
        let gen = self.posted.load(Ordering::Acquire);
        if gen == seen {
            return None;
        }
        let slice = OwnSlice {
            bucket: self.bucket.load(Ordering::Relaxed),
            offset: self.offset.load(Ordering::Relaxed),
            len: self.len.load(Ordering::Relaxed),
            addr: self.addr.load(Ordering::Relaxed),
            dtype: u8::try_from(self.dtype.load(Ordering::Relaxed)).unwrap_or(u8::MAX),
            scale: f32::from_bits(self.scale.load(Ordering::Relaxed)),
        };
        Some((gen, slice))
    }

    /// Server: claims post `gen` for reading one chunk; `false` when it was
    /// revoked (or superseded): drop it without touching the buffer.
    pub(crate) fn claim(&self, gen: u64) -> bool {
        self.claim
            .compare_exchange(
                tag(gen, FREE),
                tag(gen, BUSY),
                Ordering::Acquire,
                Ordering::Relaxed,
            )
            .is_ok()
    }

    /// Server, once its thread has failed (panicked): frees a claim it
    /// still held (the read it was doing ended with the thread), so that the
    /// client's [`revoke`](Self::revoke) does not wait for it forever. The
    /// post is not reported done.
    pub(crate) fn abandon(&self) {
        let w = self.claim.load(Ordering::Acquire);
        if w & 3 == BUSY {
            // Only the server claims, and it is gone: no claim can race this.
            let _ = self.claim.compare_exchange(
                w,
                tag(w >> 2, FREE),
                Ordering::AcqRel,
                Ordering::Relaxed,
            );
        }
    }

    /// Server: ends a claim; with `finished`, also reports post `gen` done.
    pub(crate) fn unclaim(&self, gen: u64, finished: bool) {
        // Free the claim before reporting done: once the client sees done it
        // may post the next generation, whose claim word this must not
        // overwrite.
        self.claim.store(tag(gen, FREE), Ordering::Release);
        if finished {
            self.done.store(gen, Ordering::Release);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn slice() -> OwnSlice {
        OwnSlice {
            bucket: 0,
            offset: 0,
            len: 4,
            addr: 0x1000,
            dtype: 0,
            scale: 1.0,
        }
    }

    #[test]
    fn a_claim_left_by_a_failed_server_no_longer_holds_up_the_revoke() {
        let own = OwnPush::new();
        own.post(1, slice());
        assert!(own.claim(1)); // the server reads a chunk ... and its thread dies
        own.abandon();
        own.revoke(1); // returns: it waited for the BUSY claim forever before
        assert!(!own.is_done(1));
        assert!(!own.claim(1), "a revoked post cannot be claimed");
    }

    #[test]
    fn abandoning_without_a_claim_changes_nothing() {
        let own = OwnPush::new();
        own.post(1, slice());
        own.abandon();
        assert!(own.claim(1), "the free post is still claimable");
        own.unclaim(1, true);
        assert!(own.is_done(1));
        own.post(2, slice());
        own.revoke(2);
        own.abandon();
        assert!(!own.claim(2), "abandon does not undo a revoke");
    }
}
