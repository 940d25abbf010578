//! Versions of a published shard: the owner's `seen_version` word, every
//! client's `released` and `done` words.
//!
//! The rules: an owner publishes version `v` only after every client's
//! `released` or `done` word reaches `v` (the client is done reading
//! `v − 1`), so no reader sees a shard being overwritten; versions
//! increase; a reader reads an owner's shard once it holds exactly the
//! version it needs, and a newer one there means the reader missed a
//! release.

use super::stamp;

/// Why a publish or a gather is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VersionError {
    /// `u64::MAX` has no stamp.
    Reserved,
    /// A publish of `version` after `current` (versions must increase).
    NotIncreasing {
        /// The version this publish was asked for.
        version: u64,
        /// The version the shard already holds.
        current: u64,
    },
    /// A gather of `version` while the owner holds the newer `current`.
    Newer {
        /// The version this gather was asked for.
        version: u64,
        /// The newer version the owner holds.
        current: u64,
    },
}

/// The stamp to signal for a publish of `version` over an own word that
/// reads `seen`.
pub fn publish_stamp(seen: u64, version: u64) -> Result<u64, VersionError> {
    let s = stamp(version).ok_or(VersionError::Reserved)?;
    if seen >= s {
        return Err(VersionError::NotIncreasing {
            version,
            current: seen - 1,
        });
    }
    Ok(s)
}

/// The first client (index) that has not finished reading `version − 1`,
/// given each client's `(released, done)` words; `None`: publish `version`.
pub fn unreleased_reader(
    words: impl IntoIterator<Item = (u64, u64)>,
    version: u64,
) -> Option<usize> {
    if version == 0 {
        return None;
    }
    // A stamp of `version − 1` is `version`.
    super::lagging(words.into_iter().map(|(r, d)| r.max(d)), version)
}

/// What a reader may do with an owner's shard whose word reads `seen`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shard {
    /// It holds the version: read it.
    Ready,
    /// Not yet: wait for the owner.
    Pending,
}

/// The gather rule for `version` against an owner's `seen_version` word.
pub fn shard(seen: u64, version: u64) -> Result<Shard, VersionError> {
    let want = version.saturating_add(1);
    match seen {
        s if s == want => Ok(Shard::Ready),
        s if s > want => Err(VersionError::Newer {
            version,
            current: s - 1,
        }),
        _ => Ok(Shard::Pending),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_increase() {
        assert_eq!(publish_stamp(0, 0), Ok(1));
        assert_eq!(publish_stamp(1, 1), Ok(2));
        assert_eq!(
            publish_stamp(2, 1),
            Err(VersionError::NotIncreasing {
                version: 1,
                current: 1
            })
        );
        assert_eq!(publish_stamp(0, u64::MAX), Err(VersionError::Reserved));
    }

    #[test]
    fn a_publish_waits_for_every_release_or_done() {
        // Version 0 waits for nothing.
        assert_eq!(unreleased_reader([(0, 0)], 0), None);
        // Version 2 needs each client at stamp 2 (released 1, or done 1).
        assert_eq!(unreleased_reader([(2, 0), (0, 2), (1, 1)], 2), Some(2));
        assert_eq!(unreleased_reader([(2, 0), (0, 2), (3, 1)], 2), None);
    }

    #[test]
    fn a_reader_reads_exactly_its_version() {
        assert_eq!(shard(0, 0), Ok(Shard::Pending));
        assert_eq!(shard(1, 0), Ok(Shard::Ready));
        assert_eq!(
            shard(3, 1),
            Err(VersionError::Newer {
                version: 1,
                current: 2
            })
        );
    }
}
