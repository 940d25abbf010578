//! A landing slot's 64-byte header, as the owner's daemon reads it after
//! the slot's signal: `SlotHeader::decode`, `control::check_header` against
//! a small registered layout, and the add of the slot's data that an
//! accepted header allows.
//!
//! Properties: encode → decode round trips (the client's minibatch and
//! the owner a node-mate's chunk is for included, which the daemon's admission rule reads); `check_header` accepts exactly
//! the headers a spelled-out rule accepts, and what it accepts lies inside
//! the bucket's shard and the slot; a refusal is `Error::Malformed` naming
//! the client and a field; the add writes exactly the accepted range, with
//! the scalar reference kernel's result bit for bit.

use arbitrary::{Result, Unstructured};
use half::{bf16, f16};
use odc_core::control::{check_header, Chunk, SlotHeader, HEADER_BYTES};
use odc_core::{BucketLayout, BucketSpec, Error};
use odc_kernels::cpu::{accumulate_into_f32, reference};
use odc_kernels::DType;

/// Runs one input.
pub fn run(data: &[u8]) {
    let _ = body(&mut Unstructured::new(data));
}

fn dtype(u: &mut Unstructured<'_>) -> Result<DType> {
    Ok(DType::ALL[u.choose_index(DType::ALL.len())?])
}

fn body(u: &mut Unstructured<'_>) -> Result<()> {
    // The registered layout: a few buckets over a small shard group, slots
    // of 64 B to 1 KiB (the engine's are larger; the rules are the same).
    let world = u.int_in_range(1..=4usize)?;
    let mut buckets = Vec::new();
    for i in 0..u.int_in_range(1..=4usize)? {
        let numel = u.int_in_range(1..=3000usize)?;
        let spec = BucketSpec::new(format!("b{i}"), numel, dtype(u)?);
        match BucketLayout::new(spec, world) {
            Ok(b) => buckets.push(b),
            Err(e) => panic!("a valid bucket is refused: {e}"),
        }
    }
    let chunk_bytes = 64 * u.int_in_range(1..=16usize)?;
    let peer = u.int_in_range(0..=world - 1)?;
    let signal: u64 = u.arbitrary()?;

    // The header: raw bytes, or a plausible one with a few bytes changed
    // (what a torn or stale write leaves).
    let mut raw = [0u8; HEADER_BYTES];
    if u.ratio(1, 3)? {
        u.fill_buffer(&mut raw)?;
    } else {
        let h = SlotHeader {
            seq: if u.ratio(3, 4)? {
                signal
            } else {
                u.arbitrary()?
            },
            bucket: u.int_in_range(0..=buckets.len() as u32)?,
            dtype: dtype(u)?,
            offset: u.int_in_range(0..=3000u64)?,
            len: u.int_in_range(0..=600u64)?,
            scale: u.arbitrary()?,
            minibatch: u.arbitrary()?,
            // A rank (below u32::MAX: the wire holds rank + 1) or none.
            owner: if u.ratio(1, 2)? {
                None
            } else {
                Some(u.int_in_range(0..=u32::MAX - 1)?)
            },
            compress: None,
        };
        round_trips(&h);
        raw = h.encode();
        for _ in 0..u.int_in_range(0..=2u8)? {
            let at = u.choose_index(HEADER_BYTES)?;
            raw[at] = u.arbitrary()?;
        }
    }

    let decoded = SlotHeader::decode(&raw);
    assert_eq!(
        decoded.is_some(),
        DType::from_u8(raw[12]).is_some() && SlotHeader::compress_of(&raw).is_ok()
    );
    if let Some(h) = decoded {
        // The fields the format defines come back as written.
        let again = h.encode();
        for r in [0..13, 16..36, 40..52] {
            assert_eq!(again[r.clone()], raw[r]);
        }
    }

    let checked = check_header(&raw, signal, peer, &buckets, chunk_bytes);
    let expected = match SlotHeader::compress_of(&raw) {
        Err(_) => Err("format"),
        Ok(_) => spelled_out(decoded, signal, &buckets, chunk_bytes),
    };
    match (&checked, expected) {
        (Ok(c), Ok(())) => inside(c, &raw, &buckets, chunk_bytes),
        (
            Err(
                e @ Error::Malformed {
                    peer: p,
                    what,
                    field,
                    ..
                },
            ),
            Err(want),
        ) => {
            assert_eq!(*p, peer);
            assert_eq!(*what, "landing-slot header");
            assert_eq!(*field, want, "{e:?}");
            let msg = e.to_string();
            assert!(
                crate::names_rank(&msg, peer) && msg.contains(field),
                "{msg}"
            );
        }
        (got, want) => panic!("check_header gave {got:?}, the rule says {want:?}"),
    }
    if let Some(c) = checked.ok().filter(|c| c.compress.is_none()) {
        accumulate(u, &c, buckets[c.bucket].shard_len())?;
    }
    Ok(())
}

fn round_trips(h: &SlotHeader) {
    let back = SlotHeader::decode(&h.encode());
    let Some(back) = back else {
        panic!("{h:?} does not decode")
    };
    assert_eq!(
        (
            back.seq,
            back.bucket,
            back.dtype,
            back.offset,
            back.len,
            back.minibatch,
            back.owner
        ),
        (
            h.seq,
            h.bucket,
            h.dtype,
            h.offset,
            h.len,
            h.minibatch,
            h.owner
        )
    );
    assert_eq!(back.scale.to_bits(), h.scale.to_bits());
}

/// The daemon's rule, written out independently (in u128, so nothing
/// overflows): the first field that is wrong, or `Ok`.
fn spelled_out(
    h: Option<SlotHeader>,
    signal: u64,
    buckets: &[BucketLayout],
    chunk_bytes: usize,
) -> std::result::Result<(), &'static str> {
    let h = h.ok_or("dtype")?;
    if h.seq != signal {
        return Err("seq");
    }
    let b = buckets.get(h.bucket as usize).ok_or("bucket")?;
    let shard = b.shard_len() as u128;
    if u128::from(h.offset) > shard {
        return Err("offset");
    }
    if u128::from(h.offset) + u128::from(h.len) > shard {
        return Err("len");
    }
    let bytes = match h.compress {
        Some(spec) => spec.chunk_bytes(h.len as usize) as u128,
        None => u128::from(h.len) * h.dtype.size_bytes() as u128,
    };
    if bytes > chunk_bytes as u128 {
        return Err("len");
    }
    Ok(())
}

/// An accepted chunk lies inside its bucket's shard and its slot, and says
/// what the header says.
fn inside(c: &Chunk, raw: &[u8; HEADER_BYTES], buckets: &[BucketLayout], chunk_bytes: usize) {
    let Some(b) = buckets.get(c.bucket) else {
        panic!("accepted bucket {} of {}", c.bucket, buckets.len())
    };
    assert!(c.offset + c.len <= b.shard_len(), "{c:?} outside {b:?}");
    match c.compress {
        Some(spec) => assert_eq!(c.bytes, spec.chunk_bytes(c.len)),
        None => assert_eq!(c.bytes, c.len * c.dtype.size_bytes()),
    }
    assert!(c.bytes <= chunk_bytes);
    let Some(h) = SlotHeader::decode(raw) else {
        panic!("accepted a header that does not decode")
    };
    assert_eq!(
        (
            h.seq,
            h.bucket as usize,
            h.offset as usize,
            h.len as usize,
            h.dtype
        ),
        (c.seq, c.bucket, c.offset, c.len, c.dtype)
    );
    assert_eq!(h.scale.to_bits(), c.scale.to_bits());
    assert_eq!(h.owner, c.owner);
}

/// Adds the slot's data as the daemon does and checks the accumulator
/// against the reference kernel: the range changes as the reference says,
/// nothing outside it changes.
fn accumulate(u: &mut Unstructured<'_>, c: &Chunk, shard: usize) -> Result<()> {
    let mut acc: Vec<f32> = (0..shard).map(|i| i as f32 * 0.25 - 3.0).collect();
    if u.ratio(1, 4)? {
        for a in acc.iter_mut().take(64) {
            *a = f32::from_bits(u.arbitrary()?);
        }
    }
    // The slot's data, in a buffer aligned for any element type.
    let mut words = vec![0u32; c.bytes.div_ceil(4)];
    for w in &mut words {
        *w = u.arbitrary()?;
    }
    let data = &bytemuck::cast_slice::<u32, u8>(&words)[..c.bytes];
    let mut want = acc.clone();
    let range = c.offset..c.offset + c.len;
    let reference = match c.dtype {
        DType::F32 => reference::accumulate(
            &mut want[range.clone()],
            bytemuck::cast_slice::<u8, f32>(data),
            c.scale,
        ),
        DType::BF16 => reference::accumulate(
            &mut want[range.clone()],
            bytemuck::cast_slice::<u8, bf16>(data),
            c.scale,
        ),
        DType::F16 => reference::accumulate(
            &mut want[range.clone()],
            bytemuck::cast_slice::<u8, f16>(data),
            c.scale,
        ),
    };
    let added = accumulate_into_f32(&mut acc[range], data, c.dtype, c.scale);
    assert_eq!(
        added.is_ok(),
        reference.is_ok(),
        "{added:?} / {reference:?}"
    );
    for (i, (a, w)) in acc.iter().zip(&want).enumerate() {
        assert!(
            a.to_bits() == w.to_bits() || (a.is_nan() && w.is_nan()),
            "element {i} of {c:?}: {a} ({:#x}), reference {w} ({:#x})",
            a.to_bits(),
            w.to_bits()
        );
    }
    Ok(())
}
