//! Block-scaled formats from Python: `odc._odc.quantise`, `dequantise`,
//! `dequantise_accumulate`, `quant_sizes` and `odc._odc.ErrorFeedback`,
//! over `odc_kernels::cpu::quant` (the host kernels).
//!
//! Buffers are CPU torch tensors or NumPy arrays, C-contiguous, read in
//! place (no copy): a tensor through `data_ptr()` / `nbytes`, an array
//! through `__array_interface__` (the stable ABI this crate builds for has
//! no buffer protocol before Python 3.11). Each argument's dtype is checked:
//! values and scales are float32; a payload is bytes (uint8, int8 or
//! `torch.float8_e4m3fn`) for fp8 and int8, and bfloat16 (or its bits as
//! uint16 / int16) for bf16; a dequantised output is float32 or bfloat16.
//! A wrong buffer raises `odc.LayoutError` naming it; an unknown format or
//! block size raises `odc.ConfigError`. The kernels run with the GIL
//! released; the caller must not resize or free the buffers meanwhile.

use odc_kernels::cpu::quant::{self, ErrorFeedback, Format, Spec};
use odc_kernels::half::bf16;
use pyo3::prelude::*;

use crate::errors::odc_error;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(quant_sizes, m)?)?;
    m.add_function(wrap_pyfunction!(quantise, m)?)?;
    m.add_function(wrap_pyfunction!(dequantise, m)?)?;
    m.add_function(wrap_pyfunction!(dequantise_accumulate, m)?)?;
    m.add_class::<PyErrorFeedback>()
}

/// What a buffer's elements are, as far as these kernels care.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    F32,
    /// bfloat16, or 16-bit integers holding its bits.
    Bf16,
    /// Any one-byte type: uint8, int8, float8_e4m3fn.
    Byte,
    Other,
}

/// A C-contiguous host buffer borrowed from a tensor or an array.
#[derive(Clone, Copy, Debug)]
struct Buf {
    ptr: usize,
    nbytes: usize,
    kind: Kind,
}

impl Buf {
    /// Bytes per element, the alignment the kernels need.
    fn align(self) -> usize {
        match self.kind {
            Kind::F32 => 4,
            Kind::Bf16 => 2,
            Kind::Byte | Kind::Other => 1,
        }
    }

    fn elements(self) -> usize {
        match self.kind {
            Kind::F32 => self.nbytes / 4,
            Kind::Bf16 => self.nbytes / 2,
            Kind::Byte | Kind::Other => self.nbytes,
        }
    }
}

fn layout_error(py: Python<'_>, message: String) -> PyErr {
    odc_error(py, "LayoutError", message)
}

fn kind_of(name: &str) -> Kind {
    match name {
        "torch.float32" | "<f4" | "=f4" => Kind::F32,
        "torch.bfloat16" | "torch.uint16" | "torch.int16" | "<u2" | "<i2" | "=u2" | "=i2" => {
            Kind::Bf16
        }
        "torch.uint8" | "torch.int8" | "torch.float8_e4m3fn" | "|u1" | "|i1" => Kind::Byte,
        _ => Kind::Other,
    }
}

/// Reads `obj` (a CPU tensor or a NumPy array) as a contiguous buffer;
/// `what` names the argument in errors.
fn buffer(py: Python<'_>, obj: &Bound<'_, PyAny>, what: &str, writable: bool) -> PyResult<Buf> {
    if obj.hasattr("data_ptr")? {
        let device: String = obj.getattr("device")?.getattr("type")?.extract()?;
        if device != "cpu" {
            return Err(layout_error(
                py,
                format!("{what} is on {device}; these kernels take CPU tensors"),
            ));
        }
        if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(layout_error(py, format!("{what} is not contiguous")));
        }
        let dtype: String = obj.getattr("dtype")?.str()?.extract()?;
        return Ok(Buf {
            ptr: obj.call_method0("data_ptr")?.extract()?,
            nbytes: obj.getattr("nbytes")?.extract()?,
            kind: kind_of(&dtype),
        });
    }
    if let Ok(interface) = obj.getattr("__array_interface__") {
        let (ptr, readonly): (usize, bool) = interface.get_item("data")?.extract()?;
        if writable && readonly {
            return Err(layout_error(py, format!("{what} is a read-only array")));
        }
        let contiguous: bool = obj.getattr("flags")?.getattr("c_contiguous")?.extract()?;
        if !contiguous {
            return Err(layout_error(py, format!("{what} is not C-contiguous")));
        }
        let dtype: String = obj.getattr("dtype")?.getattr("str")?.extract()?;
        return Ok(Buf {
            ptr,
            nbytes: obj.getattr("nbytes")?.extract()?,
            kind: kind_of(&dtype),
        });
    }
    Err(layout_error(
        py,
        format!(
            "{what} is a {}; pass a CPU torch.Tensor or a numpy.ndarray",
            obj.get_type().name()?
        ),
    ))
}

fn expect(py: Python<'_>, buf: Buf, what: &str, kinds: &[Kind], names: &str) -> PyResult<()> {
    if kinds.contains(&buf.kind) {
        return Ok(());
    }
    Err(layout_error(py, format!("{what} must be {names}")))
}

fn spec(py: Python<'_>, format: &str, block: usize) -> PyResult<Spec> {
    let format: Format = format
        .parse()
        .map_err(|e: odc_kernels::Error| odc_error(py, "ConfigError", e.to_string()))?;
    Spec::new(format, block).map_err(|e| odc_error(py, "ConfigError", e.to_string()))
}

fn payload_kinds(spec: Spec) -> (&'static [Kind], &'static str) {
    if spec.format().scaled() {
        (&[Kind::Byte], "uint8, int8 or float8_e4m3fn bytes")
    } else {
        (&[Kind::Bf16], "bfloat16 (or its bits as uint16 / int16)")
    }
}

/// Runs a kernel with the GIL released; its error raises `LayoutError`.
fn run(py: Python<'_>, work: impl FnOnce() -> odc_kernels::Result<()> + Send) -> PyResult<()> {
    py.detach(work).map_err(|e| layout_error(py, e.to_string()))
}

/// The buffers of one call, as slices.
///
/// # Safety
///
/// `buf` must describe memory valid for `buf.nbytes` bytes for `'a`, aligned
/// for `T`, and not aliased by any other slice alive meanwhile.
unsafe fn slice_mut<'a, T>(buf: Buf) -> &'a mut [T] {
    let n = buf.nbytes / std::mem::size_of::<T>();
    if n == 0 {
        return &mut [];
    }
    // SAFETY: the caller's guarantee.
    unsafe { std::slice::from_raw_parts_mut(buf.ptr as *mut T, n) }
}

/// # Safety
///
/// As [`slice_mut`], read-only.
unsafe fn slice<'a, T>(buf: Buf) -> &'a [T] {
    let n = buf.nbytes / std::mem::size_of::<T>();
    if n == 0 {
        return &[];
    }
    // SAFETY: the caller's guarantee.
    unsafe { std::slice::from_raw_parts(buf.ptr as *const T, n) }
}

fn check_aligned(py: Python<'_>, buf: Buf, what: &str, align: usize) -> PyResult<()> {
    if buf.nbytes > 0 && (buf.ptr == 0 || buf.ptr % align != 0) {
        return Err(layout_error(
            py,
            format!(
                "{what} at {:#x} is null or not aligned to {align} bytes",
                buf.ptr
            ),
        ));
    }
    Ok(())
}

fn check_distinct(py: Python<'_>, bufs: &[(Buf, &str)]) -> PyResult<()> {
    for (i, (a, an)) in bufs.iter().enumerate() {
        for (b, bn) in &bufs[i + 1..] {
            let overlap = a.nbytes > 0
                && b.nbytes > 0
                && a.ptr < b.ptr + b.nbytes
                && b.ptr < a.ptr + a.nbytes;
            if overlap {
                return Err(layout_error(py, format!("{an} and {bn} overlap")));
            }
        }
    }
    Ok(())
}

/// `(payload_bytes, scales)` of `numel` elements in `format` with blocks of
/// `block`.
#[pyfunction]
fn quant_sizes(
    py: Python<'_>,
    format: &str,
    block: usize,
    numel: usize,
) -> PyResult<(usize, usize)> {
    let spec = spec(py, format, block)?;
    Ok((spec.payload_bytes(numel), spec.scales(numel)))
}

/// Quantises float32 `src` into `payload` and `scales` (sized as
/// `quant_sizes` says).
#[pyfunction]
fn quantise(
    py: Python<'_>,
    format: &str,
    block: usize,
    src: &Bound<'_, PyAny>,
    payload: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let spec = spec(py, format, block)?;
    let s = buffer(py, src, "src", false)?;
    let p = buffer(py, payload, "payload", true)?;
    let c = buffer(py, scales, "scales", true)?;
    expect(py, s, "src", &[Kind::F32], "float32")?;
    let (kinds, names) = payload_kinds(spec);
    expect(py, p, "payload", kinds, names)?;
    expect(py, c, "scales", &[Kind::F32], "float32")?;
    check_aligned(py, s, "src", 4)?;
    check_aligned(py, c, "scales", 4)?;
    check_aligned(py, p, "payload", p.align())?;
    check_distinct(py, &[(s, "src"), (p, "payload"), (c, "scales")])?;
    run(py, move || {
        // SAFETY: each buffer was checked to be a live, contiguous, aligned
        // CPU buffer of its byte length, the three do not overlap, and the
        // Python objects outlive this call.
        let (src, payload, scales) =
            unsafe { (slice::<f32>(s), slice_mut::<u8>(p), slice_mut::<f32>(c)) };
        quant::quantise(spec, src, payload, scales)
    })
}

/// Dequantises into `out`, float32 or bfloat16.
#[pyfunction]
fn dequantise(
    py: Python<'_>,
    format: &str,
    block: usize,
    payload: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    out: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let spec = spec(py, format, block)?;
    let p = buffer(py, payload, "payload", false)?;
    let c = buffer(py, scales, "scales", false)?;
    let o = buffer(py, out, "out", true)?;
    let (kinds, names) = payload_kinds(spec);
    expect(py, p, "payload", kinds, names)?;
    expect(py, c, "scales", &[Kind::F32], "float32")?;
    expect(
        py,
        o,
        "out",
        &[Kind::F32, Kind::Bf16],
        "float32 or bfloat16 (or its bits as uint16 / int16)",
    )?;
    check_aligned(py, c, "scales", 4)?;
    check_aligned(py, p, "payload", p.align())?;
    check_aligned(py, o, "out", o.align())?;
    check_distinct(py, &[(o, "out"), (p, "payload"), (c, "scales")])?;
    run(py, move || {
        // SAFETY: as in `quantise`.
        let (payload, scales) = unsafe { (slice::<u8>(p), slice::<f32>(c)) };
        match o.kind {
            // SAFETY: as above; `out` holds float32.
            Kind::F32 => quant::dequantise(spec, payload, scales, unsafe { slice_mut::<f32>(o) }),
            // SAFETY: as above; `out` holds 2-byte elements, read as bf16.
            _ => quant::dequantise(spec, payload, scales, unsafe { slice_mut::<bf16>(o) }),
        }
    })
}

/// `acc += factor * dequantised`, in one pass; `acc` is float32.
#[pyfunction]
#[pyo3(signature = (format, block, payload, scales, acc, factor = 1.0))]
fn dequantise_accumulate(
    py: Python<'_>,
    format: &str,
    block: usize,
    payload: &Bound<'_, PyAny>,
    scales: &Bound<'_, PyAny>,
    acc: &Bound<'_, PyAny>,
    factor: f32,
) -> PyResult<()> {
    let spec = spec(py, format, block)?;
    let p = buffer(py, payload, "payload", false)?;
    let c = buffer(py, scales, "scales", false)?;
    let a = buffer(py, acc, "acc", true)?;
    let (kinds, names) = payload_kinds(spec);
    expect(py, p, "payload", kinds, names)?;
    expect(py, c, "scales", &[Kind::F32], "float32")?;
    expect(py, a, "acc", &[Kind::F32], "float32")?;
    check_aligned(py, c, "scales", 4)?;
    check_aligned(py, a, "acc", 4)?;
    check_aligned(py, p, "payload", p.align())?;
    check_distinct(py, &[(a, "acc"), (p, "payload"), (c, "scales")])?;
    run(py, move || {
        // SAFETY: as in `quantise`.
        let (payload, scales, acc) =
            unsafe { (slice::<u8>(p), slice::<f32>(c), slice_mut::<f32>(a)) };
        quant::dequantise_accumulate(spec, payload, scales, acc, factor)
    })
}

/// A pusher's quantisation residuals, per bucket (`odc_kernels`'
/// `ErrorFeedback`): `push` quantises `grad + residual` and keeps what the
/// quantisation lost for the next push of those elements.
#[pyclass(module = "odc._odc", name = "ErrorFeedback")]
struct PyErrorFeedback {
    inner: ErrorFeedback,
}

#[pymethods]
impl PyErrorFeedback {
    #[new]
    fn new(py: Python<'_>, format: &str, block: usize) -> PyResult<Self> {
        Ok(PyErrorFeedback {
            inner: ErrorFeedback::new(spec(py, format, block)?),
        })
    }

    /// The format's name.
    #[getter]
    fn format(&self) -> &'static str {
        self.inner.spec().format().name()
    }

    /// Elements per scale block.
    #[getter]
    fn block(&self) -> usize {
        self.inner.spec().block()
    }

    /// Gives `bucket` a zero residual of `numel` elements (kept if already
    /// registered with that size).
    fn register(&mut self, py: Python<'_>, bucket: usize, numel: usize) -> PyResult<()> {
        self.inner
            .register(bucket, numel)
            .map_err(|e| layout_error(py, e.to_string()))
    }

    /// Quantises `grad + residual` for elements `offset .. offset + len(grad)`
    /// of `bucket` into `payload` and `scales`; keeps the new residual.
    fn push(
        &mut self,
        py: Python<'_>,
        bucket: usize,
        offset: usize,
        grad: &Bound<'_, PyAny>,
        payload: &Bound<'_, PyAny>,
        scales: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let spec = self.inner.spec();
        let g = buffer(py, grad, "grad", false)?;
        let p = buffer(py, payload, "payload", true)?;
        let c = buffer(py, scales, "scales", true)?;
        expect(py, g, "grad", &[Kind::F32], "float32")?;
        let (kinds, names) = payload_kinds(spec);
        expect(py, p, "payload", kinds, names)?;
        expect(py, c, "scales", &[Kind::F32], "float32")?;
        check_aligned(py, g, "grad", 4)?;
        check_aligned(py, c, "scales", 4)?;
        check_aligned(py, p, "payload", p.align())?;
        check_distinct(py, &[(g, "grad"), (p, "payload"), (c, "scales")])?;
        // SAFETY: as in `quantise`; the residual is this object's own memory,
        // which no Python buffer can alias. The GIL stays held: `self` is
        // borrowed mutably from Python.
        let (grad, payload, scales) =
            unsafe { (slice::<f32>(g), slice_mut::<u8>(p), slice_mut::<f32>(c)) };
        self.inner
            .push(bucket, offset, grad, payload, scales)
            .map_err(|e| layout_error(py, e.to_string()))
    }

    /// Copies the residual of `bucket` into float32 `out` (its length).
    fn residual(&self, py: Python<'_>, bucket: usize, out: &Bound<'_, PyAny>) -> PyResult<()> {
        let Some(r) = self.inner.residual(bucket) else {
            return Err(layout_error(
                py,
                format!("bucket {bucket} is not registered"),
            ));
        };
        let o = buffer(py, out, "out", true)?;
        expect(py, o, "out", &[Kind::F32], "float32")?;
        check_aligned(py, o, "out", 4)?;
        if o.elements() != r.len() {
            return Err(layout_error(
                py,
                format!(
                    "out has {} elements, bucket {bucket}'s residual {}",
                    o.elements(),
                    r.len()
                ),
            ));
        }
        // SAFETY: checked above: a live, aligned float32 buffer of r.len()
        // elements, distinct from the residual (this object's memory).
        unsafe { slice_mut::<f32>(o) }.copy_from_slice(r);
        Ok(())
    }

    /// Zeroes every residual.
    fn clear(&mut self) {
        self.inner.clear();
    }
}
