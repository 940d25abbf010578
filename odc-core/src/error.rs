//! The crate's one error type.
//!
//! Variants are few on purpose: the Python layer maps each one to an
//! exception class (`PeerTimeout`, `PeerDied`, `RegistrationError`,
//! `LayoutError`, `ProtocolError`, `MalformedError`, `ConfigError`, `TransportError`,
//! `ShmSpaceError`,
//! `StoreError`, `OSError`). Every variant carries enough context (peer rank,
//! bucket, what was awaited) for a user to act on it without a debugger.

use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong in the engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A wait on a peer passed its deadline while the peer still looked alive.
    #[error(
        "timed out after {after:?} waiting for rank {peer} ({waited_for}{})",
        bucket_suffix(.bucket)
    )]
    PeerTimeout {
        /// The rank that did not make progress.
        peer: usize,
        /// The bucket involved, if the wait was about one.
        bucket: Option<String>,
        /// What was awaited, in words (`"version 3 of the shard"`).
        waited_for: String,
        /// How long the wait lasted.
        after: Duration,
    },

    /// A peer's process exited (or closed its engine) while this rank still
    /// needed it.
    #[error(
        "rank {peer} (pid {pid}) died or closed its engine while waiting for {waited_for}{}{}",
        bucket_suffix(.bucket),
        .reported_by.map(|r| format!(" (reported by rank {r})")).unwrap_or_default()
    )]
    PeerDied {
        /// The rank that died (the root cause when another rank reported it).
        peer: usize,
        /// Its process id (0 when unknown).
        pid: u32,
        /// The bucket involved, if any.
        bucket: Option<String>,
        /// What this rank was waiting for.
        waited_for: String,
        /// Set when a third rank failed because of `peer` and exited in turn.
        reported_by: Option<usize>,
    },

    /// Ranks registered different bucket lists.
    #[error(
        "registration mismatch with rank {peer}: first differing bucket is #{first_differing_bucket} \
         (this rank: {ours}; rank {peer}: {theirs})"
    )]
    Registration {
        /// The rank whose list differs from ours.
        peer: usize,
        /// Index of the first bucket that differs.
        first_differing_bucket: usize,
        /// Our bucket at that index (`name numel dtype`, or `<none>`).
        ours: String,
        /// Their bucket at that index.
        theirs: String,
    },

    /// A buffer, dtype, offset or bucket does not match the registered layout.
    #[error("layout error{}: {detail}", bucket_suffix(.bucket))]
    Layout {
        /// The bucket involved, if known.
        bucket: Option<String>,
        /// What is wrong, with the expected and actual values.
        detail: String,
    },

    /// Calls made in an order the protocol forbids (publish before register,
    /// a gather of a version newer than the owner's, a corrupt landing slot).
    #[error("protocol violation{}: {detail}", bucket_suffix(.bucket))]
    Protocol {
        /// The bucket involved, if any.
        bucket: Option<String>,
        /// What happened.
        detail: String,
    },

    /// A peer wrote something this rank cannot accept: a landing-slot
    /// header, a control word or a descriptor whose field does not fit the
    /// registered layout. It is refused, never applied.
    #[error("rank {peer} wrote a malformed {what}: {field} {detail}")]
    Malformed {
        /// The rank that wrote it (a landing slot's client, a descriptor's owner).
        peer: usize,
        /// What it wrote (`"landing-slot header"`, `"IPC handle"`, ...).
        what: &'static str,
        /// The offending field (`"bucket"`, `"offset"`, `"len"`, ...).
        field: &'static str,
        /// Its value and what was expected.
        detail: String,
    },

    /// An invalid configuration or topology.
    #[error("invalid configuration: {0}")]
    Config(String),

    /// A transport operation failed.
    #[error("transport {op} failed: {detail}")]
    Transport {
        /// The operation (`"shm_open"`, `"mmap"`, `"get"`, ...).
        op: &'static str,
        /// What it was applied to and why it failed.
        detail: String,
        /// The underlying error, when there is one.
        #[source]
        source: Option<std::io::Error>,
    },

    /// Shared memory (`/dev/shm`) has too little room for this engine's
    /// segments: a container started with a small `--shm-size`, or other
    /// jobs' segments. Raised at registration, before any peer waits on
    /// this rank's memory.
    #[error(
        "not enough shared memory in {dir} for {what}: {needed} bytes needed, {free} bytes free \
         (give the container a larger /dev/shm, e.g. docker run --shm-size)"
    )]
    ShmSpace {
        /// The shared-memory directory (`/dev/shm`).
        dir: String,
        /// Bytes needed.
        needed: u64,
        /// Bytes free when it was checked.
        free: u64,
        /// What needed them (this rank's regions, a segment).
        what: String,
    },

    /// The rendezvous store failed or returned malformed data.
    #[error("store {op} failed for key {key:?}: {detail}")]
    Store {
        /// The operation (`"set"`, `"get"`, `"wait"`, `"add"`).
        op: &'static str,
        /// The key involved.
        key: String,
        /// Why it failed.
        detail: String,
    },

    /// Elastic hybrid sharding: this rank's node was dropped from the job
    /// (a rank of it died or failed, and its replica has a hole); the other
    /// nodes go on without it.
    #[error(
        "this rank's node {node} was dropped from the job at minibatch {minibatch} \
         (elastic hybrid sharding): one of its ranks died or failed, so its replica \
         cannot serve; the other nodes go on without it. Its ranks must exit \
         (rejoining a running job is not supported yet)"
    )]
    Dropped {
        /// The node (index of its replica).
        node: usize,
        /// The minibatch whose round dropped it.
        minibatch: u64,
    },

    /// A GPU transport cannot run here: a library or device is missing.
    #[error("GPU unavailable: {0}")]
    GpuUnavailable(#[from] Missing),

    /// A CUDA driver call failed (device memory, streams, kernels).
    #[error("CUDA {call} failed: {detail}")]
    Cuda {
        /// The driver call (`"cuMemCreate"`, `"cuMemcpyDtoDAsync"`, ...).
        call: &'static str,
        /// Its status and context.
        detail: String,
    },

    /// An NVSHMEM call failed.
    #[error("NVSHMEM {call} failed: {detail}")]
    Nvshmem {
        /// The native call.
        call: &'static str,
        /// Its status and context.
        detail: String,
    },

    /// A libfabric call failed (the `fabric` transport).
    #[error("libfabric {call} failed: {detail} (fi errno {code})")]
    Fabric {
        /// The libfabric call (`"fi_getinfo"`, `"fi_read"`, ...).
        call: &'static str,
        /// Its fi errno (positive; 0 when the failure is ours, not the call's).
        code: i32,
        /// `fi_strerror` text and context (peer, region, bytes).
        detail: String,
    },

    /// An operating-system error outside the transport.
    #[error(transparent)]
    Io(#[from] std::io::Error),

    /// A bug in ODC: its native code panicked, in a call on this rank or in
    /// a thread the engine started (the shard server daemon, the fabric
    /// progress thread). The panic was caught where it happened (never an
    /// abort of the process); this rank's engine cannot go on.
    #[error(
        "rank {rank}: internal error in ODC while {during}: {detail} (a bug: the panic's \
         location is on this rank's stderr; this rank's engine cannot go on)"
    )]
    Internal {
        /// The rank whose code panicked.
        rank: usize,
        /// What it was doing (`"adding rank 2's chunk of bucket \"b\" ..."`).
        during: String,
        /// The panic's message.
        detail: String,
    },
}

fn bucket_suffix(bucket: &Option<String>) -> String {
    match bucket {
        Some(b) => format!(" (bucket {b:?})"),
        None => String::new(),
    }
}

impl Error {
    /// The peer this error blames, for `PeerTimeout` and `PeerDied`.
    pub fn blamed_peer(&self) -> Option<usize> {
        match self {
            Error::PeerTimeout { peer, .. } | Error::PeerDied { peer, .. } => Some(*peer),
            _ => None,
        }
    }

    pub(crate) fn layout(bucket: Option<&str>, detail: impl Into<String>) -> Error {
        Error::Layout {
            bucket: bucket.map(str::to_owned),
            detail: detail.into(),
        }
    }

    pub(crate) fn protocol(bucket: Option<&str>, detail: impl Into<String>) -> Error {
        Error::Protocol {
            bucket: bucket.map(str::to_owned),
            detail: detail.into(),
        }
    }

    pub(crate) fn malformed(
        peer: usize,
        what: &'static str,
        field: &'static str,
        detail: impl Into<String>,
    ) -> Error {
        Error::Malformed {
            peer,
            what,
            field,
            detail: detail.into(),
        }
    }

    pub(crate) fn transport(op: &'static str, detail: impl Into<String>) -> Error {
        Error::Transport {
            op,
            detail: detail.into(),
            source: None,
        }
    }

    pub(crate) fn transport_io(
        op: &'static str,
        detail: impl Into<String>,
        source: std::io::Error,
    ) -> Error {
        Error::Transport {
            op,
            detail: detail.into(),
            source: Some(source),
        }
    }

    /// The error a caught panic becomes: rank `rank` was doing `during`;
    /// `payload` is what [`std::panic::catch_unwind`] returned (dropped
    /// here, where a panic of its own `Drop` cannot unwind any further).
    pub fn from_panic(
        rank: usize,
        during: impl Into<String>,
        payload: Box<dyn std::any::Any + Send>,
    ) -> Error {
        Error::Internal {
            rank,
            during: during.into(),
            detail: panic_message(payload),
        }
    }
}

/// The message of a caught panic (`panic!("...")` carries a `&str` or a
/// `String`); the payload is dropped inside a `catch_unwind` of its own.
pub fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    let text = if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    };
    // A payload whose Drop panics would otherwise unwind out of the handler
    // that caught the first panic (and across a thread's or an FFI
    // boundary: an abort).
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(payload)));
    text
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_peer_and_bucket() {
        let e = Error::PeerTimeout {
            peer: 3,
            bucket: Some("layer.0".into()),
            waited_for: "version 2 of its shard".into(),
            after: Duration::from_secs(5),
        };
        let s = e.to_string();
        assert!(
            s.contains("rank 3") && s.contains("layer.0") && s.contains("version 2"),
            "{s}"
        );
        assert_eq!(e.blamed_peer(), Some(3));
        let e = Error::PeerDied {
            peer: 1,
            pid: 42,
            bucket: None,
            waited_for: "x".into(),
            reported_by: Some(2),
        };
        assert!(e.to_string().contains("reported by rank 2"));
    }

    #[test]
    fn a_caught_panic_names_the_rank_what_it_was_doing_and_the_message() {
        for (payload, want) in [
            (
                std::panic::catch_unwind(|| panic!("plain")).unwrap_err(),
                "plain",
            ),
            (
                std::panic::catch_unwind(|| panic!("formatted {}", 7)).unwrap_err(),
                "formatted 7",
            ),
            (
                std::panic::catch_unwind(|| std::panic::panic_any(3u8)).unwrap_err(),
                "a panic without a message",
            ),
        ] {
            let e = Error::from_panic(2, "adding rank 1's chunk", payload);
            let s = e.to_string();
            assert!(
                s.starts_with("rank 2: internal error in ODC while adding rank 1's chunk: ")
                    && s.contains(want),
                "{s}"
            );
            assert_eq!(e.blamed_peer(), None);
        }
    }

    #[test]
    fn a_payload_whose_drop_panics_does_not_unwind_out_of_the_handler() {
        struct Bomb;
        impl Drop for Bomb {
            fn drop(&mut self) {
                panic!("the payload's drop panics (expected by this test)");
            }
        }
        let payload = std::panic::catch_unwind(|| std::panic::panic_any(Bomb)).unwrap_err();
        assert_eq!(panic_message(payload), "a panic without a message");
    }
}

/// What a GPU transport needs and this machine lacks.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Missing {
    /// The CUDA driver, a device or NVRTC (see [`Unavailable`](odc_kernels::Unavailable)).
    #[error(transparent)]
    Cuda(#[from] odc_kernels::Unavailable),

    /// No NVSHMEM host library could be loaded.
    #[error("no NVSHMEM host library (libnvshmem_host.so.3): tried {}; run `make setup` (PyPI nvidia-nvshmem-cu12) or set ODC_NVSHMEM_LIB", .tried.join(", "))]
    NvshmemLibrary {
        /// Every place tried, with why it failed.
        tried: Vec<String>,
    },

    /// The CUDA driver loaded but lacks a function ODC calls (too old).
    #[error("the CUDA driver ({library}) has no {symbol} ({detail}): update the NVIDIA driver (CUDA 12 or newer)")]
    DriverSymbol {
        /// The missing function.
        symbol: String,
        /// The library that was opened.
        library: String,
        /// The loader's message.
        detail: String,
    },

    /// The device lacks a capability a GPU transport needs.
    #[error("CUDA device {ordinal} lacks {what}")]
    DeviceCapability {
        /// The device.
        ordinal: usize,
        /// What it lacks.
        what: String,
    },

    /// The library loaded but lacks a function ODC calls (too old).
    #[error("{library:?} has no symbol {symbol} ({detail}): NVSHMEM 3.x is required")]
    NvshmemSymbol {
        /// The missing function.
        symbol: &'static str,
        /// The library that was opened.
        library: PathBuf,
        /// The loader's message.
        detail: String,
    },
}
