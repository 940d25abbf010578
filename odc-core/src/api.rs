//! The public [`Engine`]: one rank's engine as its users hold it. It
//! composes the engine's state ([`crate::engine`]), the shard server's
//! thread ([`crate::server`]) and the worker handles ([`crate::client`]),
//! and is the only module above both: setup, registration, lifetime,
//! accessors. The worker calls live on the handle of the engine's kind,
//! [`Host`] or [`Device`], handed out by [`Engine::host`] /
//! [`Engine::device`].

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::client::{Device, Host};
use crate::engine::{data_sizes, BucketId, Core, EngineConfig};
use crate::layout::{BucketLayout, BucketSpec};
use crate::plane::DataSizes;
use crate::region::Bell;
use crate::store::Store;
use crate::sync::Ordering;

/// What [`Engine::bytes_across_nodes`] counts, in bytes since the engine
/// started.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BytesAcrossNodes {
    /// Read by this rank's gathers from shards owned on another node.
    pub gathered: u64,
    /// Pushed by this rank to landing slots on another node, headers
    /// included.
    pub pushed: u64,
    /// Read by this rank's cross-node sum (hybrid sharding) from its
    /// replicas on the other nodes: their partial sums, or their quantised
    /// copies under a push format.
    pub summed: u64,
}
use crate::topology::Topology;
use crate::{Error, Result};

/// One rank's ODC engine: the shard server daemon, and the worker API on
/// the handle of its kind.
///
/// See the crate docs for the protocol, thread safety and cleanup.
#[derive(Debug)]
pub struct Engine {
    core: Arc<Core>,
    /// The daemon, once registered (the lock also serializes `register`).
    daemon: Mutex<Option<JoinHandle<()>>>,
}

impl Engine {
    /// Joins the job as `topology.rank()`: agrees on a job id through the
    /// store (rank 0 draws it) and creates this rank's transport.
    ///
    /// Errors: [`Error::Config`](crate::Error::Config) for an `ODC_*`
    /// variable that is set but malformed ([`crate::engine::check_env`]),
    /// before anything is created.
    pub fn new(store: Arc<dyn Store>, topology: Topology, config: EngineConfig) -> Result<Engine> {
        crate::engine::check_env()?;
        Ok(Engine {
            core: Arc::new(Core::new(store, topology, config)?),
            daemon: Mutex::new(None),
        })
    }

    /// Registers every bucket: eager and collective, in the same order on
    /// every rank. The lists are compared through the store and a mismatch
    /// fails on every rank naming the first differing bucket. Allocates the
    /// published shards, accumulators, landing slots and control words,
    /// exchanges descriptors, connects to every peer and starts the server.
    pub fn register(&self, specs: &[BucketSpec]) -> Result<()> {
        let mut daemon = self
            .daemon
            .lock()
            .map_err(|_| Error::protocol(None, "an earlier register call panicked"))?;
        let fault = crate::server::Fault::from_env()?;
        self.core.register(specs)?;
        *daemon = Some(crate::server::spawn(Arc::clone(&self.core), fault)?);
        Ok(())
    }

    /// The worker calls of a host engine (`shm`, `fabric`, `shm+fabric`).
    ///
    /// Errors: not registered yet, the engine's data lives in device
    /// memory (use [`device`](Self::device)), or a thread of this rank's
    /// engine (its shard server, the fabric progress thread) panicked
    /// ([`Error::Internal`], naming what it was doing).
    pub fn host(&self) -> Result<Host<'_>> {
        let reg = self.core.registered()?;
        if let Some(e) = self.core.failed() {
            return Err(e);
        }
        if reg.plane.is_some() {
            return Err(Error::Config(format!(
                "this engine's data lives in device memory ({}): use Engine::device",
                self.transport_name()
            )));
        }
        Ok(Host::new(&self.core, reg))
    }

    /// The worker calls of a device engine (`cuda-ipc`, `nvshmem`, `emu-ipc`,
    /// `emu-shmem`).
    ///
    /// Errors: not registered yet, the engine's data lives in host memory
    /// (use [`host`](Self::host)), or a thread of this rank's engine
    /// panicked ([`Error::Internal`]).
    pub fn device(&self) -> Result<Device<'_>> {
        let reg = self.core.registered()?;
        if let Some(e) = self.core.failed() {
            return Err(e);
        }
        match &reg.plane {
            Some(plane) => Ok(Device::new(&self.core, reg, plane.as_ref())),
            None => Err(Error::Config(format!(
                "this engine's data lives in host memory ({}): use Engine::host",
                self.transport_name()
            ))),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.core.topo.rank()
    }

    /// D.
    pub fn world(&self) -> usize {
        self.core.topo.world()
    }

    /// The topology.
    pub fn topology(&self) -> Topology {
        self.core.topo
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.core.config
    }

    /// The transport in use (`"shm"`, `"fabric"`, `"shm+fabric"`,
    /// `"cuda-ipc"`, `"nvshmem"`, `"emu-ipc"`, `"emu-shmem"`).
    pub fn transport_name(&self) -> &'static str {
        self.core.transport_name()
    }

    /// Whether this engine's data lives in device memory: its worker calls
    /// are then [`device`](Self::device)'s.
    pub fn is_device(&self) -> bool {
        self.core.device.is_some()
    }

    /// The data regions an engine with `config` on `topology` allocates
    /// for `specs` on a device transport: published shards (with a gather
    /// format, their quantised copies and the gathers' staging after them),
    /// landing slots (with a push format, the packing buffers after them),
    /// f32 accumulators, this rank's share of the node cache (the figures
    /// `register` gives the plane).
    ///
    /// Errors: as [`register`](Self::register) for a bad bucket list.
    pub fn data_sizes(
        specs: &[BucketSpec],
        topology: &Topology,
        config: &EngineConfig,
    ) -> Result<DataSizes> {
        data_sizes(specs, topology, config)
    }

    /// The symmetric-heap bytes an `nvshmem` engine with `config` on
    /// `topology` takes for `specs`: what an earlier engine of the same
    /// process reserves ([`EngineConfig::heap_reserve`]) for it.
    pub fn heap_bytes(
        specs: &[BucketSpec],
        topology: &Topology,
        config: &EngineConfig,
    ) -> Result<usize> {
        Ok(data_sizes(specs, topology, config)?
            .heap_plan()
            .used_bytes())
    }

    /// The id of the bucket named `name`.
    pub fn bucket_id(&self, name: &str) -> Result<BucketId> {
        self.core.bucket_id(name)
    }

    /// The layout of bucket `id`.
    pub fn bucket(&self, id: BucketId) -> Result<&BucketLayout> {
        self.core.registered()?.bucket(id)
    }

    /// Every registered bucket, in registration order.
    pub fn buckets(&self) -> Result<&[BucketLayout]> {
        Ok(&self.core.registered()?.buckets)
    }

    /// How gradients for owners on other nodes cross: resolved at
    /// registration ([`Direct`](crate::CrossNode::Direct) or
    /// [`Node`](crate::CrossNode::Node)), as configured before.
    pub fn cross_node(&self) -> crate::CrossNode {
        self.core
            .reg
            .get()
            .map_or(self.core.config.cross_node, |r| r.cross_node)
    }

    /// What this rank's gathers did with its node's cache of remote shards
    /// ([`EngineConfig::node_cache`]); `None` where it keeps none (one
    /// node, not full sharding, the cache off, or not registered yet).
    pub fn node_cache_stats(&self) -> Option<crate::NodeCacheStats> {
        Some(self.core.reg.get()?.cache.as_ref()?.stats())
    }

    /// Bytes this rank moved across nodes on the host data path since the
    /// engine started: its gathers' reads of shards owned on another node
    /// (the node cache's fetches and hybrid-zero's piece copies included),
    /// its pushes' chunks to landing slots on another node (headers
    /// included) and what hybrid sharding's end-of-minibatch sum read from
    /// the other nodes, compressed or not. Not counted: control words.
    /// `None` on a device engine, whose data path does not count.
    ///
    /// # Errors
    ///
    /// [`Error::Protocol`] when a push panicked holding the
    /// push state.
    pub fn bytes_across_nodes(&self) -> Result<Option<BytesAcrossNodes>> {
        if self.core.config.is_device() {
            return Ok(None);
        }
        let reg = self.core.reg.get();
        let gathered = reg.map_or(0, |r| r.read_across.load(Ordering::Relaxed));
        let summed = reg.map_or(0, |r| r.summed_across.load(Ordering::Relaxed));
        let pushed = self
            .core
            .push
            .lock()
            .map_err(|_| Error::protocol(None, "a push panicked"))?
            .sent_across;
        Ok(Some(BytesAcrossNodes {
            gathered,
            pushed,
            summed,
        }))
    }

    /// Elastic hybrid sharding ([`EngineConfig::elastic`]): the nodes whose
    /// replicas the next minibatch's cross-node sum counts (every node until
    /// one is dropped); `None` unless elastic.
    pub fn members(&self) -> Option<Vec<usize>> {
        let m = self.core.elastic.as_ref()?;
        Some(crate::elastic::nodes_of(m.members()))
    }

    /// Elastic hybrid sharding: every node drop this rank saw, oldest first
    /// (empty unless elastic).
    pub fn elastic_events(&self) -> Vec<crate::elastic::Event> {
        self.core
            .elastic
            .as_ref()
            .map_or_else(Vec::new, |m| m.events())
    }

    /// Elastic hybrid sharding: the nodes a committed round admitted and
    /// the minibatch they join at, where this engine's generation ends
    /// (the loop builds the next one: [`crate::elastic::Generation`]);
    /// `None` until a round admits one.
    pub fn admitted(&self) -> Option<(u64, Vec<usize>)> {
        let (from, nodes) = self.core.elastic.as_ref()?.admitted()?;
        Some((from, crate::elastic::nodes_of(nodes)))
    }

    /// Elastic hybrid sharding: forgets the admission [`Engine::admitted`]
    /// reports, after the generation that would have counted the nodes was
    /// abandoned ([`crate::elastic::Generation::decide`]); this engine's
    /// generation goes on.
    pub fn clear_admitted(&self) {
        if let Some(m) = &self.core.elastic {
            m.clear_admitted();
        }
    }

    #[cfg(test)]
    pub(crate) fn core(&self) -> &Core {
        &self.core
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.core.shutdown.store(true, Ordering::Release);
        self.core.transport.ring(Bell::Server);
        let handle = match self.daemon.get_mut() {
            Ok(h) => h.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        // Written without `eprintln!`, which panics when stderr is gone: a
        // panic in a drop that runs while another unwinds aborts.
        let mut err = std::io::stderr().lock();
        let rank = self.core.topo.rank();
        if let Some(h) = handle {
            if h.join().is_err() {
                let _ = writeln!(err, "odc: rank {rank}: server thread panicked");
            }
        }
        if let Some(e) = self.core.failed() {
            let _ = writeln!(err, "odc: {e}");
        }
        if let Some(e) = self.core.take_server_error() {
            let _ = writeln!(err, "odc: rank {rank}: server reported: {e}");
        }
    }
}
