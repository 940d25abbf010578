//! The remote CQ data of a `put_signal`: which word of which region to
//! store which value into, and which bell to ring, in 64 bits.

use super::STATUS_ID;
use crate::region::Bell;
use crate::{Error, Result};

/// Bits of a signal value in the remote CQ data.
pub const VALUE_BITS: u32 = 36;
/// Bits of a signal word index (offset / 8) in the remote CQ data.
pub const WORD_BITS: u32 = 24;
const REGION_SHIFT: u32 = VALUE_BITS + WORD_BITS;
const BELL_SHIFT: u32 = 63;

/// Remote CQ data for storing `value` into the 8-byte word at `offset` of
/// region `region` and ringing `bell`:
/// `bell << 63 | region << 60 | (offset / 8) << 36 | value`.
///
/// Engine signal values are version stamps, done stamps and per
/// (client, owner) chunk sequence numbers: 2^36 chunks is months of pushes
/// at thousands per second. Signal words must lie in the region's first
/// 2^24 words (128 MiB): the engine's control region puts every signal
/// word before the landing slots' data (a few hundred bytes per rank and
/// bucket), whatever D and the chunk size are.
pub fn encode_signal(region: u32, offset: usize, bell: Bell, value: u64) -> Result<u64> {
    if offset % 8 != 0 {
        return Err(Error::transport(
            "put_signal",
            format!("signal offset {offset} is not 8-byte aligned"),
        ));
    }
    let word = (offset / 8) as u64;
    if word >> WORD_BITS != 0 {
        return Err(Error::transport(
            "put_signal",
            format!(
                "signal offset {offset} beyond the {} MiB the remote CQ data can name",
                (8u64 << WORD_BITS) >> 20
            ),
        ));
    }
    if value >> VALUE_BITS != 0 {
        return Err(Error::transport(
            "put_signal",
            format!("signal value {value} does not fit the {VALUE_BITS}-bit remote CQ data field"),
        ));
    }
    if region > STATUS_ID {
        return Err(Error::transport(
            "put_signal",
            format!("region id {region} does not fit the remote CQ data"),
        ));
    }
    let bell_bit = u64::from(bell == Bell::Server);
    Ok(bell_bit << BELL_SHIFT | u64::from(region) << REGION_SHIFT | word << VALUE_BITS | value)
}

/// Inverse of [`encode_signal`]: (region, offset, bell, value).
pub fn decode_signal(data: u64) -> (u32, usize, Bell, u64) {
    let bell = if data >> BELL_SHIFT != 0 {
        Bell::Server
    } else {
        Bell::Client
    };
    let region = ((data >> REGION_SHIFT) & 0x7) as u32;
    let word = (data >> VALUE_BITS) & ((1 << WORD_BITS) - 1);
    (
        region,
        (word * 8) as usize,
        bell,
        data & ((1 << VALUE_BITS) - 1),
    )
}
