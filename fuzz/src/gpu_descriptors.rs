//! What the GPU transports read from peers: the cuda-ipc exchange's post
//! (region ids and sizes, descriptor numbers or legacy IPC handles, from
//! the store), the fd-share socket's 8-byte request (read by the owner's
//! server) and reply header (read by the importer), and an NVSHMEM unique
//! id (from the store).
//!
//! Properties: an accepted post has this rank's region ids, in order, each
//! at least as large as this rank's and with a descriptor or a handle that
//! is exactly the post's hex; a refusal names the peer; requests and
//! replies round trip and a refusal's message length stays bounded; a
//! unique id is accepted exactly at its length and round trips.

use arbitrary::{Result, Unstructured};
use odc_core::gpu::fdshare::{decode_reply, decode_request, encode_request, Reply, MAX_MESSAGE};
use odc_core::gpu::ipc::{parse_post, Handle};
use odc_core::gpu::nvshmem::UniqueId;
use odc_core::Error;
use serde_json::{json, Value};

/// Runs one input.
pub fn run(data: &[u8]) {
    let _ = body(&mut Unstructured::new(data));
}

fn body(u: &mut Unstructured<'_>) -> Result<()> {
    match u.int_in_range(0..=2u8)? {
        0 => ipc_post(u),
        1 => fd_socket(u),
        _ => unique_id(u),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn ipc_post(u: &mut Unstructured<'_>) -> Result<()> {
    let peer = u.int_in_range(0..=7usize)?;
    // This rank's regions: (id, bytes it touches).
    let mut regions = Vec::new();
    for id in 0..u.int_in_range(0..=3u32)? {
        regions.push((id, u.int_in_range(1..=1usize << 21)?));
    }
    let bytes: Vec<u8> = if u.ratio(1, 5)? {
        u.arbitrary()?
    } else {
        let mut posted = Vec::new();
        for &(id, len) in &regions {
            let id = if u.ratio(15, 16)? { id } else { u.arbitrary()? };
            let size: u64 = match u.int_in_range(0..=3u8)? {
                0 => u.arbitrary()?,
                1 => (len as u64).saturating_sub(u.int_in_range(0..=2u64)?),
                _ => len as u64 + u.int_in_range(0..=4096u64)?,
            };
            let mut handle = [0u8; 64];
            u.fill_buffer(&mut handle)?;
            let legacy = match u.int_in_range(0..=4u8)? {
                0 => Value::Null,
                1 => Value::from(u.arbitrary::<String>()?),
                2 => Value::from(hex(&handle).to_uppercase()),
                _ => Value::from(hex(&handle)),
            };
            let fd = if u.arbitrary()? {
                Value::from(u.arbitrary::<i32>()?)
            } else {
                Value::Null
            };
            posted.push(json!({ "id": id, "size": size, "fd": fd, "legacy": legacy }));
        }
        if u.ratio(1, 16)? && !posted.is_empty() {
            posted.pop();
        }
        let post = json!({ "pid": u.arbitrary::<u32>()?, "socket": "odc-fd-x", "regions": posted });
        match serde_json::to_vec(&post) {
            Ok(v) => v,
            Err(e) => panic!("{e}"),
        }
    };
    match parse_post(peer, &bytes, &regions) {
        Ok((post, handles)) => {
            assert_eq!(handles.len(), regions.len());
            for ((r, &(id, len)), (size, handle)) in post.regions.iter().zip(&regions).zip(&handles)
            {
                assert!(
                    r.id == id && *size >= len && *size as u64 == r.size,
                    "{r:?}"
                );
                match (handle, r.fd, &r.legacy) {
                    (Handle::Fd(fd), Some(f), _) => assert_eq!(*fd, f),
                    (Handle::Legacy(h), None, Some(s)) => {
                        assert_eq!(hex(h), s.to_ascii_lowercase())
                    }
                    other => panic!("{other:?} from {r:?}"),
                }
            }
        }
        Err(e) => {
            let named = match &e {
                Error::Malformed {
                    peer: p,
                    what: "IPC post",
                    ..
                } => *p == peer,
                Error::Config(m) => crate::names_rank(m, peer),
                _ => false,
            };
            assert!(named, "{e:?} does not name rank {peer}");
        }
    }
    Ok(())
}

fn fd_socket(u: &mut Unstructured<'_>) -> Result<()> {
    let id: u32 = u.arbitrary()?;
    assert_eq!(decode_request(&encode_request(id)), Some(id));
    let mut raw = [0u8; 8];
    u.fill_buffer(&mut raw)?;
    if let Some(id) = decode_request(&raw) {
        assert_eq!(encode_request(id), raw);
    }
    match decode_reply(&raw) {
        Reply::Granted => assert_eq!(raw[..4], [0; 4]),
        Reply::Refused(len) => {
            assert_eq!(raw[..4], 1u32.to_le_bytes());
            assert!(len <= MAX_MESSAGE);
            assert_eq!(
                len as u32,
                u32::from_le_bytes([raw[4], raw[5], raw[6], raw[7]]).min(MAX_MESSAGE as u32)
            );
        }
        Reply::Unknown(s) => assert!(s > 1 && s.to_le_bytes() == raw[..4]),
    }
    Ok(())
}

fn unique_id(u: &mut Unstructured<'_>) -> Result<()> {
    let n = if u.ratio(3, 4)? {
        UniqueId::LEN
    } else {
        u.int_in_range(0..=2 * UniqueId::LEN)?
    };
    let bytes = u.bytes(n.min(u.len()))?.to_vec();
    match UniqueId::from_bytes(&bytes) {
        Ok(id) => {
            assert_eq!(bytes.len(), UniqueId::LEN);
            assert_eq!(id.to_bytes(), bytes);
        }
        Err(e) => assert!(bytes.len() != UniqueId::LEN, "{e}"),
    }
    Ok(())
}
