//! A gather's remote shards through the node cache (the rules are
//! [`crate::protocol::cache`]'s, the memory [`crate::engine::cache`]'s).
//!
//! For every piece of every shard owned on another node, in one pass:
//! a piece the cache holds at the version is copied out; one nobody has is
//! claimed and its read posted into a slot (every claimed read of the pass
//! in flight at once, with this node's own shards copied meanwhile); one a
//! node-mate fetches is set aside. Then each claimed piece is copied out
//! of its slot (nobody evicts a slot being filled), marked ready, and the
//! node-mates are told (a signal raising their `cache_fill` word, which
//! rings their client bell). Last, the set-aside pieces are waited for
//! (the node-mates' fills ring this rank's bell too); one whose fetcher
//! died is taken over and fetched here. A piece that cannot be cached (no
//! slot free of fills) is read straight into the output, as without a
//! cache.
//!
//! Under compressed gathers a piece is a run of the owner's quantised copy
//! ([`super::quantised`]): the slot holds its quantised bytes and every
//! copy out of it dequantises into the output; a piece read straight lands
//! in the gather's staging and is dequantised once its read completed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::quantised::{self, Run};
use super::{version_error, DataPath, ShardRead, Staging, Worker};
use crate::engine::cache::{Counters, NodeCache};
use crate::engine::{load, record_error, BucketId, Registered};
use crate::layout::BucketLayout;
use crate::protocol::cache::{self, Entry, Look, Slot};
use crate::protocol::versions;
use crate::region::{Bell, SignalRef};
use crate::sync::{fence, Ordering};
use crate::transport::PeerStatus;
use crate::{Error, Result};

/// How often a wait for a node-mate's fetch checks that the fetcher lives.
const FETCHER_PROBE: Duration = Duration::from_millis(50);

/// One piece of one remote owner's shard, and where it goes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Piece {
    /// The owner (global rank: full sharding).
    owner: usize,
    entry: usize,
    /// Where it is read (bytes from the owner's shard of the bucket in its
    /// params region: [`ShardRead::at`]), and the piece's bytes.
    at: usize,
    len: usize,
    /// Where its bytes go in the output, and how many of them (the output
    /// may end before the padding).
    dst: u64,
    out_len: usize,
    /// Compressed gathers: the run it is, and where a straight read of it
    /// lands (the gather's staging) before it is dequantised.
    quant: Option<(Run, u64)>,
}

impl Piece {
    /// Copies the piece from `src` (a slot holding it, or its staging)
    /// into the output: a copy, or a dequantisation of a quantised run.
    ///
    /// # Safety
    /// `src` holds the piece; `dst` is valid for `out_len` bytes (until the
    /// copy ran, on a device).
    unsafe fn copy_out(&self, path: &impl DataPath, src: u64) -> Result<()> {
        match self.quant {
            // SAFETY: the caller's contract.
            Some((run, _)) => unsafe { path.dequantise(run, src, self.dst) },
            // SAFETY: the caller's contract.
            None => unsafe { path.copy_in_node(src, self.dst, self.out_len) },
        }
    }
}

/// What a pass does with a piece it does not copy at once.
#[derive(Clone, Copy, Debug)]
enum Todo {
    /// Claimed into `slot`; its read is in the batch.
    Fill { piece: Piece, slot: usize },
    /// A node-mate fetches it, or the owner has not published the version.
    Wait(Piece),
    /// Read straight into the output, or its staging when quantised (its
    /// read is in the batch).
    Direct(Piece),
    /// Copied out of the cache already.
    Done,
}

/// The first pass of a cached gather: an iterator over the reads to post
/// (claimed pieces into their slots, uncacheable ones into the output).
pub(super) struct CachedReads<'w, 'e> {
    w: &'w Worker<'e>,
    cache: &'w Arc<NodeCache>,
    b: &'w BucketLayout,
    bucket: BucketId,
    version: u64,
    out: u64,
    /// Bytes of the output.
    out_bytes: usize,
    /// Compressed gathers: where straight reads of quantised runs land.
    staging: Option<Staging>,
    /// Next owner step (from 1) and piece.
    step: usize,
    piece: usize,
    fills: Vec<(Piece, usize)>,
    waits: Vec<Piece>,
    /// Quantised pieces read straight into staging in this pass.
    staged: Vec<Piece>,
    error: Option<Error>,
}

impl<'w, 'e> CachedReads<'w, 'e> {
    pub(super) fn new(
        w: &'w Worker<'e>,
        cache: &'w Arc<NodeCache>,
        (b, bucket): (&'w BucketLayout, BucketId),
        version: u64,
        (out, out_bytes): (u64, usize),
        staging: Option<Staging>,
    ) -> CachedReads<'w, 'e> {
        CachedReads {
            w,
            cache,
            b,
            bucket,
            version,
            out,
            out_bytes,
            staging,
            step: 1,
            piece: 0,
            fills: Vec::new(),
            waits: Vec::new(),
            staged: Vec::new(),
            error: None,
        }
    }

    /// The next piece of a remote shard that lands in the output.
    fn next_piece(&mut self) -> Option<Piece> {
        let reg = self.w.reg;
        let world = reg.groups.group.len();
        let cb = self.cache.layout.buckets[self.bucket.0];
        let size = self.b.dtype().size_bytes();
        while self.step < world {
            let owner = (reg.groups.me + self.step) % world;
            if self.piece >= cb.pieces || self.w.core.topo.is_local(owner) {
                self.step += 1;
                self.piece = 0;
                continue;
            }
            let j = self.piece;
            self.piece += 1;
            let at = j * cb.stride;
            let len = cb.stride.min(cb.shard - at);
            let first = j * cb.elems;
            let elems = cb.elems.min(self.b.shard_len() - first);
            let start = (owner * self.b.shard_len() + first) * size;
            let end = (start + elems * size).min(self.out_bytes);
            if start >= end {
                continue; // padding past the output's end
            }
            let quant = match (self.cache.layout.quant, self.staging) {
                (Some(spec), Some(st)) => {
                    let run = Run {
                        spec,
                        len: elems,
                        take: (end - start) / size,
                        dtype: self.b.dtype(),
                    };
                    Some((run, st.of(owner) + at as u64))
                }
                _ => None,
            };
            return Some(Piece {
                owner,
                entry: self
                    .cache
                    .layout
                    .entry(self.bucket.0, owner, self.cache.node_start, j),
                at: match quant {
                    Some(_) => quantised::copy_at(self.w.reg, self.bucket.0, at),
                    None => at,
                },
                len,
                dst: self.out + start as u64,
                out_len: end - start,
                quant,
            });
        }
        None
    }

    /// Copies the cached pieces and sets aside the pieces others fetch;
    /// returns the next read to post.
    fn advance(&mut self, path: &impl DataPath) -> Option<ShardRead> {
        while self.error.is_none() {
            let piece = self.next_piece()?;
            let look = first_look(
                self.w,
                path,
                self.cache,
                (self.b, self.bucket),
                self.version,
                piece,
            );
            match look {
                Ok((Todo::Fill { piece, slot }, read)) => {
                    self.fills.push((piece, slot));
                    return read;
                }
                Ok((Todo::Direct(p), read)) => {
                    if p.quant.is_some() {
                        self.staged.push(p);
                    }
                    return read;
                }
                Ok((Todo::Wait(p), _)) => self.waits.push(p),
                Ok((Todo::Done, _)) => {}
                Err(e) => self.error = Some(e),
            }
        }
        None
    }

    /// After the batch of this pass completed: copies every claimed piece
    /// out, marks it ready and tells the node-mates; then waits for the
    /// pieces set aside. On a failed batch (`ok` false) the claims are
    /// given back instead (the entries read empty again).
    ///
    /// # Safety
    /// The output is valid for the bytes the pieces name until this
    /// returns.
    pub(super) unsafe fn finish(self, path: &impl DataPath, ok: bool) -> Result<()> {
        let CachedReads {
            w,
            cache,
            b,
            bucket,
            version,
            fills,
            mut waits,
            staged,
            error,
            ..
        } = self;
        if !ok || error.is_some() {
            for (piece, slot) in &fills {
                give_back(cache, piece.entry, *slot);
            }
            return error.map_or(Ok(()), Err);
        }
        let mut copied = Ok(());
        for piece in &staged {
            if let (Some((_, src)), true) = (piece.quant, copied.is_ok()) {
                // SAFETY: its read into staging completed with the batch;
                // the caller vouches for the output.
                copied = unsafe { piece.copy_out(path, src) };
            }
        }
        let mut filled = Vec::with_capacity(fills.len());
        for (piece, slot) in &fills {
            if copied.is_ok() {
                // SAFETY: the slot is ours while it is filling (nobody
                // evicts it) and holds the piece once the batch's reads ran
                // (on the host: completed; on a device stream: enqueued
                // before this copy); the caller vouches for the output.
                copied = unsafe { piece.copy_out(path, cache.slot_data(*slot)) };
            }
            if copied.is_ok() {
                filled.push((piece.entry, *slot));
            } else {
                give_back(cache, piece.entry, *slot);
            }
        }
        if let Err(e) = copied {
            for &(entry, slot) in &filled {
                give_back(cache, entry, slot);
            }
            return Err(e);
        }
        publish_fills(w, path, cache, version, filled)?;
        if waits.is_empty() {
            return Ok(());
        }
        // SAFETY: as the caller vouches.
        unsafe { wait_for_pieces(w, path, cache, b, bucket, version, &mut waits) }
    }
}

/// [`CachedReads`] with the path its hits are copied on: the first pass's
/// iterator of reads.
pub(super) struct Pass<'p, 'w, 'e, P: DataPath> {
    pub(super) reads: &'p mut CachedReads<'w, 'e>,
    pub(super) path: &'p P,
}

impl<P: DataPath> Iterator for Pass<'_, '_, '_, P> {
    type Item = ShardRead;

    fn next(&mut self) -> Option<ShardRead> {
        self.reads.advance(self.path)
    }
}

/// What to do with `piece` at a first look: copy it now (a hit), claim it,
/// read it straight, or set it aside ([`Todo`]). Returns the read to post
/// for a claim or a straight read.
fn first_look(
    w: &Worker<'_>,
    path: &impl DataPath,
    cache: &NodeCache,
    (b, bucket): (&BucketLayout, BucketId),
    version: u64,
    piece: Piece,
) -> Result<(Todo, Option<ShardRead>)> {
    let reg = w.reg;
    for _ in 0..4 {
        let word = cache.entry_word(piece.entry).load(Ordering::Acquire);
        match look(cache, piece.entry, word, version)? {
            Look::Hit { slot } => {
                // SAFETY: the gather's output (its caller's contract).
                if unsafe { copy_cached(path, cache, piece, slot)? } {
                    Counters::add(&cache.counters.hits);
                    return Ok((Todo::Done, None));
                }
                if Slot::holds(cache.slot_word(slot).load(Ordering::Acquire), piece.entry) {
                    continue; // changed while it was read: look again
                }
                // Evicted since it was marked ready: claimed anew below.
            }
            Look::Wait { .. } => return Ok((Todo::Wait(piece), None)),
            Look::Newer { current } => return Err(newer(b, version, current, piece.owner)),
            Look::Claim => {}
        }
        {
            {
                if !published(reg, b, bucket, version, piece.owner)? {
                    return Ok((Todo::Wait(piece), None));
                }
                match claim(cache, piece.entry, word, version) {
                    Claimed::Slot(slot) => {
                        Counters::add(&cache.counters.fetched);
                        let read = ShardRead {
                            rank: piece.owner,
                            bucket: bucket.0,
                            at: piece.at,
                            dst: cache.slot_data(slot),
                            len: piece.len,
                        };
                        return Ok((Todo::Fill { piece, slot }, Some(read)));
                    }
                    Claimed::Lost => {} // another rank claimed it: look again
                    Claimed::NoSlot => {
                        Counters::add(&cache.counters.direct);
                        return Ok((Todo::Direct(piece), Some(direct(piece, bucket))));
                    }
                }
            }
        }
    }
    // The entry kept changing under this reader: read it straight.
    Counters::add(&cache.counters.direct);
    Ok((Todo::Direct(piece), Some(direct(piece, bucket))))
}

/// The reader's rule on `entry`'s word `word` ([`cache::look_in`]): a word
/// whose slot or fetcher does not fit this node's cache is refused before
/// either indexes anything.
fn look(cache: &NodeCache, entry: usize, word: u64, version: u64) -> Result<Look> {
    let (slots, local) = (cache.layout.slots, cache.layout.local);
    cache::look_in(word, version, slots, local).map_err(|b| Error::Malformed {
        peer: cache.node_start + entry % local,
        what: "node-cache entry word",
        field: b.field,
        detail: format!(
            "in {:#x} (entry {entry}, held in this rank's cache region, written by any \
             node-mate; the cache has {slots} slots and {local} ranks per node)",
            b.word
        ),
    })
}

/// The read of `piece` straight into the output (no cache), or of a
/// quantised run into its staging (the whole run).
fn direct(piece: Piece, bucket: BucketId) -> ShardRead {
    let (dst, len) = match piece.quant {
        Some((_, stage)) => (stage, piece.len),
        None => (piece.dst, piece.out_len),
    };
    ShardRead {
        rank: piece.owner,
        bucket: bucket.0,
        at: piece.at,
        dst,
        len,
    }
}

/// Whether `owner`'s shard of `bucket` holds `version` (as the word that
/// holds its versions for this rank says, `Registered::version_word`); a
/// newer one is the gather's error.
fn published(
    reg: &Registered,
    b: &BucketLayout,
    bucket: BucketId,
    version: u64,
    owner: usize,
) -> Result<bool> {
    let word = reg.version_word(owner, bucket.0);
    match versions::shard(load(word), version) {
        Ok(s) => Ok(s == versions::Shard::Ready),
        Err(e) => Err(version_error(b, e, Some(reg.groups.group[owner]))),
    }
}

fn newer(b: &BucketLayout, version: u64, current: u64, owner: usize) -> Error {
    version_error(
        b,
        versions::VersionError::Newer { version, current },
        Some(owner),
    )
}

/// How a claim came out.
enum Claimed {
    /// The entry is this rank's to fetch, into this slot (taken: filling).
    Slot(usize),
    /// Another rank claimed the entry first.
    Lost,
    /// Claimed, but no slot could be taken (every one being filled); the
    /// claim was given back.
    NoSlot,
}

/// Claims `entry` (its word read `word`) for `version`: the entry first,
/// then a slot — its own (no eviction), the one its older version is in,
/// or the least recently used.
fn claim(cache: &NodeCache, entry: usize, word: u64, version: u64) -> Claimed {
    let me = cache.me;
    let layout = &cache.layout;
    let guess = if layout.direct() {
        entry
    } else {
        Entry::decode(word).slot().unwrap_or(0) % layout.slots
    };
    let ent = cache.entry_word(entry);
    if ent
        .compare_exchange(
            word,
            cache::claim(version, guess, me),
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .is_err()
    {
        return Claimed::Lost;
    }
    let mut slot = guess;
    for attempt in 0..8 {
        if attempt > 0 || !reusable(cache, slot, entry) {
            if layout.direct() {
                break; // its own slot is being filled by a dead claim: taken over below
            }
            match cache::victim(
                (0..layout.slots).map(|s| {
                    (
                        cache.slot_word(s).load(Ordering::Acquire),
                        cache.slot_used(s).load(Ordering::Relaxed),
                        cache.slot_readers(s).load(Ordering::Relaxed),
                    )
                }),
                all_readers(layout.local),
            ) {
                Some(s) => slot = s,
                None => break,
            }
        }
        let sw = cache.slot_word(slot);
        let cur = sw.load(Ordering::Acquire);
        let s = Slot::decode(cur);
        if s.filling && s.entry != Some(entry) {
            continue;
        }
        if sw
            .compare_exchange(
                cur,
                Slot::claim(cur, entry),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            // A new fill: nobody has read it yet (advice only; a late reader
            // of the old fill setting its bit costs nothing but a choice).
            cache.slot_readers(slot).store(0, Ordering::Relaxed);
            if slot != guess {
                ent.store(cache::claim(version, slot, me), Ordering::Release);
            }
            return Claimed::Slot(slot);
        }
    }
    if layout.direct() {
        // The entry's own slot, still marked filling by a claim that died
        // (the entry word was that claim's): the entry is ours now.
        let sw = cache.slot_word(entry);
        let cur = sw.load(Ordering::Acquire);
        sw.store(Slot::claim(cur, entry), Ordering::Release);
        return Claimed::Slot(entry);
    }
    ent.store(Entry::Empty.encode(), Ordering::Release);
    Claimed::NoSlot
}

/// Whether `slot` may be taken for `entry` without a scan: it holds the
/// entry (an older version), or no entry at all, and is not being filled
/// by another claim.
fn reusable(cache: &NodeCache, slot: usize, entry: usize) -> bool {
    let s = Slot::decode(cache.slot_word(slot).load(Ordering::Acquire));
    (s.entry == Some(entry) || s.entry.is_none()) && !s.filling
}

/// Marks every `(entry, slot)` of `filled` ready at `version` and tells
/// the node-mates, once the copies `path` made so far ran: at once on the
/// host; on a device, by work on the stream after them (a node-mate that
/// sees the mark copies out of the slot on its own stream, so the mark
/// must follow the bytes, as a version signal follows a shard).
fn publish_fills(
    w: &Worker<'_>,
    path: &impl DataPath,
    cache: &Arc<NodeCache>,
    version: u64,
    filled: Vec<(usize, usize)>,
) -> Result<()> {
    if filled.is_empty() {
        return Ok(());
    }
    let offset = w.reg.ctrl_layout.cache_fill();
    if !cache.layout.device {
        for (entry, slot) in filled {
            publish(cache, entry, version, slot);
        }
        return tell_node(cache, offset).map_err(|e| w.core.attribute(None, e));
    }
    let (cache, errors) = (Arc::clone(cache), Arc::clone(&w.core.server_error));
    path.then(Box::new(move || {
        for (entry, slot) in filled {
            publish(&cache, entry, version, slot);
        }
        if let Err(e) = tell_node(&cache, offset) {
            record_error(&errors, format!("telling the node of a cache fill: {e}"));
        }
    }))
}

/// Marks `entry` ready at `version` in `slot`, whose data is in.
fn publish(cache: &NodeCache, entry: usize, version: u64, slot: usize) {
    let sw = cache.slot_word(slot);
    sw.store(Slot::filled(sw.load(Ordering::Acquire)), Ordering::Release);
    cache
        .entry_word(entry)
        .store(cache::filled(version, slot), Ordering::Release);
    touch(cache, slot);
}

/// Gives a claim back: the entry reads empty (claimed anew by the next
/// reader), the slot holds nothing.
fn give_back(cache: &NodeCache, entry: usize, slot: usize) {
    cache
        .entry_word(entry)
        .store(Entry::Empty.encode(), Ordering::Release);
    let sw = cache.slot_word(slot);
    let gen = Slot::decode(sw.load(Ordering::Acquire)).gen.wrapping_add(1);
    sw.store(
        Slot {
            entry: None,
            gen,
            filling: false,
        }
        .encode(),
        Ordering::Release,
    );
}

/// Records a use of `slot` by this rank (the node clock's next tick, and
/// this rank among the fill's readers).
fn touch(cache: &NodeCache, slot: usize) {
    let tick = cache.clock().fetch_add(1, Ordering::Relaxed) + 1;
    cache.slot_used(slot).store(tick, Ordering::Relaxed);
    if cache.me < 64 {
        cache
            .slot_readers(slot)
            .fetch_or(1 << cache.me, Ordering::Relaxed);
    }
}

/// The readers' set of a fill every node-mate of a node of `local` ranks
/// has read; 0 (plain LRU) beyond 64 ranks per node.
fn all_readers(local: usize) -> u64 {
    match local {
        64 => u64::MAX,
        l if l < 64 => (1 << l) - 1,
        _ => 0,
    }
}

/// Copies `piece` out of `slot`, which held it ready at the version when
/// the entry word was read; `false` when the slot changed meanwhile (the
/// copy is then void and the reader looks again).
///
/// # Safety
/// `piece.dst` is valid for `piece.out_len` bytes (until the copy ran, on
/// a device).
unsafe fn copy_cached(
    path: &impl DataPath,
    cache: &NodeCache,
    piece: Piece,
    slot: usize,
) -> Result<bool> {
    let sw = cache.slot_word(slot);
    let before = sw.load(Ordering::Acquire);
    if !Slot::holds(before, piece.entry) {
        return Ok(false);
    }
    if cache.layout.device {
        // A device layout evicts nothing, and the entry's next version
        // lands in this slot only after the owner published it, i.e. after
        // this rank released this version, by work on its stream after
        // this copy (the slot cannot change before the copy ran).
        debug_assert!(cache.layout.direct());
        // SAFETY: the slot holds the piece (above, and until this rank's
        // release); the caller vouches for the output.
        unsafe { piece.copy_out(path, cache.slot_data(slot))? };
        touch(cache, slot);
        return Ok(true);
    }
    match piece.quant {
        // SAFETY: as below; a run dequantised from a slot overwritten
        // meanwhile is garbage in the output, discarded the same way.
        Some((run, _)) => unsafe {
            quantised::dequantise_run(run, cache.slot_data(slot), piece.dst)?
        },
        // SAFETY: the slot's data is `slot_bytes` >= the piece; a concurrent
        // eviction may overwrite it during the copy, which the check after it
        // catches (the copy is then discarded by the caller, who reads again).
        None => unsafe {
            odc_kernels::cpu::copy_raw(
                piece.dst as usize as *mut u8,
                cache.slot_data(slot) as usize as *const u8,
                piece.out_len,
            )
        },
    }
    fence(Ordering::Acquire);
    if sw.load(Ordering::Relaxed) != before {
        return Ok(false);
    }
    touch(cache, slot);
    Ok(true)
}

/// Raises every node-mate's `cache_fill` word, at `offset` of their
/// control regions (waking their gathers that wait for a piece).
fn tell_node(cache: &NodeCache, offset: usize) -> Result<()> {
    let tick = cache.clock().load(Ordering::Relaxed);
    let sig = SignalRef {
        offset,
        bell: Bell::Client,
    };
    cache.transport.put_signals(&cache.mates, sig, tick)
}

/// Waits for the pieces a node-mate fetches (or whose version the owner
/// has not published yet), copying each as it comes in; fetches one here
/// when its fetcher died or nobody fetches it.
///
/// # Safety
/// As [`CachedReads::finish`].
#[allow(clippy::too_many_arguments)]
unsafe fn wait_for_pieces(
    w: &Worker<'_>,
    path: &impl DataPath,
    cache: &Arc<NodeCache>,
    b: &BucketLayout,
    bucket: BucketId,
    version: u64,
    waits: &mut Vec<Piece>,
) -> Result<()> {
    let reg = w.reg;
    let mut next_probe = Instant::now() + FETCHER_PROBE;
    w.core.wait_via(
        Some(b.name()),
        &|| format!("version {version} of its shard (fetched into the node cache)"),
        &|o| reg.version_relay(o),
        || {
            let probe = Instant::now() >= next_probe;
            if probe {
                next_probe = Instant::now() + FETCHER_PROBE;
            }
            let mut lagging = None;
            let mut i = 0;
            while i < waits.len() {
                let piece = waits[i];
                let word = cache.entry_word(piece.entry).load(Ordering::Acquire);
                let done = match look(cache, piece.entry, word, version)? {
                    // SAFETY: the caller vouches for the output.
                    Look::Hit { slot } => {
                        // SAFETY: the caller vouches for the output.
                        if unsafe { copy_cached(path, cache, piece, slot)? } {
                            Counters::add(&cache.counters.hits);
                            Counters::add(&cache.counters.waited);
                            true
                        } else if Slot::holds(
                            cache.slot_word(slot).load(Ordering::Acquire),
                            piece.entry,
                        ) {
                            false // changed while it was read: look again
                        } else if published(reg, b, bucket, version, piece.owner)? {
                            // Evicted since it was marked ready: fetch it anew.
                            // SAFETY: as above.
                            unsafe { fetch_here(w, path, cache, bucket, version, piece, word)? }
                        } else {
                            false
                        }
                    }
                    Look::Newer { current } => return Err(newer(b, version, current, piece.owner)),
                    Look::Claim => {
                        if published(reg, b, bucket, version, piece.owner)? {
                            // SAFETY: as above.
                            unsafe { fetch_here(w, path, cache, bucket, version, piece, word)? }
                        } else {
                            false
                        }
                    }
                    Look::Wait { by } => {
                        let fetcher = cache.node_start + by;
                        let dead = probe
                            && fetcher != w.core.topo.rank()
                            && matches!(
                                w.core.transport.peer_status(fetcher),
                                PeerStatus::Dead { .. }
                            );
                        match cache::take_over(word, by, cache.me).filter(|_| dead) {
                            // SAFETY: as above.
                            Some(_) => unsafe {
                                take_over(w, path, cache, bucket, version, piece, word, by)?
                            },
                            None => false,
                        }
                    }
                };
                if done {
                    waits.swap_remove(i);
                } else {
                    lagging.get_or_insert(piece.owner);
                    i += 1;
                }
            }
            Ok(lagging)
        },
    )
}

/// Claims and fetches `piece` on its own (nobody had it once its version
/// was published); `false` when another rank claimed it first.
///
/// # Safety
/// As [`CachedReads::finish`].
unsafe fn fetch_here(
    w: &Worker<'_>,
    path: &impl DataPath,
    cache: &Arc<NodeCache>,
    bucket: BucketId,
    version: u64,
    piece: Piece,
    word: u64,
) -> Result<bool> {
    let slot = match claim(cache, piece.entry, word, version) {
        Claimed::Lost => return Ok(false),
        Claimed::NoSlot => {
            Counters::add(&cache.counters.direct);
            let mut read = std::iter::once(direct(piece, bucket));
            // SAFETY: the caller vouches for the output; the version is
            // published (checked by the caller).
            unsafe { path.read_shards(w.reg, &mut read) }.map_err(|e| w.core.attribute(None, e))?;
            if let Some((_, stage)) = piece.quant {
                // SAFETY: the read into staging completed; as above.
                unsafe { piece.copy_out(path, stage)? };
            }
            return Ok(true);
        }
        Claimed::Slot(slot) => slot,
    };
    Counters::add(&cache.counters.fetched);
    // SAFETY: as above.
    unsafe { fill(w, path, cache, bucket, version, piece, slot)? };
    Ok(true)
}

/// Takes over the claim of dead node-mate `by` on `piece` (its word read
/// `word`) and fetches it here; `false` when someone else took it over.
///
/// # Safety
/// As [`CachedReads::finish`].
#[allow(clippy::too_many_arguments)]
unsafe fn take_over(
    w: &Worker<'_>,
    path: &impl DataPath,
    cache: &Arc<NodeCache>,
    bucket: BucketId,
    version: u64,
    piece: Piece,
    word: u64,
    by: usize,
) -> Result<bool> {
    let Some(mine) = cache::take_over(word, by, cache.me) else {
        return Ok(false);
    };
    if cache
        .entry_word(piece.entry)
        .compare_exchange(word, mine, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return Ok(false);
    }
    let slot = Entry::decode(mine).slot().unwrap_or(0);
    let sw = cache.slot_word(slot);
    let cur = sw.load(Ordering::Acquire);
    // The dead fetcher's claim marked the slot filling with this entry;
    // a new generation makes it this rank's fill.
    sw.store(Slot::claim(cur, piece.entry), Ordering::Release);
    Counters::add(&cache.counters.taken_over);
    Counters::add(&cache.counters.fetched);
    // SAFETY: as above.
    unsafe { fill(w, path, cache, bucket, version, piece, slot)? };
    Ok(true)
}

/// Reads `piece` into `slot` (claimed: filling), copies it out, marks it
/// ready and tells the node.
///
/// # Safety
/// As [`CachedReads::finish`].
unsafe fn fill(
    w: &Worker<'_>,
    path: &impl DataPath,
    cache: &Arc<NodeCache>,
    bucket: BucketId,
    version: u64,
    piece: Piece,
    slot: usize,
) -> Result<()> {
    let mut read = std::iter::once(ShardRead {
        rank: piece.owner,
        bucket: bucket.0,
        at: piece.at,
        dst: cache.slot_data(slot),
        len: piece.len,
    });
    // SAFETY: the slot is ours while filling; the version is published.
    let got = unsafe { path.read_shards(w.reg, &mut read) }
        // SAFETY: the slot holds the piece now (or once the read above
        // ran, on a device stream); the caller vouches for dst.
        .and_then(|()| unsafe { piece.copy_out(path, cache.slot_data(slot)) });
    match got {
        Ok(()) => publish_fills(w, path, cache, version, vec![(piece.entry, slot)]),
        Err(e) => {
            give_back(cache, piece.entry, slot);
            Err(w.core.attribute(None, e))
        }
    }
}
