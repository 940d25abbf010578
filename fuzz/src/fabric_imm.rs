//! The libfabric transport's remote CQ data — the 4-byte immediate a peer's
//! write carries, naming the signal word it completed — and the peer
//! address an endpoint post carries (hex of `fi_getname` bytes).
//!
//! Properties: every 32-bit immediate decodes, and encodes back to itself;
//! an encodable `Imm` decodes back to itself; the words an immediate makes
//! the progress thread touch are aligned and inside the region, exactly
//! when a spelled-out rule says so; a peer address is accepted exactly
//! when it is hex of the provider's length, and comes back as those bytes.

use arbitrary::{Result, Unstructured};
use odc_core::region::Bell;
use odc_core::transport::fabric::{peer_address, Imm, Update, MAILBOX, STATUS_ID, WORD_BITS};
use odc_core::Error;

/// Runs one input.
pub fn run(data: &[u8]) {
    let _ = body(&mut Unstructured::new(data));
}

fn body(u: &mut Unstructured<'_>) -> Result<()> {
    match u.int_in_range(0..=2u8)? {
        0 => immediates(u),
        1 => encodes(u),
        _ => addresses(u),
    }
}

fn immediates(u: &mut Unstructured<'_>) -> Result<()> {
    // A provider with wider CQ data may leave anything above bit 32.
    let data: u64 = u.arbitrary()?;
    let imm = Imm::decode(data);
    assert!(imm.region <= STATUS_ID && imm.offset % 8 == 0 && imm.offset >> WORD_BITS >> 3 == 0);
    match imm.encode() {
        Ok(back) => assert_eq!(back, data as u32, "{imm:?}"),
        Err(e) => panic!("decoded {imm:?} does not encode: {e}"),
    }
    // The region the immediate names is as long as the owner registered.
    let len = if u.ratio(1, 2)? {
        u.int_in_range(0..=4096usize)?
    } else {
        u.arbitrary()?
    };
    let fits = |at: usize| at % 8 == 0 && at.checked_add(8).is_some_and(|end| end <= len);
    let want = fits(imm.offset).then(|| match imm.update {
        Update::Count => Some((imm.offset, None)),
        Update::Raise => {
            fits(imm.offset + MAILBOX).then_some((imm.offset, Some(imm.offset + MAILBOX)))
        }
    });
    assert_eq!(imm.words(len), want.flatten(), "{imm:?} in {len} bytes");
    if let Some((w, m)) = imm.words(len) {
        assert!(w + 8 <= len && m.is_none_or(|m| m + 8 <= len && m == w + MAILBOX));
    }
    Ok(())
}

fn encodes(u: &mut Unstructured<'_>) -> Result<()> {
    let imm = Imm {
        region: u.int_in_range(0..=9u32)?,
        offset: if u.ratio(1, 2)? {
            u.int_in_range(0..=(8usize << WORD_BITS) + 64)?
        } else {
            u.arbitrary()?
        },
        bell: if u.arbitrary()? {
            Bell::Server
        } else {
            Bell::Client
        },
        update: if u.arbitrary()? {
            Update::Count
        } else {
            Update::Raise
        },
    };
    let ok = imm.offset % 8 == 0 && imm.offset / 8 < 1 << WORD_BITS && imm.region <= STATUS_ID;
    match imm.encode() {
        Ok(data) => {
            assert!(ok, "{imm:?} encoded");
            assert_eq!(Imm::decode(u64::from(data)), imm);
        }
        Err(e) => assert!(!ok && matches!(e, Error::Transport { .. }), "{imm:?}: {e}"),
    }
    Ok(())
}

fn addresses(u: &mut Unstructured<'_>) -> Result<()> {
    let peer = u.int_in_range(0..=1024usize)?;
    let len = u.int_in_range(0..=64usize)?;
    let text: String = if u.ratio(1, 2)? {
        // Well-formed hex, maybe of the wrong length, maybe with a stray
        // character in it.
        let n = if u.ratio(3, 4)? {
            len
        } else {
            u.int_in_range(0..=70usize)?
        };
        let mut s: String = (0..n)
            .map(|_| u.arbitrary::<u8>().map(|b| format!("{b:02x}")))
            .collect::<Result<_>>()?;
        if u.ratio(1, 4)? && !s.is_empty() {
            let at = u.choose_index(s.len())?;
            let c: char = u.arbitrary()?;
            if s.is_char_boundary(at) {
                s.insert(at, c);
            }
        }
        s
    } else {
        u.arbitrary()?
    };
    let valid = text.len() == 2 * len && text.bytes().all(|b| b.is_ascii_hexdigit());
    match peer_address(peer, &text, len) {
        Ok(name) => {
            assert!(valid, "accepted {text:?} as {name:?}");
            let back: String = name.iter().map(|b| format!("{b:02x}")).collect();
            assert_eq!(back, text.to_ascii_lowercase());
        }
        Err(
            e @ Error::Malformed {
                peer: p,
                field: "address",
                ..
            },
        ) => {
            assert!(!valid && p == peer, "refused {text:?}: {e}");
            assert!(crate::names_rank(&e.to_string(), peer));
        }
        Err(e) => panic!("{text:?}: {e:?}"),
    }
    Ok(())
}
