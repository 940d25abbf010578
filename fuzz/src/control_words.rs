//! The control words `protocol/` interprets, with any value a peer may
//! leave in them: landing-slot counts and acknowledgements, versions,
//! releases, done stamps, partials, pieces, and the rank a dead peer's
//! blame word names.
//!
//! Properties: every rule agrees with a spelled-out reference on arbitrary
//! words; slot sequence numbers and counts map one to one; driven honestly
//! (a random schedule of pushes and adds), every chunk is added exactly
//! once, in push order, and acknowledged; a corrupt count never makes the
//! owner add a chunk twice without a new count.

use arbitrary::{Result, Unstructured};
use odc_core::protocol::slots::{slot_count, slot_seq, SlotReceiver, SlotSender};
use odc_core::protocol::{finish, lagging, partials, pieces, stamp, versions};
use odc_core::wait::blame;

/// Runs one input.
pub fn run(data: &[u8]) {
    let _ = body(&mut Unstructured::new(data));
}

fn words(u: &mut Unstructured<'_>) -> Result<Vec<u64>> {
    let n = u.int_in_range(0..=8usize)?;
    (0..n).map(|_| small_or_any(u)).collect()
}

/// Mostly values near each other (where the rules' edges are), sometimes
/// anything.
fn small_or_any(u: &mut Unstructured<'_>) -> Result<u64> {
    if u.ratio(1, 4)? {
        u.arbitrary()
    } else {
        u.int_in_range(0..=6u64)
    }
}

fn body(u: &mut Unstructured<'_>) -> Result<()> {
    match u.int_in_range(0..=4u8)? {
        0 => slot_words(u),
        1 => honest_slots(u),
        2 => version_words(u),
        3 => cross_node_words(u),
        _ => blame_words(u),
    }
}

/// A slot's signal word is whatever count the peer (or its NIC) left.
fn slot_words(u: &mut Unstructured<'_>) -> Result<()> {
    let slot = u.choose_index(2)?;
    let count: u64 = if u.ratio(1, 2)? {
        u.arbitrary()?
    } else {
        small_or_any(u)?
    };
    let seq = slot_seq(slot, count);
    if count == 0 {
        assert_eq!(seq, 0);
    } else if seq < u64::MAX - 1 {
        // Below the top, where sequence numbers saturate, the map is one
        // to one: the count after chunk `seq` is `count`, in slot `seq % 2`.
        assert_eq!(seq % 2, slot as u64, "slot {slot} count {count} -> {seq}");
        assert_eq!(slot_count(seq), count);
    }
    let any: u64 = u.arbitrary()?;
    if any > 0 {
        assert_eq!(slot_seq((any % 2) as usize, slot_count(any)), any);
    }
    // An owner fed arbitrary counts: it takes a chunk only on a change,
    // and always the sequence number the count names.
    let mut r = SlotReceiver::default();
    let mut last = [0u64; 2];
    for _ in 0..u.int_in_range(0..=16u8)? {
        let order = r.order();
        assert!(order == [0, 1] || order == [1, 0]);
        let slot = order[u.choose_index(2)?];
        let count = small_or_any(u)?;
        let want = slot_seq(slot, count);
        match r.arrived(slot, count) {
            Some(seq) => {
                assert_eq!(seq, want);
                assert_ne!(seq, last[slot]);
                last[slot] = seq;
            }
            None => assert_eq!(want, last[slot]),
        }
    }
    Ok(())
}

/// A client and an owner following the protocol, in a random schedule:
/// every chunk is added once, in push order, and the client sees all of
/// them acknowledged at the end.
fn honest_slots(u: &mut Unstructured<'_>) -> Result<()> {
    let mut sender = SlotSender::default();
    let mut receiver = SlotReceiver::default();
    let (mut signal, mut ack) = ([0u64; 2], [0u64; 2]);
    let mut pending: Vec<(usize, u64)> = Vec::new(); // written, not yet added
    let (mut pushed, mut added) = (0u64, 0u64);
    let total = u.int_in_range(1..=40u64)?;
    for _ in 0..400 {
        if added == total {
            break;
        }
        let push = pushed < total && (pending.is_empty() || u.ratio(1, 2)?);
        if push {
            let Some((slot, seq)) = sender.ready(ack[sender.next().0]) else {
                // The next slot still holds an unacknowledged chunk: the
                // owner must add it first.
                assert!(pending.iter().any(|&(s, _)| s == sender.next().0));
                push_owner(
                    &mut receiver,
                    &mut signal,
                    &mut ack,
                    &mut pending,
                    &mut added,
                );
                continue;
            };
            assert_eq!(seq, pushed + 1);
            signal[slot] = slot_count(seq);
            sender.sent(slot, seq);
            pending.push((slot, seq));
            pushed += 1;
        } else {
            push_owner(
                &mut receiver,
                &mut signal,
                &mut ack,
                &mut pending,
                &mut added,
            );
        }
    }
    while added < pushed {
        push_owner(
            &mut receiver,
            &mut signal,
            &mut ack,
            &mut pending,
            &mut added,
        );
    }
    assert!(sender.acknowledged(ack), "{sender:?} {ack:?}");
    Ok(())
}

/// One scan of the owner's daemon: the slots in its order, each added and
/// acknowledged when its count changed.
fn push_owner(
    r: &mut SlotReceiver,
    signal: &mut [u64; 2],
    ack: &mut [u64; 2],
    pending: &mut Vec<(usize, u64)>,
    added: &mut u64,
) {
    let before = *added;
    for slot in r.order() {
        if let Some(seq) = r.arrived(slot, signal[slot]) {
            assert_eq!(seq, *added + 1, "chunks are added in push order");
            assert_eq!(pending.first(), Some(&(slot, seq)));
            pending.remove(0);
            *added += 1;
            ack[slot] = seq;
        }
    }
    assert!(
        pending.is_empty() || *added > before,
        "a scan left written chunks {pending:?} untouched"
    );
}

/// Versions, releases and done words with any values.
fn version_words(u: &mut Unstructured<'_>) -> Result<()> {
    let seen = small_or_any(u)?;
    let version = small_or_any(u)?;
    match versions::publish_stamp(seen, version) {
        Ok(s) => assert!(s == version + 1 && s > seen),
        Err(versions::VersionError::Reserved) => assert_eq!(version, u64::MAX),
        Err(versions::VersionError::NotIncreasing {
            version: v,
            current,
        }) => {
            assert!(v == version && seen > version && current == seen - 1)
        }
        Err(e) => panic!("publish_stamp({seen}, {version}): {e:?}"),
    }
    match versions::shard(seen, version) {
        Ok(versions::Shard::Ready) => assert_eq!(seen, version.saturating_add(1)),
        Ok(versions::Shard::Pending) => assert!(seen < version.saturating_add(1)),
        Err(versions::VersionError::Newer { current, .. }) => {
            assert!(seen > version.saturating_add(1) && current == seen - 1)
        }
        Err(e) => panic!("shard({seen}, {version}): {e:?}"),
    }
    let (released, done) = (words(u)?, words(u)?);
    let pairs: Vec<(u64, u64)> = released.iter().copied().zip(done.iter().copied()).collect();
    let want = (version > 0)
        .then(|| pairs.iter().position(|&(r, d)| r.max(d) < version))
        .flatten();
    assert_eq!(
        versions::unreleased_reader(pairs.iter().copied(), version),
        want
    );
    let finished = small_or_any(u)?;
    match finish::done_stamp(finished, version) {
        Ok(s) => assert!(s == stamp(version).unwrap_or(u64::MAX) && finished <= s),
        Err(finish::FinishError::Backwards { k, earlier }) => {
            assert!(
                k == version && earlier + 1 == finished && finished > stamp(k).unwrap_or(u64::MAX)
            )
        }
    }
    let want = done.iter().position(|&d| d < seen);
    assert_eq!(finish::unfinished_client(done.iter().copied(), seen), want);
    assert_eq!(lagging(done.iter().copied(), seen), want);
    Ok(())
}

/// Hybrid sharding's words from the other nodes.
fn cross_node_words(u: &mut Unstructured<'_>) -> Result<()> {
    let w = words(u)?;
    let node = u.int_in_range(0..=8usize)?;
    let s = small_or_any(u)?;
    let want = w.iter().enumerate().position(|(n, &x)| n != node && x < s);
    assert_eq!(partials::lagging_replica(w.iter().copied(), node, s), want);
    let want_unread = if s == 0 { None } else { want };
    assert_eq!(pieces::unread(w.iter().copied(), node, s), want_unread);
    let word = small_or_any(u)?;
    match pieces::piece(word, s) {
        Ok(pieces::Piece::Ready) => assert_eq!(word, s),
        Ok(pieces::Piece::Pending) => assert!(word < s),
        Err(pieces::Ahead { current }) => assert!(current == word && word > s),
    }
    Ok(())
}

/// The blame word of a dead peer names any rank (+ 1) it likes: an error
/// names a third rank only when it is one of the job.
fn blame_words(u: &mut Unstructured<'_>) -> Result<()> {
    let world = u.int_in_range(1..=64usize)?;
    let me = u.int_in_range(0..=world - 1)?;
    let peer = u.int_in_range(0..=world - 1)?;
    let word: u64 = if u.ratio(1, 2)? {
        u.arbitrary()?
    } else {
        u.int_in_range(0..=70u64)?
    };
    // As the shm and fabric transports decode it: rank + 1, 0 for none.
    let blamed = word.checked_sub(1).and_then(|b| usize::try_from(b).ok());
    let (who, reported_by) = blame(me, world, peer, blamed);
    assert!(
        who < world,
        "blame({me}, {world}, {peer}, {blamed:?}) = {who}"
    );
    match reported_by {
        Some(r) => assert!(r == peer && who != peer && who != me && Some(who) == blamed),
        None => assert_eq!(who, peer),
    }
    Ok(())
}
