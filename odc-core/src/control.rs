//! Where every control word and landing slot lives in a rank's control
//! region, and the landing-slot header's wire format.
//!
//! Every rank's control region has the same layout (same shard-group size G
//! — D under full sharding, the ranks of a node under hybrid sharding —,
//! node count N, bucket count B and chunk size C, checked at registration).
//! Ranks are indexed by their place in the shard group (`o`, `c`) or, for
//! the cross-node words, by node (`n`). All words are written by a peer
//! with `put_signal` and waited on by the owner of the region, so every
//! wait is local:
//!
//! | words | written by | meaning (stored as value + 1; 0 = never) |
//! |---|---|---|
//! | `seen_version[o][b]` | owner o at publish | o's shard of b holds this version |
//! | `released[c][b]` | client c | c finished reading this version of b |
//! | `done[c]` | client c at finish | c's pushes for minibatch k are acknowledged |
//! | `ack[o][s]` | owner o's server | sequence number of the last chunk o added from slot s |
//! | slot `[c][s]` signal | client c | how many chunks c wrote into the slot (a count, not stored + 1) |
//! | `partial_ready[n]` | node n's replica | its node-summed shards of minibatch k are final (hybrid) |
//! | `partial_read[n]` | node n's replica | it finished reading this rank's partial sums of k (hybrid) |
//! | `piece_version[n][b]` | node n's replica | its piece of b holds this version (hybrid-zero) |
//! | `piece_read[n][b]` | node n's replica | it copied this rank's piece of b at this version (hybrid-zero) |
//! | `claim` | this rank and its daemon | its unclaimed microbatches of a minibatch ([`crate::protocol::claims`]; not a signal) |
//! | `steal_req[c]` | client c | c's latest request to steal from this rank (sequence, minibatch) |
//! | `steal_grant[o]` | owner o's daemon | its answer to this rank's latest request (sequence, outcome) |
//! | `cache_fill` | a node-mate | it filled entries of the node cache (a tick of the node clock; wakes this rank's gathers that wait for them) |
//!
//! Every signal word is a **cell** of 16 bytes: the word, then a mailbox
//! that belongs to the transport (the libfabric transport lands a pure
//! signal's value there and raises the word to it, see
//! `transport::fabric`). Cells of the per-bucket tables are packed; every
//! other cell sits in a 64-byte line of its own. All of them come before
//! the landing slots' data, so a signal's offset stays small whatever D
//! and C are (the libfabric transport names it in 27 bits of a 4-byte
//! immediate). A landing slot is its signal line, and elsewhere a 64-byte
//! [`SlotHeader`] followed by C bytes of data. Sequence numbers per
//! (client, owner) pair start at 1; chunk `seq` goes to slot `seq % 2`, so
//! the slot's count after it is [`slot_count`](crate::protocol::slots::slot_count)`(seq)`: a network transport
//! counts the writes that completed into the slot instead of carrying the
//! sequence number (fabric-lib's immediate counter), and the server turns
//! the count back into the sequence number ([`slot_seq`](crate::protocol::slots::slot_seq)).

use odc_kernels::cpu::quant::{Format, Spec};
use odc_kernels::DType;

use crate::layout::BucketLayout;
use crate::{Error, Result};

/// Bytes of slot header on the wire.
pub const HEADER_BYTES: usize = 64;
const LINE: usize = 64;
/// Bytes of a signal cell: the word and the transport's mailbox.
pub const CELL: usize = 16;

/// The smallest landing chunk the budget may shrink to (64 KiB). Every
/// chunk costs one network operation and one client → server hand-off,
/// about 7–20 µs here (FABRIC_NOTES: a 64 KiB read takes 6.6–22 µs over
/// tcp); 64 KiB take about as long on the wire at the 5–8 GB/s a tcp
/// link streams, so a push keeps at least half its bandwidth. Below that
/// the overhead dominates.
pub const MIN_CHUNK: usize = 64 << 10;

/// Default landing budget per rank (`ODC_LANDING_MB`, 256 MiB).
pub const DEFAULT_LANDING_BUDGET: usize = 256 << 20;

/// The landing chunk for a shard group of `group` ranks: the asked
/// `chunk_bytes`, shrunk so that the landing slots (`2 · group · chunk`)
/// fit `budget` bytes, in 64-byte lines, never below [`MIN_CHUNK`] (nor
/// above what was asked). A group too large for the budget even at the
/// floor is an [`Error::Config`] naming the budget it needs.
pub fn landing_chunk(chunk_bytes: usize, group: usize, budget: usize) -> Result<usize> {
    let slots = 2 * group.max(1);
    let fit = (budget / slots) / LINE * LINE;
    let asked = chunk_bytes.div_ceil(LINE) * LINE;
    let floor = MIN_CHUNK.min(asked);
    if fit < floor {
        let need_mb = (slots * floor).div_ceil(1 << 20);
        return Err(Error::Config(format!(
            "landing slots for {group} ranks do not fit the landing budget of {} MiB per rank \
             (ODC_LANDING_MB): 2 slots x {group} ranks x the smallest chunk ({} KiB) need \
             {need_mb} MiB; raise ODC_LANDING_MB to at least {need_mb}, or shard over fewer \
             ranks (hybrid sharding keeps landing slots within a node)",
            budget >> 20,
            floor >> 10
        )));
    }
    Ok(asked.min(fit).max(floor))
}

/// Offsets into a control region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CtrlLayout {
    world: usize,
    buckets: usize,
    chunk_bytes: usize,
    off_seen: usize,
    off_released: usize,
    off_done: usize,
    off_ack: usize,
    off_slot_signals: usize,
    off_cross: usize,
    off_piece_version: usize,
    off_piece_read: usize,
    off_claim: usize,
    off_steal_req: usize,
    off_steal_grant: usize,
    off_cache_fill: usize,
    off_slots: usize,
    nodes: usize,
    len: usize,
}

fn round_line(n: usize) -> usize {
    n.div_ceil(LINE) * LINE
}

impl CtrlLayout {
    /// The layout for a shard group of `world` ranks, `nodes` replicas of it
    /// (1 unless hybrid), `buckets` buckets and chunks of `chunk_bytes`
    /// (rounded up to 64).
    pub fn new(world: usize, nodes: usize, buckets: usize, chunk_bytes: usize) -> CtrlLayout {
        let chunk_bytes = round_line(chunk_bytes.max(LINE));
        let table = round_line(world * buckets * CELL);
        let off_seen = LINE;
        let off_released = off_seen + table;
        let off_done = off_released + table;
        let off_ack = off_done + world * LINE;
        let off_slot_signals = off_ack + world * 2 * LINE;
        let off_cross = off_slot_signals + world * 2 * LINE;
        let pieces = round_line(nodes * buckets * CELL);
        let off_piece_version = off_cross + nodes * 2 * LINE;
        let off_piece_read = off_piece_version + pieces;
        let off_claim = off_piece_read + pieces;
        let off_steal_req = off_claim + LINE;
        let off_steal_grant = off_steal_req + world * LINE;
        let off_cache_fill = off_steal_grant + world * LINE;
        let off_slots = off_cache_fill + LINE;
        let len = off_slots + world * 2 * (LINE + chunk_bytes);
        CtrlLayout {
            world,
            buckets,
            chunk_bytes,
            off_seen,
            off_released,
            off_done,
            off_ack,
            off_slot_signals,
            off_cross,
            off_piece_version,
            off_piece_read,
            off_claim,
            off_steal_req,
            off_steal_grant,
            off_cache_fill,
            off_slots,
            nodes,
            len,
        }
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the layout is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Landing-slot data capacity in bytes.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// `seen_version[owner][bucket]`.
    pub fn seen_version(&self, owner: usize, bucket: usize) -> usize {
        self.off_seen + (owner * self.buckets + bucket) * CELL
    }

    /// The bytes of every `seen_version` word.
    pub fn seen_versions(&self) -> std::ops::Range<usize> {
        self.off_seen..self.off_released
    }

    /// `released[client][bucket]`.
    pub fn released(&self, client: usize, bucket: usize) -> usize {
        self.off_released + (client * self.buckets + bucket) * CELL
    }

    /// `done[client]`.
    pub fn done(&self, client: usize) -> usize {
        self.off_done + client * LINE
    }

    /// `ack[owner][slot]`.
    pub fn ack(&self, owner: usize, slot: usize) -> usize {
        self.off_ack + (owner * 2 + slot) * LINE
    }

    /// Signal word of landing slot `[client][slot]`.
    pub fn slot_signal(&self, client: usize, slot: usize) -> usize {
        self.off_slot_signals + (client * 2 + slot) * LINE
    }

    /// Header of landing slot `[client][slot]`; the data follows it.
    pub fn slot_header(&self, client: usize, slot: usize) -> usize {
        self.off_slots + (client * 2 + slot) * (LINE + self.chunk_bytes)
    }

    /// Data of landing slot `[client][slot]`.
    pub fn slot_data(&self, client: usize, slot: usize) -> usize {
        self.slot_header(client, slot) + LINE
    }

    /// Data of landing slot `[client][slot]` in a separate landing region
    /// (device transports keep landing data out of the control region).
    pub fn landing_data(&self, client: usize, slot: usize) -> usize {
        (client * 2 + slot) * self.chunk_bytes
    }

    /// Bytes of a separate landing region: two slots per client.
    pub fn landing_len(&self) -> usize {
        self.world * 2 * self.chunk_bytes
    }

    /// Bytes from the start of the region past the last signal word: every
    /// signal offset is below this.
    pub fn signals_end(&self) -> usize {
        self.off_slots
    }

    /// `partial_ready[node]` (hybrid sharding).
    pub fn partial_ready(&self, node: usize) -> usize {
        debug_assert!(node < self.nodes);
        self.off_cross + node * LINE
    }

    /// `partial_read[node]` (hybrid sharding).
    pub fn partial_read(&self, node: usize) -> usize {
        debug_assert!(node < self.nodes);
        self.off_cross + (self.nodes + node) * LINE
    }

    /// `piece_version[node][bucket]` (hybrid-zero).
    pub fn piece_version(&self, node: usize, bucket: usize) -> usize {
        debug_assert!(node < self.nodes && bucket < self.buckets);
        self.off_piece_version + (node * self.buckets + bucket) * CELL
    }

    /// `piece_read[node][bucket]` (hybrid-zero).
    pub fn piece_read(&self, node: usize, bucket: usize) -> usize {
        debug_assert!(node < self.nodes && bucket < self.buckets);
        self.off_piece_read + (node * self.buckets + bucket) * CELL
    }

    /// This rank's claim word (work stealing).
    pub fn claim(&self) -> usize {
        self.off_claim
    }

    /// `steal_req[client]`: client's latest request to steal from this rank.
    pub fn steal_req(&self, client: usize) -> usize {
        self.off_steal_req + client * LINE
    }

    /// `steal_grant[owner]`: owner's answer to this rank's latest request.
    pub fn steal_grant(&self, owner: usize) -> usize {
        self.off_steal_grant + owner * LINE
    }

    /// `cache_fill`: raised by a node-mate that filled node-cache entries.
    pub fn cache_fill(&self) -> usize {
        self.off_cache_fill
    }

    /// Shard-group size this layout was built for.
    pub fn world(&self) -> usize {
        self.world
    }
}

/// What a pushed chunk is: written in front of the data, read by the server
/// after it sees the slot's signal.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SlotHeader {
    /// Sequence number (equals the signal value).
    pub seq: u64,
    /// Bucket index.
    pub bucket: u32,
    /// Element type of the data.
    pub dtype: DType,
    /// First element, relative to the owner's shard.
    pub offset: u64,
    /// Elements in the chunk.
    pub len: u64,
    /// Factor applied while accumulating.
    pub scale: f32,
    /// The client's running minibatch (how many it finished): the owner adds
    /// the chunk only once its accumulator takes that minibatch
    /// ([`crate::protocol::admit`]).
    pub minibatch: u64,
    /// The global rank whose shard the chunk belongs to when that is not
    /// the receiving server (node aggregation: the server adds it into its
    /// node buffer for that owner, [`crate::protocol::nodesum`]); `None`
    /// for the server's own shard. On the wire `rank + 1`, 0 for `None`.
    pub owner: Option<u32>,
    /// The chunk's compressed format and block size, when its data is a
    /// compressed chunk of `len` elements (block scales, then codes:
    /// `odc_kernels::cpu::quant`) rather than `len` elements of `dtype`
    /// ([`crate::protocol::compress`]). On the wire the format's code at
    /// byte 13 (0 for `None`) and the block size at bytes 52..56.
    pub compress: Option<Spec>,
}

impl SlotHeader {
    /// Little-endian wire form.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..8].copy_from_slice(&self.seq.to_le_bytes());
        b[8..12].copy_from_slice(&self.bucket.to_le_bytes());
        b[12] = self.dtype.as_u8();
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..36].copy_from_slice(&self.scale.to_le_bytes());
        b[40..48].copy_from_slice(&self.minibatch.to_le_bytes());
        let owner = self.owner.map_or(0, |o| o.saturating_add(1));
        b[48..52].copy_from_slice(&owner.to_le_bytes());
        if let Some(spec) = self.compress {
            b[13] = spec.format().code();
            let block = u32::try_from(spec.block()).unwrap_or(u32::MAX);
            b[52..56].copy_from_slice(&block.to_le_bytes());
        }
        b
    }

    /// Parses the wire form; `None` for an unknown dtype code or a
    /// compressed format or block size that is none
    /// ([`compress_of`](Self::compress_of) says which).
    pub fn decode(b: &[u8; HEADER_BYTES]) -> Option<SlotHeader> {
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        let mut w4 = [0u8; 4];
        w4.copy_from_slice(&b[8..12]);
        let bucket = u32::from_le_bytes(w4);
        w4.copy_from_slice(&b[32..36]);
        let scale = f32::from_le_bytes(w4);
        w4.copy_from_slice(&b[48..52]);
        let owner = u32::from_le_bytes(w4).checked_sub(1);
        Some(SlotHeader {
            seq: u64_at(0),
            bucket,
            dtype: DType::from_u8(b[12])?,
            offset: u64_at(16),
            len: u64_at(24),
            scale,
            minibatch: u64_at(40),
            owner,
            compress: SlotHeader::compress_of(b).ok()?,
        })
    }

    /// The compressed format and block size of the wire form `b`:
    /// `Ok(None)` for an uncompressed chunk, `Err` naming what is wrong.
    pub fn compress_of(b: &[u8; HEADER_BYTES]) -> std::result::Result<Option<Spec>, String> {
        if b[13] == 0 {
            return Ok(None);
        }
        let format = Format::from_code(b[13]).map_err(|e| e.to_string())?;
        let mut w4 = [0u8; 4];
        w4.copy_from_slice(&b[52..56]);
        let block = usize::try_from(u32::from_le_bytes(w4)).unwrap_or(usize::MAX);
        Spec::new(format, block)
            .map(Some)
            .map_err(|e| e.to_string())
    }
}

/// A landing-slot chunk the server accepted: `len` elements of `dtype`
/// (`bytes` bytes of slot data) to add, times `scale`, into elements
/// `[offset, offset + len)` of bucket `bucket`'s shard.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Chunk {
    /// Sequence number (equals the slot's signal).
    pub seq: u64,
    /// Bucket index, below the registered bucket count.
    pub bucket: usize,
    /// First element, relative to the owner's shard.
    pub offset: usize,
    /// Elements; `offset + len` is at most the shard's length.
    pub len: usize,
    /// Bytes of slot data the chunk covers, at most the slot's capacity.
    pub bytes: usize,
    /// Element type of the data.
    pub dtype: DType,
    /// Factor applied while accumulating.
    pub scale: f32,
    /// The owner the chunk is for when it is not the receiving rank (a
    /// node-mate's push into this rank's node buffer for a remote owner,
    /// [`crate::protocol::nodesum`]); `None` for the receiver's own shard.
    pub owner: Option<u32>,
    /// The compressed format and block size, when the `bytes` of slot data
    /// are a compressed chunk of `len` elements (scales, then codes).
    pub compress: Option<Spec>,
}

/// What the owner's daemon may do with the header `raw` that client rank
/// `peer` wrote in front of a landing slot's data, the slot's signal
/// reading `seq`: the chunk to add if the header fits the registered
/// layout (`buckets`, slots of `chunk_bytes`), else an
/// [`Error::Malformed`] naming the peer and the first field that does not:
/// `dtype` (an unknown code), `seq` (not the signal's), `bucket` (not
/// registered), `offset` / `len` (the range leaves the shard) or `len`
/// (more bytes than a slot holds).
pub fn check_header(
    raw: &[u8; HEADER_BYTES],
    seq: u64,
    peer: usize,
    buckets: &[BucketLayout],
    chunk_bytes: usize,
) -> Result<Chunk> {
    const WHAT: &str = "landing-slot header";
    let bad = |field, detail: String| Error::malformed(peer, WHAT, field, detail);
    let compress = SlotHeader::compress_of(raw).map_err(|e| bad("format", e))?;
    let h = SlotHeader::decode(raw)
        .ok_or_else(|| bad("dtype", format!("code {} is no element type", raw[12])))?;
    if h.seq != seq {
        return Err(bad(
            "seq",
            format!("{} differs from the slot's signal ({seq})", h.seq),
        ));
    }
    let bucket = usize::try_from(h.bucket)
        .ok()
        .and_then(|b| Some((b, buckets.get(b)?)));
    let Some((b, layout)) = bucket else {
        return Err(bad(
            "bucket",
            format!("{} is not registered ({} buckets)", h.bucket, buckets.len()),
        ));
    };
    let shard = layout.shard_len();
    let offset = usize::try_from(h.offset).ok().filter(|&o| o <= shard);
    let Some(offset) = offset else {
        return Err(bad(
            "offset",
            format!(
                "{} lies outside the shard of bucket {:?} ({shard} elements)",
                h.offset,
                layout.name()
            ),
        ));
    };
    let len = usize::try_from(h.len).ok().filter(|&l| l <= shard - offset);
    let Some(len) = len else {
        return Err(bad(
            "len",
            format!(
                "{} elements at {offset} leave the shard of bucket {:?} ({shard} elements)",
                h.len,
                layout.name()
            ),
        ));
    };
    let bytes = match compress {
        // `len <= shard`, so the product cannot overflow.
        Some(spec) => Some(spec.chunk_bytes(len)),
        None => len.checked_mul(h.dtype.size_bytes()),
    }
    .filter(|&n| n <= chunk_bytes);
    let Some(bytes) = bytes else {
        let what = compress.map_or_else(|| h.dtype.name().to_owned(), |s| s.to_string());
        return Err(bad(
            "len",
            format!("{len} elements of {what} exceed a landing slot ({chunk_bytes} bytes)"),
        ));
    };
    Ok(Chunk {
        seq,
        bucket: b,
        offset,
        len,
        bytes,
        dtype: h.dtype,
        scale: h.scale,
        owner: h.owner,
        compress,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        let h = SlotHeader {
            seq: 7,
            bucket: 3,
            dtype: DType::BF16,
            offset: 1 << 40,
            len: 99,
            scale: 0.5,
            minibatch: 12,
            owner: None,
            compress: None,
        };
        assert_eq!(SlotHeader::decode(&h.encode()), Some(h));
        let int8 = Spec::new(Format::Int8, 128).unwrap();
        let packed = SlotHeader {
            compress: Some(int8),
            ..h
        };
        assert_eq!(SlotHeader::decode(&packed.encode()), Some(packed));
        let mut unknown = packed.encode();
        unknown[13] = 9;
        assert!(SlotHeader::compress_of(&unknown)
            .unwrap_err()
            .contains("format code 9"));
        let via = SlotHeader {
            owner: Some(4095),
            ..h
        };
        assert_eq!(SlotHeader::decode(&via.encode()), Some(via));
        let mut bad = h.encode();
        bad[12] = 9;
        assert_eq!(SlotHeader::decode(&bad), None);
    }

    #[test]
    fn words_do_not_overlap() {
        let l = CtrlLayout::new(3, 2, 5, 1000);
        assert_eq!(l.chunk_bytes(), 1024);
        assert!(l.seen_version(2, 4) + CELL <= l.released(0, 0));
        assert_eq!(l.seen_version(1, 0) - l.seen_version(0, 4), CELL);
        assert!(l.released(2, 4) + CELL <= l.done(0));
        assert!(l.done(2) + CELL <= l.ack(0, 0));
        assert!(l.ack(2, 1) + CELL <= l.slot_signal(0, 0));
        assert!(l.slot_signal(2, 1) + CELL <= l.partial_ready(0));
        assert!(l.partial_ready(1) + CELL <= l.partial_read(0));
        assert!(l.partial_read(1) + CELL <= l.piece_version(0, 0));
        assert_eq!(l.piece_version(1, 0) - l.piece_version(0, 4), CELL);
        assert!(l.piece_version(1, 4) + CELL <= l.piece_read(0, 0));
        assert!(l.piece_read(1, 4) + CELL <= l.claim());
        assert!(l.claim() + CELL <= l.steal_req(0));
        assert!(l.steal_req(2) + CELL <= l.steal_grant(0));
        assert!(l.steal_grant(2) + CELL <= l.cache_fill());
        assert!(l.cache_fill() + CELL <= l.signals_end());
        assert_eq!(l.signals_end(), l.slot_header(0, 0));
        assert_eq!(l.slot_data(2, 1) + 1024, l.len());
        assert_eq!(l.slot_data(0, 0) % 64, 0);
    }

    #[test]
    fn landing_memory_stays_within_the_budget_at_any_world_size() {
        let mib = 1usize << 20;
        let budget = DEFAULT_LANDING_BUDGET;
        // Small worlds keep the asked 2 MiB chunk.
        assert_eq!(landing_chunk(2 * mib, 8, budget).unwrap(), 2 * mib);
        assert_eq!(landing_chunk(2 * mib, 64, budget).unwrap(), 2 * mib);
        // D = 1024: the chunk shrinks to 128 KiB, 256 MiB of slots.
        let c = landing_chunk(2 * mib, 1024, budget).unwrap();
        assert_eq!(c, 128 << 10);
        assert!(2 * 1024 * c <= budget);
        assert_eq!(CtrlLayout::new(1024, 1, 4, c).landing_len(), budget);
        // D = 4096 needs 512 MiB at the 64 KiB floor: a clear error...
        let e = landing_chunk(2 * mib, 4096, budget)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("4096 ranks") && e.contains("512 MiB") && e.contains("ODC_LANDING_MB"),
            "{e}"
        );
        // ...and fits once the budget allows it.
        let c = landing_chunk(2 * mib, 4096, 512 * mib).unwrap();
        assert_eq!(c, MIN_CHUNK);
        assert!(2 * 4096 * c <= 512 * mib);
        // Never larger than asked, and a small asked chunk is kept as is.
        assert_eq!(landing_chunk(4096, 4096, budget).unwrap(), 4096);
        assert_eq!(landing_chunk(1000, 2, budget).unwrap(), 1024);
        // The whole control region stays within budget + the signal cells.
        let l = CtrlLayout::new(4096, 1, 100, MIN_CHUNK);
        assert!(l.len() - l.signals_end() <= 512 * mib + 2 * 4096 * LINE);
    }

    #[test]
    fn signals_stay_in_the_first_megabyte_at_scale() {
        // 256 ranks, 2 MiB chunks: 2 GiB of landing slots, yet every signal
        // word is named by a small offset.
        let l = CtrlLayout::new(256, 1, 64, 2 << 20);
        assert!(l.signals_end() < 1 << 20, "{}", l.signals_end());
        assert!(l.slot_signal(255, 1) < l.signals_end());
        assert_eq!(l.slot_data(0, 0) % 64, 0);
    }
}
