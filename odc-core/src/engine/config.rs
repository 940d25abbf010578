//! Engine settings: [`EngineConfig`], [`Sharding`], the shard and replica
//! [`Groups`] a rank belongs to, and [`BucketId`].

use std::time::Duration;

use odc_kernels::DType;

use crate::topology::Topology;
use crate::transport::TransportKind;
use crate::Error;

/// How parameters and gradients are spread over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Sharding {
    /// Every bucket is sharded over all D ranks; gathers and pushes reach
    /// every rank.
    #[default]
    Full,
    /// Every bucket is sharded over the G ranks of a node; gathers and
    /// pushes stay inside the node, and at the end of each minibatch the
    /// node-summed gradient shards are summed across the nodes once (each
    /// rank with the ranks of the same local rank on the other nodes).
    /// Parameter shards, accumulators and landing slots scale with G, not D;
    /// each node holds a full replica of the sharded state.
    Hybrid,
    /// ZeRO++-style hybrid (`"hybrid-zero"`): parameters and gradients are
    /// sharded over the G ranks of a node, as [`Sharding::Hybrid`], and the
    /// optimizer's part over all D ranks. Each node shard is cut into N
    /// pieces, one per node ([`crate::layout`]'s blocked layout): rank
    /// (n, l) publishes and steps piece n of local rank l's node shard.
    /// At the end of a minibatch each rank reads only its piece of the
    /// other nodes' partial sums (a reduce-scatter across nodes), and a
    /// publish reads the other nodes' updated pieces of its node shard (an
    /// all-gather across nodes): HSDP's cross-node bytes, with gradients
    /// and optimizer state 1/D. Host transports only.
    HybridZero,
}

impl Sharding {
    /// Every name [`Sharding::parse`] takes.
    pub const NAMES: [&'static str; 3] = ["full", "hybrid", "hybrid-zero"];

    /// Parses `"full"`, `"hybrid"` or `"hybrid-zero"`.
    pub fn parse(name: &str) -> Option<Sharding> {
        match name.trim().to_ascii_lowercase().as_str() {
            "full" => Some(Sharding::Full),
            "hybrid" => Some(Sharding::Hybrid),
            "hybrid-zero" => Some(Sharding::HybridZero),
            _ => None,
        }
    }

    /// `"full"`, `"hybrid"` or `"hybrid-zero"`.
    pub fn name(self) -> &'static str {
        match self {
            Sharding::Full => "full",
            Sharding::Hybrid => "hybrid",
            Sharding::HybridZero => "hybrid-zero",
        }
    }
}

/// How gradients for owners on other nodes cross the network under full
/// sharding (`cross_node`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum CrossNode {
    /// Pick by the measured rule ([`CrossNode::resolve`]).
    #[default]
    Auto,
    /// Every rank pushes its own chunks to every remote owner (G pushes of
    /// each node's gradient cross the network, overlapped with the
    /// backward).
    Direct,
    /// Node-mates' chunks for a remote owner are summed on the node (by the
    /// daemon of the node-mate with the owner's local rank) and the node
    /// pushes each remote owner's sum once, when its last node-mate finished
    /// the minibatch ([`crate::protocol::nodesum`]): G times fewer bytes,
    /// for waiting on the node's slowest rank. Memory: `(N − 1)` times this
    /// rank's accumulators (the node buffers), f32.
    Node,
}

impl CrossNode {
    /// Every name [`CrossNode::parse`] takes.
    pub const NAMES: [&'static str; 3] = ["auto", "direct", "node"];

    /// Parses `"auto"`, `"direct"` or `"node"`.
    pub fn parse(name: &str) -> Option<CrossNode> {
        match name.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(CrossNode::Auto),
            "direct" => Some(CrossNode::Direct),
            "node" => Some(CrossNode::Node),
            _ => None,
        }
    }

    /// `"auto"`, `"direct"` or `"node"`.
    pub fn name(self) -> &'static str {
        match self {
            CrossNode::Auto => "auto",
            CrossNode::Direct => "direct",
            CrossNode::Node => "node",
        }
    }

    /// What a job of `nodes` nodes of `local` ranks runs under `sharding`
    /// over the transport `transport` (its name): `Direct` or `Node`.
    /// Aggregation applies to full sharding over several nodes of several
    /// ranks, and not in deterministic mode (the node sums in f32 before
    /// the owner's exact accumulator sees them). `Auto` picks `Node` where
    /// the nodes of a host transport are joined by a network (`mixed`,
    /// `fabric`) and `Direct` where they share one host (`shm`: nothing
    /// crosses a network), the rule the cross-node benchmark measured
    /// (docs/benchmarks/cross-node.md); on a device transport (`device`)
    /// `Auto` keeps `Direct`, which no GPU run has measured against `Node`
    /// yet, and an explicit `Node` keeps the node buffers in device memory.
    /// An explicit `Node` where it cannot apply is an error naming why.
    pub fn resolve(
        self,
        sharding: Sharding,
        (nodes, local): (usize, usize),
        transport: &str,
        device: bool,
        deterministic: bool,
    ) -> Result<CrossNode, String> {
        let applies = sharding == Sharding::Full && nodes > 1 && local > 1;
        match self {
            CrossNode::Direct => Ok(CrossNode::Direct),
            CrossNode::Auto if !applies || device || deterministic => Ok(CrossNode::Direct),
            CrossNode::Auto if transport == "shm" => Ok(CrossNode::Direct),
            CrossNode::Auto => Ok(CrossNode::Node),
            CrossNode::Node if deterministic => Err(
                "cross_node=\"node\" adds node-mates' chunks in f32 before their owner's exact \
                 accumulator sees them, so sums would depend on arrival order: deterministic \
                 mode needs cross_node=\"direct\" (auto picks it)"
                    .into(),
            ),
            CrossNode::Node if applies => Ok(CrossNode::Node),
            // One node, one rank per node or hybrid sharding: nothing to sum.
            CrossNode::Node => Ok(CrossNode::Direct),
        }
    }
}

/// Who shares this rank's shards (the shard group) and who holds the same
/// shards on other nodes (the replica group), as global ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Groups {
    /// Global ranks of the shard group, in shard order.
    pub(crate) group: Vec<usize>,
    /// This rank's index in `group`.
    pub(crate) me: usize,
    /// Global ranks holding this rank's shards, one per node, in node order
    /// (just this rank unless hybrid over several nodes).
    pub(crate) replicas: Vec<usize>,
    /// This rank's index in `replicas`.
    pub(crate) node: usize,
    /// Blocks per shard: the node count under hybrid-zero (piece n of a
    /// node shard is block n), else 1.
    pub(crate) blocks: usize,
}

impl Groups {
    pub(crate) fn new(topo: &Topology, sharding: Sharding) -> Groups {
        let rank = topo.rank();
        match sharding {
            Sharding::Full => Groups {
                group: (0..topo.world()).collect(),
                me: rank,
                replicas: vec![rank],
                node: 0,
                blocks: 1,
            },
            Sharding::Hybrid | Sharding::HybridZero => {
                let g = topo.local_world();
                let (node, local) = (topo.node_of(rank), topo.local_rank_of(rank));
                Groups {
                    group: (node * g..(node + 1) * g).collect(),
                    me: local,
                    replicas: (0..topo.nodes()).map(|n| n * g + local).collect(),
                    node,
                    blocks: if sharding == Sharding::HybridZero {
                        topo.nodes()
                    } else {
                        1
                    },
                }
            }
        }
    }
}

/// Engine settings. `Default` reads `ODC_TIMEOUT_S` and `ODC_JOB_KEY`.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Landing-slot size: the most bytes one push carries (default 2 MiB).
    /// Must be equal on every rank.
    ///
    /// Chosen by `scatter_accumulate_perf` on a shared 2-core host: each
    /// chunk costs a hand-off between a client and a server thread (a wake-up
    /// that under load can wait for a scheduler slice), and that cost, not
    /// the cache residency of small slots, dominated: 2 MiB chunks beat
    /// 1 MiB, 512 KiB and 256 KiB at 4–64 MiB pushes. Landing memory is
    /// `2 · D · chunk` per rank (D: the shard group), where the chunk is
    /// this, shrunk to fit [`EngineConfig::landing_budget`]
    /// ([`crate::control::landing_chunk`]).
    pub chunk_bytes: usize,
    /// Bytes of landing slots per rank at most, whatever the world size
    /// (default 256 MiB, `ODC_LANDING_MB`): large worlds get smaller
    /// chunks, down to [`crate::control::MIN_CHUNK`]; a world too large
    /// even for that fails at registration naming the budget it needs.
    pub landing_budget: usize,
    /// Deadline of every wait (default 300 s, or `ODC_TIMEOUT_S`).
    pub timeout: Duration,
    /// Accumulator dtype; only `F32` is supported.
    pub accum_dtype: DType,
    /// Deterministic accumulation: final gradient shards are the same bits
    /// whatever the order pushes arrive in and whichever rank ran which
    /// microbatch. The daemon adds every contribution into an exact
    /// fixed-point accumulator ([`odc_kernels::cpu::exact`]: 16 more bytes
    /// per shard element) and `finish_minibatch` reads it out. Host
    /// transports only; equal on every rank.
    pub deterministic: bool,
    /// Backend.
    pub transport: TransportKind,
    /// Names this job's shared-memory segments so that a restart of the same
    /// job removes a crashed run's leftovers (default `ODC_JOB_KEY`, else
    /// `"default"`).
    pub job_key: String,
    /// Store key prefix, so several engines can share one store.
    pub store_prefix: String,
    /// Full, hybrid or hybrid-zero sharding; equal on every rank.
    pub sharding: Sharding,
    /// The CUDA device a `cuda-ipc` engine uses (default: the rank's local
    /// rank). Ignored by the other transports.
    pub device: Option<usize>,
    /// Bytes of node memory per node for the **node cache** of remote
    /// shards (full sharding over several nodes): the first rank of a node
    /// that gathers a shard version owned on another node fetches it into
    /// node shared memory, and its node-mates read it from there, so each
    /// version crosses the network once per node while it stays cached
    /// ([`crate::protocol::cache`]; beyond the bound the least recently
    /// used pieces are evicted, those every node-mate has read first). `None` (the default, `ODC_NODE_CACHE_MB` unset):
    /// [`DEFAULT_NODE_CACHE`] where the nodes are joined by a network (the
    /// `mixed` transport), off where every rank shares one host (`shm`:
    /// nothing would cross a network). `Some(0)` turns it off. Each
    /// node-mate keeps `1/G` of it, allocated at registration up to what
    /// the registered buckets' remote shards need; equal on every rank.
    /// On `shm` and `mixed` (`fabric` maps no node-mate's memory), and on
    /// the device transports across nodes (`nvshmem`, `emu-shmem`), where
    /// the slots are device memory and nothing is evicted: the cache keeps
    /// every remote shard within the bound, none beyond the default bound,
    /// and a smaller explicit bound is an error naming the bytes needed.
    pub node_cache: Option<usize>,
    /// How gradients for owners on other nodes cross the network under
    /// full sharding: [`CrossNode::Direct`], [`CrossNode::Node`] or
    /// [`CrossNode::Auto`] (the default, `ODC_CROSS_NODE`); equal on every
    /// rank.
    pub cross_node: CrossNode,
    /// Elastic hybrid sharding ([`crate::elastic`]): under
    /// [`Sharding::Hybrid`] over several nodes, a node whose rank dies is
    /// dropped at the end of the minibatch and the others go on, summing
    /// the minibatch's gradients over the surviving nodes (the dead node's
    /// microbatches are dropped). Refused under the other shardings, where
    /// one copy of a shard or of its optimizer state dies with its rank.
    /// Equal on every rank (default off).
    pub elastic: bool,
    /// Elastic only: the nodes that start as members, one bit per node
    /// (default every node). The ranks of the other nodes take no part in
    /// registration; a node joins such an engine generation by asking the
    /// membership rounds (see [`crate::elastic::await_admission`]). Equal
    /// on every member rank, and this rank's node among them.
    pub members: Option<u64>,
    /// How long joining the job and registering may wait for the other
    /// ranks (default: [`EngineConfig::timeout`]). An elastic generation
    /// that admits a node waits less: a rank that died meanwhile must not
    /// hold the members for the whole timeout.
    pub register_timeout: Option<Duration>,
    /// `nvshmem` only: bytes of symmetric heap to plan beyond this engine's
    /// own data regions, for the engines this process creates later in the
    /// same job, which share this engine's NVSHMEM session (one per
    /// process; its heap is fixed when it starts). Compute it with
    /// [`Engine::heap_bytes`](crate::Engine::heap_bytes) of those engines (default 0).
    pub heap_reserve: usize,
    /// Compressed chunks ([`crate::protocol::compress`]): pushes carry
    /// block-scaled low-precision chunks, with error feedback if asked, and
    /// gathers read the owners' quantised copies of their shards (made once
    /// per version), by default only what crosses nodes. `None` (the
    /// default) moves every byte as it is. Under hybrid sharding across
    /// nodes the push format compresses the cross-node sum of the gradient
    /// shards ([`crate::protocol::compress::sum_spec`]), and under
    /// hybrid-zero the gather format the pieces copied across nodes. Not
    /// with `deterministic`; quantised copies not of f16 buckets on device
    /// engines, not under hybrid-zero with scope all, nor under hybrid.
    pub compress: Option<crate::protocol::compress::Compress>,
}

impl EngineConfig {
    /// The deadline of joining the job and of registration, from now.
    pub(crate) fn register_deadline(&self) -> std::time::Instant {
        std::time::Instant::now() + self.register_timeout.unwrap_or(self.timeout)
    }

    /// Whether the engine's data path is the device's (a device plane, or
    /// a device transport): what the host-only features refuse.
    pub(crate) fn is_device(&self) -> bool {
        self.device.is_some() || self.transport.is_device()
    }
}

impl Default for EngineConfig {
    /// The built-in settings, with the `ODC_*` variables that set them
    /// ([`check_env`] is what refuses a malformed one: here it is skipped).
    fn default() -> EngineConfig {
        let timeout = lenient(env_timeout()).unwrap_or(Duration::from_secs(300));
        let landing_budget =
            lenient(env_landing_budget()).unwrap_or(crate::control::DEFAULT_LANDING_BUDGET);
        let node_cache = lenient(env_node_cache());
        EngineConfig {
            chunk_bytes: 2 << 20,
            landing_budget,
            timeout,
            accum_dtype: DType::F32,
            deterministic: false,
            transport: TransportKind::Auto,
            job_key: std::env::var("ODC_JOB_KEY").unwrap_or_else(|_| "default".into()),
            store_prefix: "odc".into(),
            sharding: Sharding::Full,
            device: None,
            node_cache,
            cross_node: lenient(env_cross_node()).unwrap_or_default(),
            heap_reserve: 0,
            compress: None,
            elastic: false,
            members: None,
            register_timeout: None,
        }
    }
}

/// A variable's value, trimmed; `None` when unset or blank.
fn env_set(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// Variable `name` through `parse`: `None` when unset or blank, a
/// [`Error::Config`] naming the variable, its value and `want` when `parse`
/// refuses it.
fn env_parsed<T>(
    name: &str,
    want: &str,
    parse: impl FnOnce(&str) -> Option<T>,
) -> crate::Result<Option<T>> {
    match env_set(name) {
        None => Ok(None),
        Some(v) => parse(&v)
            .map(Some)
            .ok_or_else(|| Error::Config(format!("{name}={v:?} is not {want}"))),
    }
}

/// What [`EngineConfig::default`] takes of a variable: its value, or none
/// where it is malformed (the error is [`check_env`]'s to raise).
fn lenient<T>(v: crate::Result<Option<T>>) -> Option<T> {
    v.ok().flatten()
}

fn env_timeout() -> crate::Result<Option<Duration>> {
    env_parsed("ODC_TIMEOUT_S", "a positive number of seconds", |v| {
        let s = v
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)?;
        Some(Duration::from_secs_f64(s))
    })
}

fn env_landing_budget() -> crate::Result<Option<usize>> {
    env_parsed("ODC_LANDING_MB", "a positive whole number of MiB", |v| {
        let mb = v.parse::<usize>().ok().filter(|&mb| mb > 0)?;
        Some(mb.saturating_mul(1 << 20))
    })
}

fn env_node_cache() -> crate::Result<Option<usize>> {
    env_parsed(
        "ODC_NODE_CACHE_MB",
        "a size in MiB (0 or more; fractions allowed; 0 turns the cache off)",
        |v| node_cache_bytes(v.parse::<f64>().ok()?),
    )
}

fn env_cross_node() -> crate::Result<Option<CrossNode>> {
    env_parsed(
        "ODC_CROSS_NODE",
        &format!("one of {}", CrossNode::NAMES.join(", ")),
        CrossNode::parse,
    )
}

/// Checks the environment variables [`EngineConfig::default`] reads: a
/// value that is set but malformed (not a number, not positive, not a
/// known name) is an [`Error::Config`] naming the variable and the value,
/// where `default` alone would fall back to the built-in setting and train
/// with something the user did not ask for. [`Engine::new`](crate::Engine::new)
/// calls it. Unset or blank variables are fine.
pub fn check_env() -> crate::Result<()> {
    env_timeout()?;
    env_landing_budget()?;
    env_node_cache()?;
    env_cross_node()?;
    Ok(())
}

/// Bytes of a node cache bound of `mb` MiB (fractions allowed: a small
/// model's bound of one bucket per in-flight gather is under 1 MiB), or
/// `None` for a negative or non-finite `mb`.
pub fn node_cache_bytes(mb: f64) -> Option<usize> {
    // A float-to-int `as` cast saturates: an absurd bound is the largest usize.
    (mb.is_finite() && mb >= 0.0).then(|| (mb * f64::from(1u32 << 20)).round() as usize)
}

/// The node cache's bound per node where [`EngineConfig::node_cache`] is
/// left at its default on a network (1 GiB): room for the remote shards of
/// a model of 0.5 G bf16 parameters on two nodes.
pub const DEFAULT_NODE_CACHE: usize = 1 << 30;

/// A registered bucket's index, as returned by [`Engine::bucket_id`](crate::Engine::bucket_id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BucketId(pub usize);

#[cfg(test)]
mod tests {
    use super::node_cache_bytes;

    #[test]
    fn a_node_cache_bound_takes_fractions_of_a_mib_and_refuses_what_is_not_a_size() {
        assert_eq!(node_cache_bytes(0.0), Some(0));
        assert_eq!(node_cache_bytes(1.0), Some(1 << 20));
        assert_eq!(node_cache_bytes(0.5), Some(1 << 19));
        assert_eq!(node_cache_bytes(1e30), Some(usize::MAX));
        for bad in [-1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(node_cache_bytes(bad), None, "{bad}");
        }
    }
}
