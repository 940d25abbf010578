//! The engine's lower layer: configuration ([`config`]), the state a rank
//! shares between its worker handles and its daemon ([`state`]), and
//! collective registration ([`register`]). [`Core::new`] joins the job and
//! creates the transport; [`Core::register`] registers the buckets. The
//! public [`crate::Engine`] (in `api`) composes this with the server thread
//! and the worker handles; this module depends on neither.

pub(crate) mod cache;
pub use cache::NodeCacheStats;
mod config;
pub(crate) mod register;
mod state;

use std::sync::{Arc, Mutex, OnceLock};

use odc_kernels::DType;

pub(crate) use config::Groups;
pub use config::{
    check_env, node_cache_bytes, BucketId, CrossNode, EngineConfig, Sharding, DEFAULT_NODE_CACHE,
};
pub(crate) use register::data_sizes;
pub(crate) use state::{
    load, record_error, Core, DevicePack, DeviceQuant, NodeSums, Packer, PushState, Quant,
    Registered,
};

use crate::layout::BucketSpec;
use crate::protocol::handoff::OwnPush;
use crate::store::{wait_get, Store};
use crate::sync::AtomicBool;
use crate::topology::Topology;
use crate::{Error, Result};

impl Core {
    /// Joins the job as `topology.rank()`: agrees on a job id through the
    /// store (rank 0 draws it) and creates this rank's transport.
    pub(crate) fn new(
        store: Arc<dyn Store>,
        topology: Topology,
        config: EngineConfig,
    ) -> Result<Core> {
        if config.chunk_bytes == 0 || config.chunk_bytes > 1 << 30 {
            return Err(Error::Config(format!(
                "chunk_bytes {} not in 1..=1 GiB",
                config.chunk_bytes
            )));
        }
        if config.accum_dtype != DType::F32 {
            return Err(Error::Config(format!(
                "accumulation dtype {} unsupported; only f32",
                config.accum_dtype
            )));
        }
        if config.timeout.is_zero() {
            return Err(Error::Config("timeout must be positive".into()));
        }
        let groups = Groups::new(&topology, config.sharding);
        if config.transport.is_device() && groups.replicas.len() > 1 {
            return Err(Error::Config(format!(
                "{} sharding over {} nodes reduces the replicas' accumulators in host memory, \
                 which the {} transport does not keep: use full sharding (or a host transport)",
                config.sharding.name(),
                topology.nodes(),
                config.transport.name()
            )));
        }
        if config.deterministic && config.transport.is_device() {
            return Err(Error::Config(format!(
                "deterministic accumulation runs on the host transports (shm, fabric, auto); \
                 the {} transport adds gradients on the device, where the exact accumulator \
                 is not built: drop deterministic=True or use a host transport",
                config.transport.name()
            )));
        }
        if let Some(c) = &config.compress {
            check_compress(c, &config)?;
        }
        if config.elastic && config.sharding != Sharding::Hybrid {
            return Err(Error::Config(format!(
                "elastic training needs sharding=\"hybrid\", where every node holds a whole \
                 replica of the parameters and the optimizer state; under {} sharding one copy \
                 of {} lives on one rank and dies with it, so a death must end the job",
                config.sharding.name(),
                if config.sharding == Sharding::Full {
                    "each parameter and gradient shard"
                } else {
                    "each shard's optimizer state"
                }
            )));
        }
        if config.elastic && topology.nodes() > crate::protocol::membership::MAX_NODES {
            return Err(Error::Config(format!(
                "elastic training tracks at most {} nodes; this job has {}",
                crate::protocol::membership::MAX_NODES,
                topology.nodes()
            )));
        }
        let all = crate::protocol::membership::all_nodes(topology.nodes());
        let members = match config.members {
            None => all,
            Some(_) if !config.elastic => {
                return Err(Error::Config(
                    "members (the nodes an engine generation starts with) needs elastic=True"
                        .into(),
                ))
            }
            Some(m) if m == 0 || m & !all != 0 => {
                return Err(Error::Config(format!(
                    "members {m:#x}: expected a nonempty set of this job's {} nodes",
                    topology.nodes()
                )))
            }
            Some(m)
                if m & crate::protocol::membership::node(topology.node_of(topology.rank()))
                    == 0 =>
            {
                return Err(Error::Config(format!(
                    "members {:?} leave out this rank's node {}: a rank takes part only in a \
                     generation its node is a member of",
                    crate::elastic::nodes_of(m),
                    topology.node_of(topology.rank())
                )))
            }
            Some(m) => m,
        };
        let deadline = config.register_deadline();
        // Before the job id, which a joiner waits for before it reads the members.
        if config.elastic && members != all {
            crate::elastic::Generation::describe_first(
                store.as_ref(),
                &config.store_prefix,
                members,
            )?;
        }
        let key = format!("{}/job_id", config.store_prefix);
        // The first rank of the first member node draws the job id.
        let first = members.trailing_zeros() as usize * topology.local_world();
        let job_id = if topology.rank() == first {
            let id = register::random_job_id()?;
            store.set(&key, id.as_bytes())?;
            id
        } else {
            String::from_utf8_lossy(&wait_get(store.as_ref(), &key, deadline)?).into_owned()
        };
        let elastic = config.elastic.then(|| {
            crate::elastic::Membership::new(
                format!("{}/elastic/{job_id}", config.store_prefix),
                members,
            )
        });
        let transport = crate::transport::create(
            config.transport,
            topology,
            &config.job_key,
            &job_id,
            config.timeout,
        )?;
        let device = crate::plane::create(
            config.transport,
            &topology,
            config.device,
            config.heap_reserve,
        )?;
        let world = groups.group.len();
        Ok(Core {
            topo: topology,
            config,
            store,
            transport: Arc::from(transport),
            device,
            reg: OnceLock::new(),
            shutdown: AtomicBool::new(false),
            server_error: Arc::new(Mutex::new(None)),
            server_failure: OnceLock::new(),
            own: OwnPush::new(),
            push: Mutex::new(PushState::new(world)),
            publish_lock: Mutex::new(()),
            elastic,
        })
    }

    /// Whether rank `r` takes part in this engine: every rank, unless an
    /// elastic generation started without `r`'s node
    /// ([`EngineConfig::members`]).
    pub(crate) fn takes_part(&self, r: usize) -> bool {
        self.config
            .members
            .is_none_or(|m| m & crate::protocol::membership::node(self.topo.node_of(r)) != 0)
    }

    /// Registers every bucket (see [`register`]).
    pub(crate) fn register(&self, specs: &[BucketSpec]) -> Result<()> {
        register::register(self, specs)
    }

    /// The transport in use.
    pub(crate) fn transport_name(&self) -> &'static str {
        match &self.device {
            Some(d) => d.name(),
            None => self.transport.name(),
        }
    }

    /// The id of the bucket named `name`.
    pub(crate) fn bucket_id(&self, name: &str) -> Result<BucketId> {
        self.registered()?
            .names
            .get(name)
            .map(|&i| BucketId(i))
            .ok_or_else(|| Error::layout(Some(name), "unknown bucket"))
    }
}

/// Refuses by name what compressed chunks and copies do not (yet) combine
/// with.
fn check_compress(c: &crate::protocol::compress::Compress, config: &EngineConfig) -> Result<()> {
    use crate::protocol::compress::Scope;
    if config.deterministic {
        return Err(Error::Config(
            "compress with deterministic=True: deterministic mode promises the same bits in any \
             arrival order, which compressed pushes (each quantised on its own, with a \
             residual kept per pusher) do not keep; drop compress or deterministic"
                .into(),
        ));
    }
    if let (Some(g), Scope::All, true) =
        (c.gather, c.scope, config.sharding == Sharding::HybridZero)
    {
        return Err(Error::Config(format!(
            "compress gather={g} with scope \"all\" under sharding \"hybrid-zero\": a node \
             shard there is assembled from pieces of every node, and its quantised copy is not \
             built; leave gather unset"
        )));
    }
    if c.scope == Scope::CrossNode && config.sharding == Sharding::Hybrid {
        // Only the minibatch's cross-node sum of the gradient shards crosses
        // nodes there: the push format compresses it, a gather format has
        // nothing to compress (hybrid-zero's piece copies it compresses).
        if let Some(g) = c.gather {
            return Err(Error::Config(format!(
                "compress gather={g} with scope \"cross-node\" under sharding \"hybrid\": no \
                 gather crosses nodes there (every node holds the whole parameters), so nothing \
                 would be; leave gather unset (push compresses the minibatch's cross-node sum), \
                 or use sharding \"hybrid-zero\" or \"full\""
            )));
        }
    }
    Ok(())
}
