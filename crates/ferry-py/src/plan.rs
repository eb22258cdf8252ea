//! The memory plan from Python: the same choices ferry's own models get
//! ([`ferry::autograd::MemoryPlan`]), for costs a torch model's profiled step measured.

use ferry::autograd::{Choice, Link, MemoryPlan, RegionCost};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::guarded;

/// Plans `regions` (forward order; each `(forward_ms, saved_bytes, input_bytes)`) for at most
/// `target_bytes` of activations on the device, with `link` `(to_host_bytes_per_ms,
/// to_device_bytes_per_ms)` or `None` where nothing can be offloaded. Returns a dict: `choices`
/// (`"keep"`, `"offload"` or `"recompute"` per region), `extra_ms` per region, and the plan's
/// `peak_bytes`, `plain_bytes`, `target_bytes`, `total_extra_ms`, `step_ms`, `reached` and
/// `text` (the table `str(plan)` prints).
#[pyfunction]
#[pyo3(signature = (regions, link, target_bytes))]
pub fn plan_memory<'py>(
    py: Python<'py>,
    regions: Vec<(f64, u64, u64)>,
    link: Option<(f64, f64)>,
    target_bytes: u64,
) -> PyResult<Bound<'py, PyDict>> {
    guarded(|| {
        let costs: Vec<RegionCost> = regions
            .iter()
            .map(|&(forward_ms, saved_bytes, input_bytes)| RegionCost {
                forward_ms,
                saved_bytes,
                input_bytes,
            })
            .collect();
        let link = link.map(|(to_host, to_device)| Link {
            to_host_bytes_per_ms: to_host,
            to_device_bytes_per_ms: to_device,
        });
        let plan = MemoryPlan::new(&costs, link, target_bytes)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        let out = PyDict::new(py);
        let name = |c: Choice| match c {
            Choice::Keep => "keep",
            Choice::Offload => "offload",
            Choice::Recompute => "recompute",
        };
        let choices: Vec<&str> = plan.choices().into_iter().map(name).collect();
        let extra: Vec<f64> = plan.regions().iter().map(|r| r.extra_ms).collect();
        out.set_item("choices", choices)?;
        out.set_item("extra_ms", extra)?;
        out.set_item("peak_bytes", plan.peak_bytes())?;
        out.set_item("plain_bytes", plan.plain_bytes())?;
        out.set_item("target_bytes", plan.target_bytes())?;
        out.set_item("total_extra_ms", plan.extra_ms())?;
        out.set_item("step_ms", plan.step_ms())?;
        out.set_item("reached", plan.reached())?;
        out.set_item("text", plan.to_string())?;
        Ok(out)
    })
}
