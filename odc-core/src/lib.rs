//! ODC engine: a decentralized parameter server for FSDP built on one-sided
//! operations. A rank **gathers** parameter shards straight out of their
//! owners' registered memory and **scatter-accumulates** gradient chunks
//! into landing slots that each owner's **server daemon** adds into its
//! gradient accumulators. Ranks meet once per minibatch, never per layer,
//! and may run different numbers of microbatches.
//!
//! # Module map
//!
//! | module | owns |
//! |---|---|
//! | [`error`] | the one [`Error`] type |
//! | [`topology`] | world D, ranks per node G, rank → node |
//! | [`layout`] | [`BucketSpec`], [`BucketLayout`]: padded shards, chunking |
//! | [`store`] | the rendezvous [`Store`] trait and [`FileStore`] |
//! | [`sync`] | atomics (std or loom), [`sync::Backoff`], futex sleep/wake |
//! | [`region`] | registered memory and its plain-data [`RegionDesc`] |
//! | [`transport`] | the [`Transport`] trait (`get`, `put_signal`, bells), the backend choice (`create`, [`TransportKind`]) and the `shm` backend |
//! | `transport::fabric` | libfabric RMA backend (feature `fabric`): C shim, sys / result / safe, progress thread |
//! | `transport::mixed` | `shm` to peers on this node, `fabric` to the others, in one engine (feature `fabric`) |
//! | [`control`] | where control words and landing slots live; slot header format |
//! | [`protocol`] | the rules as pure state machines over word values: slots, versions, finish, hybrid partials, the own-slice hand-off |
//! | [`wait`] | every wait on a peer: spin → futex → liveness → deadline, and whom an error blames |
//! | [`plane`] | the device data plane: `DeviceBackend` (memory + stream operations), `cuda-ipc` (`plane::cuda`), `nvshmem` (`plane::nvshmem`) and their host emulations (`plane::emu`) |
//! | `gpu` | GPU presence ([`gpu::probe`]), device memory shared within a node ([`gpu::device`]), descriptor passing ([`gpu::fdshare`]), NVSHMEM bindings (sys / result / safe) |
//! | `engine` | configuration ([`EngineConfig`], [`Sharding`]), the state shared by workers and daemon, collective registration in steps |
//! | `client` | the worker API written once over a data path: [`Host`] (host memory) and [`Device`] (device memory on a stream) |
//! | `server` | the shard server daemon loop |
//! | `api` | the public [`Engine`]: setup, registration, the daemon's lifetime, accessors, the worker handle of its kind |
//! | [`weights`] | rollout weights: a trainer rank's K snapshot slots ([`weights::WeightServer`]) and a reader outside the training group that reads a whole version or none ([`weights::WeightReader`]) |
//!
//! Data flows one way, and so do the module arrows (`scripts/module-graph.py`
//! checks it in `make lint`): `api` → `client`, `server` → `engine` →
//! `transport`, `plane` → `protocol`, `wait`, `control`, `region`, `sync`,
//! ... ; `client` and `server` never use each other. The server reads
//! signals from its own memory and calls `odc-kernels`.
//!
//! # Quick start
//!
//! One rank of a job (every rank runs the same code with its own rank):
//!
//! ```no_run
//! use std::sync::Arc;
//! use odc_core::{bytes_of, bytes_of_mut, BucketSpec, Engine, EngineConfig, FileStore, Topology};
//! use odc_kernels::DType;
//!
//! # fn main() -> odc_core::Result<()> {
//! let (rank, world) = (0, 2);
//! let store = Arc::new(FileStore::new("/tmp/odc-store")?);
//! let engine = Engine::new(store, Topology::single_node(rank, world)?, EngineConfig::default())?;
//! engine.register(&[BucketSpec::new("layer0", 1000, DType::F32)])?;
//! let b = engine.bucket_id("layer0")?;
//! let shard_len = engine.bucket(b)?.shard_len();
//! let worker = engine.host()?; // host memory (`engine.device()` for GPU transports)
//!
//! let mut shard = vec![1.0f32; shard_len];
//! worker.publish(b, bytes_of(&shard), DType::F32, 0)?; // initial parameters
//! for k in 0..10u64 {
//!     let mut params = vec![0f32; 1000];
//!     worker.gather(b, k, bytes_of_mut(&mut params), DType::F32)?;
//!     let grads = vec![1.0f32; 1000]; // forward + backward, any number of microbatches
//!     worker.scatter_accumulate(b, bytes_of(&grads), DType::F32, 1.0)?;
//!     worker.finish_minibatch(k)?; // this rank's gradient shards are final
//!     let mut g = vec![0f32; shard_len];
//!     worker.read_grad_shard(b, &mut g)?;
//!     shard.iter_mut().zip(&g).for_each(|(p, g)| *p -= 0.01 * g); // optimizer step
//!     worker.zero_grads()?;
//!     worker.publish(b, bytes_of(&shard), DType::F32, k + 1)?;
//! }
//! # Ok(()) }
//! ```
//!
//! # Protocol
//!
//! See [`control`] for the words. In short: `publish(v)` waits until every
//! client released `v - 1`, writes the shard, then signals version `v` to
//! every reader; `gather(v)` waits for version `v` of each owner's shard and
//! copies it; `scatter_accumulate` writes chunks into two landing slots per
//! (client, peer owner) and never waits for the last acknowledgements, and
//! hands this rank's own slice to its own server as a pointer (no copy; the
//! server adds it fused with the peers' chunks and the call waits for it);
//! `finish_minibatch(k)` waits for its acknowledgements, writes `done = k`
//! to every owner and returns when every client's `done` here reads `k`.
//! Every wait spins briefly, then sleeps on a futex in this rank's own
//! memory, checks the awaited peer's liveness every 50 ms and fails at
//! [`EngineConfig::timeout`] with [`Error::PeerTimeout`] (or earlier with
//! [`Error::PeerDied`]).
//!
//! # Across nodes under full sharding
//!
//! Every remote operation of a gather or push is in flight at once
//! ([`Transport::run_batch`]). A version of a shard owned on another node
//! crosses once per node: the first node-mate that gathers a piece of it
//! fetches it into the node cache (node shared memory; its node-mates copy
//! it from there, or fetch it themselves if the fetcher died), bounded by
//! [`EngineConfig::node_cache`] with least-recently-used eviction
//! ([`protocol::cache`]). With [`CrossNode::Node`] a node's gradient for an
//! owner on another node crosses once too: node-mates push their chunks to
//! the node-mate with the owner's local rank, whose daemon sums them, and
//! that rank pushes the sum when the node's last rank finished the
//! minibatch ([`protocol::nodesum`]).
//!
//! # Hybrid sharding
//!
//! With [`Sharding::Hybrid`] a bucket is sharded over the G ranks of a
//! node (the shard group) and every word above is exchanged only inside
//! it. At the end of minibatch `k`, once its node-summed shards are final,
//! a rank tells the ranks holding the same shards on the other nodes (its
//! replicas) `partial_ready = k`, reads each replica's accumulators, sums
//! them in node order (so every replica gets bitwise the same result) and
//! answers `partial_read = k`. The optimizer reads that sum; the
//! accumulators may change again (zeroing, or the next publish) only once
//! every replica read them, so `zero_grad` and `publish` wait for the
//! replicas' `partial_read`. The reduction costs (N − 1) shard reads per
//! rank per minibatch, against N − 1 chunks per push and gather over the
//! network under full sharding.
//!
//! With [`Sharding::HybridZero`] (ZeRO++-style) the node shards are made of
//! N blocks dealt round-robin ([`layout`]): block r of a bucket, rank r's
//! *piece*, is all it publishes, steps and reads gradients for. The reduce
//! above then reads only this rank's piece of each replica's accumulators
//! (a reduce-scatter across nodes), and a publish writes the piece, reads
//! the replicas' pieces of the same version into the node shard
//! (`piece_version`, `piece_read`: [`protocol::pieces`]) and only then
//! announces it to the node. Cross-node bytes equal HSDP's all-reduce;
//! gradients and optimizer state are 1/D (docs/hybrid-zero.md).
//!
//! # Thread safety
//!
//! [`Engine`] is `Send + Sync`. Gathers may run from several threads at once
//! and concurrently with pushes; pushes and finish serialize on one internal
//! lock (taken once per call, never per chunk), publishes on another. The
//! server daemon is a separate thread per engine that never blocks the
//! caller. Accumulators may only be read or zeroed between
//! `finish_minibatch` and the next publish, as the protocol prescribes.
//!
//! # Resource cleanup
//!
//! Dropping the [`Engine`] stops and joins the server thread, unmaps peers'
//! memory and unlinks this rank's shared-memory segments; peers that still
//! wait on it see it as gone (`PeerDied`). A crashed rank's segments are
//! removed at the next start of a job with the same
//! [`EngineConfig::job_key`].

#![warn(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]
#![cfg_attr(loom, allow(dead_code))]

pub mod control;
pub mod elastic;
pub mod error;
pub mod gpu;
pub mod layout;
pub mod protocol;
pub mod store;
pub mod sync;
pub mod topology;

// Under `--cfg loom` only the pure modules and the protocol model build:
// loom's atomics cannot live in shared mappings.
#[cfg(not(loom))]
pub mod plane;
#[cfg(not(loom))]
pub mod region;
#[cfg(not(loom))]
pub mod transport;
#[cfg(not(loom))]
pub mod wait;
#[cfg(not(loom))]
pub mod weights;

#[cfg(not(loom))]
mod api;
#[cfg(not(loom))]
pub mod client;
#[cfg(not(loom))]
mod engine;
#[cfg(not(loom))]
mod server;

#[cfg(all(feature = "fuzzing", not(loom)))]
#[doc(hidden)]
pub mod fuzzing;

#[cfg(all(test, not(loom)))]
mod engine_tests;
#[cfg(all(test, loom))]
mod loom_model;
#[cfg(all(loom, not(feature = "loom")))]
compile_error!("--cfg loom needs odc-core's loom feature: run `make loom` (scripts/loom.sh)");

#[cfg(not(loom))]
pub use api::{BytesAcrossNodes, Engine};
#[cfg(not(loom))]
pub use client::{Device, Host};
#[cfg(not(loom))]
pub use engine::{
    check_env, node_cache_bytes, BucketId, CrossNode, EngineConfig, NodeCacheStats, Sharding,
    DEFAULT_NODE_CACHE,
};
pub use error::{Error, Result};
pub use layout::{BucketLayout, BucketSpec};
#[cfg(not(loom))]
pub use region::RegionDesc;
pub use store::{FileStore, Store};
pub use topology::Topology;
#[cfg(not(loom))]
pub use transport::{Transport, TransportKind};

pub use odc_kernels::{DType, Element};

/// Views a slice of f32, bf16 or f16 as bytes.
pub fn bytes_of<T: Element>(s: &[T]) -> &[u8] {
    // SAFETY: `Element` types are plain old data without padding; the byte
    // view covers exactly the slice's memory and borrows it.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

/// Views a mutable slice of f32, bf16 or f16 as bytes.
pub fn bytes_of_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `bytes_of`; every bit pattern is a valid value of these
    // types, so writes through the byte view cannot create invalid values.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}
