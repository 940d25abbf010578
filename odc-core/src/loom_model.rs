//! Model checks, with loom, of the protocol code the engine runs.
//!
//! Each model drives the same types the engine does — [`SlotSender`] /
//! [`SlotReceiver`] (slots), [`versions`] (publish and gather), [`finish`]
//! (done words), the own-slice [`handoff`](crate::protocol::handoff),
//! hybrid-zero's [`pieces`] and [`EventCount`] (the waiter's sleep and
//! wake) — over loom atomics, with
//! the transport's part played as the transports play it: data written
//! first, then the signal word raised with release ordering (a landing
//! slot's count incremented, a stamp stored), read with acquire. Data sits
//! in loom `UnsafeCell`s, so a read overlapping a write (a slot reused
//! before its acknowledgement, a shard overwritten while a peer reads it)
//! fails the model, as does a wrong sum or a lost wake-up (a deadlock).
//!
//! Each rule has a test that breaks it on purpose ([`Mistake`]) and must
//! fail: the models can tell.

use loom::cell::UnsafeCell;
use loom::sync::Arc;

use crate::protocol::admit::{self, Admit};
use crate::protocol::cache::{self as node_cache, Look};
use crate::protocol::claims::{self, Claim};
use crate::protocol::finish;
use crate::protocol::nodesum;
use crate::protocol::pieces::{self, Piece};
use crate::protocol::slots::{slot_count, SlotReceiver, SlotSender};
use crate::protocol::versions::{self, Shard};
use crate::sync::{yield_now, AtomicU64, EventCount, Ordering};

/// A deliberate error, to show that a model catches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mistake {
    None,
    /// The client writes a slot without waiting for its acknowledgement.
    ReuseUnacked,
    /// The slot's count is raised with relaxed ordering (the data may not
    /// be visible when the count is).
    RelaxedSignal,
    /// The owner publishes the next version without waiting for the
    /// reader's release.
    PublishUnreleased,
    /// The client writes `done` before its last chunk was acknowledged.
    DoneBeforeAck,
    /// The notifier looks for sleepers before it bumps the epoch.
    NotifyBeforeBump,
    /// Hybrid-zero: a rank overwrites its piece without waiting until the
    /// other node copied the previous version.
    OverwriteUnread,
    /// Work stealing: a claim stores the new word instead of swapping it
    /// in (load, decide, store).
    ClaimWithoutSwap,
    /// The daemon adds a chunk whatever minibatch it belongs to (no
    /// admission rule).
    AddUnopened,
    /// Node cache: a reader claims an entry by storing its claim instead of
    /// swapping it in (two node-mates fetch, one writing the slot while the
    /// other reads it).
    ClaimByStore,
    /// Node cache: the fetcher marks the entry ready before its data is in
    /// the slot.
    ReadyBeforeData,
    /// Node cache: a waiter takes the claim over without the fetcher being
    /// dead (two writers of one slot).
    TakeOverLive,
    /// Node aggregation: the aggregator pushes its node buffer before its
    /// node-mate's done (the node-mate's chunk may still be added).
    SumsBeforeNodeMates,
    /// Node aggregation: the aggregator tells the owner `done` before its
    /// sums are acknowledged.
    DoneBeforeSums,
    /// Node aggregation: the aggregator tells the owner `done` (which
    /// releases its node's reads) before its node-mate's done.
    ReleaseBeforeNodeMates,
}

fn check(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(preemptions);
    builder.check(f);
}

fn payload(seq: u64) -> u64 {
    seq * 10 + 1
}

/// One client's two landing slots at one owner.
struct Slots {
    signal: [AtomicU64; 2],
    ack: [AtomicU64; 2],
    data: [UnsafeCell<u64>; 2],
}

impl Slots {
    fn new() -> Slots {
        Slots {
            signal: [AtomicU64::new(0), AtomicU64::new(0)],
            ack: [AtomicU64::new(0), AtomicU64::new(0)],
            data: [UnsafeCell::new(0), UnsafeCell::new(0)],
        }
    }

    fn acks(&self) -> [u64; 2] {
        [
            self.ack[0].load(Ordering::Acquire),
            self.ack[1].load(Ordering::Acquire),
        ]
    }

    /// The client's push of one chunk, as `Worker::push_chunks` does it.
    fn push(&self, sender: &mut SlotSender, value: u64, mistake: Mistake) {
        let (slot, seq) = loop {
            let (slot, seq) = sender.next();
            if mistake == Mistake::ReuseUnacked {
                break (slot, seq);
            }
            match sender.ready(self.ack[slot].load(Ordering::Acquire)) {
                Some(next) => break next,
                None => yield_now(),
            }
        };
        // SAFETY (model): the slot's last chunk was acknowledged, so the
        // owner no longer reads it; loom checks this claim.
        self.data[slot].with_mut(|d| unsafe { *d = value });
        let order = if mistake == Mistake::RelaxedSignal {
            Ordering::Relaxed
        } else {
            Ordering::Release
        };
        // The transport counts the write into the slot (fabric's progress
        // thread, shm's store of the count).
        debug_assert_eq!(
            slot_count(seq),
            self.signal[slot].load(Ordering::Relaxed) + 1
        );
        self.signal[slot].fetch_add(1, order);
        sender.sent(slot, seq);
    }

    /// The owner's scan, as the server daemon does it: adds every new chunk
    /// (in push order) and acknowledges it. Returns what it added.
    fn scan(&self, receiver: &mut SlotReceiver) -> Option<u64> {
        let mut added = None;
        for slot in receiver.order() {
            let count = self.signal[slot].load(Ordering::Acquire);
            if let Some(seq) = receiver.arrived(slot, count) {
                // SAFETY (model): the count was raised after the data, and
                // the client leaves the slot alone until the ack below.
                let v = self.data[slot].with(|d| unsafe { *d });
                *added.get_or_insert(0) += v;
                self.ack[slot].store(seq, Ordering::Release);
            }
        }
        added
    }
}

/// Slots: a client pushes three chunks through two slots while the owner
/// adds them; every chunk is added once, none is overwritten first.
fn slots_model(mistake: Mistake) {
    check(3, move || {
        let chunks = 3;
        let slots = Arc::new(Slots::new());
        let owner = {
            let slots = Arc::clone(&slots);
            loom::thread::spawn(move || {
                let mut receiver = SlotReceiver::default();
                let (mut sum, mut want) = (0, (1..=chunks).map(payload).sum::<u64>());
                while want > 0 {
                    match slots.scan(&mut receiver) {
                        Some(v) => {
                            sum += v;
                            want = want.saturating_sub(v);
                        }
                        None => yield_now(),
                    }
                }
                sum
            })
        };
        let mut sender = SlotSender::default();
        for seq in 1..=chunks {
            slots.push(&mut sender, payload(seq), mistake);
        }
        while !sender.acknowledged(slots.acks()) {
            yield_now();
        }
        assert_eq!(
            owner.join().unwrap(),
            (1..=chunks).map(payload).sum::<u64>()
        );
    });
}

#[test]
fn loom_slots_are_reused_only_after_their_acknowledgement() {
    slots_model(Mistake::None);
}

#[test]
#[should_panic]
fn loom_slots_catch_a_slot_reused_before_its_acknowledgement() {
    slots_model(Mistake::ReuseUnacked);
}

#[test]
#[should_panic]
fn loom_slots_catch_a_relaxed_signal() {
    slots_model(Mistake::RelaxedSignal);
}

/// One owner and one client for two minibatches, the whole cycle without a
/// barrier: the owner publishes version k of its shard once the client
/// released k − 1 (its done word), then adds the client's pushes and, once
/// the client's done word reads k, reads its final gradient; the client
/// gathers version k, pushes one chunk, waits for its acknowledgement and
/// writes done = k.
struct Pair {
    shard: UnsafeCell<u64>,
    seen_version: AtomicU64,
    done: AtomicU64,
    slots: Slots,
}

fn shard_value(k: u64) -> u64 {
    100 + k
}

fn grad_value(k: u64) -> u64 {
    1000 * (k + 1)
}

fn minibatch_model(mistake: Mistake) {
    check(2, move || {
        let minibatches = 2;
        let pair = Arc::new(Pair {
            shard: UnsafeCell::new(0),
            seen_version: AtomicU64::new(0),
            done: AtomicU64::new(0),
            slots: Slots::new(),
        });
        let owner = {
            let pair = Arc::clone(&pair);
            loom::thread::spawn(move || {
                let mut receiver = SlotReceiver::default();
                for k in 0..minibatches {
                    // Publish k: the client released k − 1.
                    let stamp =
                        versions::publish_stamp(pair.seen_version.load(Ordering::Acquire), k)
                            .unwrap();
                    while versions::unreleased_reader([(0, pair.done.load(Ordering::Acquire))], k)
                        .is_some()
                    {
                        yield_now();
                    }
                    // SAFETY (model): no reader reads the shard now.
                    pair.shard.with_mut(|s| unsafe { *s = shard_value(k) });
                    pair.seen_version.store(stamp, Ordering::Release);
                    // Serve pushes until the client is done with k.
                    let done = finish::done_stamp(0, k).unwrap();
                    let mut accum = 0;
                    loop {
                        if let Some(v) = pair.slots.scan(&mut receiver) {
                            accum += v;
                        }
                        if finish::unfinished_client([pair.done.load(Ordering::Acquire)], done)
                            .is_none()
                        {
                            break;
                        }
                        yield_now();
                    }
                    assert_eq!(
                        accum,
                        grad_value(k),
                        "minibatch {k}: gradient not final at done"
                    );
                }
            })
        };
        let mut sender = SlotSender::default();
        for k in 0..minibatches {
            loop {
                match versions::shard(pair.seen_version.load(Ordering::Acquire), k).unwrap() {
                    Shard::Ready => break,
                    Shard::Pending => yield_now(),
                }
            }
            // SAFETY (model): the owner does not overwrite before done = k.
            let v = pair.shard.with(|s| unsafe { *s });
            assert_eq!(v, shard_value(k), "gathered the wrong version");
            pair.slots.push(&mut sender, grad_value(k), Mistake::None);
            if mistake != Mistake::DoneBeforeAck {
                while !sender.acknowledged(pair.slots.acks()) {
                    yield_now();
                }
            }
            pair.done
                .store(finish::done_stamp(0, k).unwrap(), Ordering::Release);
        }
        owner.join().unwrap();
    });
}

#[test]
fn loom_a_minibatch_needs_no_barrier() {
    minibatch_model(Mistake::None);
}

/// Versions on their own, as the `odc` process group's scratch buckets use
/// them (no minibatch end): the owner publishes three versions back to
/// back, each once the reader released the previous one; the reader
/// gathers each and releases it.
fn release_model(mistake: Mistake) {
    check(3, move || {
        let versions_ = 3;
        let shard = Arc::new((UnsafeCell::new(0u64), AtomicU64::new(0), AtomicU64::new(0)));
        let owner = {
            let shard = Arc::clone(&shard);
            loom::thread::spawn(move || {
                let (data, seen, released) = &*shard;
                for v in 0..versions_ {
                    let stamp = versions::publish_stamp(seen.load(Ordering::Acquire), v).unwrap();
                    while mistake != Mistake::PublishUnreleased
                        && versions::unreleased_reader([(released.load(Ordering::Acquire), 0)], v)
                            .is_some()
                    {
                        yield_now();
                    }
                    // SAFETY (model): every reader released v − 1.
                    data.with_mut(|d| unsafe { *d = shard_value(v) });
                    seen.store(stamp, Ordering::Release);
                }
            })
        };
        let (data, seen, released) = &*shard;
        for v in 0..versions_ {
            while versions::shard(seen.load(Ordering::Acquire), v).unwrap() == Shard::Pending {
                yield_now();
            }
            // SAFETY (model): the owner waits for the release below.
            assert_eq!(data.with(|d| unsafe { *d }), shard_value(v), "version {v}");
            released.fetch_max(versions::publish_stamp(0, v).unwrap(), Ordering::Release);
        }
        owner.join().unwrap();
    });
}

#[test]
fn loom_versions_wait_for_every_release() {
    release_model(Mistake::None);
}

#[test]
#[should_panic]
fn loom_versions_catch_a_publish_before_the_release() {
    release_model(Mistake::PublishUnreleased);
}

#[test]
#[should_panic]
fn loom_finish_catches_done_before_the_acknowledgement() {
    minibatch_model(Mistake::DoneBeforeAck);
}

/// An owner's accumulator, its daemon's admission rule and a client whose
/// first operation of minibatch 1 is a push; the two bells the engine's
/// waiters sleep on.
struct Admitting {
    slots: Slots,
    accum: UnsafeCell<u64>,
    /// The minibatch the accumulator takes (the engine's `Registered::open`).
    open: AtomicU64,
    /// The client's done word.
    done: AtomicU64,
    /// The daemon's bell: rung after a slot's signal and after an opening.
    server: EventCount,
    /// The owner's bell: rung after a done word and after an acknowledgement.
    owner: EventCount,
}

/// The minibatch a chunk of [`grad_value`] belongs to: in the engine its
/// header names it, written with the data before the signal.
fn minibatch_of(value: u64) -> u64 {
    value / 1000 - 1
}

/// Sleeps on `bell` until `ready` holds, as the engine's waiters do.
fn wait_on(bell: &EventCount, ready: impl Fn() -> bool) {
    loop {
        let epoch = bell.epoch();
        if ready() {
            return;
        }
        bell.wait(epoch, ());
    }
}

/// Pushes belong to their minibatch: the client finishes minibatch 0 (it
/// pushed nothing there) and pushes minibatch 1's chunk at once (no gather
/// first: every group still unsharded), while the owner reads minibatch
/// 0's sum, zeroes it and only then opens its accumulator for minibatch 1.
/// The daemon, a thread of its own as in the engine, holds the chunk in its
/// slot until then. The accumulator sits in an `UnsafeCell`, so an add
/// racing the owner's read or zeroing fails the model, as does a sum
/// counted in the wrong minibatch.
fn admit_model(mistake: Mistake) {
    check(2, move || {
        let s = Arc::new(Admitting {
            slots: Slots::new(),
            accum: UnsafeCell::new(0),
            open: AtomicU64::new(0),
            done: AtomicU64::new(0),
            server: EventCount::default(),
            owner: EventCount::default(),
        });
        let daemon = {
            let s = Arc::clone(&s);
            loom::thread::spawn(move || {
                let mut receiver = SlotReceiver::default();
                let slot = receiver.order()[0];
                wait_on(&s.server, || {
                    let count = s.slots.signal[slot].load(Ordering::Acquire);
                    let Some(seq) = receiver.waiting(slot, count) else {
                        return false;
                    };
                    // SAFETY (model): the count was raised after the data.
                    let v = s.slots.data[slot].with(|d| unsafe { *d });
                    let open = s.open.load(Ordering::Acquire);
                    mistake == Mistake::AddUnopened
                        || admit::admit(minibatch_of(v), open) != Admit::Hold
                });
                let seq = receiver.waiting(slot, 1).unwrap();
                receiver.take(slot, seq);
                let v = s.slots.data[slot].with(|d| unsafe { *d });
                // SAFETY (model): the rule orders this add after the owner's
                // zeroing; loom checks the claim.
                s.accum.with_mut(|a| unsafe { *a += v });
                s.slots.ack[slot].store(seq, Ordering::Release);
                s.owner.notify();
            })
        };
        let client = {
            let s = Arc::clone(&s);
            loom::thread::spawn(move || {
                // Done with minibatch 0 (it pushed nothing there), then
                // minibatch 1's first operation: a push.
                s.done
                    .store(finish::done_stamp(0, 0).unwrap(), Ordering::Release);
                s.owner.notify();
                s.slots
                    .push(&mut SlotSender::default(), grad_value(1), Mistake::None);
                s.server.notify();
            })
        };
        // Minibatch 0: the client is done; read its sum, zero it, open 1.
        wait_on(&s.owner, || {
            finish::unfinished_client([s.done.load(Ordering::Acquire)], 1).is_none()
        });
        // SAFETY (model): no chunk of minibatch 1 is added before `open`.
        let sum = s.accum.with(|a| unsafe { *a });
        assert_eq!(sum, 0, "minibatch 0: a push of minibatch 1 counted in it");
        s.accum.with_mut(|a| unsafe { *a = 0 });
        s.open.store(admit::opened(0, 1), Ordering::Release);
        s.server.notify();
        // Minibatch 1: its chunk is added and acknowledged (the client's
        // done follows the acknowledgement).
        wait_on(&s.owner, || s.slots.acks() != [0, 0]);
        // SAFETY (model): the acknowledgement follows the add.
        let sum = s.accum.with(|a| unsafe { *a });
        assert_eq!(
            sum,
            grad_value(1),
            "minibatch 1: its push was zeroed with minibatch 0"
        );
        client.join().unwrap();
        daemon.join().unwrap();
    });
}

#[test]
fn loom_pushes_are_added_in_their_own_minibatch() {
    admit_model(Mistake::None);
}

#[test]
#[should_panic]
fn loom_admission_catches_a_push_added_before_its_minibatch() {
    admit_model(Mistake::AddUnopened);
}

/// One rank's side of hybrid-zero's piece exchange: its working copy of a
/// node shard (block n: node n's piece) and the words the other node raises.
struct Column {
    block: [UnsafeCell<u64>; 2],
    piece_version: [AtomicU64; 2],
    piece_read: [AtomicU64; 2],
}

impl Column {
    fn new() -> Column {
        Column {
            block: [UnsafeCell::new(0), UnsafeCell::new(0)],
            piece_version: [AtomicU64::new(0), AtomicU64::new(0)],
            piece_read: [AtomicU64::new(0), AtomicU64::new(0)],
        }
    }
}

fn piece_value(node: usize, v: u64) -> u64 {
    100 * (node as u64 + 1) + v
}

/// Publishes of three versions by one rank of a column, as
/// `Worker::publish` / `gather_pieces` run them under hybrid-zero: wait
/// until the other node copied the piece this rank holds ([`pieces::unread`]),
/// write the own piece, raise `piece_version` there, wait for the other's
/// piece of the same version ([`pieces::piece`]), copy it, raise
/// `piece_read` there.
fn publish_pieces(ranks: &[Column; 2], me: usize, mistake: Mistake) {
    let other = 1 - me;
    let mut seen = 0;
    for v in 0..3u64 {
        let stamp = v + 1;
        let read = |n: usize| ranks[me].piece_read[n].load(Ordering::Acquire);
        while mistake != Mistake::OverwriteUnread
            && pieces::unread([read(0), read(1)], me, seen).is_some()
        {
            yield_now();
        }
        // SAFETY (model): the other node copied the previous version.
        ranks[me].block[me].with_mut(|d| unsafe { *d = piece_value(me, v) });
        ranks[other].piece_version[me].fetch_max(stamp, Ordering::Release);
        loop {
            let word = ranks[me].piece_version[other].load(Ordering::Acquire);
            match pieces::piece(word, stamp) {
                Ok(Piece::Ready) => break,
                Ok(Piece::Pending) => yield_now(),
                Err(ahead) => panic!("the other node ran ahead: {ahead:?}"),
            }
        }
        // SAFETY (model): the other node overwrites its piece only after
        // this rank's piece_read below.
        let got = ranks[other].block[other].with(|d| unsafe { *d });
        assert_eq!(got, piece_value(other, v), "node {me} copied a torn piece");
        // SAFETY (model): only this rank writes its own working copy.
        ranks[me].block[other].with_mut(|d| unsafe { *d = got });
        ranks[other].piece_read[me].fetch_max(stamp, Ordering::Release);
        seen = stamp;
    }
}

fn pieces_model(mistake: Mistake) {
    check(3, move || {
        let ranks = Arc::new([Column::new(), Column::new()]);
        let peer = {
            let ranks = Arc::clone(&ranks);
            loom::thread::spawn(move || publish_pieces(&ranks, 1, mistake))
        };
        publish_pieces(&ranks, 0, mistake);
        peer.join().unwrap();
        for (n, column) in ranks.iter().enumerate() {
            for m in 0..2 {
                // SAFETY (model): both threads are done.
                let v = column.block[m].with(|d| unsafe { *d });
                assert_eq!(v, piece_value(m, 2), "node {n}'s copy of piece {m}");
            }
        }
    });
}

#[test]
fn loom_pieces_are_overwritten_only_after_the_other_node_copied_them() {
    pieces_model(Mistake::None);
}

#[test]
#[should_panic]
fn loom_pieces_catch_an_overwrite_before_the_copy() {
    pieces_model(Mistake::OverwriteUnread);
}

/// One claim on the claim word, as `Worker::claim_own` (`steal = false`)
/// and the daemon's `serve_steals` (`steal = true`) make it.
fn claim_once(word: &AtomicU64, k: u64, count: u64, steal: bool, mistake: Mistake) -> Claim {
    let mut cur = word.load(Ordering::Acquire);
    loop {
        let (new, claim) = if steal {
            claims::steal(cur, k)
        } else {
            claims::own(cur, k, count).unwrap()
        };
        let Some(new) = new else { return claim };
        if mistake == Mistake::ClaimWithoutSwap {
            word.store(new, Ordering::Release);
            return claim;
        }
        match word.compare_exchange(cur, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return claim,
            Err(now) => cur = now,
        }
    }
}

/// Work stealing ([`claims`]): the owner claims its list of 3 from the
/// front while two thieves' requests are served from the back (the
/// daemon's thread); every microbatch is claimed exactly once.
fn claims_model(mistake: Mistake) {
    check(3, move || {
        let word = Arc::new(AtomicU64::new(0));
        // The owner's first claim starts minibatch 0 (a request before it
        // is answered NotYet and retried, which the model leaves out).
        let first = claim_once(&word, 0, 3, false, mistake);
        assert_eq!(first, Claim::Got(0));
        let daemon = {
            let word = Arc::clone(&word);
            loom::thread::spawn(move || {
                let mut got = Vec::new();
                for _ in 0..2 {
                    if let Claim::Got(i) = claim_once(&word, 0, 3, true, mistake) {
                        got.push(i);
                    }
                }
                got
            })
        };
        let mut all = vec![0];
        while let Claim::Got(i) = claim_once(&word, 0, 3, false, mistake) {
            all.push(i);
        }
        all.extend(daemon.join().unwrap());
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2], "each microbatch claimed once");
    });
}

#[test]
fn loom_claims_hand_out_every_microbatch_once() {
    claims_model(Mistake::None);
}

#[test]
#[should_panic]
fn loom_claims_catch_a_claim_without_a_swap() {
    claims_model(Mistake::ClaimWithoutSwap);
}

/// The waiter's sleep and wake ([`EventCount`], as every bell uses it): a
/// waiter checks a flag and sleeps on the epoch it read before the check; a
/// notifier sets the flag, then notifies. No wake-up may be lost (loom
/// reports a deadlock otherwise).
fn event_count_model(mistake: Mistake) {
    check(3, move || {
        let ec = Arc::new(EventCount::default());
        let flag = Arc::new(AtomicU64::new(0));
        let waiter = {
            let (ec, flag) = (Arc::clone(&ec), Arc::clone(&flag));
            loom::thread::spawn(move || loop {
                let epoch = ec.epoch();
                if flag.load(Ordering::Acquire) == 1 {
                    return;
                }
                ec.wait(epoch, ());
            })
        };
        flag.store(1, Ordering::Release);
        if mistake == Mistake::NotifyBeforeBump {
            broken_notify(&ec);
        } else {
            ec.notify();
        }
        waiter.join().unwrap();
    });
}

/// `EventCount::notify` with its two steps swapped.
fn broken_notify(ec: &EventCount) {
    let (epoch, sleepers) = ec.words();
    let someone = sleepers.load(Ordering::SeqCst) != 0;
    crate::sync::fence(Ordering::SeqCst);
    epoch.fetch_add(1, Ordering::SeqCst);
    if someone {
        ec.wake_for_model();
    }
}

#[test]
fn loom_sleepers_are_always_woken() {
    event_count_model(Mistake::None);
}

/// A lost wake-up is a deadlock, which loom reports by aborting the
/// process; so this runs the broken model in a child process (this test
/// binary, this test only) and checks that it died of the deadlock.
#[test]
fn loom_sleep_catches_a_notify_that_looks_before_it_bumps() {
    const CHILD: &str = "ODC_LOOM_BROKEN_NOTIFY";
    if std::env::var_os(CHILD).is_some() {
        event_count_model(Mistake::NotifyBeforeBump);
        return;
    }
    let name = "loom_model::loom_sleep_catches_a_notify_that_looks_before_it_bumps";
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads", "1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the broken notify passed the model");
    assert!(stderr.contains("deadlock"), "{stderr}");
}

/// The own-slice hand-off (`crate::protocol::handoff`): the server reads
/// the client's buffer only under a claim; once the client saw `done` or
/// revoked, it reuses the buffer (a write loom checks against every server
/// read).
mod own_handoff {
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;

    use crate::protocol::handoff::{OwnPush, OwnSlice};
    use crate::sync::yield_now;

    struct Shared {
        own: OwnPush,
        buffer: UnsafeCell<u64>,
    }

    const CHUNKS: usize = 2;

    fn slice() -> OwnSlice {
        OwnSlice {
            bucket: 0,
            offset: 0,
            len: CHUNKS,
            addr: 0,
            dtype: 0,
            scale: 1.0,
        }
    }

    /// The daemon's side: take the post, add it chunk by chunk under claims.
    fn server(s: &Shared) -> u64 {
        let (gen, slice) = loop {
            match s.own.take(0) {
                Some(p) => break p,
                None => yield_now(),
            }
        };
        let mut sum = 0;
        for done in 1..=slice.len {
            if !s.own.claim(gen) {
                break;
            }
            // SAFETY (model): the claim keeps the client off the buffer.
            sum += s.buffer.with(|b| unsafe { *b });
            s.own.unclaim(gen, done == slice.len);
        }
        sum
    }

    fn run(revoke: bool) {
        super::check(3, move || {
            let s = Arc::new(Shared {
                own: OwnPush::new(),
                buffer: UnsafeCell::new(7),
            });
            let srv = {
                let s = Arc::clone(&s);
                loom::thread::spawn(move || server(&s))
            };
            s.own.post(1, slice());
            if revoke {
                s.own.revoke(1);
            } else {
                while !s.own.is_done(1) {
                    yield_now();
                }
            }
            // The call returns: the caller reuses its buffer.
            // SAFETY (model): done or revoked, so no server read is pending.
            s.buffer.with_mut(|b| unsafe { *b = 0 });
            let sum = srv.join().unwrap();
            if !revoke {
                assert_eq!(sum, 7 * CHUNKS as u64);
            }
        });
    }

    #[test]
    fn loom_own_handoff_completes() {
        run(false);
    }

    #[test]
    fn loom_own_handoff_revoked_mid_way() {
        run(true);
    }
}

/// The node cache's entry: a piece of a remote shard (its value at the
/// version, [`piece_value`]), one slot of node memory, the entry's word,
/// the node's bell and a count of fetches across the network.
struct CacheEntry {
    word: AtomicU64,
    slot: UnsafeCell<u64>,
    bell: EventCount,
    fetches: AtomicU64,
    /// Set by a fetcher that dies after its claim (the liveness probe).
    dead: [loom::sync::atomic::AtomicBool; 2],
}

/// The remote piece at version 1 (what a fetch reads across the network).
const PIECE_V1: u64 = 4242;

/// Local rank `me` gathers the piece at version 1 through the cache, as
/// `client::cache` does: copy it when ready, wait while a node-mate fetches
/// it (or take the claim over once that one is dead), or claim and fetch it.
/// With `die`, a claim is made and then abandoned (the fetcher dies).
/// Returns the value read (`None`: died).
fn cache_reader(e: &CacheEntry, me: usize, die: bool, mistake: Mistake) -> Option<u64> {
    loop {
        let epoch = e.bell.epoch();
        let w = e.word.load(Ordering::Acquire);
        match node_cache::look(w, 1) {
            // SAFETY (model): ready is stored after the data (release).
            Look::Hit { slot: 0 } => return Some(e.slot.with(|d| unsafe { *d })),
            Look::Hit { .. } | Look::Newer { .. } => unreachable!("one slot, one version"),
            Look::Wait { by } => {
                let dead = e.dead[by].load(Ordering::Acquire) || mistake == Mistake::TakeOverLive;
                let Some(mine) = node_cache::take_over(w, by, me).filter(|_| dead) else {
                    e.bell.wait(epoch, ());
                    continue;
                };
                if e.word
                    .compare_exchange(w, mine, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
                {
                    continue;
                }
            }
            Look::Claim => {
                let mine = node_cache::claim(1, 0, me);
                if mistake == Mistake::ClaimByStore {
                    e.word.store(mine, Ordering::Release);
                } else if e
                    .word
                    .compare_exchange(w, mine, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
                {
                    continue;
                }
                if die {
                    e.dead[me].store(true, Ordering::Release);
                    e.bell.notify();
                    return None;
                }
            }
        }
        // This rank's claim: fetch, then mark ready, then wake the node.
        e.fetches.fetch_add(1, Ordering::Relaxed);
        if mistake == Mistake::ReadyBeforeData {
            e.word.store(node_cache::filled(1, 0), Ordering::Release);
        }
        // SAFETY (model): the claim makes this rank the slot's only writer.
        e.slot.with_mut(|d| unsafe { *d = PIECE_V1 });
        e.word.store(node_cache::filled(1, 0), Ordering::Release);
        e.bell.notify();
        // SAFETY (model): as above; readers only read once it is ready.
        return Some(e.slot.with(|d| unsafe { *d }));
    }
}

/// Two node-mates gather the same remote piece at once: exactly one fetch
/// crosses the network and both read the piece (the slot's data in an
/// `UnsafeCell`: a read overlapping the fill fails the model). With `die`,
/// local rank 1 claims and dies; rank 0 takes over and fetches.
fn cache_model(die: bool, mistake: Mistake) {
    check(3, move || {
        let e = Arc::new(CacheEntry {
            word: AtomicU64::new(0),
            slot: UnsafeCell::new(0),
            bell: EventCount::default(),
            fetches: AtomicU64::new(0),
            dead: [
                loom::sync::atomic::AtomicBool::new(false),
                loom::sync::atomic::AtomicBool::new(false),
            ],
        });
        let other = {
            let e = Arc::clone(&e);
            loom::thread::spawn(move || cache_reader(&e, 1, die, mistake))
        };
        let mine = cache_reader(&e, 0, false, mistake);
        let theirs = other.join().unwrap();
        assert_eq!(mine, Some(PIECE_V1), "rank 0 read the piece");
        if !die {
            assert_eq!(theirs, Some(PIECE_V1), "rank 1 read the piece");
        }
        assert_eq!(
            e.fetches.load(Ordering::Relaxed),
            1,
            "one fetch per node per piece and version"
        );
    });
}

#[test]
fn loom_node_cache_fetches_once_and_every_node_mate_reads_it() {
    cache_model(false, Mistake::None);
}

#[test]
fn loom_node_cache_takes_over_a_dead_fetchers_claim() {
    cache_model(true, Mistake::None);
}

#[test]
#[should_panic]
fn loom_node_cache_catches_a_claim_without_a_swap() {
    cache_model(false, Mistake::ClaimByStore);
}

#[test]
#[should_panic]
fn loom_node_cache_catches_ready_before_the_data() {
    cache_model(false, Mistake::ReadyBeforeData);
}

#[test]
#[should_panic]
fn loom_node_cache_catches_a_take_over_of_a_live_fetcher() {
    cache_model(false, Mistake::TakeOverLive);
}

/// Node aggregation's words for one node-mate `c`, its aggregator `a` for
/// owner `o` on another node, and `o`: `a`'s node buffer, `a`'s landing
/// slot at `o` (data, signal, ack), `o`'s accumulator, the done words
/// `c → a` and `a → o`, and `a`'s and `o`'s bells.
struct NodeSum {
    buffer: UnsafeCell<u64>,
    a_slot: UnsafeCell<u64>,
    a_signal: AtomicU64,
    a_ack: AtomicU64,
    accum: UnsafeCell<u64>,
    done_c: AtomicU64,
    done_a: AtomicU64,
    bell_a: EventCount,
    bell_o: EventCount,
}

/// `c`'s and `a`'s own gradients for `o` (their sum is what `o` must read).
const GRAD_C: u64 = 30;
const GRAD_A: u64 = 12;

/// Minibatch 0 under node aggregation: `c`'s chunk for `o` is added into
/// `a`'s node buffer (which holds `a`'s own part already) and `c` says
/// done (in the engine `a`'s daemon adds it, then acknowledges, and `c`'s
/// done follows the acknowledgement: the same order, played here by `c`);
/// `a` finishes: waits for `c`'s done ([`nodesum::sums_ready`]), pushes the
/// buffer to `o` (whose daemon, a thread, adds it into `o`'s accumulator),
/// waits for the acknowledgement, then tells `o` done
/// ([`nodesum::done_after_sums`]); `o` reads its gradient once the done
/// words that feed it ([`nodesum::feeds`]) read 0. The buffer and the
/// accumulator are `UnsafeCell`s: an add racing a read fails the model, as
/// does a sum without `c`'s chunk.
fn nodesum_model(mistake: Mistake) {
    // Ranks 0 (`a`) and 1 (`c`) on node 0, rank 2 (`o`) on node 1 with
    // `a`'s local rank: nodes of 2.
    let (a, c, o, local) = (0usize, 1usize, 2usize, 2usize);
    assert_eq!(nodesum::server(c, o, local), a);
    assert!(nodesum::done_after_sums(a, o, local) && !nodesum::done_after_sums(c, o, local));
    assert!(nodesum::feeds(o, a, local) && !nodesum::feeds(o, c, local));
    check(1, move || {
        let s = Arc::new(NodeSum {
            buffer: UnsafeCell::new(GRAD_A),
            a_slot: UnsafeCell::new(0),
            a_signal: AtomicU64::new(0),
            a_ack: AtomicU64::new(0),
            accum: UnsafeCell::new(0),
            done_c: AtomicU64::new(0),
            done_a: AtomicU64::new(0),
            bell_a: EventCount::default(),
            bell_o: EventCount::default(),
        });
        let node_mate = {
            let s = Arc::clone(&s);
            loom::thread::spawn(move || {
                // SAFETY (model): the buffer is open for minibatch 0 and `a`
                // reads it only after this rank's done.
                s.buffer.with_mut(|b| unsafe { *b += GRAD_C });
                s.done_c
                    .store(finish::done_stamp(0, 0).unwrap(), Ordering::Release);
                s.bell_a.notify();
            })
        };
        let o_daemon = {
            let s = Arc::clone(&s);
            loom::thread::spawn(move || {
                wait_on(&s.bell_o, || s.a_signal.load(Ordering::Acquire) == 1);
                // SAFETY (model): the signal ordered the data; `o` reads its
                // accumulator only after a's done.
                let v = s.a_slot.with(|d| unsafe { *d });
                s.accum.with_mut(|x| unsafe { *x += v });
                s.a_ack.store(1, Ordering::Release);
                s.bell_a.notify();
            })
        };
        let aggregator = {
            let s = Arc::clone(&s);
            loom::thread::spawn(move || {
                let stamp = finish::done_stamp(0, 0).unwrap();
                if mistake != Mistake::SumsBeforeNodeMates {
                    // a's own done word is in (it finished): the node-mate's.
                    wait_on(&s.bell_a, || {
                        nodesum::sums_ready([stamp, s.done_c.load(Ordering::Acquire)], stamp)
                            .is_none()
                    });
                }
                if mistake == Mistake::DoneBeforeSums {
                    s.done_a.store(stamp, Ordering::Release);
                    s.bell_o.notify();
                }
                // SAFETY (model): every node-mate's chunk is in (c's done
                // followed its add).
                let sum = s.buffer.with(|b| unsafe { *b });
                s.a_slot.with_mut(|d| unsafe { *d = sum });
                s.a_signal.store(1, Ordering::Release);
                s.bell_o.notify();
                wait_on(&s.bell_a, || s.a_ack.load(Ordering::Acquire) == 1);
                s.done_a.store(stamp, Ordering::Release);
                s.bell_o.notify();
            })
        };
        // o's finish: its aggregator's done (its node is only itself here).
        wait_on(&s.bell_o, || s.done_a.load(Ordering::Acquire) != 0);
        // SAFETY (model): a's done follows the acknowledgement of its sum.
        let got = s.accum.with(|x| unsafe { *x });
        assert_eq!(got, GRAD_A + GRAD_C, "o's gradient is its node's sum");
        node_mate.join().unwrap();
        o_daemon.join().unwrap();
        aggregator.join().unwrap();
    });
}

#[test]
fn loom_node_sums_reach_the_owner_once_every_node_mate_finished() {
    nodesum_model(Mistake::None);
}

#[test]
#[should_panic]
fn loom_node_sums_catch_a_push_before_the_node_mates_finished() {
    nodesum_model(Mistake::SumsBeforeNodeMates);
}

#[test]
#[should_panic]
fn loom_node_sums_catch_done_before_the_sums() {
    nodesum_model(Mistake::DoneBeforeSums);
}

/// The release under node aggregation: node-mate `c` reads version 0 of
/// `o`'s shard (on another node) and says done to its node only; its
/// aggregator `a` for `o` says done to `o` once `c`'s done is in
/// ([`nodesum::sums_ready`]); `o` overwrites its shard with version 1 once
/// the word that releases `c`'s reads ([`nodesum::releaser`]: `a`'s) reads
/// 0. The shard is an `UnsafeCell`: an overwrite racing `c`'s read fails
/// the model.
fn node_release_model(mistake: Mistake) {
    let (a, c, o, local) = (0usize, 1usize, 2usize, 2usize);
    assert_eq!(nodesum::releaser(o, c, local), a);
    assert!(!nodesum::done_after_sums(c, o, local));
    check(2, move || {
        let shard = Arc::new(UnsafeCell::new(10u64));
        let done_c = Arc::new(AtomicU64::new(0));
        let done_a = Arc::new(AtomicU64::new(0));
        let (bell_a, bell_o) = (
            Arc::new(EventCount::default()),
            Arc::new(EventCount::default()),
        );
        let stamp = finish::done_stamp(0, 0).unwrap();
        let reader = {
            let (shard, done_c, bell_a) =
                (Arc::clone(&shard), Arc::clone(&done_c), Arc::clone(&bell_a));
            loom::thread::spawn(move || {
                // SAFETY (model): version 0 stays until this read is released.
                let v = shard.with(|x| unsafe { *x });
                assert_eq!(v, 10, "c read version 0");
                done_c.store(stamp, Ordering::Release);
                bell_a.notify();
            })
        };
        let aggregator = {
            let (done_c, done_a, bell_a, bell_o) = (
                Arc::clone(&done_c),
                Arc::clone(&done_a),
                Arc::clone(&bell_a),
                Arc::clone(&bell_o),
            );
            loom::thread::spawn(move || {
                if mistake != Mistake::ReleaseBeforeNodeMates {
                    wait_on(&bell_a, || {
                        nodesum::sums_ready([stamp, done_c.load(Ordering::Acquire)], stamp)
                            .is_none()
                    });
                }
                done_a.store(stamp, Ordering::Release);
                bell_o.notify();
            })
        };
        // o's publish of version 1: every reader released (here only c,
        // through its releaser's word; o's own done is in).
        let word = |r: usize| if r == a { &*done_a } else { &*done_c };
        wait_on(&bell_o, || {
            versions::unreleased_reader(
                [(
                    0,
                    word(nodesum::releaser(o, c, local)).load(Ordering::Acquire),
                )],
                1,
            )
            .is_none()
        });
        // SAFETY (model): every read of version 0 is released.
        shard.with_mut(|x| unsafe { *x = 20 });
        reader.join().unwrap();
        aggregator.join().unwrap();
    });
}

#[test]
fn loom_a_remote_read_is_released_by_its_nodes_aggregator() {
    node_release_model(Mistake::None);
}

#[test]
#[should_panic]
fn loom_release_catches_an_aggregator_done_before_its_node_mates() {
    node_release_model(Mistake::ReleaseBeforeNodeMates);
}
