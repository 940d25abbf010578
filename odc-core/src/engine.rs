//! [`Engine`]: setup (job rendezvous, collective registration, connection),
//! the server thread's lifetime, and the shared state the worker API
//! ([`crate::client`]) and the daemon ([`crate::server`]) use.
//!
//! This module owns every resource of a rank; it does not move data itself.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use odc_kernels::DType;
use serde::{Deserialize, Serialize};

use crate::control::{landing_chunk, CtrlLayout};
use crate::handoff::OwnPush;
use crate::layout::{BucketLayout, BucketSpec, ALIGN_BYTES};
use crate::plane::{Connect, DataSizes, Plane};
use crate::region::{Bell, Endpoint, HeapBlock, LocalRegion, RegionDesc};
use crate::store::{wait_get, Store};
use crate::sync::{AtomicBool, AtomicU64, Backoff, Ordering};
use crate::topology::Topology;
use crate::transport::{PeerStatus, Transport, TransportKind};
use crate::{Error, Result};

/// Region id of the control region (control words and landing slots).
const CTRL_REGION: u32 = 0;
/// Region id of the published parameter shards.
const PARAMS_REGION: u32 = 1;
/// Region id of the gradient accumulators, published only under hybrid
/// sharding across nodes (the other nodes read the partial sums).
const ACCUM_REGION: u32 = 2;
/// How often a sleeping waiter checks that the peer it waits for is alive.
const LIVENESS_PERIOD: Duration = Duration::from_millis(50);

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
}

impl Sharding {
    /// Parses `"full"` or `"hybrid"`.
    pub fn parse(name: &str) -> Option<Sharding> {
        match name.trim().to_ascii_lowercase().as_str() {
            "full" => Some(Sharding::Full),
            "hybrid" => Some(Sharding::Hybrid),
            _ => None,
        }
    }

    /// `"full"` or `"hybrid"`.
    pub fn name(self) -> &'static str {
        match self {
            Sharding::Full => "full",
            Sharding::Hybrid => "hybrid",
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
            },
            Sharding::Hybrid => {
                let g = topo.local_world();
                let (node, local) = (topo.node_of(rank), topo.local_rank_of(rank));
                Groups {
                    group: (node * g..(node + 1) * g).collect(),
                    me: local,
                    replicas: (0..topo.nodes()).map(|n| n * g + local).collect(),
                    node,
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
    /// Backend.
    pub transport: TransportKind,
    /// Names this job's shared-memory segments so that a restart of the same
    /// job removes a crashed run's leftovers (default `ODC_JOB_KEY`, else
    /// `"default"`).
    pub job_key: String,
    /// Store key prefix, so several engines can share one store.
    pub store_prefix: String,
    /// Full or hybrid (intra-node) sharding; equal on every rank.
    pub sharding: Sharding,
    /// The CUDA device a `cuda-ipc` engine uses (default: the rank's local
    /// rank). Ignored by the other transports.
    pub device: Option<usize>,
    /// `nvshmem` only: bytes of symmetric heap to plan beyond this engine's
    /// own data regions, for the engines this process creates later in the
    /// same job, which share this engine's NVSHMEM session (one per
    /// process; its heap is fixed when it starts). Compute it with
    /// [`Engine::heap_bytes`] of those engines (default 0).
    pub heap_reserve: usize,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        let timeout = std::env::var("ODC_TIMEOUT_S")
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s > 0.0)
            .map_or(Duration::from_secs(300), Duration::from_secs_f64);
        let landing_budget = std::env::var("ODC_LANDING_MB")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .filter(|&mb| mb > 0)
            .map_or(crate::control::DEFAULT_LANDING_BUDGET, |mb| {
                mb.saturating_mul(1 << 20)
            });
        EngineConfig {
            chunk_bytes: 2 << 20,
            landing_budget,
            timeout,
            accum_dtype: DType::F32,
            transport: TransportKind::Auto,
            job_key: std::env::var("ODC_JOB_KEY").unwrap_or_else(|_| "default".into()),
            store_prefix: "odc".into(),
            sharding: Sharding::Full,
            device: None,
            heap_reserve: 0,
        }
    }
}

/// A registered bucket's index, as returned by [`Engine::bucket_id`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BucketId(pub usize);

/// Everything that exists after [`Engine::register`].
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
    pub(crate) ctrl: LocalRegion,
    pub(crate) params: LocalRegion,
    pub(crate) accum: Accum,
    /// Hybrid across nodes: the accumulators summed over every node (what
    /// the optimizer reads); empty otherwise.
    pub(crate) reduced: HeapBlock,
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
    /// Highest minibatch + 1 this client finished.
    pub(crate) finished: AtomicU64,
    /// Highest minibatch + 1 whose partial sums this rank handed to the
    /// other nodes (hybrid); they must have read them before the
    /// accumulators change again.
    pub(crate) partials_out: AtomicU64,
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
    /// cross-node sum.
    pub(crate) fn grad_ptr(&self, b: usize) -> (*mut f32, usize) {
        if !self.cross_node() {
            return self.accum_ptr(b);
        }
        let len = self.buckets[b].shard_len();
        // SAFETY: `reduced` has accum_len f32s, the same layout as `accum`.
        let ptr = unsafe { self.reduced.as_ptr().cast::<f32>().add(self.accum_off[b]) };
        (ptr, len)
    }

    /// The accumulator of bucket `b` as a raw pointer and length.
    pub(crate) fn accum_ptr(&self, b: usize) -> (*mut f32, usize) {
        let len = self.buckets[b].shard_len();
        // SAFETY: accum_off[b] + len is within the block (sized at register).
        let ptr = unsafe { self.accum.as_ptr().cast::<f32>().add(self.accum_off[b]) };
        (ptr, len)
    }
}

/// State shared by the worker API and the server daemon.
pub(crate) struct Inner {
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
    /// This client's own slice of the push in progress, for its server.
    pub(crate) own: OwnPush,
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inner")
            .field("topo", &self.topo)
            .field("transport", &self.transport)
            .field("registered", &self.reg.get().is_some())
            .finish_non_exhaustive()
    }
}

/// Pushes in flight from this client: per owner, the next sequence number
/// and the sequence number last written into each of its two slots.
#[derive(Debug)]
pub(crate) struct PushState {
    pub(crate) next_seq: Vec<u64>,
    pub(crate) sent: Vec<[u64; 2]>,
    pub(crate) cursor: Vec<std::ops::Range<usize>>,
    /// Generation of the last own-slice hand-off ([`OwnPush`]).
    pub(crate) own_gen: u64,
}

/// One rank's ODC engine: worker API plus the shard server daemon.
///
/// See the crate docs for the protocol, thread safety and cleanup.
#[derive(Debug)]
pub struct Engine {
    pub(crate) inner: Arc<Inner>,
    pub(crate) push: Mutex<PushState>,
    pub(crate) publish_lock: Mutex<()>,
    register_lock: Mutex<Option<JoinHandle<()>>>,
}

#[derive(Serialize, Deserialize)]
struct RegPost {
    hash: u64,
    chunk_bytes: usize,
    sharding: String,
    local_world: usize,
    accum: String,
    specs: Vec<(String, usize, String)>,
}

#[derive(Serialize, Deserialize)]
struct EndpointPost {
    endpoint: Endpoint,
    regions: Vec<RegionDesc>,
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
fn check_shm_room(transport: &str, topo: &Topology, lens: [usize; 3]) -> Result<()> {
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
                 landing slots {}, published shards {}, accumulators {})",
                lens[0], lens[1], lens[2]
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

fn random_job_id() -> Result<String> {
    use std::io::Read;
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut b)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
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

impl Engine {
    /// Joins the job as `topology.rank()`: agrees on a job id through the
    /// store (rank 0 draws it) and creates this rank's transport.
    pub fn new(store: Arc<dyn Store>, topology: Topology, config: EngineConfig) -> Result<Engine> {
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
        let deadline = Instant::now() + config.timeout;
        let key = format!("{}/job_id", config.store_prefix);
        let job_id = if topology.rank() == 0 {
            let id = random_job_id()?;
            store.set(&key, id.as_bytes())?;
            id
        } else {
            String::from_utf8_lossy(&wait_get(store.as_ref(), &key, deadline)?).into_owned()
        };
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
        Ok(Engine {
            inner: Arc::new(Inner {
                topo: topology,
                config,
                store,
                transport: Arc::from(transport),
                device,
                reg: OnceLock::new(),
                shutdown: AtomicBool::new(false),
                server_error: Arc::new(Mutex::new(None)),
                own: OwnPush::new(),
            }),
            push: Mutex::new(PushState {
                next_seq: vec![0; world],
                sent: vec![[0; 2]; world],
                cursor: vec![0..0; world],
                own_gen: 0,
            }),
            publish_lock: Mutex::new(()),
            register_lock: Mutex::new(None),
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.topo.rank()
    }

    /// D.
    pub fn world(&self) -> usize {
        self.inner.topo.world()
    }

    /// The topology.
    pub fn topology(&self) -> Topology {
        self.inner.topo
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// The transport in use (`"shm"`, `"fabric"`, `"shm+fabric"`,
    /// `"cuda-ipc"`, `"emu-ipc"`).
    pub fn transport_name(&self) -> &'static str {
        match &self.inner.device {
            Some(d) => d.name(),
            None => self.inner.transport.name(),
        }
    }

    /// Whether this engine's data lives in device memory (a device
    /// transport): its worker calls are then the `*_device` ones.
    pub fn is_device(&self) -> bool {
        self.inner.device.is_some()
    }

    /// Registers every bucket: eager and collective, in the same order on
    /// every rank. The lists are compared through the store and a mismatch
    /// fails on every rank naming the first differing bucket. Allocates the
    /// published shards, accumulators, landing slots and control words,
    /// exchanges descriptors, connects to every peer and starts the server.
    pub fn register(&self, specs: &[BucketSpec]) -> Result<()> {
        let mut server = self
            .register_lock
            .lock()
            .map_err(|_| Error::protocol(None, "an earlier register call panicked"))?;
        if self.inner.reg.get().is_some() {
            return Err(Error::protocol(None, "register called twice"));
        }
        let inner = &self.inner;
        let (rank, world) = (inner.topo.rank(), inner.topo.world());
        let deadline = Instant::now() + inner.config.timeout;
        let prefix = &inner.config.store_prefix;
        let groups = Groups::new(&inner.topo, inner.config.sharding);
        let cross_node = groups.replicas.len() > 1;

        let mut buckets = Vec::with_capacity(specs.len());
        let mut names = HashMap::new();
        for (i, s) in specs.iter().enumerate() {
            if names.insert(s.name.clone(), i).is_some() {
                return Err(Error::layout(Some(&s.name), "bucket name registered twice"));
            }
            buckets.push(BucketLayout::new(s.clone(), groups.group.len())?);
        }
        if buckets.is_empty() {
            return Err(Error::layout(None, "register needs at least one bucket"));
        }

        // 1. Compare bucket lists through the store.
        let spec_list: Vec<(String, usize, String)> = specs
            .iter()
            .map(|s| (s.name.clone(), s.numel, s.dtype.name().to_owned()))
            .collect();
        let ctrl_layout = CtrlLayout::new(
            groups.group.len(),
            groups.replicas.len(),
            buckets.len(),
            landing_chunk(
                inner.config.chunk_bytes,
                groups.group.len(),
                inner.config.landing_budget,
            )?,
        );
        let mut post = RegPost {
            hash: 0,
            chunk_bytes: ctrl_layout.chunk_bytes(),
            sharding: inner.config.sharding.name().into(),
            local_world: inner.topo.local_world(),
            accum: inner.config.accum_dtype.name().into(),
            specs: spec_list,
        };
        post.hash = fnv1a(&json("reg", &post.specs)?);
        let my_key = format!("{prefix}/reg/{rank}");
        // Shared memory for every rank of this host, checked before any
        // rank of the job allocates (each waits for every post below): a
        // /dev/shm too small fails here, on every rank, naming the bytes.
        let (params_off, accum_off, params_len, accum_len) = offsets(&buckets);
        let on_device = inner.device.is_some();
        let host_params_len = if on_device { 0 } else { params_len };
        let accum_region = if cross_node && !on_device {
            accum_len * 4
        } else {
            0
        };
        if let Err(e) = check_shm_room(
            inner.transport.name(),
            &inner.topo,
            [ctrl_layout.len(), host_params_len, accum_region],
        ) {
            post_failure(inner.store.as_ref(), &my_key, &e);
            return Err(e);
        }
        inner.store.set(&my_key, &json(&my_key, &post)?)?;
        for peer in 0..world {
            let key = format!("{prefix}/reg/{peer}");
            let theirs: RegPost =
                parse_post(&key, peer, &wait_get(inner.store.as_ref(), &key, deadline)?)?;
            if theirs.hash != post.hash || theirs.specs != post.specs {
                let n = post.specs.len().max(theirs.specs.len());
                let show = |l: &[(String, usize, String)], i: usize| {
                    l.get(i).map_or("<none>".to_owned(), |(a, b, c)| {
                        format!("{a} numel={b} dtype={c}")
                    })
                };
                let i = (0..n)
                    .find(|&i| post.specs.get(i) != theirs.specs.get(i))
                    .unwrap_or(0);
                return Err(Error::Registration {
                    peer,
                    first_differing_bucket: i,
                    ours: show(&post.specs, i),
                    theirs: show(&theirs.specs, i),
                });
            }
            if theirs.sharding != post.sharding || theirs.local_world != post.local_world {
                return Err(Error::Config(format!(
                    "rank {peer} uses {} sharding with {} ranks per node, this rank {} sharding with {}",
                    theirs.sharding, theirs.local_world, post.sharding, post.local_world
                )));
            }
            if theirs.chunk_bytes != post.chunk_bytes || theirs.accum != post.accum {
                return Err(Error::Config(format!(
                    "rank {peer} uses chunk_bytes {} / accumulation {}, this rank {} / {}",
                    theirs.chunk_bytes, theirs.accum, post.chunk_bytes, post.accum
                )));
            }
        }

        // 2. Allocate (a device engine keeps only its control words in host
        // memory). A failure is posted where the peers wait for this
        // rank's endpoint, so they fail at once naming it.
        let my_key = format!("{prefix}/ep/{rank}");
        let allocated = (|| -> Result<_> {
            let ctrl = inner.transport.register(CTRL_REGION, ctrl_layout.len())?;
            let params = inner.transport.register(PARAMS_REGION, host_params_len)?;
            let (accum, reduced) = if on_device {
                (Accum::Heap(HeapBlock::zeroed(0)?), HeapBlock::zeroed(0)?)
            } else if cross_node {
                (
                    Accum::Region(inner.transport.register(ACCUM_REGION, accum_region)?),
                    HeapBlock::zeroed(accum_len * 4)?,
                )
            } else {
                (
                    Accum::Heap(HeapBlock::zeroed(accum_len * 4)?),
                    HeapBlock::zeroed(0)?,
                )
            };
            Ok((ctrl, params, accum, reduced))
        })();
        let (ctrl, params, accum, reduced) = match allocated {
            Ok(a) => a,
            Err(e) => {
                post_failure(inner.store.as_ref(), &my_key, &e);
                return Err(e);
            }
        };

        // 3. Exchange descriptors and connect to every rank (this one too).
        let mut regions = vec![ctrl.desc(), params.desc()];
        if let Accum::Region(r) = &accum {
            regions.push(r.desc());
        }
        let ep = EndpointPost {
            endpoint: inner.transport.endpoint(),
            regions,
        };
        inner.store.set(&my_key, &json(&my_key, &ep)?)?;
        let my_host = ep.endpoint.host.clone();
        let (mut peer_ctrl, mut peer_params, mut peer_pid) = (Vec::new(), Vec::new(), Vec::new());
        let mut peer_accum = Vec::with_capacity(world);
        for peer in 0..world {
            let key = format!("{prefix}/ep/{peer}");
            let theirs: EndpointPost =
                parse_post(&key, peer, &wait_get(inner.store.as_ref(), &key, deadline)?)?;
            let find = |id: u32| {
                theirs
                    .regions
                    .iter()
                    .copied()
                    .find(|r| r.id == id)
                    .ok_or_else(|| Error::Store {
                        op: "get",
                        key: key.clone(),
                        detail: format!("rank {peer} published no region {id}"),
                    })
            };
            let (c, p) = (find(CTRL_REGION)?, find(PARAMS_REGION)?);
            if c.len < ctrl_layout.len() as u64 || p.len < host_params_len as u64 {
                return Err(Error::Config(format!(
                    "rank {peer} registered regions of a different size"
                )));
            }
            let a = if cross_node && groups.replicas.contains(&peer) {
                let a = find(ACCUM_REGION)?;
                if a.len < (accum_len * 4) as u64 {
                    return Err(Error::Config(format!(
                        "rank {peer} registered accumulators of a different size"
                    )));
                }
                Some(a)
            } else {
                None
            };
            if inner.transport.name() == "shm" && theirs.endpoint.host != my_host {
                return Err(Error::Config(format!(
                    "rank {peer} runs on host {:?}, this rank on {my_host:?}: the shm transport \
                     reaches only ranks on this host (use transport \"auto\" or \"fabric\")",
                    theirs.endpoint.host
                )));
            }
            inner
                .transport
                .connect(peer, &theirs.endpoint, &theirs.regions)?;
            peer_ctrl.push(c);
            peer_params.push(p);
            peer_pid.push(theirs.endpoint.pid);
            peer_accum.push(a);
        }
        // Every rank has mapped every segment before anyone may drop (and
        // unlink) its own: the one barrier, at setup only.
        let my_key = format!("{prefix}/connected/{rank}");
        inner.store.set(&my_key, b"1")?;
        let keys: Vec<String> = (0..world)
            .map(|p| format!("{prefix}/connected/{p}"))
            .collect();
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        inner.store.wait(&keys, deadline)?;
        let plane = match &inner.device {
            None => None,
            Some(device) => {
                let sizes = DataSizes {
                    params: params_len,
                    landing: ctrl_layout.landing_len(),
                    accum: accum_len * 4,
                };
                debug_assert_eq!(
                    Some(sizes),
                    Engine::data_sizes(specs, &inner.topo, &inner.config).ok()
                );
                let left = deadline.saturating_duration_since(Instant::now());
                Some(device.connect(
                    inner.store.as_ref(),
                    prefix,
                    &inner.config.job_key,
                    rank,
                    &groups.group,
                    sizes,
                    left,
                )?)
            }
        };
        let nb = buckets.len();
        let group_ctrl = groups.group.iter().map(|&r| (r, peer_ctrl[r])).collect();
        let reg = Registered {
            groups,
            buckets,
            names,
            ctrl_layout,
            params_off,
            accum_off,
            ctrl,
            params,
            accum,
            reduced,
            accum_len,
            peer_accum,
            peer_ctrl,
            group_ctrl,
            peer_params,
            peer_pid,
            plane,
            released: (0..nb).map(|_| AtomicU64::new(0)).collect(),
            finished: AtomicU64::new(0),
            partials_out: AtomicU64::new(0),
        };
        if inner.reg.set(reg).is_err() {
            return Err(Error::protocol(None, "register called twice"));
        }

        // 4. Start the shard server daemon.
        let daemon = Arc::clone(&self.inner);
        let handle = std::thread::Builder::new()
            .name(format!("odc-server-{rank}"))
            .spawn(move || crate::server::run(&daemon))?;
        *server = Some(handle);
        Ok(())
    }

    /// The data regions an engine with `config` on `topology` allocates
    /// for `specs` on a device transport: published shards, landing slots,
    /// f32 accumulators (the figures `register` gives the plane).
    ///
    /// Errors: as [`register`](Self::register) for a bad bucket list.
    pub fn data_sizes(
        specs: &[BucketSpec],
        topology: &Topology,
        config: &EngineConfig,
    ) -> Result<DataSizes> {
        let groups = Groups::new(topology, config.sharding);
        let buckets = specs
            .iter()
            .map(|s| BucketLayout::new(s.clone(), groups.group.len()))
            .collect::<Result<Vec<_>>>()?;
        let (_, _, params, accum) = offsets(&buckets);
        let ctrl = CtrlLayout::new(
            groups.group.len(),
            groups.replicas.len(),
            buckets.len(),
            landing_chunk(
                config.chunk_bytes,
                groups.group.len(),
                config.landing_budget,
            )?,
        );
        Ok(DataSizes {
            params,
            landing: ctrl.landing_len(),
            accum: accum * 4,
        })
    }

    /// The symmetric-heap bytes an `nvshmem` engine with `config` on
    /// `topology` takes for `specs`: what an earlier engine of the same
    /// process reserves ([`EngineConfig::heap_reserve`]) for it.
    pub fn heap_bytes(
        specs: &[BucketSpec],
        topology: &Topology,
        config: &EngineConfig,
    ) -> Result<usize> {
        Ok(Engine::data_sizes(specs, topology, config)?
            .heap_plan()
            .used_bytes())
    }

    /// The id of the bucket named `name`.
    pub fn bucket_id(&self, name: &str) -> Result<BucketId> {
        let reg = self.inner.registered()?;
        reg.names
            .get(name)
            .map(|&i| BucketId(i))
            .ok_or_else(|| Error::layout(Some(name), "unknown bucket"))
    }

    /// The layout of bucket `id`.
    pub fn bucket(&self, id: BucketId) -> Result<&BucketLayout> {
        self.inner.registered()?.bucket(id)
    }

    /// Every registered bucket, in registration order.
    pub fn buckets(&self) -> Result<&[BucketLayout]> {
        Ok(&self.inner.registered()?.buckets)
    }
}

impl Inner {
    pub(crate) fn registered(&self) -> Result<&Registered> {
        self.reg.get().ok_or_else(|| {
            Error::protocol(
                None,
                "the engine has no registered buckets; call register first",
            )
        })
    }

    /// Waits until `check` reports nothing pending (`Ok(None)`); while it
    /// names a lagging peer, spins briefly, then sleeps on this rank's
    /// client bell, probing that peer's liveness every 50 ms, until the
    /// configured deadline.
    pub(crate) fn wait(
        &self,
        bucket: Option<&str>,
        waited_for: &dyn Fn() -> String,
        mut check: impl FnMut() -> Result<Option<usize>>,
    ) -> Result<()> {
        let mut backoff = Backoff::new();
        let start = Instant::now();
        let deadline = start + self.config.timeout;
        let mut next_probe = start;
        loop {
            if check()?.is_none() {
                return Ok(());
            }
            if !backoff.is_completed() {
                backoff.snooze();
                continue;
            }
            let epoch = self.transport.bell_epoch(Bell::Client);
            let lagging = match check()? {
                None => return Ok(()),
                Some(p) => p,
            };
            let now = Instant::now();
            if now >= next_probe {
                next_probe = now + LIVENESS_PERIOD;
                if let Some((root, err)) = self.probe(lagging, bucket, waited_for) {
                    // A peer may deliver what we wait for and then close its
                    // engine between the check above and the probe: it
                    // signals before it closes, so look once more.
                    if check()?.is_none() {
                        return Ok(());
                    }
                    self.transport.set_blame(root);
                    return Err(err);
                }
            }
            if now >= deadline {
                self.transport.set_blame(lagging);
                return Err(Error::PeerTimeout {
                    peer: lagging,
                    bucket: bucket.map(str::to_owned),
                    waited_for: waited_for(),
                    after: now - start,
                });
            }
            let nap = LIVENESS_PERIOD.min(deadline - now);
            self.transport.bell_wait(Bell::Client, epoch, nap)?;
        }
    }

    /// Resolves an error a transport call returned: a `PeerDied` that names
    /// the peer the call went to is re-attributed to the root cause that peer
    /// reported (it may have closed its engine because a third rank died),
    /// and recorded as this rank's blame, so that every survivor names the
    /// same rank. Every transport data call goes through here.
    pub(crate) fn attribute(&self, bucket: Option<&str>, err: Error) -> Error {
        let Error::PeerDied {
            peer,
            reported_by: None,
            waited_for,
            ..
        } = &err
        else {
            return err;
        };
        let peer = *peer;
        match self.probe(peer, bucket, &|| waited_for.clone()) {
            Some((root, resolved)) => {
                self.transport.set_blame(root);
                resolved
            }
            None => {
                self.transport.set_blame(peer);
                err
            }
        }
    }

    /// Checks `peer`'s liveness; for a dead peer returns the rank to blame
    /// (the root cause it reported, or itself) and the error to raise.
    fn probe(
        &self,
        peer: usize,
        bucket: Option<&str>,
        waited_for: &dyn Fn() -> String,
    ) -> Option<(usize, Error)> {
        match self.transport.peer_status(peer) {
            PeerStatus::Alive => None,
            PeerStatus::Dead { pid, blamed } => {
                let me = self.topo.rank();
                let (root, pid, reported_by) = match blamed {
                    Some(b) if b != me && b != peer && b < self.topo.world() => {
                        let pid = self
                            .reg
                            .get()
                            .and_then(|r| r.peer_pid.get(b).copied())
                            .unwrap_or(0);
                        (b, pid, Some(peer))
                    }
                    _ => (peer, pid, None),
                };
                Some((
                    root,
                    Error::PeerDied {
                        peer: root,
                        pid,
                        bucket: bucket.map(str::to_owned),
                        waited_for: waited_for(),
                        reported_by,
                    },
                ))
            }
        }
    }

    pub(crate) fn record_server_error(&self, msg: String) {
        record_error(&self.server_error, msg);
    }

    pub(crate) fn take_server_error(&self) -> Option<String> {
        self.server_error.lock().ok().and_then(|s| s.clone())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.inner.shutdown.store(true, Ordering::Release);
        self.inner.transport.ring(Bell::Server);
        let handle = match self.register_lock.get_mut() {
            Ok(h) => h.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        if let Some(h) = handle {
            if h.join().is_err() {
                eprintln!(
                    "odc: rank {}: server thread panicked",
                    self.inner.topo.rank()
                );
            }
        }
        if let Some(e) = self.inner.take_server_error() {
            eprintln!("odc: rank {}: server reported: {e}", self.inner.topo.rank());
        }
    }
}

/// Keeps the first error reported into `slot` (by the daemon, or by work
/// on a stream that runs after the call that enqueued it returned).
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
