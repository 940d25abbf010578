//! What registration reads back from the rendezvous store, written by the
//! peers (or by anyone with access to the store): endpoint posts with
//! their region descriptors, registration posts (bucket-list hash, specs,
//! settings), integer counters (`Store::add`), the job id.
//!
//! Properties: an accepted endpoint post is the peer's own, with the
//! control region and the published shards (and the accumulators when
//! asked for) at least as large as this rank's and each id once; a refusal
//! names the peer (or the store key); a registration post is equal to
//! itself and compared without panicking; descriptors round trip through
//! JSON; a counter adds like `i64::checked_add` or is refused; a job id
//! becomes a short, safe shared-memory name.

use arbitrary::{Result, Unstructured};
use odc_core::fuzzing::{check_endpoint, compare_reg_posts};
use odc_core::region::{Endpoint, RemoteRegion};
use odc_core::store::added;
use odc_core::transport::shm::sanitize_job_key;
use odc_core::{Error, RegionDesc};
use serde_json::{json, Value};

/// Runs one input.
pub fn run(data: &[u8]) {
    let _ = body(&mut Unstructured::new(data));
}

fn body(u: &mut Unstructured<'_>) -> Result<()> {
    match u.int_in_range(0..=3u8)? {
        0 => endpoint(u),
        1 => registration(u),
        2 => counter(u),
        _ => job_id(u),
    }
}

/// A number near the sizes the check compares against, or anything.
fn size(u: &mut Unstructured<'_>, near: u64) -> Result<u64> {
    Ok(match u.int_in_range(0..=3u8)? {
        0 => u.arbitrary()?,
        1 => near.saturating_sub(u.int_in_range(0..=2u64)?),
        _ => near + u.int_in_range(0..=2u64)?,
    })
}

fn endpoint(u: &mut Unstructured<'_>) -> Result<()> {
    let peer = u.int_in_range(0..=7usize)?;
    let (ctrl, params) = (
        u.int_in_range(64..=4096usize)?,
        u.int_in_range(0..=4096usize)?,
    );
    let accum = if u.arbitrary()? {
        Some(u.int_in_range(4..=4096usize)?)
    } else {
        None
    };
    let key = format!("odc/ep/{peer}");
    let bytes: Vec<u8> = if u.ratio(1, 5)? {
        u.arbitrary()?
    } else {
        let mut regions = Vec::new();
        for _ in 0..u.int_in_range(0..=4u8)? {
            let id = u.int_in_range(0..=3u32)?;
            let near = [ctrl, params, accum.unwrap_or(0), 0][id as usize] as u64;
            regions.push(json!({
                "owner": if u.ratio(7, 8)? { peer as u64 } else { u.int_in_range(0..=8u64)? },
                "id": id,
                "len": size(u, near)?,
                "key": u.arbitrary::<u64>()?,
            }));
        }
        let mut post = json!({
            "endpoint": {
                "rank": if u.ratio(7, 8)? { peer as u64 } else { u.arbitrary()? },
                "pid": u.arbitrary::<u32>()?,
                "host": u.arbitrary::<String>()?,
                "address": "",
            },
            "regions": regions,
        });
        if u.ratio(1, 8)? {
            post = json!({ "failed": "out of shared memory" });
        }
        if u.ratio(1, 6)? {
            // A field of the wrong type, or one missing.
            let f = ["endpoint", "regions"][u.choose_index(2)?];
            if let Some(o) = post.as_object_mut() {
                if u.arbitrary()? {
                    o.remove(f);
                } else {
                    o.insert(f.into(), Value::from(u.arbitrary::<i64>()?));
                }
            }
        }
        match serde_json::to_vec(&post) {
            Ok(v) => v,
            Err(e) => panic!("{e}"),
        }
    };
    match check_endpoint(&key, peer, &bytes, ctrl, params, accum) {
        Ok((all, [c, p], a)) => {
            assert!(c.id == 0 && c.len >= ctrl as u64, "{c:?}");
            assert!(p.id == 1 && p.len >= params as u64, "{p:?}");
            assert_eq!(a.is_some(), accum.is_some());
            if let (Some(a), Some(len)) = (a, accum) {
                assert!(a.id == 2 && a.len >= len as u64, "{a:?}");
            }
            for (i, d) in all.iter().enumerate() {
                assert_eq!(d.owner as usize, peer);
                assert!(all[..i].iter().all(|e| e.id != d.id), "{all:?}");
            }
        }
        Err(e) => {
            let named = match &e {
                Error::Malformed { peer: p, .. } => *p == peer,
                Error::Store { key: k, .. } => *k == key,
                Error::Config(m) => crate::names_rank(m, peer),
                Error::Transport {
                    op: "register",
                    detail,
                    ..
                } => crate::names_rank(detail, peer),
                _ => false,
            };
            assert!(named, "{e:?} does not name rank {peer} or {key:?}");
        }
    }
    // Descriptors and endpoints are plain data: JSON round trips.
    let d = RegionDesc {
        owner: u.arbitrary()?,
        id: u.arbitrary()?,
        len: u.arbitrary()?,
        key: u.arbitrary()?,
    };
    round_trip(&d);
    let ep = Endpoint {
        rank: u.arbitrary()?,
        pid: u.arbitrary()?,
        host: u.arbitrary()?,
        address: u.arbitrary()?,
        regions: vec![RemoteRegion {
            id: u.arbitrary()?,
            base: u.arbitrary()?,
            len: u.arbitrary()?,
            key: u.arbitrary()?,
        }],
    };
    round_trip(&ep);
    Ok(())
}

fn round_trip<T>(v: &T)
where
    T: serde::Serialize + for<'de> serde::Deserialize<'de> + PartialEq + std::fmt::Debug,
{
    let bytes = match serde_json::to_vec(v) {
        Ok(b) => b,
        Err(e) => panic!("{v:?}: {e}"),
    };
    match serde_json::from_slice::<T>(&bytes) {
        Ok(back) => assert_eq!(&back, v),
        Err(e) => panic!("{v:?}: {e}"),
    }
}

const OURS: &str = r#"{"hash":1234,"chunk_bytes":65536,"sharding":"full","local_world":2,"accum":"f32","specs":[["layer0",1000,"f32"],["layer1",24,"bf16"]]}"#;

fn registration(u: &mut Unstructured<'_>) -> Result<()> {
    let peer = u.int_in_range(0..=7usize)?;
    let key = format!("odc/reg/{peer}");
    let ours = OURS.as_bytes();
    if let Err(e) = compare_reg_posts(&key, peer, ours, ours) {
        panic!("a post differs from itself: {e}");
    }
    let theirs: Vec<u8> = if u.ratio(1, 3)? {
        u.arbitrary()?
    } else {
        // Ours with one field changed.
        let Ok(mut v) = serde_json::from_str::<Value>(OURS) else {
            panic!("OURS does not parse")
        };
        let f = [
            "hash",
            "chunk_bytes",
            "sharding",
            "local_world",
            "accum",
            "specs",
        ][u.choose_index(6)?];
        let new = match u.int_in_range(0..=3u8)? {
            0 => Value::from(u.arbitrary::<u64>()?),
            1 => Value::from(u.arbitrary::<String>()?),
            2 => json!([[u.arbitrary::<String>()?, u.arbitrary::<u64>()?, "f32"]]),
            _ => Value::Null,
        };
        if let Some(o) = v.as_object_mut() {
            o.insert(f.into(), new);
        }
        match serde_json::to_vec(&v) {
            Ok(b) => b,
            Err(e) => panic!("{e}"),
        }
    };
    if let Err(e) = compare_reg_posts(&key, peer, ours, &theirs) {
        let named = match &e {
            Error::Registration { peer: p, .. } => *p == peer,
            Error::Store { key: k, .. } => *k == key,
            Error::Config(m) | Error::Transport { detail: m, .. } => crate::names_rank(m, peer),
            _ => false,
        };
        assert!(named, "{e:?} does not name rank {peer} or {key:?}");
    }
    Ok(())
}

fn counter(u: &mut Unstructured<'_>) -> Result<()> {
    let delta: i64 = u.arbitrary()?;
    let value: Option<Vec<u8>> = match u.int_in_range(0..=3u8)? {
        0 => None,
        1 => Some(u.arbitrary::<i64>()?.to_string().into_bytes()),
        2 => Some(format!(" {}\n", u.arbitrary::<i64>()?).into_bytes()),
        _ => Some(u.arbitrary()?),
    };
    let current = match &value {
        None => Some(0),
        Some(v) => std::str::from_utf8(v)
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok()),
    };
    match added("n", value.as_deref(), delta) {
        Ok(n) => assert_eq!(Some(n), current.and_then(|c| c.checked_add(delta))),
        Err(Error::Store { op: "add", key, .. }) => {
            assert_eq!(key, "n");
            assert!(current.and_then(|c| c.checked_add(delta)).is_none());
        }
        Err(e) => panic!("{e:?}"),
    }
    Ok(())
}

fn job_id(u: &mut Unstructured<'_>) -> Result<()> {
    // Rank 0 posts it; the others read any bytes back, lossily as text.
    let raw: Vec<u8> = u.arbitrary()?;
    let id = sanitize_job_key(&String::from_utf8_lossy(&raw));
    assert!(!id.is_empty() && id.len() <= 32, "{id:?}");
    assert!(
        id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_'),
        "{id:?}"
    );
    Ok(())
}
