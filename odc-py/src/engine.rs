//! Bindings for the `odc-core` engine: `odc._odc.Engine`, and
//! `odc._odc.EmuStream` (an emulated stream for the `emu-ipc` transport).
//!
//! One file because pyo3 takes one `#[pymethods]` block per class (more
//! need its `multiple-pymethods` feature and the inventory crate): the host
//! calls, the device calls and the accessors of `Engine` all live in it.
//!
//! Tensors cross the boundary as raw pointers with byte lengths: the Python
//! layer (`odc.engine`) checks device, contiguity and dtype and passes
//! `tensor.data_ptr()` / `nbytes`. No copy happens on the Python side, and
//! every call that may block releases the GIL.
//!
//! A device engine (`cuda-ipc`, `emu-ipc`) takes the `*_device` methods:
//! the same arguments plus a trailing stream handle (a `CUstream` as torch's
//! `torch.cuda.current_stream().cuda_stream` gives it, or an
//! [`PyEmuStream`]'s `handle`). Their pointers are device addresses: they
//! are checked for null and alignment here and never dereferenced on the
//! host; the data moves on the stream after the call returns.
//!
//! The rendezvous store is any Python object with torch's `dist.Store`
//! methods (`set`, `get`, `check`, `add`, and `multi_get` where it has
//! it): [`PyStore`] adapts it to
//! [`odc_core::Store`]. Waits poll `check` with the GIL released between
//! polls, so a rank waiting at setup never blocks the interpreter.

use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use odc_core::elastic::Generation;
use odc_core::plane::emu::EmuStream;
use odc_core::protocol::claims::Claim;
use odc_core::protocol::compress::{Compress, Scope};
use odc_core::{
    BucketId, BucketSpec, CrossNode, DType, Engine, EngineConfig, Sharding, Store, Topology,
    TransportKind,
};
use odc_kernels::cpu::quant::{Format, Spec};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::{core_error, odc_error};

/// torch's `dist.Store` (or any object with its methods) as an ODC store.
struct PyStore {
    obj: Py<PyAny>,
}

fn store_err(op: &'static str, key: &str, e: PyErr) -> odc_core::Error {
    odc_core::Error::Store {
        op,
        key: key.to_owned(),
        detail: e.to_string(),
    }
}

impl Store for PyStore {
    fn set(&self, key: &str, value: &[u8]) -> odc_core::Result<()> {
        Python::attach(|py| {
            self.obj
                .bind(py)
                .call_method1("set", (key, PyBytes::new(py, value)))
                .map(|_| ())
                .map_err(|e| store_err("set", key, e))
        })
    }

    fn get(&self, key: &str) -> odc_core::Result<Option<Vec<u8>>> {
        Python::attach(|py| {
            let obj = self.obj.bind(py);
            let present: bool = obj
                .call_method1("check", (vec![key],))
                .and_then(|v| v.extract())
                .map_err(|e| store_err("get", key, e))?;
            if !present {
                return Ok(None);
            }
            let v = obj
                .call_method1("get", (key,))
                .map_err(|e| store_err("get", key, e))?;
            v.extract::<Vec<u8>>()
                .map(Some)
                .map_err(|e| store_err("get", key, e))
        })
    }

    fn wait(&self, keys: &[&str], deadline: Instant) -> odc_core::Result<()> {
        let keys: Vec<String> = keys.iter().map(|k| (*k).to_owned()).collect();
        let mut nap = Duration::from_micros(200);
        loop {
            let ready = Python::attach(|py| {
                self.obj
                    .bind(py)
                    .call_method1("check", (keys.clone(),))
                    .and_then(|v| v.extract::<bool>())
                    .map_err(|e| store_err("wait", &keys.join(","), e))
            })?;
            if ready {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(odc_core::Error::Store {
                    op: "wait",
                    key: keys.join(","),
                    detail: "deadline passed before every key was set (is every rank running?)"
                        .into(),
                });
            }
            std::thread::sleep(nap.min(deadline - now));
            nap = (nap * 2).min(Duration::from_millis(20));
        }
    }

    fn add(&self, key: &str, delta: i64) -> odc_core::Result<i64> {
        Python::attach(|py| {
            self.obj
                .bind(py)
                .call_method1("add", (key, delta))
                .and_then(|v| v.extract::<i64>())
                .map_err(|e| store_err("add", key, e))
        })
    }

    /// torch's `Store.compare_set`: its expected value `""` stands for an
    /// unset key (the values compared are never empty).
    fn compare_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: &[u8],
    ) -> odc_core::Result<Vec<u8>> {
        Python::attach(|py| {
            let want = PyBytes::new(py, expected.unwrap_or_default());
            self.obj
                .bind(py)
                .call_method1("compare_set", (key, want, PyBytes::new(py, desired)))
                .and_then(|v| v.extract::<Vec<u8>>())
                .map_err(|e| store_err("compare_set", key, e))
        })
    }

    /// torch's `Store.multi_get` (one request for every rank's post), or
    /// the keys one by one on a store object without it.
    fn multi_get(&self, keys: &[&str]) -> odc_core::Result<Vec<Vec<u8>>> {
        let first = keys.first().copied().unwrap_or_default();
        let batched = Python::attach(|py| -> odc_core::Result<Option<Vec<Vec<u8>>>> {
            let obj = self.obj.bind(py);
            if !obj
                .hasattr("multi_get")
                .map_err(|e| store_err("multi_get", first, e))?
            {
                return Ok(None);
            }
            obj.call_method1("multi_get", (keys.to_vec(),))
                .and_then(|v| v.extract::<Vec<Vec<u8>>>())
                .map(Some)
                .map_err(|e| store_err("multi_get", first, e))
        })?;
        match batched {
            Some(values) => Ok(values),
            None => odc_core::store::get_each(self, keys),
        }
    }
}

pub(crate) fn parse_dtype(py: Python<'_>, s: &str) -> PyResult<DType> {
    s.parse::<DType>()
        .map_err(|e| odc_error(py, "LayoutError", e.to_string()))
}

/// A byte view of caller memory.
///
/// # Safety
/// `ptr` must point to `nbytes` readable bytes that stay valid and are not
/// written by anyone else for the returned lifetime.
unsafe fn bytes<'a>(ptr: usize, nbytes: usize) -> &'a [u8] {
    if nbytes == 0 {
        return &[];
    }
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts(ptr as *const u8, nbytes) }
}

/// A mutable byte view of caller memory.
///
/// # Safety
/// `ptr` must point to `nbytes` writable bytes that stay valid and are not
/// accessed by anyone else for the returned lifetime.
unsafe fn bytes_mut<'a>(ptr: usize, nbytes: usize) -> &'a mut [u8] {
    if nbytes == 0 {
        return &mut [];
    }
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, nbytes) }
}

/// A mutable f32 view of caller memory.
///
/// # Safety
/// `ptr` must point to `numel` writable, 4-byte aligned f32s that stay valid
/// and are not accessed by anyone else for the returned lifetime.
unsafe fn f32s_mut<'a>(ptr: usize, numel: usize) -> &'a mut [f32] {
    if numel == 0 {
        return &mut [];
    }
    // SAFETY: guaranteed by the caller.
    unsafe { std::slice::from_raw_parts_mut(ptr as *mut f32, numel) }
}

/// `t` seconds as a duration, or a `ConfigError` naming `what` unless positive and finite.
fn positive_seconds(py: Python<'_>, what: &str, t: f64) -> PyResult<Duration> {
    if !(t.is_finite() && t > 0.0) {
        return Err(odc_error(
            py,
            "ConfigError",
            format!("{what} must be positive seconds, got {t}"),
        ));
    }
    Ok(Duration::from_secs_f64(t))
}

fn check_ptr(py: Python<'_>, ptr: usize, nbytes: usize, align: usize) -> PyResult<()> {
    if nbytes > 0 && (ptr == 0 || ptr % align != 0) {
        return Err(odc_error(
            py,
            "LayoutError",
            format!("buffer pointer {ptr:#x} is null or not aligned to {align} bytes"),
        ));
    }
    Ok(())
}

/// Every transport name `Engine(transport=...)` accepts.
const TRANSPORT_NAMES: [&str; 8] = [
    "auto",
    "shm",
    "fabric",
    "mixed",
    "cuda-ipc",
    "emu-ipc",
    "nvshmem",
    "emu-shmem",
];

/// One rank's ODC engine (private: use `odc.Engine`).
#[pyclass(module = "odc._odc", name = "Engine", frozen)]
pub(crate) struct PyEngine {
    engine: Engine,
}

/// Runs engine work with the GIL released, on behalf of `rank`'s `Engine.{what}`. An engine error
/// raises its class; a panic (a bug in ODC) raises `InternalError` naming the rank and the call, where
/// pyo3 would raise a `PanicException` (a `BaseException`) naming neither.
fn detached<T: Send>(
    py: Python<'_>,
    rank: usize,
    what: &str,
    work: impl FnOnce() -> odc_core::Result<T> + Send,
) -> PyResult<T> {
    let ran = py.detach(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)));
    match ran {
        Ok(result) => result.map_err(|e| core_error(py, e)),
        Err(payload) => Err(core_error(
            py,
            odc_core::Error::from_panic(rank, format!("in Engine.{what}"), payload),
        )),
    }
}

impl PyEngine {
    /// [`detached`] for this engine's rank.
    fn detached<T: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        work: impl FnOnce() -> odc_core::Result<T> + Send,
    ) -> PyResult<T> {
        detached(py, self.engine.rank(), what, work)
    }

    /// The engine's host worker handle (a device engine refuses, naming the right calls).
    fn host_calls(&self, py: Python<'_>) -> PyResult<odc_core::Host<'_>> {
        if self.engine.is_device() {
            return Err(odc_error(
                py,
                "ConfigError",
                format!(
                    "this engine's data lives in device memory ({}): use the *_device calls \
                     (publish_device, gather_device, scatter_accumulate_device, ...)",
                    self.engine.transport_name()
                ),
            ));
        }
        self.engine.host().map_err(|e| core_error(py, e))
    }

    /// The engine's device worker handle (a host engine refuses).
    fn device_calls(&self, py: Python<'_>) -> PyResult<odc_core::Device<'_>> {
        if !self.engine.is_device() {
            return Err(odc_error(
                py,
                "ConfigError",
                format!(
                    "this engine's data lives in host memory ({}): the *_device calls need a \
                     device transport (cuda-ipc, nvshmem, emu-ipc, emu-shmem)",
                    self.engine.transport_name()
                ),
            ));
        }
        self.engine.device().map_err(|e| core_error(py, e))
    }
}

/// A `dict` of `key => value` pairs (each value converted to Python); `?`
/// on a failed insert.
macro_rules! py_dict {
    ($py:expr, $($k:literal => $v:expr),* $(,)?) => {{
        let d = PyDict::new($py);
        $(d.set_item($k, $v)?;)*
        d
    }};
}

/// `compress=` as `odc.Engine` passes it: (push format, gather format,
/// block size, error feedback, scope), checked there for unknown keys.
type CompressArgs = (Option<String>, Option<String>, usize, bool, String);

/// The engine's compressed-chunk setting from [`CompressArgs`].
fn parse_compress(
    py: Python<'_>,
    (push, gather, block, feedback, scope): CompressArgs,
) -> PyResult<Compress> {
    let config = |msg: String| odc_error(py, "ConfigError", msg);
    let spec = |what: &str, name: Option<String>| -> PyResult<Option<Spec>> {
        let Some(name) = name else { return Ok(None) };
        let format =
            Format::from_str(&name).map_err(|e| config(format!("compress {what}: {e}")))?;
        Spec::new(format, block)
            .map(Some)
            .map_err(|e| config(format!("compress {what}: {e}")))
    };
    let scope = Scope::parse(&scope).ok_or_else(|| {
        config(format!(
            "compress scope {scope:?}: expected one of {}",
            Scope::NAMES.join(", ")
        ))
    })?;
    Ok(Compress {
        push: spec("push", push)?,
        gather: spec("gather", gather)?,
        feedback,
        scope,
    })
}

#[pymethods]
impl PyEngine {
    /// Joins the job as `rank` of `world_size` through `store`.
    #[new]
    #[pyo3(signature = (store, rank, world_size, *, local_world_size=None, chunk_bytes=None, timeout=None, job_key=None, prefix=None, transport=None, sharding=None, device=None, heap_reserve=None, deterministic=false, cross_node=None, node_cache_mb=None, elastic=false, members=None, register_timeout=None, compress=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        store: Py<PyAny>,
        rank: usize,
        world_size: usize,
        local_world_size: Option<usize>,
        chunk_bytes: Option<usize>,
        timeout: Option<f64>,
        job_key: Option<String>,
        prefix: Option<String>,
        transport: Option<String>,
        sharding: Option<String>,
        device: Option<usize>,
        heap_reserve: Option<usize>,
        deterministic: bool,
        cross_node: Option<String>,
        node_cache_mb: Option<f64>,
        elastic: bool,
        members: Option<Vec<usize>>,
        register_timeout: Option<f64>,
        compress: Option<CompressArgs>,
    ) -> PyResult<Self> {
        let topo = Topology::new(rank, world_size, local_world_size.unwrap_or(world_size))
            .map_err(|e| core_error(py, e))?;
        let mut cfg = EngineConfig::default();
        if let Some(c) = chunk_bytes {
            cfg.chunk_bytes = c;
        }
        if let Some(t) = timeout {
            cfg.timeout = positive_seconds(py, "timeout", t)?;
        }
        if let Some(k) = job_key {
            cfg.job_key = k;
        }
        if let Some(p) = prefix {
            cfg.store_prefix = p;
        }
        if let Some(t) = transport {
            cfg.transport = TransportKind::parse(&t).ok_or_else(|| {
                odc_error(
                    py,
                    "ConfigError",
                    format!(
                        "unknown transport {t:?}: expected one of {}",
                        TRANSPORT_NAMES.join(", ")
                    ),
                )
            })?;
        }
        if let Some(s) = sharding {
            cfg.sharding = parse_sharding(py, &s)?;
        }
        cfg.device = device;
        cfg.heap_reserve = heap_reserve.unwrap_or(0);
        cfg.deterministic = deterministic;
        cfg.elastic = elastic;
        if let Some(t) = register_timeout {
            cfg.register_timeout = Some(positive_seconds(py, "register_timeout", t)?);
        }
        if let Some(ms) = members {
            let mut set = 0u64;
            for n in ms {
                if n >= topo.nodes() {
                    return Err(odc_error(
                        py,
                        "ConfigError",
                        format!(
                            "members: node {n} is not one of the job's {} nodes",
                            topo.nodes()
                        ),
                    ));
                }
                set |= 1 << n;
            }
            cfg.members = Some(set);
        }
        if let Some(c) = cross_node {
            cfg.cross_node = CrossNode::parse(&c).ok_or_else(|| {
                odc_error(
                    py,
                    "ConfigError",
                    format!(
                        "unknown cross_node {c:?}: expected one of {}",
                        CrossNode::NAMES.join(", ")
                    ),
                )
            })?;
        }
        if let Some(mb) = node_cache_mb {
            cfg.node_cache = Some(odc_core::node_cache_bytes(mb).ok_or_else(|| {
                odc_error(
                    py,
                    "ConfigError",
                    format!("node_cache_mb={mb}: expected a finite number of MiB, 0 or more"),
                )
            })?);
        }
        if let Some(c) = compress {
            cfg.compress = Some(parse_compress(py, c)?);
        }
        let store: Arc<dyn Store> = Arc::new(PyStore { obj: store });
        let engine = detached(py, rank, "__init__", || Engine::new(store, topo, cfg))?;
        Ok(PyEngine { engine })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.engine.rank()
    }

    /// How gradients for owners on other nodes cross (`"direct"` or
    /// `"node"`, resolved at registration; `"auto"` before).
    #[getter]
    fn cross_node(&self) -> &'static str {
        self.engine.cross_node().name()
    }

    /// Bytes this rank's gathers read from, its pushes sent to and its
    /// cross-node sum (hybrid) read from other nodes since the engine
    /// started (`None` on a device engine).
    fn bytes_across_nodes(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let Some(b) = self
            .engine
            .bytes_across_nodes()
            .map_err(|e| core_error(py, e))?
        else {
            return Ok(None);
        };
        let d = py_dict!(py, "gathered" => b.gathered, "pushed" => b.pushed, "summed" => b.summed);
        Ok(Some(d.into_any().unbind()))
    }

    /// What this rank's gathers did with the node cache (`None` without
    /// one): counts of pieces since registration.
    fn node_cache_stats(&self, py: Python<'_>) -> PyResult<Option<Py<PyAny>>> {
        let Some(s) = self.engine.node_cache_stats() else {
            return Ok(None);
        };
        let d = py_dict!(py, "bytes" => s.bytes, "slots" => s.slots, "entries" => s.entries,
            "fetched" => s.fetched, "hits" => s.hits, "waited" => s.waited, "direct" => s.direct,
            "taken_over" => s.taken_over);
        Ok(Some(d.into_any().unbind()))
    }

    /// Elastic hybrid sharding: the member nodes (`None` unless elastic).
    #[getter]
    fn members(&self) -> Option<Vec<usize>> {
        self.engine.members()
    }

    /// Elastic hybrid sharding: `(minibatch, nodes)` a committed round
    /// admitted from that minibatch on (`None` until one does).
    fn admitted(&self) -> Option<(u64, Vec<usize>)> {
        self.engine.admitted()
    }

    /// Elastic hybrid sharding: forgets the admission `admitted` reports
    /// (its generation was abandoned).
    fn clear_admitted(&self) {
        self.engine.clear_admitted();
    }

    /// Elastic rejoin: serves this rank's replica state (`nbytes` at `ptr`)
    /// to `readers`, at the start of a generation.
    fn serve_state(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        readers: Vec<usize>,
    ) -> PyResult<()> {
        let host = self.host_calls(py)?;
        check_ptr(py, ptr, nbytes, 1)?;
        // SAFETY: as in `publish`.
        let state = unsafe { bytes(ptr, nbytes) };
        self.detached(py, "serve_state", || host.serve_state(state, &readers))
    }

    /// Elastic rejoin: reads rank `source`'s replica state into `nbytes` at
    /// `ptr`.
    fn read_state(&self, py: Python<'_>, source: usize, ptr: usize, nbytes: usize) -> PyResult<()> {
        let host = self.host_calls(py)?;
        check_ptr(py, ptr, nbytes, 1)?;
        // SAFETY: as in `gather`.
        let out = unsafe { bytes_mut(ptr, nbytes) };
        self.detached(py, "read_state", || host.read_state(source, out))
    }

    /// Elastic hybrid sharding: the node drops this rank saw, oldest first.
    fn elastic_events(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        (self.engine.elastic_events().into_iter())
            .map(|e| {
                let d = py_dict!(py, "minibatch" => e.minibatch, "epoch" => e.epoch, "node" => e.node,
                    "members" => e.members, "detected_s" => e.detected_s,
                    "recovered_s" => e.recovered_s);
                Ok(d.into_any().unbind())
            })
            .collect()
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.engine.world()
    }

    /// The transport in use (`"auto"` resolved); a device engine's is
    /// `"cuda-ipc"`, `"nvshmem"`, `"emu-ipc"` or `"emu-shmem"`.
    #[getter]
    fn transport(&self) -> &'static str {
        if self.engine.is_device() {
            return self.engine.transport_name();
        }
        let kind = self.engine.config().transport;
        kind.resolve(&self.engine.topology()).name()
    }

    /// Whether the engine's data lives in device memory: its data calls are
    /// then the `*_device` methods.
    #[getter]
    fn is_device(&self) -> bool {
        self.engine.is_device()
    }

    /// The CUDA ordinal asked for (`None`: the local rank's); only
    /// `cuda-ipc` and `nvshmem` use it.
    #[getter]
    fn device(&self) -> Option<usize> {
        self.engine.config().device
    }

    #[getter]
    fn sharding(&self) -> &'static str {
        self.engine.config().sharding.name()
    }

    /// Whether gradients accumulate exactly, the same bits in any order.
    #[getter]
    fn deterministic(&self) -> bool {
        self.engine.config().deterministic
    }

    #[getter]
    fn local_world_size(&self) -> usize {
        self.engine.topology().local_world()
    }

    #[getter]
    fn chunk_bytes(&self) -> usize {
        self.engine.config().chunk_bytes
    }

    #[getter]
    fn timeout(&self) -> f64 {
        self.engine.config().timeout.as_secs_f64()
    }

    /// Registers `buckets` (a list of `(name, numel, dtype)`), collectively.
    fn register(&self, py: Python<'_>, buckets: Vec<(String, usize, String)>) -> PyResult<()> {
        let mut specs = Vec::with_capacity(buckets.len());
        for (name, numel, dtype) in buckets {
            specs.push(BucketSpec::new(name, numel, parse_dtype(py, &dtype)?));
        }
        self.detached(py, "register", || self.engine.register(&specs))
    }

    /// The index of the bucket called `name`.
    fn bucket_id(&self, py: Python<'_>, name: &str) -> PyResult<usize> {
        self.engine
            .bucket_id(name)
            .map(|b| b.0)
            .map_err(|e| core_error(py, e))
    }

    /// Layout of bucket `bucket`: name, numel, dtype, shard_len, padded_len,
    /// blocks, piece_len (what a publish takes and the gradient holds).
    fn bucket_info<'py>(&self, py: Python<'py>, bucket: usize) -> PyResult<Bound<'py, PyDict>> {
        let b = self
            .engine
            .bucket(BucketId(bucket))
            .map_err(|e| core_error(py, e))?;
        let d = PyDict::new(py);
        d.set_item("name", b.name())?;
        d.set_item("numel", b.numel())?;
        d.set_item("dtype", b.dtype().name())?;
        d.set_item("shard_len", b.shard_len())?;
        d.set_item("padded_len", b.padded_len())?;
        d.set_item("blocks", b.blocks())?;
        d.set_item("piece_len", b.block_len())?;
        Ok(d)
    }

    /// Number of registered buckets.
    fn num_buckets(&self, py: Python<'_>) -> PyResult<usize> {
        self.engine
            .buckets()
            .map(|b| b.len())
            .map_err(|e| core_error(py, e))
    }

    /// Publishes this rank's shard (`nbytes` at `ptr`) as `version`.
    fn publish(
        &self,
        py: Python<'_>,
        bucket: usize,
        ptr: usize,
        nbytes: usize,
        dtype: &str,
        version: u64,
    ) -> PyResult<()> {
        let host = self.host_calls(py)?;
        let dtype = parse_dtype(py, dtype)?;
        check_ptr(py, ptr, nbytes, dtype.size_bytes())?;
        // SAFETY: `odc.engine` passes a live, contiguous tensor of `nbytes`
        // bytes and holds a reference to it until this call returns, so the
        // memory stays allocated. The GIL is released below, so nothing stops
        // another Python thread from touching the tensor meanwhile: the
        // contract of `odc.engine` (its module doc, "Threads") is that a
        // tensor handed to a call is not written by anyone until it returns,
        // as for torch's own kernels, which also run without the GIL.
        let shard = unsafe { bytes(ptr, nbytes) };
        self.detached(py, "publish", || {
            host.publish(BucketId(bucket), shard, dtype, version)
        })
    }

    /// Gathers `version` of the bucket into `nbytes` at `ptr`; with
    /// `skip_own` this rank's shard range is left as it is.
    #[pyo3(signature = (bucket, version, ptr, nbytes, dtype, skip_own=false))]
    #[allow(clippy::too_many_arguments)]
    fn gather(
        &self,
        py: Python<'_>,
        bucket: usize,
        version: u64,
        ptr: usize,
        nbytes: usize,
        dtype: &str,
        skip_own: bool,
    ) -> PyResult<()> {
        let host = self.host_calls(py)?;
        let dtype = parse_dtype(py, dtype)?;
        check_ptr(py, ptr, nbytes, dtype.size_bytes())?;
        // SAFETY: as in `publish`; for an output the same contract forbids
        // reading it too until the call returns.
        let out = unsafe { bytes_mut(ptr, nbytes) };
        self.detached(py, "gather", || {
            if skip_own {
                host.gather_remote(BucketId(bucket), version, out, dtype)
            } else {
                host.gather(BucketId(bucket), version, out, dtype)
            }
        })
    }

    /// Tells the owners this rank is done reading `version` of `bucket`.
    fn release(&self, py: Python<'_>, bucket: usize, version: u64) -> PyResult<()> {
        let host = self.host_calls(py)?;
        self.detached(py, "release", || host.release(BucketId(bucket), version))
    }

    /// Pushes `nbytes` of gradients at `ptr`, scaled by `scale`: the whole
    /// bucket when `offset` is `None`, else the part from element `offset`.
    #[pyo3(signature = (bucket, ptr, nbytes, dtype, scale=1.0, offset=None))]
    #[allow(clippy::too_many_arguments)]
    fn scatter_accumulate(
        &self,
        py: Python<'_>,
        bucket: usize,
        ptr: usize,
        nbytes: usize,
        dtype: &str,
        scale: f32,
        offset: Option<usize>,
    ) -> PyResult<()> {
        let host = self.host_calls(py)?;
        let dtype = parse_dtype(py, dtype)?;
        check_ptr(py, ptr, nbytes, dtype.size_bytes())?;
        // SAFETY: as in `publish`.
        let grads = unsafe { bytes(ptr, nbytes) };
        self.detached(py, "scatter_accumulate", || match offset {
            None => host.scatter_accumulate(BucketId(bucket), grads, dtype, scale),
            Some(at) => host.scatter_accumulate_at(BucketId(bucket), at, grads, dtype, scale),
        })
    }

    /// Ends minibatch `k` for this rank; returns when its own gradient shards are final.
    fn finish_minibatch(&self, py: Python<'_>, k: u64) -> PyResult<()> {
        let host = self.host_calls(py)?;
        self.detached(py, "finish_minibatch", || host.finish_minibatch(k))
    }

    /// `(pointer, numel)` of this rank's f32 gradient accumulator for `bucket`.
    fn grad_shard_ptr(&self, py: Python<'_>, bucket: usize) -> PyResult<(usize, usize)> {
        let host = self.host_calls(py)?;
        let (p, n) = host
            .grad_shard_ptr(BucketId(bucket))
            .map_err(|e| core_error(py, e))?;
        Ok((p.as_ptr() as usize, n))
    }

    /// Work stealing: claims this rank's next microbatch of minibatch `k`
    /// (of `count`): its index, or None once every one is claimed.
    fn claim_own(&self, py: Python<'_>, k: u64, count: u64) -> PyResult<Option<u64>> {
        let host = self.host_calls(py)?;
        match host.claim_own(k, count).map_err(|e| core_error(py, e))? {
            Claim::Got(i) => Ok(Some(i)),
            Claim::Empty | Claim::NotYet => Ok(None),
        }
    }

    /// Work stealing: asks rank `victim` for one of its unclaimed
    /// microbatches of minibatch `k`: `("got", index)`, `("empty", None)` or
    /// `("not-yet", None)` (the victim has not started `k`).
    fn steal(
        &self,
        py: Python<'_>,
        victim: usize,
        k: u64,
    ) -> PyResult<(&'static str, Option<u64>)> {
        let host = self.host_calls(py)?;
        let claim = self.detached(py, "steal", || host.steal(victim, k))?;
        Ok(match claim {
            Claim::Got(i) => ("got", Some(i)),
            Claim::Empty => ("empty", None),
            Claim::NotYet => ("not-yet", None),
        })
    }

    /// Work stealing: rank `rank`'s claim word now: `(minibatch or None,
    /// front, back)` (its unclaimed range of that minibatch's list).
    fn claims_of(&self, py: Python<'_>, rank: usize) -> PyResult<(Option<u64>, u64, u64)> {
        let host = self.host_calls(py)?;
        let w = self.detached(py, "claims_of", || host.claims_of(rank))?;
        Ok((w.stamp.checked_sub(1), w.front, w.back))
    }

    /// Zeroes the accumulator of `bucket`. Under hybrid sharding across
    /// nodes it first waits for the other nodes to read this rank's partial
    /// sums, so the GIL is released.
    fn zero_grad(&self, py: Python<'_>, bucket: usize) -> PyResult<()> {
        let host = self.host_calls(py)?;
        self.detached(py, "zero_grad", || host.zero_grad(BucketId(bucket)))
    }

    /// Zeroes every accumulator (the same wait, without the GIL).
    fn zero_grads(&self, py: Python<'_>) -> PyResult<()> {
        let host = self.host_calls(py)?;
        self.detached(py, "zero_grads", || host.zero_grads())
    }

    /// Waits until the other nodes read this rank's partial sums of the last
    /// finished minibatch, without the GIL (hybrid across nodes; at once
    /// otherwise).
    fn wait_partials_read(&self, py: Python<'_>) -> PyResult<()> {
        let host = self.host_calls(py)?;
        self.detached(py, "wait_partials_read", || host.wait_partials_read())
    }

    // -- device engines (cuda-ipc, emu-ipc) ---------------------------------
    //
    // Pointers are device addresses (host addresses under emu-ipc); every
    // call enqueues its data movement on `stream` and returns before it runs.

    /// [`Engine::publish_device`]: waits on the host for every reader's
    /// release of `version - 1`, then enqueues the copy of the shard at
    /// `ptr` and the version signal on `stream`.
    #[allow(clippy::too_many_arguments)]
    fn publish_device(
        &self,
        py: Python<'_>,
        bucket: usize,
        ptr: u64,
        nbytes: usize,
        dtype: &str,
        version: u64,
        stream: usize,
    ) -> PyResult<()> {
        let device = self.device_calls(py)?;
        let dtype = parse_dtype(py, dtype)?;
        check_ptr(py, ptr as usize, nbytes, dtype.size_bytes())?;
        self.detached(py, "publish_device", || {
            // SAFETY: the Python layer passes a live, contiguous tensor of
            // `nbytes` on the engine's device, allocated on (or recorded to)
            // `stream`, so it stays valid until the enqueued copy has run.
            unsafe { device.publish(BucketId(bucket), ptr, nbytes, dtype, version, stream) }
        })
    }

    /// [`Engine::gather_device`]: enqueues on `stream` the copies of every
    /// owner's shard of `version` into `nbytes` at `ptr`.
    #[pyo3(signature = (bucket, version, ptr, nbytes, dtype, skip_own, stream))]
    #[allow(clippy::too_many_arguments)]
    fn gather_device(
        &self,
        py: Python<'_>,
        bucket: usize,
        version: u64,
        ptr: u64,
        nbytes: usize,
        dtype: &str,
        skip_own: bool,
        stream: usize,
    ) -> PyResult<()> {
        let device = self.device_calls(py)?;
        let dtype = parse_dtype(py, dtype)?;
        check_ptr(py, ptr as usize, nbytes, dtype.size_bytes())?;
        self.detached(py, "gather_device", || {
            // SAFETY: as in `publish_device`; nothing else writes the
            // output on `stream` between the copies.
            unsafe {
                device.gather(
                    BucketId(bucket),
                    version,
                    ptr,
                    nbytes,
                    dtype,
                    stream,
                    skip_own,
                )
            }
        })
    }

    /// [`Engine::release_device`]: the release signal, enqueued on `stream`.
    fn release_device(
        &self,
        py: Python<'_>,
        bucket: usize,
        version: u64,
        stream: usize,
    ) -> PyResult<()> {
        let device = self.device_calls(py)?;
        self.detached(py, "release_device", || {
            device.release(BucketId(bucket), version, stream)
        })
    }

    /// [`Engine::scatter_accumulate_device`]: pushes `nbytes` of gradients
    /// at `ptr` on `stream`, the whole bucket when `offset` is `None`
    /// (`numel` or padded length, as the host call checks), else the part
    /// from element `offset`.
    #[pyo3(signature = (bucket, ptr, nbytes, dtype, scale, offset, stream))]
    #[allow(clippy::too_many_arguments)]
    fn scatter_accumulate_device(
        &self,
        py: Python<'_>,
        bucket: usize,
        ptr: u64,
        nbytes: usize,
        dtype: &str,
        scale: f32,
        offset: Option<usize>,
        stream: usize,
    ) -> PyResult<()> {
        let device = self.device_calls(py)?;
        let dtype = parse_dtype(py, dtype)?;
        check_ptr(py, ptr as usize, nbytes, dtype.size_bytes())?;
        if offset.is_none() && nbytes % dtype.size_bytes() == 0 {
            // The whole-bucket form accepts exactly the lengths the host
            // call does (an uneven length is named by the device call).
            self.engine
                .bucket(BucketId(bucket))
                .and_then(|b| b.check_full_len(nbytes / dtype.size_bytes()))
                .map_err(|e| core_error(py, e))?;
        }
        self.detached(py, "scatter_accumulate_device", || {
            // SAFETY: as in `publish_device`; the gradient stays unchanged
            // until the work enqueued on `stream` has run (stream order).
            unsafe {
                device.scatter_accumulate(
                    BucketId(bucket),
                    offset.unwrap_or(0),
                    ptr,
                    nbytes,
                    dtype,
                    scale,
                    stream,
                )
            }
        })
    }

    /// [`Engine::finish_minibatch_device`]: waits for `stream`, finishes
    /// minibatch `k`; on return the accumulators are final in device memory.
    fn finish_minibatch_device(&self, py: Python<'_>, k: u64, stream: usize) -> PyResult<()> {
        let device = self.device_calls(py)?;
        self.detached(py, "finish_minibatch_device", || {
            device.finish_minibatch(k, stream)
        })
    }

    /// `(device address, numel)` of this rank's f32 accumulator of `bucket`
    /// (a host address under emu-ipc).
    fn grad_shard_device(&self, py: Python<'_>, bucket: usize) -> PyResult<(u64, usize)> {
        let device = self.device_calls(py)?;
        device
            .grad_shard(BucketId(bucket))
            .map_err(|e| core_error(py, e))
    }

    /// Copies this rank's accumulator of `bucket` into the host buffer of
    /// `numel` f32s at `ptr` (after the daemon's stream has run).
    fn read_grad_shard_device(
        &self,
        py: Python<'_>,
        bucket: usize,
        ptr: usize,
        numel: usize,
    ) -> PyResult<()> {
        let device = self.device_calls(py)?;
        check_ptr(py, ptr, numel * 4, 4)?;
        // SAFETY: as in `gather`: a live, contiguous host f32 tensor of
        // `numel` elements (aligned, checked above) that `odc.engine` holds
        // for the call and that, by its contract, nobody touches until it
        // returns.
        let out = unsafe { f32s_mut(ptr, numel) };
        self.detached(py, "read_grad_shard_device", || {
            device.read_grad_shard(BucketId(bucket), out)
        })
    }

    /// [`Engine::zero_grad_device`]: zeroes the accumulator of `bucket` on
    /// the daemon's stream after `stream`'s work so far.
    fn zero_grad_device(&self, py: Python<'_>, bucket: usize, stream: usize) -> PyResult<()> {
        let device = self.device_calls(py)?;
        self.detached(py, "zero_grad_device", || {
            device.zero_grad(BucketId(bucket), stream)
        })
    }

    /// [`Engine::zero_grads_device`]: every accumulator.
    fn zero_grads_device(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        let device = self.device_calls(py)?;
        self.detached(py, "zero_grads_device", || device.zero_grads(stream))
    }

    fn __repr__(&self) -> String {
        format!(
            "Engine(rank={}, world_size={})",
            self.engine.rank(),
            self.engine.world()
        )
    }
}

/// An emulated stream for `emu-ipc` engines: a host thread that runs the
/// operations enqueued on it in order, each after a random sleep of up to
/// `jitter_us` microseconds (private: `odc.Engine` owns one).
#[pyclass(module = "odc._odc", name = "EmuStream", frozen)]
pub(crate) struct PyEmuStream {
    stream: EmuStream,
}

#[pymethods]
impl PyEmuStream {
    #[new]
    #[pyo3(signature = (jitter_us=0))]
    fn new(py: Python<'_>, jitter_us: u64) -> PyResult<Self> {
        EmuStream::new(Duration::from_micros(jitter_us))
            .map(|stream| PyEmuStream { stream })
            .map_err(|e| core_error(py, e))
    }

    /// The handle the `*_device` methods take.
    #[getter]
    fn handle(&self) -> usize {
        self.stream.handle()
    }

    /// Blocks until everything enqueued so far has run; raises the first
    /// error an operation reported.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.stream.synchronize())
            .map_err(|e| core_error(py, e))
    }

    fn __repr__(&self) -> String {
        format!("EmuStream(handle={})", self.stream.handle())
    }
}

fn parse_sharding(py: Python<'_>, s: &str) -> PyResult<Sharding> {
    Sharding::parse(s).ok_or_else(|| {
        odc_error(
            py,
            "ConfigError",
            format!(
                "unknown sharding {s:?}: expected one of {}",
                Sharding::NAMES.map(|n| format!("{n:?}")).join(", ")
            ),
        )
    })
}

/// The symmetric-heap bytes an `nvshmem` engine of `world_size` ranks takes
/// for `buckets` (`(name, numel, dtype)`): what an earlier engine of the
/// same process reserves for it (`heap_reserve`).
#[pyfunction]
#[pyo3(signature = (buckets, world_size, *, local_world_size=None, chunk_bytes=None, sharding=None))]
fn heap_bytes(
    py: Python<'_>,
    buckets: Vec<(String, usize, String)>,
    world_size: usize,
    local_world_size: Option<usize>,
    chunk_bytes: Option<usize>,
    sharding: Option<String>,
) -> PyResult<usize> {
    let topo = Topology::new(0, world_size, local_world_size.unwrap_or(world_size))
        .map_err(|e| core_error(py, e))?;
    let mut cfg = EngineConfig::default();
    if let Some(c) = chunk_bytes {
        cfg.chunk_bytes = c;
    }
    if let Some(s) = sharding {
        cfg.sharding = parse_sharding(py, &s)?;
    }
    let mut specs = Vec::with_capacity(buckets.len());
    for (name, numel, dtype) in buckets {
        specs.push(BucketSpec::new(name, numel, parse_dtype(py, &dtype)?));
    }
    Engine::heap_bytes(&specs, &topo, &cfg).map_err(|e| core_error(py, e))
}

/// The landing chunk an engine uses for a shard group of `group` ranks when
/// asked for `chunk_bytes` under a landing budget of `budget` bytes per rank
/// (odc-core's rule; a `ConfigError` when even the floor does not fit).
#[pyfunction]
fn landing_chunk(
    py: Python<'_>,
    chunk_bytes: usize,
    group: usize,
    budget: usize,
) -> PyResult<usize> {
    odc_core::control::landing_chunk(chunk_bytes, group, budget).map_err(|e| core_error(py, e))
}

/// A generation as Python reads it.
fn generation_dict(py: Python<'_>, g: Generation) -> PyResult<Py<PyAny>> {
    let d = py_dict!(py, "prefix" => g.prefix, "start" => g.start,
        "members" => odc_core::elastic::nodes_of(g.members),
        "joining" => odc_core::elastic::nodes_of(g.joining));
    Ok(d.into_any().unbind())
}

/// Elastic rejoin: rank `rank` of node `node`, restarted, asks the job
/// under `base` (`nodes` nodes) to admit its node and waits up to
/// `timeout` seconds for the generation that does.
#[pyfunction]
fn await_admission(
    py: Python<'_>,
    store: Py<PyAny>,
    base: String,
    nodes: usize,
    rank: usize,
    node: usize,
    timeout: f64,
) -> PyResult<Py<PyAny>> {
    let store = PyStore { obj: store };
    let deadline = Instant::now() + Duration::from_secs_f64(timeout.max(0.0));
    let g = py
        .detach(|| odc_core::elastic::await_admission(&store, &base, nodes, rank, node, deadline))
        .map_err(|e| core_error(py, e))?;
    generation_dict(py, g)
}

/// Elastic rejoin: makes the generation admitted at minibatch `start`
/// (members `members`, of which `joining` join) the current one of the
/// job under `base`.
#[pyfunction]
fn begin_generation(
    py: Python<'_>,
    store: Py<PyAny>,
    base: String,
    start: u64,
    members: Vec<usize>,
    joining: Vec<usize>,
) -> PyResult<Py<PyAny>> {
    let store = PyStore { obj: store };
    let set = |ns: &[usize]| ns.iter().fold(0u64, |s, &n| s | (1u64 << (n % 64)));
    let (m, j) = (set(&members), set(&joining));
    let g = py
        .detach(|| Generation::begin(&store, &base, start, m, j))
        .map_err(|e| core_error(py, e))?;
    generation_dict(py, g)
}

/// Elastic rejoin: proposes that the generation under `prefix` goes
/// ahead (`go`) or is abandoned; returns the decision that stands.
#[pyfunction]
fn decide_generation(py: Python<'_>, store: Py<PyAny>, prefix: String, go: bool) -> PyResult<bool> {
    let store = PyStore { obj: store };
    py.detach(|| Generation::decide(&store, &prefix, go))
        .map_err(|e| core_error(py, e))
}

/// Elastic rejoin: proposes that the generation admitted at `start` of the
/// job under `base` is abandoned before anyone began it (the members
/// decline the admission there; the joiners ask a later round); returns the
/// decision that stands (`true`: another rank proposed that it go ahead).
#[pyfunction]
fn decline_generation(
    py: Python<'_>,
    store: Py<PyAny>,
    base: String,
    start: u64,
) -> PyResult<bool> {
    let store = PyStore { obj: store };
    py.detach(|| Generation::decide(&store, &Generation::prefix_at(&base, start), false))
        .map_err(|e| core_error(py, e))
}

/// Elastic rejoin: makes the generation under `prefix` the current one of
/// the job under `base` again.
#[pyfunction]
fn restore_generation(
    py: Python<'_>,
    store: Py<PyAny>,
    base: String,
    prefix: String,
) -> PyResult<()> {
    let store = PyStore { obj: store };
    py.detach(|| Generation::restore(&store, &base, &prefix))
        .map_err(|e| core_error(py, e))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(await_admission, m)?)?;
    m.add_function(wrap_pyfunction!(decide_generation, m)?)?;
    m.add_function(wrap_pyfunction!(decline_generation, m)?)?;
    m.add_function(wrap_pyfunction!(restore_generation, m)?)?;
    m.add_function(wrap_pyfunction!(begin_generation, m)?)?;
    m.add_class::<PyEngine>()?;
    m.add_class::<PyEmuStream>()?;
    m.add_function(wrap_pyfunction!(heap_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(landing_chunk, m)?)
}
