//! Bindings for `odc-packing`.

use std::ffi::OsString;

use odc_packing::{CostModel, PlanConfig, Strategy};
use pyo3::prelude::*;

use crate::errors::odc_error;

fn packing_error(py: Python<'_>, e: odc_packing::Error) -> PyErr {
    odc_error(py, "PackingError", e.to_string())
}

/// Converts Python ints to lengths, naming the first one that is not a positive integer.
fn lengths_from(py: Python<'_>, lengths: Vec<i64>) -> PyResult<Vec<u64>> {
    lengths
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            u64::try_from(v).map_err(|_| {
                odc_error(
                    py,
                    "PackingError",
                    format!(
                        "sequence length at index {i} is {v}; lengths must be positive integers"
                    ),
                )
            })
        })
        .collect()
}

/// Plans microbatches for every rank and minibatch; returns the plan as JSON text.
#[pyfunction]
#[pyo3(signature = (lengths, world_size, minibatch_size, strategy, max_tokens, cost, seed))]
#[allow(clippy::too_many_arguments)]
fn plan_json(
    py: Python<'_>,
    lengths: Vec<i64>,
    world_size: usize,
    minibatch_size: usize,
    strategy: &str,
    max_tokens: u64,
    cost: &str,
    seed: u64,
) -> PyResult<String> {
    let lengths = lengths_from(py, lengths)?;
    let strategy: Strategy = strategy.parse().map_err(|e| packing_error(py, e))?;
    let cost: CostModel = cost.parse().map_err(|e| packing_error(py, e))?;
    let cfg = PlanConfig {
        world: world_size,
        minibatch_size,
        strategy,
        max_tokens,
        cost,
        seed,
    };
    let plan = py
        .detach(|| odc_packing::plan(&lengths, &cfg))
        .map_err(|e| packing_error(py, e))?;
    serde_json::to_string(&plan).map_err(|e| odc_error(py, "OdcError", e.to_string()))
}

/// Karmarkar–Karp k-way partition of `weights`: lists of indices.
#[pyfunction]
#[pyo3(signature = (weights, k_partitions, equal_size))]
fn karmarkar_karp(
    py: Python<'_>,
    weights: Vec<f64>,
    k_partitions: usize,
    equal_size: bool,
) -> PyResult<Vec<Vec<usize>>> {
    py.detach(|| odc_packing::karmarkar_karp(&weights, k_partitions, equal_size))
        .map_err(|e| packing_error(py, e))
}

/// Cost of one sequence of `length` tokens under the cost model `cost`.
#[pyfunction]
fn sequence_cost(py: Python<'_>, cost: &str, length: u64) -> PyResult<f64> {
    let model: CostModel = cost.parse().map_err(|e| packing_error(py, e))?;
    Ok(model.cost(length))
}

/// Lengths drawn from a synthetic distribution spec such as `lognormal:n=1000,median=10000`.
#[pyfunction]
fn synthetic(py: Python<'_>, spec: &str) -> PyResult<Vec<u64>> {
    odc_packing::synthetic(spec).map_err(|e| packing_error(py, e))
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
    Ok(())
}
