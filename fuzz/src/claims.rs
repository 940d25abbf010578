//! Work stealing's words: the claim word (this rank's and its daemon's,
//! read by thieves as a hint), a thief's request word (written by a peer
//! into the victim's memory, decoded by the victim's daemon) and the
//! grant word (written by the victim's daemon, decoded by the thief).
//!
//! Properties: words round trip; arbitrary request words never make the
//! daemon's claim panic or hand out a microbatch outside the unclaimed
//! part of the word; an owner and thieves claiming in any interleaving
//! over any minibatch numbers claim every microbatch of the owner's list
//! exactly once, and only those.

use std::collections::HashSet;

use arbitrary::{Result, Unstructured};
use odc_core::protocol::claims::{
    grant, own, parse_grant, parse_request, request, steal, Claim, ClaimError, Word, MAX_COUNT,
    MAX_MINIBATCH,
};

/// Runs one input.
pub fn run(data: &[u8]) {
    let _ = body(&mut Unstructured::new(data));
}

fn body(u: &mut Unstructured<'_>) -> Result<()> {
    match u.int_in_range(0..=2u8)? {
        0 => words(u),
        1 => daemon(u),
        _ => exactly_once(u),
    }
}

fn words(u: &mut Unstructured<'_>) -> Result<()> {
    let w: u64 = u.arbitrary()?;
    let word = Word::unpack(w);
    assert_eq!(word.pack(), w, "{word:?}");
    assert!(word.front <= MAX_COUNT && word.back <= MAX_COUNT && word.stamp < 1 << 24);
    let k: u64 = u.arbitrary()?;
    let left = word.left(k);
    assert!(left <= word.back);

    let seq = u.int_in_range(1..=u32::MAX as u64)?;
    let k = u.int_in_range(0..=MAX_MINIBATCH)?;
    assert_eq!(parse_request(request(seq, k)), Some((seq, k)));
    let raw: u64 = u.arbitrary()?;
    if let Some((s, k)) = parse_request(raw) {
        assert!(s > 0 && s == raw >> 32 && k < u32::MAX as u64);
        assert_eq!(request(s, k), raw);
    }
    let claim = match u.int_in_range(0..=2u8)? {
        0 => Claim::Empty,
        1 => Claim::NotYet,
        _ => Claim::Got(u.int_in_range(0..=MAX_COUNT)?),
    };
    let seq = u.int_in_range(0..=u32::MAX as u64)?;
    assert_eq!(parse_grant(grant(seq, claim)), (seq, claim));
    let (s, c) = parse_grant(raw);
    assert_eq!(s, raw >> 32);
    if let Claim::Got(i) = c {
        assert!(i <= u32::MAX as u64 - 2);
    }
    Ok(())
}

/// The victim's daemon serving a request word a peer wrote, against any
/// claim word: what it grants is one of the unclaimed microbatches, taken
/// from the back.
fn daemon(u: &mut Unstructured<'_>) -> Result<()> {
    let raw: u64 = u.arbitrary()?;
    let word: u64 = u.arbitrary()?;
    let Some((_, k)) = parse_request(raw) else {
        return Ok(());
    };
    check_steal(word, k);
    // Any minibatch number, as the pure function sees it.
    check_steal(word, u.arbitrary()?);
    Ok(())
}

fn check_steal(word: u64, k: u64) {
    let w = Word::unpack(word);
    let (new, claim) = steal(word, k);
    let started = k.checked_add(1).is_some_and(|s| w.stamp >= s);
    match claim {
        Claim::Got(i) => {
            assert!(
                w.stamp == k + 1 && w.front <= i && i < w.back,
                "{w:?} k {k} -> {i}"
            );
            let Some(new) = new else {
                panic!("a claim that leaves the word unchanged")
            };
            let n = Word::unpack(new);
            assert_eq!((n.stamp, n.front, n.back), (w.stamp, w.front, i));
        }
        Claim::Empty => {
            assert!(new.is_none() && started && (w.stamp != k + 1 || w.front >= w.back))
        }
        Claim::NotYet => assert!(new.is_none() && !started),
    }
}

/// The owner (from the front) and thieves (from the back) on one word.
fn exactly_once(u: &mut Unstructured<'_>) -> Result<()> {
    let mut word = 0u64;
    let mut k = u.int_in_range(0..=3u64)?;
    let mut count = u.int_in_range(0..=12u64)?;
    let mut claimed: HashSet<u64> = HashSet::new();
    let mut owner_done = false;
    for _ in 0..u.int_in_range(0..=80u8)? {
        let thief = u.ratio(1, 2)?;
        if thief {
            // A thief may ask about an older, this or a later minibatch.
            let asked = k + u.int_in_range(0..=2u64)?;
            let asked = asked.saturating_sub(u.int_in_range(0..=1u64)?);
            let (new, c) = steal(word, asked);
            if let Some(n) = new {
                word = n;
            }
            if let Claim::Got(i) = c {
                assert_eq!(
                    asked, k,
                    "stole from minibatch {asked} while the owner is at {k}"
                );
                assert!(
                    i < count && claimed.insert(i),
                    "microbatch {i} of {count} twice"
                );
            }
            continue;
        }
        if owner_done {
            // Every microbatch of k is claimed: the owner moves on.
            assert_eq!(
                claimed.len() as u64,
                count,
                "owner saw Empty with {claimed:?} of {count}"
            );
            k += u.int_in_range(1..=2u64)?;
            count = u.int_in_range(0..=12u64)?;
            claimed.clear();
            owner_done = false;
        }
        match own(word, k, count) {
            Ok((new, c)) => {
                if let Some(n) = new {
                    word = n;
                }
                match c {
                    Claim::Got(i) => {
                        assert!(i < count && claimed.insert(i), "own {i} of {count} twice")
                    }
                    Claim::Empty => owner_done = true,
                    Claim::NotYet => panic!("the owner is never told NotYet"),
                }
            }
            Err(ClaimError::TooLarge) => assert!(count > MAX_COUNT || k > MAX_MINIBATCH),
            Err(e) => panic!("own({word:#x}, {k}, {count}): {e:?}"),
        }
    }
    // An owner going backwards is refused.
    if k > 0 && Word::unpack(word).stamp == k + 1 {
        assert!(matches!(
            own(word, k - 1, count),
            Err(ClaimError::Backwards { .. })
        ));
    }
    Ok(())
}
