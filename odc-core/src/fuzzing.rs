//! Entry points of the fuzz targets (`fuzz/`, `make fuzz`) into decoders
//! that live in private modules: what registration reads from the store,
//! the decision of an elastic membership round.
//! Built with the `fuzzing` feature only; not part of the API.

use crate::engine::register::{self, RegionSizes};
use crate::region::RegionDesc;
use crate::Result;

/// Rank `peer`'s endpoint post `v` under `key`, checked as registration
/// checks it against this rank's region sizes: the control region and
/// published shards (at least `ctrl` and `params` bytes) and, with
/// `accum`, the accumulators. Returns every descriptor the post holds and
/// the checked ones.
pub fn check_endpoint(
    key: &str,
    peer: usize,
    v: &[u8],
    ctrl: usize,
    params: usize,
    accum: Option<usize>,
) -> Result<(Vec<RegionDesc>, [RegionDesc; 2], Option<RegionDesc>)> {
    let want = RegionSizes {
        ctrl,
        params,
        accum,
    };
    let (post, found, a) = register::check_endpoint(key, peer, v, &want)?;
    Ok((post.regions, found, a))
}

/// Rank `peer`'s registration post `theirs` under `key`, compared as
/// registration compares it with this rank's post `ours` (which must
/// parse).
pub fn compare_reg_posts(key: &str, peer: usize, ours: &[u8], theirs: &[u8]) -> Result<()> {
    let ours = register::parse_reg_post("ours", 0, ours)?;
    register::compare(&ours, &register::parse_reg_post(key, peer, theirs)?, peer)
}

/// The decision a membership round's key `key` holds, decoded as
/// `elastic::Rounds` decodes it (its writer's tag dropped).
pub fn round_decision(key: &str, raw: &[u8]) -> Result<crate::protocol::membership::Round> {
    crate::elastic::decode(key, raw)
}
