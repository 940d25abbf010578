//! Bindings for rollout weights (`odc_core::weights`): `odc._odc.WeightServer`
//! (a trainer rank's snapshot slots) and `odc._odc.WeightReader` (a reader
//! outside the training group). The Python layer (`odc.weights`) owns the
//! manifest, the Store and the tensors; buffers cross as raw pointers with
//! byte lengths, and every call that copies releases the GIL.
//!
//! Endpoints and region descriptors cross as JSON strings (what the Python
//! layer puts into the Store). A read that gave up is not an exception
//! here: `read` returns a dict with `refused` set, and `odc.weights` raises
//! `odc.weights.VersionRefused` with it.

use std::sync::Arc;
use std::time::Duration;

use odc_core::region::{Endpoint, RegionDesc};
use odc_core::weights::{
    Outcome, Owner, Prefer, PublishPart, Reach, ReadOptions, Serve, SlotLayout, Want,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{core_error, odc_error};

/// Runs `work` with the GIL released, mapping an ODC error to its class.
/// One part of a publish as Python passes it: slot offset, pointer, bytes,
/// and the cast on the way (`(from, to)` dtype names) or none.
type PyPart = (usize, usize, usize, Option<(String, String)>);

fn detached<T: Send>(
    py: Python<'_>,
    work: impl FnOnce() -> odc_core::Result<T> + Send,
) -> PyResult<T> {
    py.detach(work).map_err(|e| core_error(py, e))
}

fn config(py: Python<'_>, msg: String) -> PyErr {
    odc_error(py, "ConfigError", msg)
}

fn seconds(py: Python<'_>, timeout: f64) -> PyResult<Duration> {
    if !(timeout.is_finite() && timeout > 0.0) {
        return Err(config(
            py,
            format!("timeout must be positive seconds, got {timeout}"),
        ));
    }
    Ok(Duration::from_secs_f64(timeout))
}

/// One owner as the Python layer passes it: endpoint JSON, region JSON, K,
/// slot bytes, node, fabric endpoint JSON (or None), why not fabric (or
/// None).
type OwnerTuple = (
    String,
    String,
    usize,
    usize,
    String,
    Option<String>,
    Option<String>,
);

/// One trainer rank's K snapshot slots (private: use `odc.fsdp.serve_weights`).
#[pyclass(module = "odc._odc", name = "WeightServer", frozen)]
pub(crate) struct PyWeightServer {
    inner: odc_core::weights::WeightServer,
}

#[pymethods]
impl PyWeightServer {
    /// Registers the slots of server rank `rank` of `world` with shared
    /// memory and, as `transport` says (`"shm"`, `"fabric"`, `"auto"`),
    /// libfabric; `timeout` (seconds) bounds its network operations.
    #[new]
    #[pyo3(signature = (rank, world, job_key, job_id, slots, slot_bytes, transport="shm", timeout=60.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        rank: usize,
        world: usize,
        job_key: String,
        job_id: String,
        slots: usize,
        slot_bytes: usize,
        transport: &str,
        timeout: f64,
    ) -> PyResult<Self> {
        if rank >= world {
            return Err(config(py, format!("rank {rank} of a world of {world}")));
        }
        let serve = Serve::parse(transport).ok_or_else(|| {
            let expected = "expected 'auto', 'shm' or 'fabric'";
            config(
                py,
                format!("serve_weights: transport={transport:?}; {expected}"),
            )
        })?;
        let timeout = seconds(py, timeout)?;
        let layout = SlotLayout { slots, slot_bytes };
        let inner = detached(py, || {
            odc_core::weights::WeightServer::new(
                rank, world, &job_key, &job_id, layout, serve, timeout,
            )
        })?;
        Ok(PyWeightServer { inner })
    }

    /// This rank's libfabric endpoint, as JSON, or None where the slots are
    /// not served over libfabric.
    fn fabric_endpoint(&self, py: Python<'_>) -> PyResult<Option<String>> {
        self.inner
            .fabric_endpoint()
            .map(|e| serde_json::to_string(&e).map_err(|e| config(py, e.to_string())))
            .transpose()
    }

    /// Why the slots are not served over libfabric (None when they are).
    #[getter]
    fn fabric_error(&self) -> Option<String> {
        self.inner.fabric_error().map(str::to_owned)
    }

    /// This rank's transport endpoint, as JSON.
    fn endpoint(&self, py: Python<'_>) -> PyResult<String> {
        serde_json::to_string(&self.inner.endpoint()).map_err(|e| config(py, e.to_string()))
    }

    /// The slots' region descriptor, as JSON.
    fn region(&self, py: Python<'_>) -> PyResult<String> {
        serde_json::to_string(&self.inner.desc()).map_err(|e| config(py, e.to_string()))
    }

    /// The newest version published, if any.
    #[getter]
    fn latest(&self) -> Option<u64> {
        self.inner.latest()
    }

    /// Copies `parts` (`(offset in the slot, pointer, bytes, cast)`) into
    /// slot `version mod K` and announces `version`; `cast` is `None` (the
    /// bytes as they are) or `(from, to)` dtype names (the bytes hold
    /// `from` elements, the slot takes them cast to `to`).
    fn publish(&self, py: Python<'_>, version: u64, parts: Vec<PyPart>) -> PyResult<()> {
        let mut casts = Vec::with_capacity(parts.len());
        for (_, ptr, nbytes, cast) in &parts {
            if *nbytes > 0 && *ptr == 0 {
                return Err(odc_error(py, "LayoutError", "null buffer pointer".into()));
            }
            casts.push(match cast {
                Some((from, to)) => Some((
                    crate::engine::parse_dtype(py, from)?,
                    crate::engine::parse_dtype(py, to)?,
                )),
                None => None,
            });
        }
        let inner = &self.inner;
        detached(py, move || {
            let views: Vec<PublishPart<'_>> = (parts.iter().zip(casts))
                .map(|(&(offset, ptr, nbytes, _), cast)| {
                    let bytes: &[u8] = if nbytes == 0 {
                        &[]
                    } else {
                        // SAFETY: the Python layer passes a contiguous CPU
                        // tensor's data_ptr and nbytes, kept alive (and not
                        // written: the optimizer step is over) for the call.
                        unsafe { std::slice::from_raw_parts(ptr as *const u8, nbytes) }
                    };
                    PublishPart {
                        offset,
                        bytes,
                        cast,
                    }
                })
                .collect();
            inner.publish_parts(version, &views)
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "WeightServer(rank={}, slots={}, slot_bytes={}, latest={:?})",
            self.inner.endpoint().rank,
            self.inner.layout().slots,
            self.inner.layout().slot_bytes,
            self.inner.latest()
        )
    }
}

/// A reader of every server rank's slots (private: use `odc.WeightReader`).
#[pyclass(module = "odc._odc", name = "WeightReader", frozen)]
pub(crate) struct PyWeightReader {
    inner: Arc<odc_core::weights::WeightReader>,
}

#[pymethods]
impl PyWeightReader {
    /// Connects to the slots of `owners` (by rank: endpoint JSON, region
    /// JSON, K, slot bytes, node, fabric endpoint JSON or None, why not
    /// fabric or None) of the servers under `job_key` / `job_id`, each by
    /// shared memory or libfabric as `transport` (`"auto"`, `"shm"`,
    /// `"fabric"`) and its node say; `timeout` (seconds) bounds every
    /// network operation.
    #[new]
    #[pyo3(signature = (job_key, job_id, owners, transport="auto", timeout=60.0))]
    fn new(
        py: Python<'_>,
        job_key: String,
        job_id: String,
        owners: Vec<OwnerTuple>,
        transport: &str,
        timeout: f64,
    ) -> PyResult<Self> {
        let prefer = Prefer::parse(transport).ok_or_else(|| {
            let expected = "expected 'auto', 'shm' or 'fabric'";
            config(
                py,
                format!("WeightReader: transport={transport:?}; {expected}"),
            )
        })?;
        let timeout = seconds(py, timeout)?;
        let mut list = Vec::with_capacity(owners.len());
        for (r, (ep, region, slots, slot_bytes, node, fabric, fabric_error)) in
            owners.into_iter().enumerate()
        {
            let endpoint: Endpoint = serde_json::from_str(&ep)
                .map_err(|e| config(py, format!("rank {r}'s endpoint {ep:?}: {e}")))?;
            let region: RegionDesc = serde_json::from_str(&region)
                .map_err(|e| config(py, format!("rank {r}'s region {region:?}: {e}")))?;
            let fabric: Option<Endpoint> = fabric
                .map(|f| {
                    serde_json::from_str(&f)
                        .map_err(|e| config(py, format!("rank {r}'s fabric endpoint {f:?}: {e}")))
                })
                .transpose()?;
            list.push(Owner {
                endpoint,
                region,
                layout: SlotLayout { slots, slot_bytes },
                node,
                fabric,
                fabric_error,
            });
        }
        let inner = detached(py, || {
            odc_core::weights::WeightReader::connect(&job_key, &job_id, list, prefer, timeout)
        })?;
        Ok(PyWeightReader {
            inner: Arc::new(inner),
        })
    }

    /// How each trainer rank is reached (`"shm"` or `"fabric"`), by rank.
    fn routes(&self) -> Vec<&'static str> {
        self.inner
            .reach()
            .iter()
            .map(|r| match r {
                Reach::Shm => "shm",
                Reach::Fabric => "fabric",
            })
            .collect()
    }

    /// Every owner's `latest` word (version + 1; 0: nothing published).
    fn latest(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        detached(py, || self.inner.latest())
    }

    /// Reads `version` (None: the newest every owner holds) into
    /// `buffers` (`(pointer, bytes)` per owner), each from byte `at` of
    /// the owner's slot data. Returns `{"version",
    /// "newest", "attempts"}`, or `{"refused": message, "owner",
    /// "version", "by", "attempts"}`.
    #[pyo3(signature = (version, buffers, timeout, retries, at = 0))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        version: Option<u64>,
        buffers: Vec<(usize, usize)>,
        timeout: f64,
        retries: u32,
        at: usize,
    ) -> PyResult<Bound<'py, PyDict>> {
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(config(
                py,
                format!("timeout must be positive seconds, got {timeout}"),
            ));
        }
        if buffers.iter().any(|&(ptr, n)| n > 0 && ptr == 0) {
            return Err(odc_error(py, "LayoutError", "null buffer pointer".into()));
        }
        let want = version.map_or(Want::Latest, Want::Exactly);
        let opts = ReadOptions {
            at,
            timeout: Duration::from_secs_f64(timeout),
            retries,
        };
        let inner = &self.inner;
        let outcome = detached(py, move || {
            let mut views: Vec<&mut [u8]> = buffers
                .iter()
                .map(|&(ptr, nbytes)| -> &mut [u8] {
                    if nbytes == 0 {
                        return &mut [];
                    }
                    // SAFETY: the Python layer passes its own staging
                    // tensors (contiguous, CPU, distinct), alive and used by
                    // nobody else during the call.
                    unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, nbytes) }
                })
                .collect();
            inner.read(want, &mut views, opts)
        })?;
        let d = PyDict::new(py);
        match outcome {
            Outcome::Got(g) => {
                d.set_item("version", g.version)?;
                d.set_item("newest", g.newest)?;
                d.set_item("attempts", g.attempts)?;
            }
            Outcome::Refused(r) => {
                d.set_item("refused", r.to_string())?;
                d.set_item("owner", r.owner)?;
                d.set_item("version", r.version)?;
                d.set_item("by", r.by)?;
                d.set_item("attempts", r.attempts)?;
            }
        }
        Ok(d)
    }

    /// `(address, bytes)` of every owner's data of the slot of `version`
    /// where `shm` maps it, None for owners read over the network. Read it
    /// only between two `read`s of exactly `version` with empty buffers,
    /// and trust what was read only if the second is not refused.
    fn mapped(&self, version: u64) -> Vec<Option<(usize, usize)>> {
        (0..self.inner.layouts().len())
            .map(|r| {
                self.inner
                    .mapped_data(r, version)
                    .map(|(ptr, n)| (ptr as usize, n))
            })
            .collect()
    }

    /// Test fault point: sleep `delay` seconds halfway through the copy of
    /// the last owner's slot in each of the next `reads` reads started.
    fn _set_fault(&self, delay: f64, reads: u32) {
        self.inner
            .set_fault(Duration::from_secs_f64(delay.max(0.0)), reads);
    }

    fn __repr__(&self) -> String {
        format!("WeightReader(owners={})", self.inner.layouts().len())
    }
}

/// This process's node as weight servers and readers compare them (host
/// name and network namespace).
#[pyfunction]
fn weights_node() -> String {
    odc_core::weights::node_id()
}

/// A reader-node cache (private: `odc.WeightReader(node_cache=True)`): copies
/// of the trainer ranks' slots on this node, filled by a thread that reads
/// every new version whole through `reader`.
#[pyclass(module = "odc._odc", name = "WeightNodeCache", frozen)]
pub(crate) struct PyWeightNodeCache {
    inner: odc_core::weights::cache::NodeCache,
}

#[pymethods]
impl PyWeightNodeCache {
    /// Serves the copies under `job_key` / `job_id` (the node's own job id)
    /// and starts fetching into them; `timeout` (seconds) bounds each fetch.
    #[new]
    fn new(
        py: Python<'_>,
        reader: &PyWeightReader,
        job_key: String,
        job_id: String,
        timeout: f64,
    ) -> PyResult<Self> {
        let timeout = seconds(py, timeout)?;
        let up = Arc::clone(&reader.inner);
        let inner = detached(py, || {
            odc_core::weights::cache::NodeCache::start(up, &job_key, &job_id, timeout)
        })?;
        Ok(PyWeightNodeCache { inner })
    }

    /// The copies by trainer rank: `(endpoint JSON, region JSON, K, slot
    /// bytes)`.
    fn owners(&self, py: Python<'_>) -> PyResult<Vec<(String, String, usize, usize)>> {
        self.inner
            .owners()
            .into_iter()
            .map(|o| {
                let ep =
                    serde_json::to_string(&o.endpoint).map_err(|e| config(py, e.to_string()))?;
                let region =
                    serde_json::to_string(&o.region).map_err(|e| config(py, e.to_string()))?;
                Ok((ep, region, o.layout.slots, o.layout.slot_bytes))
            })
            .collect()
    }

    /// Versions fetched across so far.
    #[getter]
    fn fetched(&self) -> u64 {
        self.inner.fetched()
    }

    /// Why the fetch thread stopped, if it did.
    #[getter]
    fn failure(&self) -> Option<String> {
        self.inner.failure()
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyWeightNodeCache>()?;
    m.add_function(wrap_pyfunction!(weights_node, m)?)?;
    m.add_class::<PyWeightServer>()?;
    m.add_class::<PyWeightReader>()
}
