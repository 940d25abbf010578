//! The state a rank's engine shares between its worker handles and its
//! shard server daemon: [`Core`] (configuration, transport, the registered
//! regions, the push and publish locks) and [`Registered`] (everything that
//! exists after registration). Nothing here moves data or waits on a peer
//! except through [`Core::waiter`].

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};

use super::cache::NodeCache;
use super::config::{CrossNode, EngineConfig, Groups};
use super::BucketId;
use crate::control::{CtrlLayout, HEADER_BYTES};
use crate::layout::{BucketLayout, ALIGN_BYTES};
use crate::plane::{Connect, Plane};
use crate::protocol::compress::{self, Compress};
use crate::protocol::handoff::OwnPush;
use crate::protocol::nodesum;
use crate::protocol::slots::SlotSender;
use crate::region::{Bell, HeapBlock, LocalRegion, RegionDesc};
use crate::store::Store;
use crate::sync::{AtomicBool, AtomicU64, Ordering};
use crate::topology::Topology;
use crate::transport::Transport;
use crate::wait::Waiter;
use crate::{Error, Result};
use odc_kernels::cpu::quant::Spec;

/// Everything that exists after registration.
#[derive(Debug)]
pub(crate) struct Registered {
    /// The shard and replica groups (indices into the control words).
    pub(crate) groups: Groups,
    pub(crate) buckets: Vec<BucketLayout>,
    pub(crate) names: HashMap<String, usize>,
    pub(crate) ctrl_layout: CtrlLayout,
    /// Byte offset of each bucket's shard in the params region.
    pub(crate) params_off: Vec<usize>,
    /// Element offset of each bucket's accumulator.
    pub(crate) accum_off: Vec<usize>,
    /// Element offset of each bucket's final gradient in `reduced` (across
    /// nodes only).
    pub(crate) grad_off: Vec<usize>,
    pub(crate) ctrl: LocalRegion,
    pub(crate) params: LocalRegion,
    pub(crate) accum: Accum,
    /// Hybrid across nodes: the accumulators summed over every node (what
    /// the optimizer reads; under hybrid-zero only this rank's piece of
    /// each bucket); empty otherwise.
    pub(crate) reduced: HeapBlock,
    /// Deterministic mode: the exact fixed-point accumulators, which the
    /// daemon adds into and `finish_minibatch` reads out into `accum` (and
    /// the cross-node sum adds across nodes); zeroed with `accum`.
    pub(crate) exact: Option<Exact>,
    /// Elements in all accumulators together.
    pub(crate) accum_len: usize,
    /// Per global rank (indexed by rank, like `peer_ctrl`); `None` unless
    /// the rank is one of this rank's replicas.
    pub(crate) peer_accum: Vec<Option<RegionDesc>>,
    pub(crate) peer_ctrl: Vec<RegionDesc>,
    /// Every shard-group rank with its control region's descriptor: where
    /// version, release and done signals go ([`crate::client::Signals`]).
    pub(crate) group_ctrl: Arc<[(usize, RegionDesc)]>,
    pub(crate) peer_params: Vec<RegionDesc>,
    pub(crate) peer_pid: Vec<u32>,
    /// Device transports: every rank's data regions (the host `params`,
    /// `accum` and landing data are then unused).
    pub(crate) plane: Option<Box<dyn Plane>>,
    /// Highest version + 1 this client released per bucket (local only).
    pub(crate) released: Vec<AtomicU64>,
    /// Highest minibatch + 1 this client finished: its running minibatch,
    /// as pushed chunks name it.
    pub(crate) finished: AtomicU64,
    /// Per bucket, the minibatch this rank's accumulator takes pushes of
    /// ([`crate::protocol::admit`]); raised by the worker, read by the
    /// daemon.
    pub(crate) open: Vec<AtomicU64>,
    /// Highest minibatch + 1 whose partial sums this rank handed to the
    /// other nodes (hybrid); they must have read them before the
    /// accumulators change again.
    pub(crate) partials_out: AtomicU64,
    /// Work stealing: this rank's last request sequence number per owner
    /// (shard-group index).
    pub(crate) steal_seq: Vec<AtomicU64>,
    /// The node cache of remote shards (full sharding across nodes).
    pub(crate) cache: Option<Arc<NodeCache>>,
    /// How gradients for owners on other nodes cross (resolved: `Direct`
    /// or `Node`).
    pub(crate) cross_node: CrossNode,
    /// Node aggregation: this rank's node buffers (sums of its node's
    /// chunks for its replicas on the other nodes).
    pub(crate) sums: Option<NodeSums>,
    /// Node aggregation: where `done` goes at once (this rank's node), and
    /// where only after the node sums (its replicas on other nodes); no
    /// other remote rank hears it (`protocol::nodesum::releaser`). Without
    /// it, `early` is every rank.
    pub(crate) done_early: Arc<[(usize, RegionDesc)]>,
    pub(crate) done_late: Arc<[(usize, RegionDesc)]>,
    /// Where a publish announces its version: every shard-group rank, or
    /// under node announces ([`NodeVersions`]) this rank's node and its
    /// replicas on the other nodes.
    pub(crate) announce_to: Arc<[(usize, RegionDesc)]>,
    /// Node announces: the node-mates' control regions, where this rank
    /// reads a remote owner's version.
    pub(crate) node_versions: Option<NodeVersions>,
    /// This rank's share of it (kept registered while the engine lives).
    pub(crate) _cache_region: Option<LocalRegion>,
    /// Compressed gathers: where this rank's quantised copies of its
    /// shards live (every rank's alike), when some gather reads them.
    pub(crate) quant: Option<Quant>,
    /// A device engine's compressed pushes: where they are packed.
    pub(crate) device_pack: Option<DevicePack>,
    /// A device engine's compressed gathers: their staging and scratch.
    pub(crate) device_quant: Option<DeviceQuant>,
    /// Bytes this rank's gathers read from ranks on other nodes (node
    /// cache fetches and hybrid-zero's piece copies included), since
    /// registration.
    pub(crate) read_across: AtomicU64,
    /// Hybrid across nodes with compressed pushes: this rank's quantised
    /// partial sums, which the other nodes' replicas read instead of its
    /// accumulators.
    pub(crate) qsum: Option<QuantSums>,
    /// Bytes the cross-node sum (hybrid) read from the other nodes'
    /// replicas, since registration.
    pub(crate) summed_across: AtomicU64,
}

/// Compressed cross-node sums (hybrid sharding over several nodes with a
/// push format, [`crate::protocol::compress::sum_spec`]): at the end of a
/// minibatch each rank quantises its partial sums (its accumulators, plus
/// the residual it kept from the last minibatch with error feedback) once
/// into the accumulator region, after the accumulators, and every replica,
/// this rank's own node included, adds the dequantised copies of every
/// node in node order: the replicas keep bitwise-equal sums.
///
/// The copy of bucket `i`'s block `p` (a node's piece under hybrid-zero;
/// the whole shard under hybrid, one block) is `copies[i * blocks + p]`, at
/// byte `off[i * blocks + p]` of the accumulator region: the same layout on
/// every rank, so a replica reads the piece it sums at the offset its own
/// copy of that piece has.
#[derive(Debug)]
pub(crate) struct QuantSums {
    pub(crate) copies: Vec<crate::protocol::compress::QuantCopy>,
    pub(crate) off: Vec<usize>,
    pub(crate) blocks: usize,
    pub(crate) state: Mutex<QuantSumState>,
}

impl QuantSums {
    /// The runs of bucket `i`'s quantised copies (blocks of `block_len`
    /// elements), in order: the run's elements of the bucket's accumulators
    /// (from its shard's start), the byte range of its chunk in the
    /// accumulator region, and its format.
    pub(crate) fn runs(
        &self,
        i: usize,
        block_len: usize,
    ) -> impl Iterator<Item = (Range<usize>, Range<usize>, Spec)> + '_ {
        (0..self.blocks).flat_map(move |p| {
            let (copy, off) = (
                self.copies[i * self.blocks + p],
                self.off[i * self.blocks + p],
            );
            (0..copy.runs()).map(move |j| {
                let elems = copy.elems(j);
                let first = p * block_len + elems.start;
                let at = off + copy.at(j);
                (
                    first..first + elems.len(),
                    at..at + copy.bytes(j),
                    copy.spec,
                )
            })
        })
    }
}

/// What the quantisation of a minibatch's partial sums changes: the
/// residuals (error feedback, per bucket), which buckets' accumulators hold
/// their residual now (folded in at the first quantisation after a
/// zeroing, settled from the last copy at the next zeroing: a minibatch
/// that continues the sums, an elastic rerun or several minibatches per
/// step, quantises the grown accumulators again from the same residual),
/// and the last minibatch + 1 it ran for (once per minibatch, also when an
/// elastic round runs again).
#[derive(Debug)]
pub(crate) struct QuantSumState {
    pub(crate) feedback: Option<odc_kernels::cpu::quant::ErrorFeedback>,
    pub(crate) folded: Vec<bool>,
    pub(crate) quantised: u64,
}

/// Compressed gathers ([`crate::protocol::compress`]): per bucket the
/// quantised copy's cut and its byte offset in the params region (after
/// every published shard, each 64-byte aligned; the same on every rank),
/// and staging buffers for reads of peers' copies (one per gather in
/// flight, reused).
#[derive(Debug)]
pub(crate) struct Quant {
    pub(crate) copies: Vec<crate::protocol::compress::QuantCopy>,
    pub(crate) off: Vec<usize>,
    pub(crate) staging: Mutex<Vec<Vec<u64>>>,
}

/// A device engine's compressed gathers: device memory in its params
/// region after the quantised copies (private to the rank; peers read only
/// the copies).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DeviceQuant {
    /// Per bucket, the byte offset of its gathers' staging: a copy's
    /// [`staging_stride`](crate::protocol::compress::QuantCopy::staging_stride)
    /// per owner of the shard group.
    pub(crate) staging: Vec<usize>,
    /// Byte offset of the f32 values a bf16 shard is widened into before
    /// it is quantised (one run's worth).
    pub(crate) values: usize,
}

impl DeviceQuant {
    /// The layout after copies ending at byte `end`, for a shard group of
    /// `world`; and where it ends (the device params region's length).
    pub(crate) fn lay_out(
        copies: &[crate::protocol::compress::QuantCopy],
        end: usize,
        world: usize,
    ) -> (DeviceQuant, usize) {
        let mut at = end.next_multiple_of(ALIGN_BYTES);
        let staging = (copies.iter())
            .map(|c| {
                let o = at;
                at = (at + c.staging_stride() * world).next_multiple_of(ALIGN_BYTES);
                o
            })
            .collect();
        let run = (copies.iter())
            .map(|c| c.run.min(c.shard_len))
            .max()
            .unwrap_or(0);
        let values = at;
        (DeviceQuant { staging, values }, values + 4 * run)
    }
}

impl Quant {
    /// A staging buffer of at least `bytes` bytes (8-aligned), taken from
    /// the pool or made; hand it back with [`Quant::put_back`].
    pub(crate) fn take(&self, bytes: usize) -> Vec<u64> {
        let mut buf = self
            .staging
            .lock()
            .ok()
            .and_then(|mut pool| pool.pop())
            .unwrap_or_default();
        if buf.len() < bytes.div_ceil(8) {
            buf.resize(bytes.div_ceil(8), 0);
        }
        buf
    }

    /// Returns a buffer [`Quant::take`] gave.
    pub(crate) fn put_back(&self, buf: Vec<u64>) {
        if let Ok(mut pool) = self.staging.lock() {
            pool.push(buf);
        }
    }
}

/// Node aggregation's node buffers ([`crate::protocol::nodesum`]): for
/// each other node `n'` (in node order, this node left out) and bucket, the
/// sum of this node's chunks for rank `(n', l)`'s shard (`l` this rank's
/// local rank), f32, at the bucket's accumulator offset; per buffer whether
/// anything was added (an untouched one is not pushed); and the minibatch
/// the buffers take chunks of (raised by the worker once it pushed and
/// cleared the previous minibatch's sums; read by the daemon).
#[derive(Debug)]
pub(crate) struct NodeSums {
    /// The buffers in host memory (empty on a device engine).
    pub(crate) block: HeapBlock,
    /// A device engine's buffers: their device address (after the
    /// accumulators in the plane's accumulator region).
    pub(crate) device: Option<u64>,
    pub(crate) touched: Vec<AtomicBool>,
    pub(crate) open: AtomicU64,
    /// Ranks per node, this rank's node, the node count.
    pub(crate) local: usize,
    pub(crate) node: usize,
    pub(crate) nodes: usize,
    pub(crate) accum_len: usize,
    pub(crate) buckets: usize,
}

/// Node announces (node sums over a transport whose node-mates map each
/// other's regions, `shm+fabric`): an owner tells its version to its node
/// and to one rank per other node, its replica there (the node-mate with
/// its local rank, which aggregates its node's gradients for it too), whose
/// transport then wakes the whole node. The others read it from that
/// node-mate's control region, through the node's shared memory: one
/// signal per node crosses the network instead of one per rank.
#[derive(Debug)]
pub(crate) struct NodeVersions {
    /// Base of each node-mate's control region, by local rank.
    bases: Vec<std::ptr::NonNull<u8>>,
    /// This rank and the ranks per node.
    me: usize,
    local: usize,
}

// SAFETY: the bases point into shared mappings that the transport keeps
// for the engine's lifetime, and only atomic words are read through them.
unsafe impl Send for NodeVersions {}
// SAFETY: as above.
unsafe impl Sync for NodeVersions {}

impl NodeVersions {
    /// Versions read through `bases` (every node-mate's control region,
    /// by local rank; this rank's own among them).
    ///
    /// # Safety
    /// Every base stays mapped, and holds a control region laid out as
    /// this rank's, as long as the returned value is used.
    pub(crate) unsafe fn new(
        bases: Vec<std::ptr::NonNull<u8>>,
        me: usize,
        local: usize,
    ) -> NodeVersions {
        NodeVersions { bases, me, local }
    }

    /// The node-mate that hears `owner`'s versions for this node (its
    /// aggregator for `owner`, [`nodesum::server`]); `None` for an owner on
    /// this node.
    fn relay(&self, owner: usize) -> Option<usize> {
        (owner / self.local != self.me / self.local)
            .then(|| nodesum::server(self.me, owner, self.local))
    }

    /// The word at `offset` of the control region of `owner`'s relay;
    /// `None` for an owner on this node.
    fn word(&self, owner: usize, offset: usize) -> Option<&AtomicU64> {
        let base = self.bases.get(self.relay(owner)? % self.local)?;
        // SAFETY: `offset` is a control-layout offset (in range, 8-byte
        // aligned) and the base a mapped control region of that layout
        // (`new`'s contract); its words are only accessed atomically.
        Some(unsafe { &*base.as_ptr().add(offset).cast::<AtomicU64>() })
    }
}

impl NodeSums {
    /// The buffer index of node `n` (another node).
    pub(crate) fn index(&self, n: usize) -> usize {
        debug_assert!(n != self.node && n < self.nodes);
        if n < self.node {
            n
        } else {
            n - 1
        }
    }

    /// Element `elem` of bucket `b`'s buffer for owner `owner` (global
    /// rank on node `owner / local`), with `accum_off` the bucket's
    /// accumulator offset; in range per the caller.
    pub(crate) fn ptr(&self, owner: usize, accum_off: usize, elem: usize) -> *mut f32 {
        debug_assert!(self.device.is_none());
        self.block
            .as_ptr()
            .cast::<f32>()
            .wrapping_add(self.at(owner, accum_off, elem))
    }

    /// [`ptr`](Self::ptr) as an address of the engine's kind: a host
    /// pointer, or a device address on a device engine.
    pub(crate) fn addr(&self, owner: usize, accum_off: usize, elem: usize) -> u64 {
        let at = self.at(owner, accum_off, elem);
        match self.device {
            Some(base) => base + (at * 4) as u64,
            None => self.block.as_ptr().cast::<f32>().wrapping_add(at) as u64,
        }
    }

    fn at(&self, owner: usize, accum_off: usize, elem: usize) -> usize {
        self.index(owner / self.local) * self.accum_len + accum_off + elem
    }

    /// Whether bucket `b`'s buffer for `owner` holds anything.
    pub(crate) fn touched(&self, owner: usize, b: usize) -> &AtomicBool {
        &self.touched[self.index(owner / self.local) * self.buckets + b]
    }
}

/// Deterministic mode's exact accumulators: an `i128` per accumulator
/// element, at the same element offsets as the f32 ones, and per bucket
/// whether the daemon added into it since the last read (so a finish reads
/// out only the buckets it pushed). They hold the exact sum from one
/// zeroing of the accumulator to the next, across minibatches.
#[derive(Debug)]
pub(crate) struct Exact {
    /// Their own heap block; `None` under hybrid sharding over several
    /// nodes, where they sit in the accumulator region from byte
    /// `region_off` on, for the replicas to read (the cross-node sum adds
    /// them as integers).
    pub(crate) block: Option<HeapBlock>,
    pub(crate) region_off: usize,
    pub(crate) touched: Vec<AtomicBool>,
}

/// Where the accumulators live: plain heap memory, or (hybrid sharding over
/// several nodes) a registered region the replicas read.
#[derive(Debug)]
pub(crate) enum Accum {
    Heap(HeapBlock),
    Region(LocalRegion),
}

impl Accum {
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        match self {
            Accum::Heap(h) => h.as_ptr(),
            Accum::Region(r) => r.as_ptr(),
        }
    }
}

impl Registered {
    /// The node-mate through which `owner`'s versions reach this rank
    /// (global ranks: full sharding), if not directly ([`NodeVersions`]).
    pub(crate) fn version_relay(&self, owner: usize) -> Option<usize> {
        self.node_versions.as_ref()?.relay(owner)
    }

    /// The word that holds `owner`'s version of `bucket` for this rank:
    /// its own control region's, or under node announces a node-mate's
    /// ([`NodeVersions`]) for an owner on another node.
    pub(crate) fn version_word(&self, owner: usize, bucket: usize) -> &AtomicU64 {
        let offset = self.ctrl_layout.seen_version(owner, bucket);
        self.node_versions
            .as_ref()
            .and_then(|v| v.word(owner, offset))
            .unwrap_or_else(|| self.word(offset))
    }

    pub(crate) fn word(&self, offset: usize) -> &AtomicU64 {
        // The control layout only yields in-range, aligned offsets.
        match self.ctrl.signal(offset) {
            Some(w) => w,
            None => unreachable!("control offset {offset} outside the control region"),
        }
    }

    pub(crate) fn bucket(&self, id: BucketId) -> Result<&BucketLayout> {
        self.buckets.get(id.0).ok_or_else(|| {
            Error::layout(
                None,
                format!(
                    "unknown bucket id {} ({} registered)",
                    id.0,
                    self.buckets.len()
                ),
            )
        })
    }

    /// Whether minibatch ends sum the shards across nodes.
    pub(crate) fn cross_node(&self) -> bool {
        self.groups.replicas.len() > 1
    }

    /// The final gradient of bucket `b` (what the optimizer reads): the
    /// accumulator, or under hybrid sharding over several nodes the
    /// cross-node sum (of this rank's piece only, under hybrid-zero).
    pub(crate) fn grad_ptr(&self, b: usize) -> (*mut f32, usize) {
        if !self.cross_node() {
            return self.accum_ptr(b);
        }
        let len = self.buckets[b].block_len();
        // SAFETY: `reduced` holds every bucket's block_len f32s at grad_off.
        let ptr = unsafe { self.reduced.as_ptr().cast::<f32>().add(self.grad_off[b]) };
        (ptr, len)
    }

    /// The block of this rank's shard it publishes and steps: its piece
    /// (its node's index) under hybrid-zero, else the whole shard (0).
    pub(crate) fn piece(&self) -> usize {
        if self.groups.blocks > 1 {
            self.groups.node
        } else {
            0
        }
    }

    /// Device engines: the device address of element `elem` of bucket `b`'s
    /// f32 accumulator.
    pub(crate) fn accum_addr(&self, plane: &dyn Plane, b: usize, elem: usize) -> u64 {
        plane.accum() + ((self.accum_off[b] + elem) * 4) as u64
    }

    /// The `i128` of exact accumulator element `elem` (an element offset
    /// into all accumulators, as `accum_off` gives them). The block holds
    /// `accum_len` of them (sized at register), 64-byte aligned; the caller
    /// keeps `elem` in range before reading through the pointer.
    pub(crate) fn exact_at(&self, exact: &Exact, elem: usize) -> *mut i128 {
        let base = match &exact.block {
            Some(h) => h.as_ptr(),
            None => self.accum.as_ptr().wrapping_add(exact.region_off),
        };
        base.cast::<i128>().wrapping_add(elem)
    }

    /// The accumulator of bucket `b` as a raw pointer and length.
    pub(crate) fn accum_ptr(&self, b: usize) -> (*mut f32, usize) {
        let len = self.buckets[b].shard_len();
        // SAFETY: accum_off[b] + len is within the block (sized at register).
        let ptr = unsafe { self.accum.as_ptr().cast::<f32>().add(self.accum_off[b]) };
        (ptr, len)
    }
}

/// One rank's state, shared by the worker handles ([`crate::client`]) and
/// the shard server daemon ([`crate::server`]).
pub(crate) struct Core {
    pub(crate) topo: Topology,
    pub(crate) config: EngineConfig,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) transport: Arc<dyn Transport>,
    /// Device transports: the backend, until `register` connects it.
    pub(crate) device: Option<Box<dyn Connect>>,
    pub(crate) reg: OnceLock<Registered>,
    pub(crate) shutdown: AtomicBool,
    /// Shared with work enqueued on streams, which may report late.
    pub(crate) server_error: Arc<Mutex<Option<String>>>,
    /// Set once if the shard server thread panicked: `(what it was doing,
    /// the panic's message)`. Every later call and wait of this rank fails
    /// with [`Error::Internal`] ([`Core::failed`]).
    pub(crate) server_failure: OnceLock<(String, String)>,
    /// This client's own slice of the push in progress, for its server.
    pub(crate) own: OwnPush,
    /// Pushes and finishes serialize on this (taken once per call).
    pub(crate) push: Mutex<PushState>,
    /// Publishes serialize on this.
    pub(crate) publish_lock: Mutex<()>,
    /// Elastic hybrid sharding: the member nodes and the drops seen.
    pub(crate) elastic: Option<crate::elastic::Membership>,
}

impl fmt::Debug for Core {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Core")
            .field("topo", &self.topo)
            .field("transport", &self.transport)
            .field("registered", &self.reg.get().is_some())
            .finish_non_exhaustive()
    }
}

/// Pushes in flight from this client: per owner (index in the shard
/// group), its two landing slots and the part of the current push still to
/// send.
#[derive(Debug)]
pub(crate) struct PushState {
    pub(crate) slots: Vec<SlotSender>,
    pub(crate) cursor: Vec<std::ops::Range<usize>>,
    /// Generation of the last own-slice hand-off ([`OwnPush`]).
    pub(crate) own_gen: u64,
    /// Per owner and slot, the header of the chunk last written there: it
    /// must outlive the write, which a batch completes later.
    pub(crate) headers: Vec<[u8; HEADER_BYTES]>,
    /// Compressed pushes' working memory, made by the first push when the
    /// engine compresses pushes.
    pub(crate) packer: Option<Packer>,
    /// Bytes this client handed to landing slots on other nodes (headers
    /// and chunk data), since the engine started.
    pub(crate) sent_across: u64,
}

impl PushState {
    pub(crate) fn new(world: usize) -> PushState {
        PushState {
            slots: vec![SlotSender::default(); world],
            cursor: vec![0..0; world],
            own_gen: 0,
            headers: vec![[0; HEADER_BYTES]; 2 * world],
            packer: None,
            sent_across: 0,
        }
    }
}

/// A pusher's compressed-chunk memory ([`crate::protocol::compress`]):
/// per server and slot a staging cell that holds the compressed chunk last
/// written there until the slot's acknowledgement (as `headers` holds its
/// header), one chunk's scaled f32 values, and the error-feedback
/// residuals, one per (bucket, owner) shard (key `bucket · world + owner`).
#[derive(Debug)]
pub(crate) struct Packer {
    pub(crate) staging: Vec<Vec<f32>>,
    pub(crate) values: Vec<f32>,
    pub(crate) feedback: Option<odc_kernels::cpu::quant::ErrorFeedback>,
}

impl Packer {
    /// Cells for `servers` servers' two slots of `slot_bytes`, chunks of
    /// at most `elems` elements, and residuals when `feedback`.
    pub(crate) fn new(
        spec: odc_kernels::cpu::quant::Spec,
        feedback: bool,
        servers: usize,
        slot_bytes: usize,
        elems: usize,
    ) -> Packer {
        Packer {
            staging: vec![vec![0.0; slot_bytes.div_ceil(4)]; 2 * servers],
            values: vec![0.0; elems],
            feedback: feedback.then(|| odc_kernels::cpu::quant::ErrorFeedback::new(spec)),
        }
    }
}

/// Where a device engine packs its compressed pushes: device memory after
/// the landing slots in its own landing region (peers write only the
/// slots): a staging cell per (server, slot) of a chunk's bytes, one
/// chunk of f32 values, and with error feedback a residual per (bucket,
/// owner) the size of the owner's shard, for each owner this rank pushes
/// compressed chunks to: under scope "all" every other rank; under
/// "cross-node" the ranks on other nodes (direct pushes: `(D - G) / D` of
/// the padded model, 4 bytes an element) or, with node sums, the ranks on
/// other nodes this rank aggregates for (`(N - 1) / D` of it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct DevicePack {
    /// Byte offset of cell 0 in the landing region; cells are
    /// `cell_bytes` apart.
    pub(crate) cells: usize,
    pub(crate) cell_bytes: usize,
    /// Byte offset of the f32 values.
    pub(crate) values: usize,
    /// Byte offset of the residuals, with error feedback.
    residuals: Option<usize>,
    /// Per owner in the shard group, its residual's place among the owners
    /// that have one.
    slot: Vec<Option<usize>>,
    /// Owners with a residual.
    count: usize,
    /// Error feedback on.
    pub(crate) feedback: bool,
    /// Bytes past the landing slots.
    pub(crate) len: usize,
}

impl DevicePack {
    /// The layout a device engine with `compress` needs beside the landing
    /// slots of `ctrl`, for accumulators of `accum_len` elements, as rank
    /// `me` of the shard group `group` (global ranks) on `topo`, with node
    /// sums when `node_sums`; `None` when its pushes are not compressed (or
    /// no whole block fits a slot: they then go as they are).
    pub(crate) fn plan(
        compress: Option<&Compress>,
        ctrl: &CtrlLayout,
        (me, group): (usize, &[usize]),
        (topo, node_sums): (&Topology, bool),
        accum_len: usize,
    ) -> Option<DevicePack> {
        let c = compress?;
        let elems = compress::chunk_elems(c.push?, ctrl.chunk_bytes())?;
        let local = topo.local_world();
        // Whether this rank pushes compressed chunks for owner `o`, by the
        // push's own rule (`compress::push_spec` on the server a chunk goes
        // to): its gradient's chunks (to the owner, or with node sums to the
        // owner's aggregator on this node), and with node sums the node
        // buffer it aggregates for an owner on another node.
        let (rank, squeezed) = (group[me], |server: usize| {
            compress::push_spec(Some(c), topo.is_local(server)).is_some()
        });
        let compressed = |o: usize| {
            let owner = group[o];
            let server = if node_sums {
                nodesum::server(rank, owner, local)
            } else {
                owner
            };
            let aggregates = node_sums && !topo.is_local(owner) && server == rank;
            o != me && (squeezed(server) || (aggregates && squeezed(owner)))
        };
        let mut count = 0;
        let slot = (0..group.len())
            .map(|o| {
                (c.feedback && compressed(o)).then(|| {
                    count += 1;
                    count - 1
                })
            })
            .collect();
        let start = ctrl.landing_len();
        let cells = start.next_multiple_of(ALIGN_BYTES);
        let world = group.len();
        let values = (cells + 2 * world * ctrl.chunk_bytes()).next_multiple_of(ALIGN_BYTES);
        let mut end = values + 4 * elems;
        let residuals = (c.feedback && count > 0).then(|| {
            let at = end.next_multiple_of(ALIGN_BYTES);
            end = at + 4 * count * accum_len;
            at
        });
        Some(DevicePack {
            cells,
            cell_bytes: ctrl.chunk_bytes(),
            values,
            residuals,
            slot,
            count,
            feedback: c.feedback,
            len: end - start,
        })
    }

    /// Byte offset, in the landing region, of the residual of element
    /// `start` of owner `owner`'s shard of the bucket whose accumulator
    /// starts at element `accum_off`; `None` without error feedback, or for
    /// an owner this rank pushes no compressed chunk to.
    pub(crate) fn residual(
        &self,
        accum_off: usize,
        b: &BucketLayout,
        owner: usize,
        start: usize,
    ) -> Option<usize> {
        let slot = (*self.slot.get(owner)?)?;
        let at = self.count * accum_off + slot * b.shard_len() + start;
        self.residuals.map(|r| r + 4 * at)
    }
}

impl Core {
    pub(crate) fn registered(&self) -> Result<&Registered> {
        self.reg.get().ok_or_else(|| {
            Error::protocol(
                None,
                "the engine has no registered buckets; call register first",
            )
        })
    }

    /// The waiter every wait of this rank goes through (see [`crate::wait`]).
    pub(crate) fn waiter(&self) -> Waiter<'_, dyn Transport> {
        Waiter {
            bells: &*self.transport,
            me: self.topo.rank(),
            world: self.topo.world(),
            timeout: self.config.timeout,
            pids: self.reg.get().map_or(&[][..], |r| &r.peer_pid),
        }
    }

    /// [`Waiter::wait`] with this rank's waiter.
    pub(crate) fn wait(
        &self,
        bucket: Option<&str>,
        waited_for: &dyn Fn() -> String,
        check: impl FnMut() -> Result<Option<usize>>,
    ) -> Result<()> {
        let check = self.unless_failed(check);
        self.retire_on_failure(self.waiter().wait(bucket, waited_for, check))
    }

    /// [`Waiter::wait_via`] with this rank's waiter.
    pub(crate) fn wait_via(
        &self,
        bucket: Option<&str>,
        waited_for: &dyn Fn() -> String,
        relay: &dyn Fn(usize) -> Option<usize>,
        check: impl FnMut() -> Result<Option<usize>>,
    ) -> Result<()> {
        let check = self.unless_failed(check);
        self.retire_on_failure(self.waiter().wait_via(bucket, waited_for, relay, check))
    }

    /// `check`, failing first once a thread of this rank's engine has
    /// failed: what a wait awaits may hang on it (an acknowledgement or the
    /// own slice from the dead daemon, a completion from the dead progress
    /// thread), so it ends now with that thread's error, not at the deadline
    /// naming a peer. Two loads per check.
    fn unless_failed<'a>(
        &'a self,
        mut check: impl FnMut() -> Result<Option<usize>> + 'a,
    ) -> impl FnMut() -> Result<Option<usize>> + 'a {
        move || match self.failed() {
            Some(e) => Err(e),
            None => check(),
        }
    }

    /// The error of a thread of this rank's engine that panicked: the shard
    /// server ([`Core::record_server_panic`]) or the transport's own
    /// ([`Transport::failure`]).
    pub(crate) fn failed(&self) -> Option<Error> {
        let server = self
            .server_failure
            .get()
            .map(|(during, detail)| Error::Internal {
                rank: self.topo.rank(),
                during: format!("its shard server thread was {during}"),
                detail: detail.clone(),
            });
        server.or_else(|| self.transport.failure())
    }

    /// The shard server thread panicked while `during`: records it (the
    /// first time), releases the own slice it may have been reading, tells
    /// the peers this rank is gone (they name it at once instead of at their
    /// deadline) and wakes this rank's waiters, which then fail with it.
    pub(crate) fn record_server_panic(&self, during: String, detail: String) {
        let _ = self.server_failure.set((during, detail));
        self.own.abandon();
        self.transport.retire();
        self.transport.ring(Bell::Client);
    }

    /// [`Waiter::attribute`] with this rank's waiter.
    pub(crate) fn attribute(&self, bucket: Option<&str>, err: Error) -> Error {
        let e = self.waiter().attribute(bucket, err);
        self.retire_on(&e);
        e
    }

    /// [`Core::retire_on`] for a result.
    pub(crate) fn retire_on_failure<T>(&self, r: Result<T>) -> Result<T> {
        if let Err(e) = &r {
            self.retire_on(e);
        }
        r
    }

    /// An elastic engine whose rank failed on a peer (or whose node was
    /// dropped) takes no further part: it tells the peers at once
    /// ([`Transport::retire`]), so that the other nodes drop its node within
    /// a liveness period instead of a network probe's timeout.
    fn retire_on(&self, e: &Error) {
        let on_a_peer = matches!(
            e,
            Error::PeerDied { .. } | Error::PeerTimeout { .. } | Error::Dropped { .. }
        );
        let Some(m) = self.elastic.as_ref().filter(|_| on_a_peer) else {
            return;
        };
        self.transport.retire();
        // And voids the membership round this rank's node would be counted
        // in, so the other nodes learn of it through the store within a
        // poll, not by a probe of a peer they may not be connected to. Best
        // effort: this rank raises `e` whatever the store says.
        if let Some(reg) = self.reg.get() {
            let k0 = reg.finished.load(std::sync::atomic::Ordering::Acquire);
            let rounds = crate::elastic::Rounds::new(&*self.store, &m.prefix, self.topo.rank());
            let _ = rounds.leave(k0.saturating_sub(1), m.members(), reg.groups.node);
        }
    }

    pub(crate) fn record_server_error(&self, msg: String) {
        record_error(&self.server_error, msg);
    }

    pub(crate) fn take_server_error(&self) -> Option<String> {
        self.server_error.lock().ok().and_then(|s| s.clone())
    }
}

/// Keeps the first error reported into `slot` (by the daemon, or by work
/// on a stream that runs after the call that enqueued it returned).
pub(crate) fn record_error(slot: &Mutex<Option<String>>, msg: String) {
    if let Ok(mut slot) = slot.lock() {
        if slot.is_none() {
            *slot = Some(msg);
        }
    }
}

/// Loads a control word (acquire).
pub(crate) fn load(word: &AtomicU64) -> u64 {
    word.load(Ordering::Acquire)
}
