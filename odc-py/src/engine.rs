//! Bindings for the `odc-core` engine: `odc._odc.Engine`.
//!
//! Tensors cross the boundary as raw pointers with byte lengths: the Python
//! layer (`odc.engine`) checks device, contiguity and dtype and passes
//! `tensor.data_ptr()` / `nbytes`. No copy happens on the Python side, and
//! every call that may block releases the GIL.
//!
//! The rendezvous store is any Python object with torch's `dist.Store`
//! methods (`set`, `get`, `check`, `add`): [`PyStore`] adapts it to
//! [`odc_core::Store`]. Waits poll `check` with the GIL released between
//! polls, so a rank waiting at setup never blocks the interpreter.

use std::sync::Arc;
use std::time::{Duration, Instant};

use odc_core::{
    BucketId, BucketSpec, DType, Engine, EngineConfig, Sharding, Store, Topology, TransportKind,
};
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
}

fn parse_dtype(py: Python<'_>, s: &str) -> PyResult<DType> {
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

/// One rank's ODC engine (private: use `odc.Engine`).
#[pyclass(module = "odc._odc", name = "Engine", frozen)]
pub(crate) struct PyEngine {
    engine: Engine,
}

#[pymethods]
impl PyEngine {
    /// Joins the job as `rank` of `world_size` through `store`.
    #[new]
    #[pyo3(signature = (store, rank, world_size, *, local_world_size=None, chunk_bytes=None, timeout=None, job_key=None, prefix=None, transport=None, sharding=None))]
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
    ) -> PyResult<Self> {
        let topo = Topology::new(rank, world_size, local_world_size.unwrap_or(world_size))
            .map_err(|e| core_error(py, e))?;
        let mut cfg = EngineConfig::default();
        if let Some(c) = chunk_bytes {
            cfg.chunk_bytes = c;
        }
        if let Some(t) = timeout {
            if !(t.is_finite() && t > 0.0) {
                return Err(odc_error(
                    py,
                    "ConfigError",
                    format!("timeout must be positive seconds, got {t}"),
                ));
            }
            cfg.timeout = Duration::from_secs_f64(t);
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
                        "unknown transport {t:?}: expected \"auto\", \"shm\", \"fabric\" or \"mixed\""
                    ),
                )
            })?;
        }
        if let Some(s) = sharding {
            cfg.sharding = Sharding::parse(&s).ok_or_else(|| {
                odc_error(
                    py,
                    "ConfigError",
                    format!("unknown sharding {s:?}: expected \"full\" or \"hybrid\""),
                )
            })?;
        }
        let store: Arc<dyn Store> = Arc::new(PyStore { obj: store });
        let engine = py
            .detach(|| Engine::new(store, topo, cfg))
            .map_err(|e| core_error(py, e))?;
        Ok(PyEngine { engine })
    }

    #[getter]
    fn rank(&self) -> usize {
        self.engine.rank()
    }

    #[getter]
    fn world_size(&self) -> usize {
        self.engine.world()
    }

    #[getter]
    fn transport(&self) -> &'static str {
        let kind = self.engine.config().transport;
        kind.resolve(&self.engine.topology()).name()
    }

    #[getter]
    fn sharding(&self) -> &'static str {
        self.engine.config().sharding.name()
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
        py.detach(|| self.engine.register(&specs))
            .map_err(|e| core_error(py, e))
    }

    /// The index of the bucket called `name`.
    fn bucket_id(&self, py: Python<'_>, name: &str) -> PyResult<usize> {
        self.engine
            .bucket_id(name)
            .map(|b| b.0)
            .map_err(|e| core_error(py, e))
    }

    /// Layout of bucket `bucket`: name, numel, dtype, shard_len, padded_len.
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
        let dtype = parse_dtype(py, dtype)?;
        check_ptr(py, ptr, nbytes, dtype.size_bytes())?;
        // SAFETY: the Python layer passes a live, contiguous tensor of
        // `nbytes` bytes and keeps it alive for the call.
        let shard = unsafe { bytes(ptr, nbytes) };
        py.detach(|| self.engine.publish(BucketId(bucket), shard, dtype, version))
            .map_err(|e| core_error(py, e))
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
        let dtype = parse_dtype(py, dtype)?;
        check_ptr(py, ptr, nbytes, dtype.size_bytes())?;
        // SAFETY: as in `publish`, and the tensor is not read or written by
        // Python while the GIL is released here.
        let out = unsafe { bytes_mut(ptr, nbytes) };
        py.detach(|| {
            if skip_own {
                self.engine
                    .gather_remote(BucketId(bucket), version, out, dtype)
            } else {
                self.engine.gather(BucketId(bucket), version, out, dtype)
            }
        })
        .map_err(|e| core_error(py, e))
    }

    /// Tells the owners this rank is done reading `version` of `bucket`.
    fn release(&self, py: Python<'_>, bucket: usize, version: u64) -> PyResult<()> {
        py.detach(|| self.engine.release(BucketId(bucket), version))
            .map_err(|e| core_error(py, e))
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
        let dtype = parse_dtype(py, dtype)?;
        check_ptr(py, ptr, nbytes, dtype.size_bytes())?;
        // SAFETY: as in `publish`.
        let grads = unsafe { bytes(ptr, nbytes) };
        py.detach(|| match offset {
            None => self
                .engine
                .scatter_accumulate(BucketId(bucket), grads, dtype, scale),
            Some(at) => {
                self.engine
                    .scatter_accumulate_at(BucketId(bucket), at, grads, dtype, scale)
            }
        })
        .map_err(|e| core_error(py, e))
    }

    /// Ends minibatch `k` for this rank; returns when its own gradient shards are final.
    fn finish_minibatch(&self, py: Python<'_>, k: u64) -> PyResult<()> {
        py.detach(|| self.engine.finish_minibatch(k))
            .map_err(|e| core_error(py, e))
    }

    /// `(pointer, numel)` of this rank's f32 gradient accumulator for `bucket`.
    fn grad_shard_ptr(&self, py: Python<'_>, bucket: usize) -> PyResult<(usize, usize)> {
        let (p, n) = self
            .engine
            .grad_shard_ptr(BucketId(bucket))
            .map_err(|e| core_error(py, e))?;
        Ok((p.as_ptr() as usize, n))
    }

    /// Zeroes the accumulator of `bucket`.
    fn zero_grad(&self, py: Python<'_>, bucket: usize) -> PyResult<()> {
        self.engine
            .zero_grad(BucketId(bucket))
            .map_err(|e| core_error(py, e))
    }

    /// Zeroes every accumulator.
    fn zero_grads(&self, py: Python<'_>) -> PyResult<()> {
        self.engine.zero_grads().map_err(|e| core_error(py, e))
    }

    fn __repr__(&self) -> String {
        format!(
            "Engine(rank={}, world_size={})",
            self.engine.rank(),
            self.engine.world()
        )
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()
}
