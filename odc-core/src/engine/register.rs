//! Collective registration, in four steps, each a function: agree on the
//! bucket list through the store ([`agree`]), allocate this rank's regions
//! ([`allocate`]), exchange descriptors and connect to every peer
//! ([`connect`]), and connect a device transport's data plane
//! ([`connect_plane`]). A rank that cannot register posts its failure where
//! the peers wait for it, so they fail at once naming it.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::cache::{CacheLayout, NodeCache};
use super::config::{CrossNode, EngineConfig, Groups, Sharding, DEFAULT_NODE_CACHE};
use super::state::{
    Accum, Core, Exact, NodeSums, NodeVersions, Quant, QuantSumState, QuantSums, Registered,
};
use crate::control::{landing_chunk, CtrlLayout};
use crate::layout::{BucketLayout, BucketSpec, ALIGN_BYTES};
use crate::plane::{DataSizes, Plane};
use crate::protocol::compress::QuantCopy;
use crate::region::{Endpoint, HeapBlock, LocalRegion, RegionDesc};
use crate::store::{wait_get_all, Store};
use crate::sync::{AtomicBool, AtomicU64};
use crate::topology::Topology;
use crate::{Error, Result};

/// Region id of the control region (control words and landing slots).
pub(crate) const CTRL_REGION: u32 = 0;
/// Region id of the published parameter shards.
pub(crate) const PARAMS_REGION: u32 = 1;
/// Region id of the gradient accumulators, published only under hybrid
/// sharding across nodes (the other nodes read the partial sums).
pub(crate) const ACCUM_REGION: u32 = 2;
/// Region id of this rank's share of the node cache (full sharding across
/// nodes; node-mates map it).
pub(crate) const CACHE_REGION: u32 = 3;

/// What every rank agreed on: the buckets, their names, the control layout
/// and where each bucket sits in the data regions.
pub(crate) struct Plan {
    groups: Groups,
    buckets: Vec<BucketLayout>,
    names: HashMap<String, usize>,
    ctrl_layout: CtrlLayout,
    params_off: Vec<usize>,
    accum_off: Vec<usize>,
    accum_len: usize,
    /// Element offset of each bucket's final gradient in the cross-node sum
    /// (its piece under hybrid-zero, its shard under hybrid).
    grad_off: Vec<usize>,
    /// Elements of the cross-node sum (0 unless across nodes).
    reduced_len: usize,
    /// Host bytes of published shards (0 on a device transport).
    host_params_len: usize,
    /// Bytes of the accumulator region the replicas read (hybrid across
    /// nodes on a host transport), else 0.
    accum_region: usize,
    /// Deterministic hybrid across nodes: the byte offset of the exact
    /// accumulators in that region (the replicas read them too).
    exact_off: Option<usize>,
    /// The node cache, where there is one.
    cache: Option<CacheLayout>,
    /// How gradients for owners on other nodes cross (resolved).
    cross_node: CrossNode,
    /// Node announces ([`NodeVersions`]): node sums over `shm+fabric`.
    node_announce: bool,
    /// Compressed gathers: each bucket's quantised copy and its byte
    /// offset in the params region, when some gather reads them.
    quant: Option<(Vec<QuantCopy>, Vec<usize>)>,
    /// A device engine's compressed pushes: their buffers past the landing
    /// slots.
    device_pack: Option<super::DevicePack>,
    /// A device engine's compressed gathers: staging and scratch after the
    /// quantised copies in its params region.
    device_quant: Option<super::DeviceQuant>,
    /// Bytes of a device engine's params region (shards, copies, their
    /// staging).
    plane_params_len: usize,
    /// Compressed cross-node sums (hybrid across nodes with a push format):
    /// each bucket block's quantised copy and its byte offset in the
    /// accumulator region (`QuantSums`).
    qsum: Option<(Vec<QuantCopy>, Vec<usize>)>,
}

impl Plan {
    /// Bytes of a replica's accumulator region this rank reads: the
    /// accumulators, and the quantised partial sums after them.
    fn accum_read_len(&self) -> usize {
        match self.qsum {
            Some(_) => self.accum_region,
            None => self.accum_len * 4,
        }
    }
}

/// This rank's regions.
pub(crate) struct Regions {
    ctrl: LocalRegion,
    params: LocalRegion,
    cache: Option<LocalRegion>,
    accum: Accum,
    reduced: HeapBlock,
    exact: Option<Exact>,
}

/// What the exchange learned about every peer, indexed by global rank.
pub(crate) struct Peers {
    ctrl: Vec<RegionDesc>,
    params: Vec<RegionDesc>,
    accum: Vec<Option<RegionDesc>>,
    pid: Vec<u32>,
    /// Node-mates' cache regions, by local rank (empty without a cache).
    cache: Vec<RegionDesc>,
}

impl Peers {
    /// A rank of a node outside this elastic generation: never reached
    /// (no rank talks to it), its descriptors empty.
    fn push_absent(&mut self) {
        let none = RegionDesc {
            owner: u32::MAX,
            id: u32::MAX,
            len: 0,
            key: 0,
        };
        self.ctrl.push(none);
        self.params.push(none);
        self.accum.push(None);
        self.pid.push(0);
    }
}

/// Registers `specs` on `core` (see the module doc); on success the
/// registered state is in `core.reg`.
pub(crate) fn register(core: &Core, specs: &[BucketSpec]) -> Result<()> {
    if core.reg.get().is_some() {
        return Err(Error::protocol(None, "register called twice"));
    }
    let deadline = core.config.register_deadline();
    let plan = agree(core, specs, deadline)?;
    let regions = allocate(core, &plan)?;
    // Before any peer can announce a version here (its publish follows its
    // own registration, which waits for this rank's region descriptors).
    if plan.node_announce
        && !core
            .transport
            .wake_node_on(&regions.ctrl, plan.ctrl_layout.seen_versions())
    {
        return Err(Error::transport(
            "register",
            format!(
                "the {} transport cannot wake a node for its versions",
                core.transport.name()
            ),
        ));
    }
    let peers = connect(core, &plan, &regions, deadline)?;
    let plane = connect_plane(core, specs, &plan, deadline)?;
    let cache = node_cache(core, &plan, &peers, plane.as_deref())?.map(Arc::new);
    let (done_early, done_late) = done_targets(core, &plan, &peers);
    let (announce_to, node_versions) = node_announce(core, &plan, &peers)?;
    let sums = node_sums(core, &plan, plane.as_deref())?;
    let nb_blocks = plan.groups.blocks;
    let nb = plan.buckets.len();
    let world_group = plan.groups.group.len();
    let group_ctrl = plan
        .groups
        .group
        .iter()
        .map(|&r| (r, peers.ctrl[r]))
        .collect();
    let reg = Registered {
        groups: plan.groups,
        buckets: plan.buckets,
        names: plan.names,
        ctrl_layout: plan.ctrl_layout,
        params_off: plan.params_off,
        accum_off: plan.accum_off,
        grad_off: plan.grad_off,
        ctrl: regions.ctrl,
        params: regions.params,
        accum: regions.accum,
        reduced: regions.reduced,
        exact: regions.exact,
        accum_len: plan.accum_len,
        peer_accum: peers.accum,
        peer_ctrl: peers.ctrl,
        group_ctrl,
        peer_params: peers.params,
        peer_pid: peers.pid,
        plane,
        released: (0..nb).map(|_| AtomicU64::new(0)).collect(),
        finished: AtomicU64::new(0),
        open: (0..nb).map(|_| AtomicU64::new(0)).collect(),
        partials_out: AtomicU64::new(0),
        steal_seq: (0..world_group).map(|_| AtomicU64::new(0)).collect(),
        cache,
        _cache_region: regions.cache,
        cross_node: plan.cross_node,
        sums,
        done_early,
        done_late,
        announce_to,
        node_versions,
        device_pack: plan.device_pack,
        device_quant: plan.device_quant,
        quant: plan.quant.map(|(copies, off)| Quant {
            copies,
            off,
            staging: std::sync::Mutex::new(Vec::new()),
        }),
        read_across: AtomicU64::new(0),
        qsum: plan.qsum.map(|(copies, off)| QuantSums {
            copies,
            off,
            blocks: nb_blocks,
            state: std::sync::Mutex::new(QuantSumState {
                feedback: (core.config.compress)
                    .filter(|c| c.feedback)
                    .and_then(|c| c.push)
                    .map(odc_kernels::cpu::quant::ErrorFeedback::new),
                folded: vec![false; nb],
                quantised: 0,
            }),
        }),
        summed_across: AtomicU64::new(0),
    };
    core.reg
        .set(reg)
        .map_err(|_| Error::protocol(None, "register called twice"))
}

/// Step 1: lays the buckets out, posts this rank's bucket list and settings,
/// and compares every rank's with it; a mismatch names the first differing
/// bucket. Also checks that `/dev/shm` has room for every rank of this host
/// before any rank allocates.
fn agree(core: &Core, specs: &[BucketSpec], deadline: Instant) -> Result<Plan> {
    let rank = core.topo.rank();
    let prefix = &core.config.store_prefix;
    let groups = Groups::new(&core.topo, core.config.sharding);
    let mut buckets = Vec::with_capacity(specs.len());
    let mut names = HashMap::new();
    for (i, s) in specs.iter().enumerate() {
        if names.insert(s.name.clone(), i).is_some() {
            return Err(Error::layout(Some(&s.name), "bucket name registered twice"));
        }
        buckets.push(BucketLayout::blocked(
            s.clone(),
            groups.group.len(),
            groups.blocks,
        )?);
    }
    if buckets.is_empty() {
        return Err(Error::layout(None, "register needs at least one bucket"));
    }
    let ctrl_layout = control_layout(&groups, buckets.len(), &core.config)?;
    let (params_off, accum_off, params_len, accum_len) = offsets(&buckets);
    let on_device = core.device.is_some();
    let quant =
        quant_copies(&core.config, &core.topo, &groups, &buckets, &ctrl_layout).map(|copies| {
            let (off, end) = lay_out(&copies, params_len);
            (copies, off, end - params_len)
        });
    // A device engine keeps its gathers' staging after the copies.
    let device_quant = (quant.as_ref())
        .filter(|_| on_device)
        .map(|(copies, _, bytes)| {
            super::DeviceQuant::lay_out(copies, params_len + bytes, groups.group.len())
        });
    if let (Some(_), Some(b)) = (
        &device_quant,
        buckets
            .iter()
            .find(|b| b.dtype() == odc_kernels::DType::F16),
    ) {
        return Err(Error::layout(
            Some(b.name()),
            "compress gather on a device engine takes f32 and bf16 buckets (the device \
             dequantises into those), not f16; leave gather unset or register it as bf16",
        ));
    }
    // Hybrid across nodes on a host transport: the replicas read each
    // other's accumulators (and their quantised copies, with a push format).
    let across = groups.replicas.len() > 1 && !on_device;
    let sum_spec =
        crate::protocol::compress::sum_spec(core.config.compress.as_ref()).filter(|_| across);
    let cache = cache_layout(
        &core.config,
        &core.topo,
        (core.transport.name(), core.device.is_some()),
        &buckets,
        (
            ctrl_layout.chunk_bytes(),
            quant.as_ref().map(|(c, _, _)| &c[..]),
        ),
    )?;
    let cross_node = cross_node(
        &core.config,
        &core.topo,
        (core.transport.name(), core.device.is_some()),
    )?;
    let device_pack = on_device
        .then(|| {
            super::DevicePack::plan(
                core.config.compress.as_ref(),
                &ctrl_layout,
                (groups.me, &groups.group),
                (&core.topo, cross_node == CrossNode::Node),
                accum_len,
            )
        })
        .flatten();
    // The announce rule must be the same on every rank (an owner tells one
    // rank per other node only where that node's ranks read it there).
    let node_announce = cross_node == CrossNode::Node && core.transport.name() == "shm+fabric";
    let mut post = RegPost {
        hash: 0,
        chunk_bytes: ctrl_layout.chunk_bytes(),
        sharding: core.config.sharding.name().into(),
        local_world: core.topo.local_world(),
        node_cache: cache.as_ref().map_or(0, CacheLayout::bytes),
        cross_node: cross_node.name().into(),
        node_announce,
        gather: (quant.as_ref()).map_or_else(String::new, |(c, _, _)| {
            c.first().map_or_else(String::new, |q| q.spec.to_string())
        }),
        sum: sum_spec.map_or_else(String::new, |s| s.to_string()),
        accum: if core.config.deterministic {
            format!("{} (deterministic)", core.config.accum_dtype.name())
        } else {
            core.config.accum_dtype.name().into()
        },
        specs: specs
            .iter()
            .map(|s| (s.name.clone(), s.numel, s.dtype.name().to_owned()))
            .collect(),
    };
    post.hash = fnv1a(&json("reg", &post.specs)?);
    let my_key = format!("{prefix}/reg/{rank}");
    if on_device && groups.blocks > 1 {
        return Err(Error::Config(format!(
            "sharding \"hybrid-zero\" runs on the host transports (shm, fabric, auto); the {} \
             transport keeps buckets in device memory",
            core.transport.name()
        )));
    }
    let grad_off: Vec<usize> = buckets
        .iter()
        .scan(0, |at, b| {
            let off = *at;
            *at += b.block_len();
            Some(off)
        })
        .collect();
    let reduced_len = if groups.replicas.len() > 1 {
        buckets.iter().map(BucketLayout::block_len).sum()
    } else {
        0
    };
    let host_params_len = match (on_device, &quant) {
        (true, _) => 0,
        (false, Some((_, _, bytes))) => params_len + bytes,
        (false, None) => params_len,
    };
    let exact_off =
        (across && core.config.deterministic).then(|| (accum_len * 4).next_multiple_of(64));
    let accum_region = match (across, exact_off) {
        (false, _) => 0,
        (true, None) => accum_len * 4,
        // Saturating: a size beyond memory fails the room check or the
        // allocation, which posts the failure for the peers.
        (true, Some(off)) => accum_len
            .saturating_mul(odc_kernels::cpu::exact::BYTES_PER_ELEMENT)
            .saturating_add(off),
    };
    // Compressed cross-node sums: the quantised copies (one per bucket and
    // block) follow.
    let qsum = sum_spec.map(|spec| {
        let copies: Vec<QuantCopy> = (buckets.iter())
            .flat_map(|b| std::iter::repeat_n(b.block_len(), groups.blocks))
            .map(|len| QuantCopy::new(spec, ctrl_layout.chunk_bytes(), len))
            .collect();
        let (off, end) = lay_out(&copies, accum_region.next_multiple_of(ALIGN_BYTES));
        (copies, off, end)
    });
    let accum_region = qsum.as_ref().map_or(accum_region, |(_, _, end)| *end);
    if let Err(e) = check_shm_room(
        core.transport.name(),
        &core.topo,
        [
            ctrl_layout.len(),
            host_params_len,
            accum_region,
            cache.as_ref().map_or(0, CacheLayout::region_len),
        ],
    ) {
        post_failure(core.store.as_ref(), &my_key, &e);
        return Err(e);
    }
    core.store.set(&my_key, &json(&my_key, &post)?)?;
    for (peer, key, v) in read_posts(core, "reg", deadline)? {
        compare(&post, &parse_reg_post(&key, peer, &v)?, peer)?;
    }
    Ok(Plan {
        groups,
        buckets,
        names,
        ctrl_layout,
        params_off,
        accum_off,
        accum_len,
        grad_off,
        reduced_len,
        host_params_len,
        accum_region,
        exact_off,
        cache,
        cross_node,
        node_announce,
        quant: quant.map(|(copies, off, _)| (copies, off)),
        plane_params_len: device_quant.as_ref().map_or(params_len, |(_, end)| *end),
        device_quant: device_quant.map(|(layout, _)| layout),
        device_pack,
        qsum: qsum.map(|(copies, off, _)| (copies, off)),
    })
}

/// Where each of `copies` starts when they are laid out back to back from
/// byte `start`, each at a multiple of [`ALIGN_BYTES`] (the same on every
/// rank), and where the last one ends.
fn lay_out(copies: &[QuantCopy], start: usize) -> (Vec<usize>, usize) {
    let mut at = start;
    let off = (copies.iter())
        .map(|q| {
            let o = at;
            at = at.saturating_add(q.len().next_multiple_of(ALIGN_BYTES));
            o
        })
        .collect();
    (off, at)
}

/// The quantised copies of every bucket's shard that compressed gathers
/// read ([`crate::protocol::compress`]), cut into runs that fit the landing
/// chunk (a node cache piece is one run); `None` where no gather reads
/// one: no gather format, or no other rank of the shard group that a read
/// of the scope compresses (scope cross-node with the whole group on this
/// node: hybrid sharding, one node). Under hybrid-zero across nodes with
/// scope cross-node, the copies of this rank's piece of each bucket, which
/// the other nodes' replicas copy into their node shards at each publish
/// (the only parameter bytes that cross there).
fn quant_copies(
    config: &EngineConfig,
    topo: &Topology,
    groups: &Groups,
    buckets: &[BucketLayout],
    ctrl: &CtrlLayout,
) -> Option<Vec<QuantCopy>> {
    let c = config.compress.as_ref()?;
    let spec = c.gather?;
    if groups.blocks > 1 {
        let across = groups.replicas.len() > 1;
        return (across && c.scope == crate::protocol::compress::Scope::CrossNode).then(|| {
            (buckets.iter())
                .map(|b| QuantCopy::new(spec, ctrl.chunk_bytes(), b.block_len()))
                .collect()
        });
    }
    let me = topo.rank();
    let read = (groups.group.iter()).any(|&r| {
        crate::protocol::compress::gather_spec(Some(c), r == me, topo.is_local(r)).is_some()
    });
    read.then(|| {
        (buckets.iter())
            .map(|b| QuantCopy::new(spec, ctrl.chunk_bytes(), b.shard_len()))
            .collect()
    })
}

/// The node cache this rank's node keeps, if any: under full sharding over
/// several nodes, on a host transport (named `transport`) that maps
/// node-mates' memory, with the bound of [`EngineConfig::node_cache`] (by
/// default only where the nodes are joined by a network), pieces of at
/// most the landing chunk. On a device transport (`device`: the nodes are
/// joined by NVSHMEM) the slots are device memory and the cache needs room
/// for every remote shard: a copy on a stream cannot be checked against
/// an eviction after it ran, as a host copy is (`protocol::cache`), so
/// nothing may be evicted. Within the bound it is kept; beyond it an
/// explicit bound is an error naming the bytes needed, the default keeps
/// no cache.
fn cache_layout(
    config: &EngineConfig,
    topo: &Topology,
    (transport, device): (&str, bool),
    buckets: &[BucketLayout],
    (piece, quant): (usize, Option<&[QuantCopy]>),
) -> Result<Option<CacheLayout>> {
    if config.sharding != Sharding::Full || topo.nodes() < 2 {
        return Ok(None);
    }
    let world = (topo.world(), topo.local_world());
    if !device {
        let bound = match (config.node_cache, transport) {
            (Some(bound), "shm" | "shm+fabric") => bound,
            (None, "shm+fabric") => DEFAULT_NODE_CACHE,
            _ => return Ok(None),
        };
        return Ok(CacheLayout::new(
            buckets,
            world,
            (piece, quant),
            bound,
            false,
        ));
    }
    let bound = config.node_cache.unwrap_or(DEFAULT_NODE_CACHE);
    if bound == 0 {
        return Ok(None);
    }
    let Some(full) = CacheLayout::new(buckets, world, (piece, quant), usize::MAX, true) else {
        return Ok(None);
    };
    if full.direct() && full.bytes() <= bound {
        return Ok(Some(full));
    }
    match config.node_cache {
        None => Ok(None),
        Some(_) => Err(Error::Config(format!(
            "node_cache={bound} bytes per node, but on a device transport the node cache keeps \
             every remote shard ({} bytes per node{}; nothing is evicted there): set node_cache \
             to at least that (ODC_NODE_CACHE_MB={}) or to 0",
            full.full_bytes(),
            if full.direct() {
                ""
            } else {
                ", more pieces than a node cache numbers"
            },
            full.full_bytes().div_ceil(1 << 20),
        ))),
    }
}

/// The control region's layout for `buckets` buckets over `groups`, its
/// landing chunk fitted to the budget.
fn control_layout(groups: &Groups, buckets: usize, config: &EngineConfig) -> Result<CtrlLayout> {
    Ok(CtrlLayout::new(
        groups.group.len(),
        groups.replicas.len(),
        buckets,
        landing_chunk(
            config.chunk_bytes,
            groups.group.len(),
            config.landing_budget,
        )?,
    ))
}

/// Whether `theirs` (rank `peer`'s post) registers what `ours` does.
pub(crate) fn compare(ours: &RegPost, theirs: &RegPost, peer: usize) -> Result<()> {
    if theirs.hash != ours.hash || theirs.specs != ours.specs {
        let n = ours.specs.len().max(theirs.specs.len());
        let show = |l: &[(String, usize, String)], i: usize| {
            l.get(i).map_or("<none>".to_owned(), |(a, b, c)| {
                format!("{a} numel={b} dtype={c}")
            })
        };
        let i = (0..n)
            .find(|&i| ours.specs.get(i) != theirs.specs.get(i))
            .unwrap_or(0);
        return Err(Error::Registration {
            peer,
            first_differing_bucket: i,
            ours: show(&ours.specs, i),
            theirs: show(&theirs.specs, i),
        });
    }
    if theirs.sharding != ours.sharding || theirs.local_world != ours.local_world {
        return Err(Error::Config(format!(
            "rank {peer} uses {} sharding with {} ranks per node, this rank {} sharding with {}",
            theirs.sharding, theirs.local_world, ours.sharding, ours.local_world
        )));
    }
    if theirs.cross_node != ours.cross_node {
        return Err(Error::Config(format!(
            "rank {peer} runs cross_node={:?}, this rank {:?} (ODC_CROSS_NODE, cross_node: set \
             it alike on every rank)",
            theirs.cross_node, ours.cross_node
        )));
    }
    if theirs.node_announce != ours.node_announce {
        return Err(Error::Config(format!(
            "rank {peer} {} versions once per node, this rank {} (every rank must reach its \
             node-mates through shared memory and the other nodes over libfabric: \
             transport=\"auto\" or \"mixed\" on every rank)",
            if theirs.node_announce {
                "announces"
            } else {
                "does not announce"
            },
            if ours.node_announce {
                "does"
            } else {
                "does not"
            }
        )));
    }
    if theirs.gather != ours.gather {
        let name = |g: &str| match g {
            "" => "no quantised copies".to_owned(),
            g => format!("quantised copies in {g}"),
        };
        return Err(Error::Config(format!(
            "rank {peer} gathers from {}, this rank from {} (compress gather, block and scope: \
             set them alike on every rank)",
            name(&theirs.gather),
            name(&ours.gather)
        )));
    }
    if theirs.sum != ours.sum {
        let name = |g: &str| match g {
            "" => "f32".to_owned(),
            g => format!("{g} (quantised)"),
        };
        return Err(Error::Config(format!(
            "rank {peer} sums across nodes in {}, this rank in {} (compress push and block: set \
             them alike on every rank)",
            name(&theirs.sum),
            name(&ours.sum)
        )));
    }
    if theirs.node_cache != ours.node_cache {
        return Err(Error::Config(format!(
            "rank {peer} keeps a node cache of {} bytes, this rank {} (ODC_NODE_CACHE_MB, \
             node_cache: set it alike on every rank)",
            theirs.node_cache, ours.node_cache
        )));
    }
    if theirs.chunk_bytes != ours.chunk_bytes || theirs.accum != ours.accum {
        return Err(Error::Config(format!(
            "rank {peer} uses chunk_bytes {} / accumulation {}, this rank {} / {}",
            theirs.chunk_bytes, theirs.accum, ours.chunk_bytes, ours.accum
        )));
    }
    Ok(())
}

/// Step 2: allocates the control region, the published shards and the
/// accumulators (a device engine keeps only its control words in host
/// memory). A failure is posted where the peers wait for this rank's
/// endpoint.
fn allocate(core: &Core, plan: &Plan) -> Result<Regions> {
    let allocated = (|| -> Result<Regions> {
        let ctrl = core
            .transport
            .register(CTRL_REGION, plan.ctrl_layout.len())?;
        let params = core
            .transport
            .register(PARAMS_REGION, plan.host_params_len)?;
        let (accum, reduced) = if core.device.is_some() {
            (Accum::Heap(HeapBlock::zeroed(0)?), HeapBlock::zeroed(0)?)
        } else if plan.accum_region > 0 {
            (
                Accum::Region(core.transport.register(ACCUM_REGION, plan.accum_region)?),
                HeapBlock::zeroed(plan.reduced_len * 4)?,
            )
        } else {
            (
                Accum::Heap(HeapBlock::zeroed(plan.accum_len * 4)?),
                HeapBlock::zeroed(0)?,
            )
        };
        let exact = if core.config.deterministic {
            let block = match plan.exact_off {
                Some(_) => None, // in the accumulator region
                None => {
                    let bytes = plan
                        .accum_len
                        .checked_mul(odc_kernels::cpu::exact::BYTES_PER_ELEMENT)
                        .ok_or_else(|| Error::Config("exact accumulator size overflows".into()))?;
                    Some(HeapBlock::zeroed(bytes)?)
                }
            };
            Some(Exact {
                block,
                region_off: plan.exact_off.unwrap_or(0),
                touched: (0..plan.buckets.len())
                    .map(|_| AtomicBool::new(false))
                    .collect(),
            })
        } else {
            None
        };
        let cache = match &plan.cache {
            Some(l) => Some(core.transport.register(CACHE_REGION, l.region_len())?),
            None => None,
        };
        Ok(Regions {
            ctrl,
            params,
            cache,
            accum,
            reduced,
            exact,
        })
    })();
    allocated.inspect_err(|e| {
        let key = format!("{}/ep/{}", core.config.store_prefix, core.topo.rank());
        post_failure(core.store.as_ref(), &key, e);
    })
}

/// Step 3: posts this rank's endpoint and region descriptors, reads every
/// peer's, checks them and connects to every rank this one talks to (this
/// one too): its shard group and its replicas, i.e. every rank under full
/// sharding, and under hybrid sharding its node and its column (G + N − 1
/// ranks of D = G · N, so that mappings, descriptors and prefaulted pages
/// grow with the node size and the node count, not with D). Then the one
/// barrier, at setup only: every rank has mapped every segment before
/// anyone may drop (and unlink) its own.
fn connect(core: &Core, plan: &Plan, regions: &Regions, deadline: Instant) -> Result<Peers> {
    let (rank, world) = (core.topo.rank(), core.topo.world());
    let prefix = &core.config.store_prefix;
    let my_key = format!("{prefix}/ep/{rank}");
    let mut descs = vec![regions.ctrl.desc(), regions.params.desc()];
    if let Accum::Region(r) = &regions.accum {
        descs.push(r.desc());
    }
    if let Some(r) = &regions.cache {
        descs.push(r.desc());
    }
    let ep = EndpointPost {
        endpoint: core.transport.endpoint(),
        regions: descs,
    };
    core.store.set(&my_key, &json(&my_key, &ep)?)?;
    let my_host = ep.endpoint.host.clone();
    let mut partner = vec![false; world];
    for &r in plan.groups.group.iter().chain(&plan.groups.replicas) {
        partner[r] = true;
    }
    let mut peers = Peers {
        ctrl: Vec::with_capacity(world),
        params: Vec::with_capacity(world),
        accum: Vec::with_capacity(world),
        pid: Vec::with_capacity(world),
        cache: Vec::new(),
    };
    for (peer, key, v) in read_posts(core, "ep", deadline)? {
        // A node outside this elastic generation: nothing to reach.
        while peers.ctrl.len() < peer {
            peers.push_absent();
        }
        let want = RegionSizes {
            ctrl: plan.ctrl_layout.len(),
            params: plan.host_params_len,
            accum: (plan.accum_region > 0 && plan.groups.replicas.contains(&peer))
                .then(|| plan.accum_read_len()),
        };
        let (theirs, [c, p], a) = check_endpoint(&key, peer, &v, &want)?;
        if core.transport.name() == "shm" && theirs.endpoint.host != my_host {
            return Err(Error::Config(format!(
                "rank {peer} runs on host {:?}, this rank on {my_host:?}: the shm transport \
                 reaches only ranks on this host (use transport \"auto\" or \"fabric\")",
                theirs.endpoint.host
            )));
        }
        if let Some(l) = &plan.cache {
            if core.topo.is_local(peer) {
                let want = l.region_len() as u64;
                let cache = theirs
                    .regions
                    .iter()
                    .copied()
                    .find(|r| r.id == CACHE_REGION)
                    .ok_or_else(|| {
                        Error::Config(format!(
                            "rank {peer}, on this node, registered no node cache; this rank one of \
                             {want} bytes (ODC_NODE_CACHE_MB differs between them?)"
                        ))
                    })?;
                if cache.len < want {
                    return Err(Error::Config(format!(
                        "rank {peer} registered a node cache of {} bytes, this rank {want}: a \
                         different layout",
                        cache.len
                    )));
                }
                peers.cache.push(cache);
            }
        }
        if partner[peer] {
            core.transport
                .connect(peer, &theirs.endpoint, &theirs.regions)?;
            prefault(core, plan, peer, c, p, a)?;
        }
        peers.ctrl.push(c);
        peers.params.push(p);
        peers.pid.push(theirs.endpoint.pid);
        peers.accum.push(a);
    }
    while peers.ctrl.len() < world {
        peers.push_absent();
    }
    let my_key = format!("{prefix}/connected/{rank}");
    core.store.set(&my_key, b"1")?;
    let keys: Vec<String> = (0..world)
        .filter(|&p| core.takes_part(p))
        .map(|p| format!("{prefix}/connected/{p}"))
        .collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    core.store.wait(&keys, deadline)?;
    Ok(peers)
}

/// The bytes this rank touches of a peer's regions: what it registered
/// itself (every rank registers the same layout).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RegionSizes {
    /// The control region.
    pub(crate) ctrl: usize,
    /// The published shards.
    pub(crate) params: usize,
    /// The accumulators, when this rank reads the peer's (a replica under
    /// hybrid sharding across nodes).
    pub(crate) accum: Option<usize>,
}

/// Rank `peer`'s endpoint post `v` (the value of `key`), or the failure it
/// posted instead, checked: the endpoint is rank `peer`'s, every region
/// descriptor is owned by it and names its id once, and the control
/// region, the published shards and (when `want` asks for them) the
/// accumulators are there and at least as large as this rank's. Returns
/// the post and those descriptors.
pub(crate) fn check_endpoint(
    key: &str,
    peer: usize,
    v: &[u8],
    want: &RegionSizes,
) -> Result<(EndpointPost, [RegionDesc; 2], Option<RegionDesc>)> {
    const WHAT: &str = "endpoint post";
    let theirs: EndpointPost = parse_post(key, peer, v)?;
    if theirs.endpoint.rank != peer {
        return Err(Error::malformed(
            peer,
            WHAT,
            "rank",
            format!("{} in {key}, expected {peer}", theirs.endpoint.rank),
        ));
    }
    for (i, d) in theirs.regions.iter().enumerate() {
        if usize::try_from(d.owner).ok() != Some(peer) {
            return Err(Error::malformed(
                peer,
                WHAT,
                "owner",
                format!("of region {} is rank {}", d.id, d.owner),
            ));
        }
        if theirs.regions[..i].iter().any(|e| e.id == d.id) {
            return Err(Error::malformed(
                peer,
                WHAT,
                "id",
                format!("{} is published twice", d.id),
            ));
        }
    }
    let find = |id: u32, what: &str, len: usize| {
        let d = theirs
            .regions
            .iter()
            .copied()
            .find(|r| r.id == id)
            .ok_or_else(|| Error::Store {
                op: "get",
                key: key.to_owned(),
                detail: format!("rank {peer} published no region {id}"),
            })?;
        if d.len < len as u64 {
            return Err(Error::Config(format!(
                "rank {peer} registered {what} of {} bytes, this rank {len}: a different layout",
                d.len
            )));
        }
        Ok(d)
    };
    let c = find(CTRL_REGION, "a control region", want.ctrl)?;
    let p = find(PARAMS_REGION, "published shards", want.params)?;
    let a = match want.accum {
        Some(len) => Some(find(ACCUM_REGION, "accumulators", len)?),
        None => None,
    };
    Ok((theirs, [c, p], a))
}

/// Rank `peer`'s registration post `v` (the value of `key`), or the
/// failure it posted instead; [`compare`] checks it against this rank's.
pub(crate) fn parse_reg_post(key: &str, peer: usize, v: &[u8]) -> Result<RegPost> {
    parse_post(key, peer, v)
}

/// Maps ahead what this rank touches of `peer`'s regions (a peer it
/// connects to: in its shard group or a replica): its own two landing
/// slots in the peer's control region (when the peer is in its shard
/// group), and the published shards and partial sums it reads. The
/// control words are left to fault in on first use: a handful of pages,
/// once. Populating the whole control region instead (as the `shm`
/// transport once did) gave every rank `G` peers × `2 · G` chunks of page
/// tables and made registration quadratic in the group size.
fn prefault(
    core: &Core,
    plan: &Plan,
    peer: usize,
    ctrl: RegionDesc,
    params: RegionDesc,
    accum: Option<RegionDesc>,
) -> Result<()> {
    let (t, g) = (&core.transport, &plan.groups);
    if g.group.contains(&peer) {
        let l = &plan.ctrl_layout;
        let slots = l.slot_header(g.me, 0)..l.slot_data(g.me, 1) + l.chunk_bytes();
        t.prefault(peer, &ctrl, slots, true)?;
    }
    t.prefault(peer, &params, 0..plan.host_params_len, false)?;
    if let Some(a) = accum {
        t.prefault(peer, &a, 0..plan.accum_read_len(), false)?;
    }
    Ok(())
}

/// Where this rank's `done` goes at once and where only after its node
/// sums. Without node aggregation: everywhere at once. With it: its node at
/// once, its replicas after the sums
/// ([`crate::protocol::nodesum::done_after_sums`]), nowhere else (the
/// other remote ranks' reads are released by their aggregators' done:
/// [`crate::protocol::nodesum::releaser`]).
type Targets = Arc<[(usize, RegionDesc)]>;

fn done_targets(core: &Core, plan: &Plan, peers: &Peers) -> (Targets, Targets) {
    let topo = &core.topo;
    let (me, local) = (topo.rank(), topo.local_world());
    let all = plan.groups.group.iter().map(|&r| (r, peers.ctrl[r]));
    if plan.cross_node != CrossNode::Node {
        return (all.collect(), Arc::from([]));
    }
    let late = |r: usize| crate::protocol::nodesum::done_after_sums(me, r, local);
    (
        all.clone().filter(|&(r, _)| topo.is_local(r)).collect(),
        all.filter(|&(r, _)| late(r)).collect(),
    )
}

/// Node aggregation's node buffers, zeroed (see `NodeSums`): host memory,
/// or on a device engine the plane's accumulator region after the
/// accumulators (zeroed at its allocation, [`node_sum_bytes`]).
fn node_sums(core: &Core, plan: &Plan, plane: Option<&dyn Plane>) -> Result<Option<NodeSums>> {
    if plan.cross_node != CrossNode::Node {
        return Ok(None);
    }
    let topo = &core.topo;
    let nodes = topo.nodes();
    let bytes = node_sum_bytes(nodes, plan.accum_len)?;
    Ok(Some(NodeSums {
        block: HeapBlock::zeroed(if plane.is_some() { 0 } else { bytes })?,
        device: plane.map(|p| p.accum() + (plan.accum_len * 4) as u64),
        touched: (0..(nodes - 1) * plan.buckets.len())
            .map(|_| AtomicBool::new(false))
            .collect(),
        open: AtomicU64::new(0),
        local: topo.local_world(),
        node: topo.node_of(topo.rank()),
        nodes,
        accum_len: plan.accum_len,
        buckets: plan.buckets.len(),
    }))
}

/// The node cache over the node-mates' regions, as this process maps them.
/// Where this process maps each node-mate's region of `descs` (by local
/// rank), named `what` in the error when the transport does not map one.
fn node_bases(core: &Core, descs: &[RegionDesc], what: &str) -> Result<Vec<NonNull<u8>>> {
    let topo = &core.topo;
    let node_start = topo.node_of(topo.rank()) * topo.local_world();
    (descs.iter().enumerate())
        .map(|(q, desc)| {
            core.transport.mapped(node_start + q, desc).ok_or_else(|| {
                Error::transport(
                    "register",
                    format!(
                        "the {} transport does not map rank {}'s {what}",
                        core.transport.name(),
                        node_start + q
                    ),
                )
            })
        })
        .collect()
}

/// Where a publish announces its version and, under node announces, where
/// this rank reads remote owners' versions ([`NodeVersions`]): every
/// shard-group rank and nothing, or this rank's node and its replicas on
/// the other nodes, and its node-mates' control regions.
fn node_announce(
    core: &Core,
    plan: &Plan,
    peers: &Peers,
) -> Result<(Targets, Option<NodeVersions>)> {
    let all = plan.groups.group.iter().map(|&r| (r, peers.ctrl[r]));
    if !plan.node_announce {
        return Ok((all.collect(), None));
    }
    let topo = &core.topo;
    let (me, local) = (topo.rank(), topo.local_world());
    let node_start = topo.node_of(me) * local;
    let bases = node_bases(
        core,
        &peers.ctrl[node_start..node_start + local],
        "control region",
    )?;
    let to = all
        .filter(|&(r, _)| topo.is_local(r) || r % local == me % local)
        .collect();
    // SAFETY: the transport keeps every connected peer's mapping (and its
    // own regions) for its lifetime, which is the engine's; node-mates'
    // control regions share this rank's layout (the plan is agreed).
    Ok((to, Some(unsafe { NodeVersions::new(bases, me, local) })))
}

fn node_cache(
    core: &Core,
    plan: &Plan,
    peers: &Peers,
    plane: Option<&dyn Plane>,
) -> Result<Option<NodeCache>> {
    let Some(layout) = &plan.cache else {
        return Ok(None);
    };
    let topo = &core.topo;
    let node_start = topo.node_of(topo.rank()) * topo.local_world();
    let bases = node_bases(core, &peers.cache, "node cache")?;
    // A device layout's slots: each node-mate's share of the plane.
    let data = match (layout.device, plane) {
        (true, Some(plane)) => Some(
            (node_start..node_start + topo.local_world())
                .map(|r| plane.node_cache(r))
                .collect::<Result<Vec<u64>>>()?,
        ),
        (true, None) => {
            return Err(Error::protocol(
                None,
                "a device node cache without a device plane",
            ))
        }
        (false, _) => None,
    };
    let mates = (node_start..node_start + topo.local_world())
        .filter(|&r| r != topo.rank())
        .map(|r| (r, peers.ctrl[r]))
        .collect();
    // SAFETY: the transport keeps every connected peer's mapping (and its
    // own regions) for its lifetime, which is the engine's.
    Ok(Some(unsafe {
        NodeCache::new(
            layout.clone(),
            (bases, data),
            (topo.local_rank_of(topo.rank()), node_start),
            mates,
            Arc::clone(&core.transport),
        )
    }))
}

/// Step 4, device transports only: connects the data plane (published
/// shards, landing slots and accumulators in device memory).
fn connect_plane(
    core: &Core,
    specs: &[BucketSpec],
    plan: &Plan,
    deadline: Instant,
) -> Result<Option<Box<dyn Plane>>> {
    let Some(device) = &core.device else {
        return Ok(None);
    };
    let sums = match plan.cross_node {
        CrossNode::Node => node_sum_bytes(core.topo.nodes(), plan.accum_len)?,
        _ => 0,
    };
    let sizes = DataSizes {
        params: plan.plane_params_len,
        landing: plan.ctrl_layout.landing_len() + plan.device_pack.as_ref().map_or(0, |p| p.len),
        accum: plan.accum_len * 4 + sums,
        cache: plan.cache.as_ref().map_or(0, CacheLayout::data_len),
    };
    debug_assert_eq!(
        Some(sizes),
        data_sizes(specs, &core.topo, &core.config).ok()
    );
    let left = deadline.saturating_duration_since(Instant::now());
    Ok(Some(device.connect(
        core.store.as_ref(),
        &core.config.store_prefix,
        &core.config.job_key,
        core.topo.rank(),
        &plan.groups.group,
        sizes,
        left,
    )?))
}

/// The data regions an engine with `config` on `topology` allocates for
/// `specs` on a device transport: published shards, landing slots, f32
/// accumulators (the figures registration gives the plane).
pub(crate) fn data_sizes(
    specs: &[BucketSpec],
    topology: &Topology,
    config: &EngineConfig,
) -> Result<DataSizes> {
    let groups = Groups::new(topology, config.sharding);
    let buckets = specs
        .iter()
        .map(|s| BucketLayout::blocked(s.clone(), groups.group.len(), groups.blocks))
        .collect::<Result<Vec<_>>>()?;
    let (_, _, params, accum) = offsets(&buckets);
    let ctrl = control_layout(&groups, buckets.len(), config)?;
    let device = config.transport.is_device();
    let copies = quant_copies(config, topology, &groups, &buckets, &ctrl).filter(|_| device);
    let cache = match device {
        true => cache_layout(
            config,
            topology,
            ("", true),
            &buckets,
            (ctrl.chunk_bytes(), copies.as_deref()),
        )?,
        false => None,
    };
    let params = match &copies {
        Some(copies) => {
            let (_, end) = lay_out(copies, params);
            super::DeviceQuant::lay_out(copies, end, groups.group.len()).1
        }
        None => params,
    };
    let transport = crate::transport::control_name(config.transport, topology);
    let node_sums = cross_node(config, topology, (transport, device))? == CrossNode::Node;
    let sums = match node_sums {
        true => node_sum_bytes(topology.nodes(), accum)?,
        false => 0,
    };
    let pack = match device {
        true => super::DevicePack::plan(
            config.compress.as_ref(),
            &ctrl,
            (groups.me, &groups.group),
            (topology, node_sums),
            accum,
        ),
        false => None,
    };
    Ok(DataSizes {
        params,
        landing: ctrl.landing_len() + pack.map_or(0, |p| p.len),
        accum: accum * 4 + sums,
        cache: cache.as_ref().map_or(0, CacheLayout::data_len),
    })
}

/// What `config.cross_node` resolves to on `topo` over the control
/// transport named `transport` ([`CrossNode::resolve`]).
fn cross_node(
    config: &EngineConfig,
    topo: &Topology,
    (transport, device): (&str, bool),
) -> Result<CrossNode> {
    config
        .cross_node
        .resolve(
            config.sharding,
            (topo.nodes(), topo.local_world()),
            transport,
            device,
            config.deterministic,
        )
        .map_err(Error::Config)
}

/// Bytes of node aggregation's node buffers: one accumulator's worth per
/// other node.
fn node_sum_bytes(nodes: usize, accum_len: usize) -> Result<usize> {
    (nodes.saturating_sub(1))
        .checked_mul(accum_len)
        .and_then(|e| e.checked_mul(4))
        .ok_or_else(|| Error::Config("node buffer size overflows".into()))
}

/// A fresh random job id (rank 0 draws it; the others read it).
pub(crate) fn random_job_id() -> Result<String> {
    use std::io::Read;
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

#[derive(Serialize, Deserialize)]
pub(crate) struct RegPost {
    hash: u64,
    chunk_bytes: usize,
    sharding: String,
    local_world: usize,
    /// Bytes of node-cache slots per node (0: none).
    #[serde(default)]
    node_cache: usize,
    /// `"direct"` or `"node"` (resolved).
    #[serde(default)]
    cross_node: String,
    /// Whether versions are announced once per node ([`NodeVersions`]).
    #[serde(default)]
    node_announce: bool,
    /// The format of the quantised copies gathers read (empty: none).
    #[serde(default)]
    gather: String,
    /// The format of the cross-node sum's quantised partial sums (empty:
    /// f32).
    #[serde(default)]
    sum: String,
    accum: String,
    specs: Vec<(String, usize, String)>,
}

#[derive(Serialize, Deserialize)]
pub(crate) struct EndpointPost {
    pub(crate) endpoint: Endpoint,
    pub(crate) regions: Vec<RegionDesc>,
}

/// What a rank posts instead of its registration or endpoint when it
/// cannot register, so that its peers fail at once naming it.
#[derive(Serialize, Deserialize)]
struct FailedPost {
    failed: String,
}

fn post_failure(store: &dyn Store, key: &str, e: &Error) {
    let post = FailedPost {
        failed: e.to_string(),
    };
    if let Ok(bytes) = serde_json::to_vec(&post) {
        // Best effort: a store that fails here fails the peers' waits too.
        let _ = store.set(key, &bytes);
    }
}

/// Every rank's post under `keys` (one per rank, in rank order): one wait
/// and one batched read, not a round trip per rank.
fn read_posts(core: &Core, what: &str, deadline: Instant) -> Result<Vec<(usize, String, Vec<u8>)>> {
    let prefix = &core.config.store_prefix;
    let ranks: Vec<usize> = (0..core.topo.world())
        .filter(|&p| core.takes_part(p))
        .collect();
    let keys: Vec<String> = ranks
        .iter()
        .map(|p| format!("{prefix}/{what}/{p}"))
        .collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let posts = wait_get_all(core.store.as_ref(), &refs, deadline)?;
    Ok(ranks
        .into_iter()
        .zip(keys)
        .zip(posts)
        .map(|((p, k), v)| (p, k, v))
        .collect())
}

/// Parses `peer`'s post at `key`, or the failure it posted instead.
fn parse_post<T: for<'de> Deserialize<'de>>(key: &str, peer: usize, v: &[u8]) -> Result<T> {
    if let Ok(FailedPost { failed }) = serde_json::from_slice::<FailedPost>(v) {
        return Err(Error::transport(
            "register",
            format!("rank {peer} could not register its memory: {failed}"),
        ));
    }
    parse(key, v)
}

/// Whether `/dev/shm` has room for the regions (`lens`, in bytes) of every
/// rank of this host that shares it, on a transport that keeps them there
/// (`shm`: every rank of the job; `shm+fabric`: the ranks of the node).
fn check_shm_room(transport: &str, topo: &Topology, lens: [usize; 4]) -> Result<()> {
    let ranks = match transport {
        "shm" => topo.world(),
        "shm+fabric" => topo.local_world(),
        _ => return Ok(()),
    };
    let page = 4096;
    let per_rank: u64 = lens
        .iter()
        .filter(|&&l| l > 0)
        .map(|&l| l.max(64).div_ceil(page) as u64 * page as u64)
        .sum();
    let needed = per_rank.saturating_mul(ranks as u64);
    match crate::transport::shm::shm_free() {
        Some(free) if free < needed => Err(Error::ShmSpace {
            dir: crate::transport::shm::SHM_DIR.into(),
            needed,
            free,
            what: format!(
                "the {ranks} ranks on this host ({per_rank} bytes each: control words and \
                 landing slots {}, published shards {}, accumulators {}, node cache {})",
                lens[0], lens[1], lens[2], lens[3]
            ),
        }),
        _ => Ok(()),
    }
}

fn fnv1a(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn json<T: Serialize>(key: &str, v: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| Error::Store {
        op: "set",
        key: key.to_owned(),
        detail: e.to_string(),
    })
}

fn parse<T: for<'de> Deserialize<'de>>(key: &str, v: &[u8]) -> Result<T> {
    serde_json::from_slice(v).map_err(|e| Error::Store {
        op: "get",
        key: key.to_owned(),
        detail: format!("malformed value: {e}"),
    })
}

/// Byte offsets of every bucket's published shard (aligned) and element
/// offsets of its f32 accumulator, and the two totals.
fn offsets(buckets: &[BucketLayout]) -> (Vec<usize>, Vec<usize>, usize, usize) {
    let mut params_off = Vec::with_capacity(buckets.len());
    let mut accum_off = Vec::with_capacity(buckets.len());
    let (mut params_len, mut accum_len) = (0usize, 0usize);
    for b in buckets {
        params_off.push(params_len);
        params_len += b.shard_bytes().div_ceil(ALIGN_BYTES) * ALIGN_BYTES;
        accum_off.push(accum_len);
        accum_len += b.shard_len();
    }
    (params_off, accum_off, params_len, accum_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn post(rank: usize, regions: &[(u32, u32, u64)]) -> Vec<u8> {
        let regions: Vec<RegionDesc> = regions
            .iter()
            .map(|&(owner, id, len)| RegionDesc {
                owner,
                id,
                len,
                key: 0,
            })
            .collect();
        let endpoint = Endpoint {
            rank,
            pid: 1,
            host: "h".into(),
            address: String::new(),
            regions: Vec::new(),
        };
        serde_json::to_vec(&EndpointPost { endpoint, regions }).unwrap_or_default()
    }

    #[test]
    fn an_endpoint_post_is_the_peers_own_and_as_large_as_this_ranks() {
        let want = RegionSizes {
            ctrl: 4096,
            params: 100,
            accum: None,
        };
        let key = "odc/ep/2";
        let ok = check_endpoint(key, 2, &post(2, &[(2, 0, 4096), (2, 1, 128)]), &want);
        assert!(ok.is_ok(), "{:?}", ok.err());
        let e = |v: Vec<u8>| {
            check_endpoint(key, 2, &v, &want)
                .err()
                .map(|e| e.to_string())
        };
        let named = |m: Option<String>, needle: &str| {
            m.is_some_and(|m| m.contains("rank 2") && m.contains(needle))
        };
        assert!(named(e(post(3, &[(2, 0, 4096), (2, 1, 128)])), "rank 3"));
        assert!(named(e(post(2, &[(5, 0, 4096), (2, 1, 128)])), "owner"));
        assert!(named(e(post(2, &[(2, 0, 4096), (2, 0, 4096)])), "twice"));
        assert!(named(e(post(2, &[(2, 0, 4095), (2, 1, 128)])), "4095"));
        assert!(named(e(post(2, &[(2, 0, 4096)])), "no region 1"));
        let failed = serde_json::to_vec(&FailedPost {
            failed: "no room".into(),
        })
        .unwrap_or_default();
        assert!(named(e(failed), "no room"));
    }
}
