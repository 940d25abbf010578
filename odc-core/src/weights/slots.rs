//! The snapshot slots of a weight server's region, and the reader's rules
//! over their words: pure functions of word values, no I/O, no clock.
//!
//! A server rank's region is a header and K slots:
//!
//! | bytes | what |
//! |---|---|
//! | 0 | magic `ODC_WGT1` |
//! | 8 | K |
//! | 16 | slot data bytes |
//! | 24 | `latest`: newest version published whole, plus one (0: none yet) |
//! | 32 | 1 when the region is a reader-node cache's copy of the owner's slots |
//! | 40 | a cache's failed fetch: the trainer rank it failed on, plus one |
//! | 64 + s · stride | slot s: `begin` word |
//! | + 64 | slot s: `end` word |
//! | + 128 | slot s: data (the rank's shards of one version) |
//!
//! Version v lives in slot `v mod K`. The server writes `begin = v + 1`,
//! then the data, then `end = v + 1`, then `latest = v + 1` (a sequence
//! lock whose two words are the counter before and after the data). A slot
//! holds version v whole when both words read `v + 1`; a reader that read
//! `end = v + 1` before its copy and `begin = v + 1` after it copied bytes
//! no write touched, since every write of another version raises `begin`
//! first.

/// "ODC_WGT1": the region's first word.
pub const MAGIC: u64 = 0x4f44_435f_5747_5431;
/// Byte offset of K.
pub const OFF_SLOTS: usize = 8;
/// Byte offset of the slot data length.
pub const OFF_SLOT_BYTES: usize = 16;
/// Byte offset of `latest`.
pub const OFF_LATEST: usize = 24;
/// Byte offset of the node-cache mark.
pub const OFF_CACHE: usize = 32;
/// Byte offset of a node cache's failure word.
pub const OFF_FAILED: usize = 40;
/// Bytes before the first slot.
pub const HEADER: usize = 64;
/// Bytes of a slot's two words (each on its own cache line) before its data.
pub const SLOT_HEAD: usize = 128;

/// Where the slots of one server rank's region lie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLayout {
    /// K, the number of versions kept.
    pub slots: usize,
    /// Bytes of one version of this rank's shards.
    pub slot_bytes: usize,
}

impl SlotLayout {
    /// Bytes from one slot to the next (data rounded up to 64).
    pub fn stride(&self) -> usize {
        SLOT_HEAD + self.slot_bytes.div_ceil(64) * 64
    }

    /// The region's length in bytes.
    pub fn region_bytes(&self) -> usize {
        HEADER + self.slots * self.stride()
    }

    /// The slot version `v` lives in.
    pub fn slot_of(&self, v: u64) -> usize {
        (v % self.slots as u64) as usize
    }

    /// Byte offset of slot `s`'s `begin` word.
    pub fn begin(&self, s: usize) -> usize {
        HEADER + s * self.stride()
    }

    /// Byte offset of slot `s`'s `end` word.
    pub fn end(&self, s: usize) -> usize {
        self.begin(s) + 64
    }

    /// Byte offset of slot `s`'s data.
    pub fn data(&self, s: usize) -> usize {
        self.begin(s) + SLOT_HEAD
    }
}

/// What a slot's words say about version `want`, read before a copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Before {
    /// Both words name `want`: copy it.
    Whole,
    /// A later version is being written or was written: `want` is gone.
    Overwritten {
        /// The newest version the words name.
        by: u64,
    },
    /// The slot does not hold `want` yet (an older version, or `want`
    /// being written).
    NotYet,
}

/// Reads `begin` and `end` (in that order after `end`, see the module
/// docs) of the slot of `want`.
pub fn before(begin: u64, end: u64, want: u64) -> Before {
    let tag = want + 1;
    if begin == tag && end == tag {
        Before::Whole
    } else if begin > tag || end > tag {
        Before::Overwritten {
            by: begin.max(end) - 1,
        }
    } else {
        Before::NotYet
    }
}

/// Whether a copy of `want` stayed whole: `begin`, read after the copy, is
/// still `want + 1`. Otherwise the version that started overwriting it.
pub fn after(begin: u64, want: u64) -> Result<(), u64> {
    if begin == want + 1 {
        Ok(())
    } else {
        Err(begin.saturating_sub(1))
    }
}

/// The version a reader of "latest" takes from the owners' `latest` words
/// (each version + 1, 0 for none): the newest every owner published whole,
/// or `None` while some owner published nothing (the first such owner).
pub fn newest_whole(latest: &[u64]) -> Result<u64, usize> {
    let mut min = u64::MAX;
    for (o, &l) in latest.iter().enumerate() {
        if l == 0 {
            return Err(o);
        }
        min = min.min(l - 1);
    }
    Ok(min)
}

/// The newest version any owner published (for a read's age), if any.
pub fn newest_any(latest: &[u64]) -> Option<u64> {
    latest.iter().copied().max().and_then(|l| l.checked_sub(1))
}

/// How a reader asks to reach the trainer ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Prefer {
    /// Shared memory for owners on the reader's node, libfabric for the
    /// others.
    #[default]
    Auto,
    /// Shared memory for every owner (one host).
    Shm,
    /// libfabric for every owner, on this node too.
    Fabric,
}

impl Prefer {
    /// Parses `"auto"`, `"shm"` or `"fabric"`.
    pub fn parse(name: &str) -> Option<Prefer> {
        match name.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(Prefer::Auto),
            "shm" => Some(Prefer::Shm),
            "fabric" => Some(Prefer::Fabric),
            _ => None,
        }
    }
}

/// How a reader reaches one owner's slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// Mapped shared memory: words are atomic loads, data a copy.
    Shm,
    /// libfabric `fi_read` of the owner's slot region: words and data are
    /// one-sided reads.
    Fabric,
}

/// Which way a reader reaches an owner: `same_node` when the owner's node
/// (host name and network namespace) is the reader's, `fabric` when the
/// owner registered its slots with libfabric. `Err` says why it cannot be
/// reached as asked.
pub fn reach(prefer: Prefer, same_node: bool, fabric: bool) -> Result<Reach, &'static str> {
    match prefer {
        Prefer::Shm => Ok(Reach::Shm),
        Prefer::Auto if same_node => Ok(Reach::Shm),
        Prefer::Auto | Prefer::Fabric if fabric => Ok(Reach::Fabric),
        Prefer::Auto => Err("it runs on another node and serves no libfabric endpoint"),
        Prefer::Fabric => Err("it serves no libfabric endpoint"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_aligned_and_disjoint() {
        let l = SlotLayout {
            slots: 3,
            slot_bytes: 100,
        };
        assert_eq!(l.stride(), 128 + 128);
        assert_eq!(l.begin(0), 64);
        assert_eq!(l.end(1) % 64, 0);
        assert!(l.data(2) + 100 <= l.region_bytes());
        assert!(l.data(0) + 100 <= l.begin(1));
        assert_eq!(l.slot_of(7), 1);
    }

    #[test]
    fn before_and_after_a_copy() {
        assert_eq!(before(6, 6, 5), Before::Whole);
        // Version 5 being written: begin moved, end did not.
        assert_eq!(before(6, 4, 5), Before::NotYet);
        assert_eq!(before(4, 4, 5), Before::NotYet);
        // Version 7 (K = 2) started over version 5's slot.
        assert_eq!(before(8, 6, 5), Before::Overwritten { by: 7 });
        assert_eq!(after(6, 5), Ok(()));
        assert_eq!(after(8, 5), Err(7));
    }

    #[test]
    fn newest_every_owner_holds() {
        assert_eq!(newest_whole(&[4, 5]), Ok(3));
        assert_eq!(newest_whole(&[4, 0, 5]), Err(1));
        assert_eq!(newest_any(&[4, 5]), Some(4));
        assert_eq!(newest_any(&[0, 0]), None);
    }

    #[test]
    fn shm_on_the_node_fabric_across() {
        assert_eq!(reach(Prefer::Auto, true, true), Ok(Reach::Shm));
        assert_eq!(reach(Prefer::Auto, false, true), Ok(Reach::Fabric));
        assert!(reach(Prefer::Auto, false, false).is_err());
        assert_eq!(reach(Prefer::Fabric, true, true), Ok(Reach::Fabric));
        assert!(reach(Prefer::Fabric, true, false).is_err());
        assert_eq!(reach(Prefer::Shm, false, true), Ok(Reach::Shm));
    }
}
