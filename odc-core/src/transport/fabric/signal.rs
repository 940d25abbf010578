//! The remote CQ data of a `put_signal`: 32 bits, what RDMA
//! WRITE-with-immediate carries (libfabric's `verbs` and `efa` report
//! `cq_data_size` 4; the transport asks for 4 and uses 4 on every
//! provider, `tcp` included, so the tests run the NIC's code path).
//!
//! The immediate names **what completed** — a signal word of one of the
//! owner's regions, the bell to ring, and how to update the word — never a
//! value. Values travel in the written bytes or are counted:
//!
//! - [`Update::Raise`] (a pure signal): the write carries the 8-byte value
//!   into the word's **mailbox**, the 8 bytes after the word
//!   ([`MAILBOX`]). A remote completion is reported only once its write is
//!   in memory, so the owner's progress thread reads the mailbox and raises
//!   the word to it (`fetch_max`, release order). Values are full 64-bit
//!   stamps and nothing the owner waits on reads memory a NIC is writing.
//! - [`Update::Count`] (a put with data): the owner's progress thread adds
//!   one to the word per completion (fabric-lib's `IMMCOUNTER`); the data
//!   is in place when the completion is seen. The engine's landing slots
//!   count the chunks written into them, so no value crosses the wire.
//!
//! Neither depends on two writes completing in the order they were posted:
//! increments commute, and raising to a maximum commutes. Nothing here is a
//! sequence number that can run out: words are 64-bit and only their names
//! cross the wire.

use super::STATUS_ID;
use crate::region::Bell;
use crate::{Error, Result};

/// Bytes of remote CQ data the transport requests and uses.
pub const IMM_BYTES: u64 = 4;
/// Bits of a signal word's index (offset / 8) in the immediate: signal
/// words lie in a region's first 2^27 words (1 GiB).
pub const WORD_BITS: u32 = 27;
/// Where a pure signal's value lands, from its word.
pub const MAILBOX: usize = 8;
const REGION_SHIFT: u32 = WORD_BITS;
const BELL_SHIFT: u32 = 30;
const COUNT_SHIFT: u32 = 31;

/// How the owner's progress thread updates the named word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Update {
    /// Raise the word to the value in its mailbox.
    Raise,
    /// Add one to the word.
    Count,
}

/// What an immediate names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Imm {
    /// The owner's region id (at most [`STATUS_ID`]).
    pub region: u32,
    /// Byte offset of the signal word in the region.
    pub offset: usize,
    /// The bell to ring after the update.
    pub bell: Bell,
    /// How to update the word.
    pub update: Update,
}

impl Imm {
    /// The 32-bit immediate:
    /// `count << 31 | bell << 30 | region << 27 | offset / 8`.
    pub fn encode(&self) -> Result<u32> {
        let Imm {
            region,
            offset,
            bell,
            update,
        } = *self;
        if offset % 8 != 0 {
            return Err(Error::transport(
                "put_signal",
                format!("signal offset {offset} is not 8-byte aligned"),
            ));
        }
        let word = offset / 8;
        if word >> WORD_BITS != 0 {
            return Err(Error::transport(
                "put_signal",
                format!(
                    "signal offset {offset} beyond the {} MiB a 4-byte immediate can name",
                    (8u64 << WORD_BITS) >> 20
                ),
            ));
        }
        if region > STATUS_ID {
            return Err(Error::transport(
                "put_signal",
                format!("region id {region} does not fit the immediate"),
            ));
        }
        let bell = u32::from(bell == Bell::Server);
        let count = u32::from(update == Update::Count);
        Ok(count << COUNT_SHIFT | bell << BELL_SHIFT | region << REGION_SHIFT | word as u32)
    }

    /// The words this immediate updates in its region of `len` bytes: the
    /// signal word's offset and, for a raise, its mailbox's; `None` when
    /// one of them is not an 8-byte word inside the region (a peer's
    /// immediate names any offset below 1 GiB).
    pub fn words(&self, len: usize) -> Option<(usize, Option<usize>)> {
        let inside = |at: usize| (at % 8 == 0 && at.checked_add(8)? <= len).then_some(at);
        let word = inside(self.offset)?;
        match self.update {
            Update::Count => Some((word, None)),
            Update::Raise => Some((word, Some(inside(word.checked_add(MAILBOX)?)?))),
        }
    }

    /// Inverse of [`Imm::encode`]; the bits above 32 (a provider with
    /// wider CQ data may leave garbage there) are ignored.
    pub fn decode(data: u64) -> Imm {
        let data = data as u32;
        Imm {
            region: (data >> REGION_SHIFT) & 0x7,
            offset: ((data & ((1 << WORD_BITS) - 1)) as usize) * 8,
            bell: if (data >> BELL_SHIFT) & 1 != 0 {
                Bell::Server
            } else {
                Bell::Client
            },
            update: if data >> COUNT_SHIFT != 0 {
                Update::Count
            } else {
                Update::Raise
            },
        }
    }
}
