//! Elastic membership: the rounds of `protocol::membership` (the rule and
//! the store's bytes, `Round::from_bytes`), their keys in the job's store
//! as `elastic::Rounds` reads and changes them (the decision with its
//! writer's tag, the read-in counter, the joiners, the last committed
//! minibatch), the generation records (`elastic::Generation::current`) and
//! a restarted rank's walk through them (`elastic::await_admission`), with
//! any bytes anyone with access to the store may have left there.
//!
//! Properties: the round decoder accepts exactly the values a spelled-out
//! reader accepts (the encoder's, and nothing else), and a refusal names
//! the field; the rule decides a round once, commits it only after every
//! member's every rank read in and no death came first, voids it naming
//! the first death, and a decided round never changes; members only grow
//! by a commit's joiners and only shrink by a void's dead node. Through the
//! store: every call returns (no hang, no panic), a refusal is a store
//! error naming a key of the round or generation, a clean store never
//! refuses anything, a decision read once reads the same ever after and is
//! never an open round; a generation record is accepted exactly as
//! `Generation::begin` / `describe_first` write it, within the job's nodes.

use std::collections::BTreeMap;
use std::time::Instant;

use arbitrary::{Result, Unstructured};
use odc_core::elastic::{await_admission, Generation, Rounds};
use odc_core::fuzzing::round_decision;
use odc_core::protocol::membership::{
    self, all_nodes, next_members, node, on_death, on_join, on_read, outcome, total, Next, Nodes,
    Outcome, Round, FRESH, MAX_NODES,
};
use odc_core::{Error, Store};

use crate::mem_store::{must, MemStore};

/// Runs one input.
pub fn run(data: &[u8]) {
    let _ = body(&mut Unstructured::new(data));
}

fn body(u: &mut Unstructured<'_>) -> Result<()> {
    match u.int_in_range(0..=5u8)? {
        0 => round_bytes(u),
        5 => decision_bytes(u),
        1 => rule(u),
        2 => store_rounds(u),
        3 => generation(u),
        _ => admission(u),
    }
}

// ----- the spelled-out readers -------------------------------------------------------------------------------

/// A decimal number as `{}` writes it: `0`, or no leading zero.
fn dec(w: &str) -> Option<u64> {
    let canonical =
        !w.is_empty() && w.bytes().all(|c| c.is_ascii_digit()) && (w == "0" || !w.starts_with('0'));
    canonical.then(|| w.parse().ok()).flatten()
}

/// A node set as `{:x}` writes it: lower-case hexadecimal, no leading zero.
fn hex(w: &str) -> Option<u64> {
    let canonical = !w.is_empty()
        && w.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
        && (w == "0" || !w.starts_with('0'));
    canonical.then(|| u64::from_str_radix(w, 16).ok()).flatten()
}

/// The round in `b` as the writers write it (`open R J`, `commit J`,
/// `void D` with one node), or the first field that is wrong.
fn spelled_round(b: &[u8]) -> std::result::Result<Round, &'static str> {
    let text = std::str::from_utf8(b).map_err(|_| "kind")?;
    let words: Vec<&str> = text.split(' ').collect();
    let want = |n: usize| -> std::result::Result<(), &'static str> {
        if words.len() > n {
            Err("trailing")
        } else {
            Ok(())
        }
    };
    let r = match words[0] {
        "open" => {
            let read = words
                .get(1)
                .and_then(|w| dec(w))
                .and_then(|r| u32::try_from(r).ok())
                .ok_or("read")?;
            let joining = words.get(2).and_then(|w| hex(w)).ok_or("joining")?;
            want(3)?;
            Round::Open { read, joining }
        }
        "commit" => {
            let joining = words.get(1).and_then(|w| hex(w)).ok_or("joining")?;
            want(2)?;
            Round::Committed { joining }
        }
        "void" => {
            let dead = words
                .get(1)
                .and_then(|w| hex(w))
                .filter(|d| d.count_ones() == 1)
                .ok_or("dead")?;
            want(2)?;
            Round::Void { dead }
        }
        _ => return Err("kind"),
    };
    Ok(r)
}

// ----- the rounds' bytes -----------------------------------------------------------------------------------

/// A value near the rounds' own (one of them with a byte changed, added or
/// dropped), or anything.
fn round_value(u: &mut Unstructured<'_>) -> Result<Vec<u8>> {
    let mut v = match u.int_in_range(0..=3u8)? {
        0 => return u.arbitrary(),
        1 => any_round(u)?.to_bytes(),
        2 => {
            let words = [
                "open",
                "commit",
                "void",
                "0",
                "1",
                "+1",
                "-1",
                "01",
                "ff",
                "FF",
                "4294967295",
                "4294967296",
                "ffffffffffffffff",
                "10000000000000000",
                "8000000000000000",
                "",
                " ",
                "@",
                "@1",
            ];
            let n = u.int_in_range(1..=4usize)?;
            let mut s = String::new();
            for i in 0..n {
                if i > 0 {
                    s.push(if u.ratio(7, 8)? { ' ' } else { '\t' });
                }
                s.push_str(words[u.choose_index(words.len())?]);
            }
            s.into_bytes()
        }
        _ => {
            let mut v = any_round(u)?.to_bytes();
            let at = u.int_in_range(0..=v.len())?;
            match u.int_in_range(0..=2u8)? {
                0 if at < v.len() => v[at] = u.arbitrary()?,
                1 => v.insert(at, u.arbitrary()?),
                _ if at < v.len() => {
                    v.remove(at);
                }
                _ => {}
            }
            v
        }
    };
    if v.len() > 64 {
        v.truncate(64);
    }
    Ok(v)
}

fn any_round(u: &mut Unstructured<'_>) -> Result<Round> {
    let set = |u: &mut Unstructured<'_>| -> Result<Nodes> {
        if u.ratio(1, 4)? {
            u.arbitrary()
        } else {
            u.int_in_range(0..=15u64)
        }
    };
    Ok(match u.int_in_range(0..=2u8)? {
        0 => Round::Open {
            read: if u.ratio(1, 4)? {
                u.arbitrary()?
            } else {
                u.int_in_range(0..=8u32)?
            },
            joining: set(u)?,
        },
        1 => Round::Committed { joining: set(u)? },
        _ => Round::Void {
            dead: node(u.int_in_range(0..=MAX_NODES - 1)?),
        },
    })
}

/// `Round::from_bytes` against the spelled-out reader, on any value.
fn round_bytes(u: &mut Unstructured<'_>) -> Result<()> {
    let r = any_round(u)?;
    assert_eq!(Round::from_bytes(Some(&r.to_bytes())), Ok(r));
    assert_eq!(Round::from_bytes(None), Ok(FRESH));
    let v = round_value(u)?;
    match (Round::from_bytes(Some(&v)), spelled_round(&v)) {
        (Ok(got), Ok(want)) => {
            assert_eq!(got, want);
            assert_eq!(got.to_bytes(), v, "a value the encoder never writes");
        }
        (Err(e), Err(field)) => assert!(e.0.contains(field), "{e} does not name {field}"),
        (got, want) => panic!("{:?}: from_bytes {got:?}, the rule {want:?}", lossy(&v)),
    }
    Ok(())
}

/// A round's decision key: what `Rounds` writes (a decided round, then
/// ` @{rank}`) and nothing else is accepted; a refusal names the key and
/// the field.
fn decision_bytes(u: &mut Unstructured<'_>) -> Result<()> {
    let mut v = round_value(u)?;
    match u.int_in_range(0..=3u8)? {
        0 => {}
        1 => v.extend_from_slice(format!(" @{}", u.arbitrary::<u16>()?).as_bytes()),
        2 => {
            let tag = round_value(u)?;
            v.extend_from_slice(b" @");
            v.extend_from_slice(&tag);
        }
        _ => v.extend_from_slice(b" @"),
    }
    let key = "job/round/3/1";
    let want = match v.iter().rposition(|&c| c == b'@') {
        Some(at) if at > 0 && v[at - 1] == b' ' => {
            match std::str::from_utf8(&v[at + 1..]).ok().and_then(dec) {
                None => Err("writer"),
                Some(_) => match spelled_round(&v[..at - 1]) {
                    Ok(Round::Open { .. }) => Err("kind"),
                    r => r,
                },
            }
        }
        _ => Err("writer"),
    };
    match (round_decision(key, &v), want) {
        (Ok(got), Ok(want)) => assert_eq!(got, want),
        (Err(e @ Error::Store { .. }), Err(field)) => {
            let msg = e.to_string();
            assert!(
                msg.contains(key) && msg.contains(field),
                "{msg} does not name {field}"
            );
        }
        (got, want) => panic!("{:?}: decision {got:?}, the rule {want:?}", lossy(&v)),
    }
    Ok(())
}

fn lossy(v: &[u8]) -> String {
    String::from_utf8_lossy(v).into_owned()
}

// ----- the rule --------------------------------------------------------------------------------------------

/// The rule driven by the ranks of a few member nodes, in any order, from
/// any round value a store may hold: reads, deaths and join requests.
fn rule(u: &mut Unstructured<'_>) -> Result<()> {
    let nodes = u.int_in_range(1..=6usize)?;
    let per_node = u.int_in_range(1..=3u32)?;
    let members = u.int_in_range(1..=all_nodes(nodes))?;
    let need = total(members, per_node);
    // From a fresh round, or from any value (the rule must not panic on one).
    let (mut cur, honest) = if u.ratio(1, 4)? {
        (any_round(u)?, false)
    } else {
        (FRESH, true)
    };
    let mut read_in = std::collections::BTreeSet::new();
    let (mut joins, mut first_death) = (0u64, None::<usize>);
    let mut decided: Option<Outcome> = outcome(cur);
    for _ in 0..u.int_in_range(0..=40u8)? {
        let before = cur;
        let next = match u.int_in_range(0..=2u8)? {
            0 => {
                let rank = u.int_in_range(0..=nodes * per_node as usize - 1)?;
                if members & node(rank / per_node as usize) == 0 || !read_in.insert(rank) {
                    continue; // a rank reads in once, and only a member's
                }
                on_read(cur, need)
            }
            1 => {
                let dead = u.int_in_range(0..=nodes - 1)?;
                if members & node(dead) == 0 {
                    continue;
                }
                if matches!(cur, Round::Open { .. }) && first_death.is_none() {
                    first_death = Some(dead);
                }
                on_death(cur, dead)
            }
            _ => {
                let who = u.int_in_range(0..=MAX_NODES - 1)?;
                if matches!(cur, Round::Open { .. }) {
                    joins |= node(who);
                }
                on_join(cur, who)
            }
        };
        match next {
            Next::Write(r) => {
                assert!(outcome(before).is_none(), "{before:?} changed to {r:?}");
                cur = r;
            }
            Next::Wait => {}
        }
        if let Some(d) = decided {
            assert_eq!(outcome(cur), Some(d), "a decided round changed");
        }
        decided = outcome(cur);
        if !honest {
            continue;
        }
        match cur {
            Round::Open { read, joining } => {
                assert_eq!(read as usize, read_in.len());
                assert_eq!(joining, joins);
                assert!(read < need.max(1));
            }
            Round::Committed { joining } => {
                assert!(read_in.len() as u32 >= need, "committed before every read");
                assert_eq!(first_death, None, "committed after a death");
                assert_eq!(joining & !joins, 0);
            }
            Round::Void { dead } => assert_eq!(Some(dead), first_death.map(node)),
        }
    }
    if let Some(o) = outcome(cur) {
        let after = next_members(members, o);
        match o {
            Outcome::Committed { joining } => {
                assert!(after & members == members && after & !members == joining & !members)
            }
            Outcome::Void { dead } => {
                assert_eq!(after, members & !dead);
                if dead & members != 0 {
                    assert_eq!(after.count_ones() + 1, members.count_ones());
                }
            }
        }
    }
    Ok(())
}

// ----- the rounds through the store ------------------------------------------------------------------------

const PREFIX: &str = "job/elastic/j0";

/// A store holding some of the keys of rounds `(k, e)`, `e < 3` and `k < 3`
/// or at the end of the counter, and the
/// last committed minibatch, each a plausible or a malformed value; and
/// whether it holds none.
fn seeded(u: &mut Unstructured<'_>) -> Result<(MemStore, bool)> {
    let store = MemStore::default();
    let n = u.int_in_range(0..=4u8)?;
    for _ in 0..n {
        // Minibatches near the start, or at the end of the counter (where a
        // walk from a stored "last" goes next).
        let k = match u.int_in_range(0..=5u8)? {
            0 => u64::MAX - u.int_in_range(0..=1u64)?,
            _ => u.int_in_range(0..=2u64)?,
        };
        let e = u.int_in_range(0..=2u32)?;
        let round = format!("{PREFIX}/round/{k}/{e}");
        let (key, value) = match u.int_in_range(0..=3u8)? {
            0 => {
                let mut v = round_value(u)?;
                if u.ratio(3, 4)? {
                    v.extend_from_slice(format!(" @{}", u.int_in_range(0..=9u8)?).as_bytes());
                }
                (round, v)
            }
            1 => (format!("{round}/reads"), number(u, 10)?),
            2 => (format!("{round}/joins"), number(u, 16)?),
            _ => (format!("{PREFIX}/last"), number(u, 10)?),
        };
        if k > 2 && u.ratio(1, 2)? {
            // A walk from the last committed minibatch starts there.
            must(store.set(&format!("{PREFIX}/last"), k.to_string().as_bytes()));
        }
        must(store.set(&key, &value));
    }
    Ok((store, n == 0))
}

/// A number as the store's writers write it in `radix`, an edge value, or
/// anything.
fn number(u: &mut Unstructured<'_>, radix: u32) -> Result<Vec<u8>> {
    let n: u64 = match u.int_in_range(0..=3u8)? {
        0 => u.int_in_range(0..=4u64)?,
        1 => u64::MAX - u.int_in_range(0..=2u64)?,
        2 => return round_value(u),
        _ => u.arbitrary()?,
    };
    Ok(match radix {
        16 => format!("{n:x}"),
        _ => n.to_string(),
    }
    .into_bytes())
}

/// A refusal must be the store's, naming one of the job's keys.
fn named(e: &Error) {
    match e {
        Error::Store { key, detail, .. } => {
            assert!(key.starts_with("job/"), "{e}");
            assert!(!detail.is_empty(), "{e}");
        }
        _ => panic!("not a store error naming the key: {e:?}"),
    }
}

/// What a rank does to round `(k, e)` in [`store_rounds`].
#[derive(Clone, Copy, Debug)]
enum Call {
    ReadIn,
    Void(usize),
    Join(usize),
    Get,
    Decision,
    Leave(usize),
    Outcome(Option<usize>),
}

/// Ranks of up to 4 member nodes (up to 2 each) driving the rounds through
/// a store that may hold anything, in any order.
fn store_rounds(u: &mut Unstructured<'_>) -> Result<()> {
    let (store, clean) = seeded(u)?;
    let nodes = u.int_in_range(1..=4usize)?;
    let per_node = u.int_in_range(1..=2u32)?;
    let members = u.int_in_range(1..=all_nodes(nodes))?;
    let need = total(members, per_node);
    // What each (k, e) was first read as decided; how many read-ins each got.
    let mut seen: BTreeMap<(u64, u32), Round> = BTreeMap::new();
    let mut reads: BTreeMap<(u64, u32), u32> = BTreeMap::new();
    for _ in 0..u.int_in_range(0..=24u8)? {
        let rank = u.int_in_range(0..=nodes * per_node as usize - 1)?;
        let r = Rounds::new(&store, PREFIX, rank);
        let (k, e) = (u.int_in_range(0..=3u64)?, u.int_in_range(0..=3u32)?);
        let call = match u.int_in_range(0..=6u8)? {
            0 => Call::ReadIn,
            1 => Call::Void(u.int_in_range(0..=nodes - 1)?),
            2 => Call::Join(u.int_in_range(0..=nodes)?),
            3 => Call::Get,
            4 => Call::Decision,
            5 => Call::Leave(u.int_in_range(0..=nodes - 1)?),
            _ => {
                let dead = u.int_in_range(0..=nodes)?;
                Call::Outcome((dead < nodes && members & node(dead) != 0).then_some(dead))
            }
        };
        let got: odc_core::Result<Option<Round>> = match call {
            Call::ReadIn => {
                *reads.entry((k, e)).or_default() += 1;
                r.read_in(k, e, members, per_node).map(Some)
            }
            Call::Void(dead) => r.void(k, e, dead).map(Some),
            Call::Join(who) => r.join(k, e, who).map(Some),
            Call::Get => r.get(k, e).map(Some),
            Call::Decision => r.decision(k, e),
            Call::Leave(who) => r.leave(k, members, who).map(|()| None),
            // The deadline is now: an open round is the store's "wait" error.
            Call::Outcome(dead) => r.outcome(k, e, Instant::now(), || dead).map(|_| None),
        };
        match got {
            Err(err) => {
                named(&err);
                let waited = matches!(&err, Error::Store { op: "wait", .. });
                assert!(!clean || waited, "a clean store refused {call:?}: {err}");
            }
            Ok(Some(Round::Committed { .. })) if clean => {
                // Only the read-in that completes the count commits.
                let n = reads.get(&(k, e)).copied().unwrap_or(0);
                assert!(
                    n >= need,
                    "round {k}/{e} committed after {n} of {need} read-ins"
                );
            }
            Ok(_) => {}
        }
        // Every decision read so far reads the same now, and none is open.
        for (&(k, e), &d) in &seen {
            match Rounds::new(&store, PREFIX, 0).decision(k, e) {
                Ok(Some(n)) => assert_eq!(n, d, "round {k}/{e} changed"),
                Ok(None) => panic!("round {k}/{e} lost its decision"),
                Err(err) => panic!("round {k}/{e} was read as {d:?}, now {err}"),
            }
        }
        if let Ok(Some(d)) = Rounds::new(&store, PREFIX, 0).decision(k, e) {
            assert!(outcome(d).is_some(), "round {k}/{e}'s decision is {d:?}");
            seen.entry((k, e)).or_insert(d);
        }
    }
    Ok(())
}

// ----- generation records ----------------------------------------------------------------------------------

/// The generation `Generation::current` must read from the store's bytes
/// for a job of `nodes` nodes under `base`, or the key and field of the
/// first thing wrong.
fn spelled_generation(
    store: &BTreeMap<String, Vec<u8>>,
    base: &str,
    nodes: usize,
) -> std::result::Result<Generation, (String, &'static str)> {
    let current = format!("{base}/elastic/current");
    let (prefix, at) = match store.get(&current) {
        None => (base.to_owned(), None),
        Some(p) => {
            let p = std::str::from_utf8(p).map_err(|_| (current.clone(), "current"))?;
            if p == base {
                (p.to_owned(), None)
            } else {
                let s = p
                    .strip_prefix(base)
                    .and_then(|r| r.strip_prefix("/gen/"))
                    .and_then(dec)
                    .ok_or((current.clone(), "current"))?;
                (p.to_owned(), Some(s))
            }
        }
    };
    let key = format!("{prefix}/generation");
    let Some(raw) = store.get(&key) else {
        if at.is_some() {
            return Err((key, "generation"));
        }
        return Ok(Generation {
            prefix,
            start: None,
            members: all_nodes(nodes),
            joining: 0,
        });
    };
    let bad = |field| (key.clone(), field);
    let text = String::from_utf8_lossy(raw);
    let w: Vec<&str> = text.split(' ').collect();
    let start = match (w[0], at) {
        ("-", None) => None,
        (s, Some(at)) => Some(dec(s).filter(|&s| s == at).ok_or(bad("start"))?),
        _ => return Err(bad("start")),
    };
    let members = w
        .get(1)
        .and_then(|m| hex(m))
        .filter(|&m| m != 0 && m & !all_nodes(nodes) == 0)
        .ok_or(bad("members"))?;
    let joining = w
        .get(2)
        .and_then(|j| hex(j))
        .filter(|&j| j & !members == 0 && (start.is_some() || j == 0))
        .ok_or(bad("joining"))?;
    if w.len() > 3 {
        return Err(bad("trailing"));
    }
    Ok(Generation {
        prefix,
        start,
        members,
        joining,
    })
}

fn generation(u: &mut Unstructured<'_>) -> Result<()> {
    let store = MemStore::default();
    let nodes = u.int_in_range(1..=MAX_NODES)?;
    let base = "job";
    // What the writers write, then perhaps a byte or a word changed.
    let start = if u.ratio(1, 4)? {
        u.arbitrary()?
    } else {
        u.int_in_range(0..=9u64)?
    };
    let members = u.int_in_range(1..=all_nodes(nodes))?;
    let joining = members & u.arbitrary::<u64>()?;
    match u.int_in_range(0..=3u8)? {
        0 => {
            let g = must(Generation::begin(&store, base, start, members, joining));
            assert_eq!(Generation::current(&store, base, nodes).ok(), Some(g));
        }
        1 => {
            must(Generation::describe_first(&store, base, members));
            let g = Generation::current(&store, base, nodes).ok();
            assert_eq!(
                g.map(|g| (g.start, g.members, g.joining)),
                Some((None, members, 0))
            );
        }
        _ => {}
    }
    for _ in 0..u.int_in_range(0..=2u8)? {
        let key = if u.arbitrary()? {
            format!("{base}/elastic/current")
        } else {
            let at = if u.arbitrary()? {
                base.to_owned()
            } else {
                Generation::prefix_at(base, start)
            };
            format!("{at}/generation")
        };
        let mut v = must(store.get(&key)).unwrap_or_default();
        match u.int_in_range(0..=3u8)? {
            0 => v = u.arbitrary()?,
            1 => v = round_value(u)?,
            2 if !v.is_empty() => {
                let at = u.choose_index(v.len())?;
                v[at] = u.arbitrary()?;
            }
            _ => v.extend_from_slice(&round_value(u)?),
        }
        must(store.set(&key, &v));
    }
    let got = Generation::current(&store, base, nodes);
    match (got, spelled_generation(&store.snapshot(), base, nodes)) {
        (Ok(g), Ok(want)) => assert_eq!(g, want),
        (Err(e @ Error::Store { .. }), Err((key, field))) => {
            let Error::Store { key: k, detail, .. } = &e else {
                unreachable!()
            };
            assert_eq!(*k, key, "{e}");
            assert!(detail.contains(field), "{e} does not name {field}");
        }
        (got, want) => panic!("{:?}: current {got:?}, the rule {want:?}", store.snapshot()),
    }
    Ok(())
}

// ----- a restarted rank's walk --------------------------------------------------------------------------------

/// A restarted rank asks for admission through a store holding anything
/// (with a deadline of now: it returns at its first wait): it returns, and
/// a generation it joins lists its node.
fn admission(u: &mut Unstructured<'_>) -> Result<()> {
    let (store, _) = seeded(u)?;
    let nodes = u.int_in_range(1..=4usize)?;
    let node_me = u.int_in_range(0..=nodes - 1)?;
    if u.ratio(3, 4)? {
        must(store.set("job/job_id", b"j0"));
    }
    if u.arbitrary()? {
        must(store.set(&format!("job/reg/{node_me}"), b"{}"));
    }
    if u.ratio(1, 2)? {
        let start = match u.int_in_range(0..=2u8)? {
            0 => u.int_in_range(0..=4u64)?,
            1 => u64::MAX - u.int_in_range(0..=2u64)?,
            _ => u.arbitrary()?,
        };
        let members = u.int_in_range(1..=all_nodes(nodes))?;
        let joining = members & u.arbitrary::<u64>()?;
        let g = must(Generation::begin(&store, "job", start, members, joining));
        if u.arbitrary()? {
            must(store.set(&format!("{}/job_id", g.prefix), b"j0"));
        }
        // Its rounds sit under its own prefix.
        for (key, value) in store.snapshot() {
            if let Some(rest) = key.strip_prefix(PREFIX) {
                must(store.set(&format!("{}/elastic/j0{rest}", g.prefix), &value));
            }
        }
    }
    match await_admission(&store, "job", nodes, node_me, node_me, Instant::now()) {
        Ok(g) => assert!(g.members & membership::node(node_me) != 0, "{g:?}"),
        Err(e) => named(&e),
    }
    Ok(())
}
