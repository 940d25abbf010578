//! The node cache's layout and memory ([`crate::protocol::cache`] has its
//! rules): which entries exist, how many slots fit the bound, and where
//! every word and slot lives in the node-mates' cache regions.
//!
//! An **entry** is one piece of one remote owner's shard of one bucket
//! (owners on other nodes only; a shard larger than a piece is cut into
//! pieces, so that node-mates gathering at once fetch different pieces).
//! Every node-mate numbers them alike, from the registered buckets. The
//! node's **slots** (node memory of one piece each) number
//! `min(entries, bound / piece)`: with room for every entry, entry `e`
//! lives in slot `e` and nothing is ever evicted; with less, a missing
//! entry takes the least recently used slot, preferring one every
//! node-mate has read since it was filled.
//!
//! Under compressed gathers ([`crate::protocol::compress`]) an entry is one
//! run of the owner's quantised copy instead (whole blocks of its shard):
//! the slots hold quantised bytes, which each reader dequantises as it
//! copies them out. A slot then holds about a quarter of an f32 piece's
//! bytes (fp8, int8), so a bound keeps about four times the pieces, and a
//! copy-out reads a quarter of the bytes; the price is a dequantisation per
//! reader instead of one per node, one multiply per element.
//!
//! Each rank of the node registers a cache region holding its share, laid
//! out alike: a header line (the node's use clock, in local rank 0's), the
//! entry words of entries `e ≡ me (mod G)`, the slot words, use stamps and
//! readers of slots `s ≡ me (mod G)`, then those slots' data. Node-mates map each
//! other's regions (`Transport::mapped`); nothing here crosses the network.
//! On a device transport the slots' data is device memory instead (each
//! rank's share a data region of the plane, [`crate::plane::Plane::node_cache`])
//! and the host region holds the words only.
//!
//! This module computes places and hands out words and pointers; it never
//! waits, fetches or copies.

use std::ptr::NonNull;
use std::sync::Arc;

use odc_kernels::cpu::quant::Spec;

use crate::layout::BucketLayout;
use crate::protocol::cache::{MAX_ENTRIES, MAX_LOCAL, MAX_SLOTS};
use crate::protocol::compress::QuantCopy;
use crate::region::RegionDesc;
use crate::sync::{AtomicU64, Ordering};
use crate::transport::Transport;

const LINE: usize = 64;

/// One bucket's entries: the first one's number, pieces per remote shard,
/// bytes per piece (the last piece of a shard may be shorter) and per shard.
/// Pieces start `stride` bytes apart in what is read (the shard, or its
/// quantised copy) and hold `elems` shard elements each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CacheBucket {
    pub(crate) first: usize,
    pub(crate) pieces: usize,
    pub(crate) piece: usize,
    pub(crate) shard: usize,
    pub(crate) stride: usize,
    pub(crate) elems: usize,
}

/// Where everything of a node cache lives, the same on every node-mate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CacheLayout {
    pub(crate) buckets: Vec<CacheBucket>,
    /// Ranks per node and the world size (remote owners: `world - local`).
    pub(crate) local: usize,
    pub(crate) world: usize,
    pub(crate) entries: usize,
    pub(crate) slots: usize,
    /// Bytes of one slot: the largest piece.
    pub(crate) slot_bytes: usize,
    off_entries: usize,
    off_slots: usize,
    off_data: usize,
    region_len: usize,
    /// Whether the slots' data lives in device memory (not in the region).
    pub(crate) device: bool,
    /// Compressed gathers: the format of the quantised copies the entries
    /// are runs of.
    pub(crate) quant: Option<Spec>,
}

fn round_line(n: usize) -> usize {
    n.div_ceil(LINE) * LINE
}

impl CacheLayout {
    /// The layout for `buckets` sharded over `world` ranks in nodes of
    /// `local`, with pieces of at most `piece_cap` bytes (with `quant`, the
    /// runs of each bucket's quantised copy instead) and `bound` bytes of
    /// slots per node; `None` when there is no remote shard, no room for
    /// one slot, or more entries, slots or ranks per node than the words
    /// hold (the gathers then read every remote shard themselves). With
    /// `device`, the host region holds the words only.
    pub(crate) fn new(
        buckets: &[BucketLayout],
        (world, local): (usize, usize),
        (piece_cap, quant): (usize, Option<&[QuantCopy]>),
        bound: usize,
        device: bool,
    ) -> Option<CacheLayout> {
        let remote = world.checked_sub(local).filter(|&r| r > 0)?;
        if local == 0 || local > MAX_LOCAL {
            return None;
        }
        let piece_cap = round_line(piece_cap.max(LINE));
        let mut entries = 0usize;
        let mut slot_bytes = 0usize;
        let mut cb = Vec::with_capacity(buckets.len());
        for (i, b) in buckets.iter().enumerate() {
            let bucket = match quant.and_then(|q| q.get(i)) {
                Some(q) => CacheBucket {
                    first: entries,
                    pieces: q.runs(),
                    piece: round_line(q.stride().min(q.len())).max(LINE),
                    shard: q.len(),
                    stride: q.stride(),
                    elems: q.run,
                },
                None => {
                    let shard = b.shard_bytes();
                    let piece = round_line(shard.min(piece_cap)).max(LINE);
                    CacheBucket {
                        first: entries,
                        pieces: shard.div_ceil(piece).max(1),
                        piece,
                        shard,
                        stride: piece,
                        elems: piece / b.dtype().size_bytes(),
                    }
                }
            };
            let (pieces, piece) = (bucket.pieces, bucket.piece);
            cb.push(bucket);
            entries = entries.checked_add(remote.checked_mul(pieces)?)?;
            slot_bytes = slot_bytes.max(piece);
        }
        if entries > MAX_ENTRIES {
            return None;
        }
        let slots = entries.min(bound / slot_bytes.max(1)).min(MAX_SLOTS);
        if slots == 0 {
            return None;
        }
        let share = |n: usize| n.div_ceil(local);
        let off_entries = LINE;
        let off_slots = off_entries + round_line(share(entries) * 8);
        let off_data = off_slots + round_line(share(slots) * 24);
        let data_len = if device { 0 } else { share(slots) * slot_bytes };
        let region_len = off_data + data_len;
        Some(CacheLayout {
            buckets: cb,
            local,
            world,
            entries,
            slots,
            slot_bytes,
            off_entries,
            off_slots,
            off_data,
            region_len,
            device,
            quant: quant.and_then(|q| q.first()).map(|q| q.spec),
        })
    }

    /// Bytes of each node-mate's share of the slots' data.
    pub(crate) fn data_len(&self) -> usize {
        self.slots.div_ceil(self.local) * self.slot_bytes
    }

    /// Bytes of slots the whole set of entries needs per node (what makes
    /// the layout [`direct`](Self::direct)).
    pub(crate) fn full_bytes(&self) -> usize {
        self.entries * self.slot_bytes
    }

    /// Bytes of each node-mate's cache region.
    pub(crate) fn region_len(&self) -> usize {
        self.region_len
    }

    /// Whether every entry has its own slot (nothing is evicted).
    pub(crate) fn direct(&self) -> bool {
        self.slots >= self.entries
    }

    /// Bytes of slots per node.
    pub(crate) fn bytes(&self) -> usize {
        self.slots * self.slot_bytes
    }

    /// The entry of piece `piece` of global rank `owner`'s shard of bucket
    /// `b`, for a rank of the node whose first rank is `node_start`
    /// (`owner` on another node).
    pub(crate) fn entry(&self, b: usize, owner: usize, node_start: usize, piece: usize) -> usize {
        let remote = if owner < node_start {
            owner
        } else {
            owner - self.local
        };
        let cb = &self.buckets[b];
        cb.first + remote * cb.pieces + piece
    }

    /// (local rank, byte offset) of entry `e`'s word.
    fn entry_at(&self, e: usize) -> (usize, usize) {
        (e % self.local, self.off_entries + (e / self.local) * 8)
    }

    /// (local rank, byte offset) of slot `s`'s word; its use stamp and its
    /// readers follow.
    fn slot_at(&self, s: usize) -> (usize, usize) {
        (s % self.local, self.off_slots + (s / self.local) * 24)
    }

    /// (local rank, byte offset from its share's data) of slot `s`'s data.
    fn data_at(&self, s: usize) -> (usize, usize) {
        (s % self.local, (s / self.local) * self.slot_bytes)
    }

    /// Where the slots' data starts in a host region.
    pub(crate) fn data_offset(&self) -> usize {
        self.off_data
    }
}

/// What this rank's gathers did with its node's cache since registration,
/// in pieces ([`crate::Engine::node_cache_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeCacheStats {
    /// Bytes of slots per node (the bound, or what the remote shards need).
    pub bytes: usize,
    /// Slots per node, and entries (pieces of remote shards).
    pub slots: usize,
    /// Entries: every piece of every remote shard.
    pub entries: usize,
    /// Pieces this rank read across the network into the cache.
    pub fetched: u64,
    /// Pieces copied out of the cache that another rank (or an earlier
    /// gather of this one) had fetched.
    pub hits: u64,
    /// Of the hits, the pieces it waited for while a node-mate fetched them.
    pub waited: u64,
    /// Pieces read straight into the output (no slot free of fills).
    pub direct: u64,
    /// Fetches it took over from a node-mate that died mid-way.
    pub taken_over: u64,
}

/// The counters behind [`NodeCacheStats`] (this process's).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) fetched: AtomicU64,
    pub(crate) hits: AtomicU64,
    pub(crate) waited: AtomicU64,
    pub(crate) direct: AtomicU64,
    pub(crate) taken_over: AtomicU64,
}

impl Counters {
    pub(crate) fn add(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// A node cache in use: its layout and every node-mate's mapped region.
#[derive(Debug)]
pub(crate) struct NodeCache {
    pub(crate) layout: CacheLayout,
    /// Base of each node-mate's cache region, by local rank.
    bases: Vec<NonNull<u8>>,
    /// Address of each node-mate's share of the slots' data, by local rank
    /// (host pointers, or device addresses on a device transport).
    data: Vec<u64>,
    /// Keeps the regions behind `bases` mapped (work queued on a device
    /// stream marks entries after the engine's call returned) and sends
    /// the fill signals.
    pub(crate) transport: Arc<dyn Transport>,
    /// This rank's local rank, and the first rank of its node.
    pub(crate) me: usize,
    pub(crate) node_start: usize,
    /// The other node-mates' control regions: where fills are announced.
    pub(crate) mates: Vec<(usize, RegionDesc)>,
    pub(crate) counters: Counters,
}

// SAFETY: the bases point into shared mappings that the transport keeps
// for the engine's lifetime; all access to words is atomic and slot data
// is read and written under the slot words' rule (protocol::cache).
unsafe impl Send for NodeCache {}
// SAFETY: as above.
unsafe impl Sync for NodeCache {}

impl NodeCache {
    /// A cache over `bases` (one per node-mate, by local rank, each
    /// `layout.region_len()` bytes, 64-byte aligned), with the slots' data
    /// in those regions, or at `data` (one per node-mate: device
    /// addresses) for a device layout.
    ///
    /// # Safety
    /// Every base stays mapped, readable and writable, as long as
    /// `transport` lives; every `data` address holds `layout.data_len()`
    /// bytes as long as the cache is used.
    pub(crate) unsafe fn new(
        layout: CacheLayout,
        (bases, data): (Vec<NonNull<u8>>, Option<Vec<u64>>),
        (me, node_start): (usize, usize),
        mates: Vec<(usize, RegionDesc)>,
        transport: Arc<dyn Transport>,
    ) -> NodeCache {
        debug_assert_eq!(bases.len(), layout.local);
        let data = data.unwrap_or_else(|| {
            let at = layout.data_offset();
            // SAFETY: the data follows the words inside each region.
            bases
                .iter()
                .map(|b| unsafe { b.as_ptr().add(at) } as u64)
                .collect()
        });
        debug_assert_eq!(data.len(), layout.local);
        NodeCache {
            layout,
            bases,
            data,
            transport,
            me,
            node_start,
            mates,
            counters: Counters::default(),
        }
    }

    /// The counts so far.
    pub(crate) fn stats(&self) -> NodeCacheStats {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let c = &self.counters;
        NodeCacheStats {
            bytes: self.layout.bytes(),
            slots: self.layout.slots,
            entries: self.layout.entries,
            fetched: n(&c.fetched),
            hits: n(&c.hits),
            waited: n(&c.waited),
            direct: n(&c.direct),
            taken_over: n(&c.taken_over),
        }
    }

    fn word(&self, (q, at): (usize, usize)) -> &AtomicU64 {
        // SAFETY: `at` is an 8-aligned offset inside node-mate q's region
        // (the layout's), mapped for the cache's lifetime (`new`); the words
        // are only ever accessed atomically.
        unsafe { &*self.bases[q].as_ptr().add(at).cast::<AtomicU64>() }
    }

    /// The node's use clock (local rank 0's header).
    pub(crate) fn clock(&self) -> &AtomicU64 {
        self.word((0, 0))
    }

    /// Entry `e`'s word.
    pub(crate) fn entry_word(&self, e: usize) -> &AtomicU64 {
        self.word(self.layout.entry_at(e))
    }

    /// Slot `s`'s word.
    pub(crate) fn slot_word(&self, s: usize) -> &AtomicU64 {
        self.word(self.layout.slot_at(s))
    }

    /// Slot `s`'s last use (a tick of the node clock).
    pub(crate) fn slot_used(&self, s: usize) -> &AtomicU64 {
        let (q, at) = self.layout.slot_at(s);
        self.word((q, at + 8))
    }

    /// The node-mates (a bit per local rank below 64) that read slot `s`'s
    /// fill, its fetcher included: advice for eviction only.
    pub(crate) fn slot_readers(&self, s: usize) -> &AtomicU64 {
        let (q, at) = self.layout.slot_at(s);
        self.word((q, at + 16))
    }

    /// Address of slot `s`'s data (`layout.slot_bytes` bytes): a host
    /// pointer, or a device address on a device transport.
    pub(crate) fn slot_data(&self, s: usize) -> u64 {
        let (q, at) = self.layout.data_at(s);
        self.data[q] + at as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::BucketSpec;
    use odc_kernels::DType;

    fn buckets(numels: &[usize], world: usize) -> Vec<BucketLayout> {
        numels
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                BucketLayout::blocked(BucketSpec::new(format!("b{i}"), n, DType::F32), world, 1)
                    .unwrap()
            })
            .collect()
    }

    #[test]
    fn entries_cover_every_remote_piece_once() {
        // 8 ranks in nodes of 4; shards of 4 KiB and 64 KiB, pieces of 16 KiB.
        let bs = buckets(&[8 * 1024, 8 * 16 * 1024], 8);
        let l = CacheLayout::new(&bs, (8, 4), (16 << 10, None), 1 << 30, false).unwrap();
        assert_eq!(l.buckets[0].pieces, 1);
        assert_eq!(l.buckets[1].pieces, 4);
        assert_eq!(l.entries, 4 + 4 * 4);
        assert!(l.direct());
        assert_eq!(l.slot_bytes, 16 << 10);
        // Node 1 (ranks 4..8) numbers owners 0..4; node 0 owners 4..8.
        let mut seen = std::collections::HashSet::new();
        for owner in 0..4 {
            for p in 0..4 {
                assert!(seen.insert(l.entry(1, owner, 4, p)));
            }
            assert!(seen.insert(l.entry(0, owner, 4, 0)));
        }
        assert_eq!(seen.len(), l.entries);
        assert!(seen.iter().all(|&e| e < l.entries));
        assert_eq!(l.entry(0, 4, 0, 0), l.entry(0, 0, 4, 0));
    }

    #[test]
    fn the_bound_limits_the_slots_and_nothing_overlaps() {
        let bs = buckets(&[8 * 16 * 1024; 3], 8);
        let l =
            CacheLayout::new(&bs, (8, 4), (16 << 10, None), 5 * (16 << 10) + 100, false).unwrap();
        assert_eq!(l.slots, 5);
        assert!(!l.direct());
        assert!(l.bytes() <= 5 * (16 << 10) + 100);
        let words: Vec<(usize, usize)> = (0..l.entries).map(|e| l.entry_at(e)).collect();
        for (q, at) in &words {
            assert!(*q < 4 && *at >= LINE && at + 8 <= l.off_slots);
        }
        for s in 0..l.slots {
            let (q, at) = l.slot_at(s);
            let (q2, d) = l.data_at(s);
            assert_eq!(q, q2);
            assert!(at + 16 <= l.off_data && l.off_data + d + l.slot_bytes <= l.region_len);
        }
        // No room for a slot, or no remote owner: no cache.
        assert!(CacheLayout::new(&bs, (8, 4), (16 << 10, None), 100, false).is_none());
        assert!(CacheLayout::new(&bs, (4, 4), (16 << 10, None), 1 << 30, false).is_none());
    }
}
