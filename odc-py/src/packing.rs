//! Bindings for `odc-packing`.

use std::ffi::OsString;

use odc_packing::fit::{fit_quadratic, MinibatchTiming, Timing};
use odc_packing::{CostModel, Error, FixedCost, Location, PlanConfig, Strategy};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyInt};

use crate::errors::odc_error;

fn packing_error(py: Python<'_>, e: odc_packing::Error) -> PyErr {
    odc_error(py, "PackingError", e.to_string())
}

/// `obj` as a Python int when it is one or converts losslessly through
/// `__index__` (numpy integers); booleans, floats and strings are not.
fn as_int<'py>(obj: &Bound<'py, PyAny>) -> Option<Bound<'py, PyInt>> {
    if obj.is_instance_of::<PyBool>() {
        return None;
    }
    obj.call_method0("__index__")
        .ok()?
        .cast_into::<PyInt>()
        .ok()
}

/// `repr(obj)`, or a placeholder when even that fails.
fn show(obj: &Bound<'_, PyAny>) -> String {
    obj.repr()
        .map_or_else(|_| "<unprintable>".to_owned(), |r| r.to_string())
}

/// Converts Python ints to lengths, naming the first value that is not an
/// integer in `1..=2^64 - 1` and its index. Never an `OverflowError`.
fn lengths_from(py: Python<'_>, items: &[Bound<'_, PyAny>]) -> PyResult<Vec<u64>> {
    if items.is_empty() {
        return Err(odc_error(
            py,
            "PackingError",
            "no sequence lengths given: the input is empty".to_owned(),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, item)| one_length(item, Location::Index(i)).map_err(|e| packing_error(py, e)))
        .collect()
}

fn one_length(item: &Bound<'_, PyAny>, at: Location) -> Result<u64, Error> {
    let Some(int) = as_int(item) else {
        return Err(Error::NonIntegerLength {
            at,
            value: show(item),
        });
    };
    match int.extract::<u64>() {
        Ok(0) => Err(Error::ZeroLength { at }),
        Ok(v) => Ok(v),
        Err(_) if int.lt(0).unwrap_or(false) => Err(Error::NegativeLength {
            at,
            value: show(item),
        }),
        Err(_) => Err(Error::LengthTooLarge {
            at,
            value: show(item),
        }),
    }
}

/// The integer argument `name`, which must lie in `lo..=hi`; anything else
/// (a negative or huge int, a float, None) is a `PackingError` naming it.
fn int_arg(py: Python<'_>, name: &str, obj: &Bound<'_, PyAny>, lo: u64, hi: u64) -> PyResult<u64> {
    as_int(obj)
        .and_then(|int| int.extract::<u64>().ok())
        .filter(|v| (lo..=hi).contains(v))
        .ok_or_else(|| {
            odc_error(
                py,
                "PackingError",
                format!(
                    "{name} must be an integer in {lo}..={hi}, got {}",
                    show(obj)
                ),
            )
        })
}

/// [`int_arg`] for a count that indexes memory.
fn usize_arg(py: Python<'_>, name: &str, obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    let hi = u64::try_from(usize::MAX).unwrap_or(u64::MAX);
    let v = int_arg(py, name, obj, 1, hi)?;
    // In range by construction: hi is usize::MAX or less.
    usize::try_from(v)
        .map_err(|_| odc_error(py, "PackingError", format!("{name} is too large: {v}")))
}

/// Plans microbatches for every rank and minibatch; returns the plan as JSON text. The fixed costs per
/// microbatch and per minibatch are in the cost model's units.
#[pyfunction]
#[pyo3(signature = (lengths, world_size, minibatch_size, strategy, max_tokens, cost, seed=None,
                    microbatch_cost=0.0, minibatch_cost=0.0))]
#[allow(clippy::too_many_arguments)]
fn plan_json(
    py: Python<'_>,
    lengths: Vec<Bound<'_, PyAny>>,
    world_size: Bound<'_, PyAny>,
    minibatch_size: Bound<'_, PyAny>,
    strategy: &str,
    max_tokens: Bound<'_, PyAny>,
    cost: &str,
    seed: Option<Bound<'_, PyAny>>,
    microbatch_cost: f64,
    minibatch_cost: f64,
) -> PyResult<String> {
    let lengths = lengths_from(py, &lengths)?;
    let world = usize_arg(py, "world_size", &world_size)?;
    let minibatch_size = usize_arg(py, "minibatch_size", &minibatch_size)?;
    let max_tokens = int_arg(py, "max_tokens", &max_tokens, 1, u64::MAX)?;
    let seed = seed
        .map(|s| int_arg(py, "seed", &s, 0, u64::MAX))
        .transpose()?;
    let strategy: Strategy = strategy.parse().map_err(|e| packing_error(py, e))?;
    let cost: CostModel = cost.parse().map_err(|e| packing_error(py, e))?;
    let fixed = FixedCost {
        microbatch: microbatch_cost,
        minibatch: minibatch_cost,
    };
    fixed.check().map_err(|e| packing_error(py, e))?;
    let cfg = PlanConfig {
        world,
        minibatch_size,
        strategy,
        max_tokens,
        cost,
        fixed,
        seed,
    };
    let plan = py
        .detach(|| odc_packing::plan(&lengths, &cfg))
        .map_err(|e| packing_error(py, e))?;
    serde_json::to_string(&plan).map_err(|e| odc_error(py, "OdcError", e.to_string()))
}

/// verl-compatible Karmarkar–Karp over sequence lengths: lists of indices.
#[pyfunction]
#[pyo3(signature = (seqlen_list, k_partitions, equal_size))]
fn karmarkar_karp(
    py: Python<'_>,
    seqlen_list: Vec<Bound<'_, PyAny>>,
    k_partitions: Bound<'_, PyAny>,
    equal_size: bool,
) -> PyResult<Vec<Vec<usize>>> {
    let lengths = lengths_from(py, &seqlen_list)?;
    let k = usize_arg(py, "k_partitions", &k_partitions)?;
    py.detach(|| odc_packing::karmarkar_karp_u64(&lengths, k, equal_size))
        .map_err(|e| packing_error(py, e))
}

/// Cost of one sequence of `length` tokens under the cost model `cost`.
#[pyfunction]
fn sequence_cost(py: Python<'_>, cost: &str, length: Bound<'_, PyAny>) -> PyResult<f64> {
    let length = int_arg(py, "length", &length, 1, u64::MAX)?;
    let model: CostModel = cost.parse().map_err(|e| packing_error(py, e))?;
    Ok(model.cost(length))
}

/// Lengths drawn from a synthetic distribution spec such as `lognormal:n=1000,median=10000`.
#[pyfunction]
fn synthetic(py: Python<'_>, spec: &str) -> PyResult<Vec<u64>> {
    odc_packing::synthetic(spec).map_err(|e| packing_error(py, e))
}

/// Fits `a·s² + b·s` to measured `(length, seconds)` pairs and, given whole-minibatch timings
/// `(microbatches, length, seconds)`, the fixed costs per microbatch and per minibatch; returns the fit as
/// JSON text (`odc_packing::fit::CostFit`).
#[pyfunction]
#[pyo3(signature = (lengths, seconds, minibatches=Vec::new()))]
fn fit_cost_json(
    py: Python<'_>,
    lengths: Vec<Bound<'_, PyAny>>,
    seconds: Vec<f64>,
    minibatches: Vec<(u64, u64, f64)>,
) -> PyResult<String> {
    let lengths = lengths_from(py, &lengths)?;
    if lengths.len() != seconds.len() {
        return Err(odc_error(
            py,
            "PackingError",
            format!("{} lengths but {} timings", lengths.len(), seconds.len()),
        ));
    }
    let timings: Vec<Timing> = lengths
        .iter()
        .zip(&seconds)
        .map(|(&length, &seconds)| Timing { length, seconds })
        .collect();
    let mut fit = fit_quadratic(&timings).map_err(|e| packing_error(py, e))?;
    if !minibatches.is_empty() {
        let timed: Vec<MinibatchTiming> = minibatches
            .iter()
            .map(|&(microbatches, length, seconds)| MinibatchTiming {
                microbatches,
                length,
                seconds,
            })
            .collect();
        fit = fit.with_fixed(&timed).map_err(|e| packing_error(py, e))?;
    }
    serde_json::to_string(&fit).map_err(|e| odc_error(py, "OdcError", e.to_string()))
}

/// Runs the `odc-pack` command line with `argv` (argv[0] is the program name); returns its exit code.
#[pyfunction]
fn pack_cli(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| odc_packing::cli::run(argv.into_iter().map(OsString::from)))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan_json, m)?)?;
    m.add_function(wrap_pyfunction!(karmarkar_karp, m)?)?;
    m.add_function(wrap_pyfunction!(sequence_cost, m)?)?;
    m.add_function(wrap_pyfunction!(synthetic, m)?)?;
    m.add_function(wrap_pyfunction!(pack_cli, m)?)?;
    m.add_function(wrap_pyfunction!(fit_cost_json, m)?)?;
    Ok(())
}
