//! The memory planner from Python: `ferry.plan` measures a torch model's regions and applies the
//! choices; the cost model and the choice are ferry's one planner (`ferry::autograd::MemoryPlan`),
//! reached through `plan_memory`.

use ferry::TensorError;
use ferry::autograd::{Choice, Link, MeasuredPeaks, MemoryPlan, RegionCost, Selective, StepCost};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{guarded, to_py};

/// One region as `ferry.plan` passes it: forward ms, saved bytes, backward ms (None: twice the
/// forward), offloadable bytes (None: all saved), bytes of its input nothing saves, whether it
/// may be recomputed, its parameters' gradient bytes, its selective recompute's held bytes and
/// extra ms (None: not measured), the part of its saved bytes autocast caches for the forward,
/// and the extra ms measured with it offloaded and with it selectively recomputed, its kept
/// outputs offloaded (None: not measured, the copies hidden in compute).
type RegionRow = (
    f64,
    i64,
    Option<f64>,
    Option<i64>,
    i64,
    bool,
    i64,
    Option<(i64, f64)>,
    i64,
    Option<f64>,
    Option<f64>,
);

/// Plans a step's regions for `target_bytes` of activations at the peak, or predicts what the
/// forced `choices` ("keep", "offload", "recompute", "selective", "selective_offload", one per
/// region) give; exactly one of the two.
/// `link` is the link's (to host, to device) rates in bytes per second, None where nothing can be
/// offloaded. `measured`: the device bytes the profiled step took without a plan, above its start,
/// as (the forward's peak, each region's backward peak in forward order); None where not measured
/// (the peak is then the costs' sum). Returns the choices, the target, the predicted `peak_bytes`,
/// `least_bytes`, `plain_bytes`, `extra_ms` (and per region, `region_extra_ms`) and `step_ms`,
/// `offload_fits` and `reached`. Costs or targets no plan can mean raise `ValueError` naming the fix.
#[pyfunction]
#[pyo3(signature = (
    regions, target_bytes=None, choices=None, *, shared_bytes=0, head_bytes=0,
    outside_grad_bytes=0, link=None, host_bytes=None, measured=None
))]
#[allow(clippy::too_many_arguments)] // the keyword arguments of one Python call
pub fn plan_memory<'py>(
    py: Python<'py>,
    regions: Vec<RegionRow>,
    target_bytes: Option<i64>,
    choices: Option<Vec<String>>,
    shared_bytes: i64,
    head_bytes: i64,
    outside_grad_bytes: i64,
    link: Option<(f64, f64)>,
    host_bytes: Option<i64>,
    measured: Option<(i64, Vec<i64>)>,
) -> PyResult<Bound<'py, PyDict>> {
    guarded(|| {
        let step = StepCost {
            regions: regions
                .iter()
                .enumerate()
                .map(|(i, row)| region(i, row))
                .collect::<PyResult<_>>()?,
            shared_bytes: bytes("shared_bytes", shared_bytes)?,
            head_bytes: bytes("head_bytes", head_bytes)?,
            outside_grad_bytes: bytes("outside_grad_bytes", outside_grad_bytes)?,
            link: link.map(|(to_host, to_device)| Link {
                to_host_bytes_per_ms: to_host / 1e3,
                to_device_bytes_per_ms: to_device / 1e3,
            }),
            host_bytes: host_bytes.map(|b| bytes("host_bytes", b)).transpose()?,
            measured: measured
                .map(|(forward, backward)| -> PyResult<MeasuredPeaks> {
                    Ok(MeasuredPeaks {
                        forward_bytes: bytes("the measured forward peak", forward)?,
                        backward_bytes: backward
                            .iter()
                            .enumerate()
                            .map(|(i, &b)| {
                                bytes(&format!("region {i}'s measured backward peak"), b)
                            })
                            .collect::<PyResult<_>>()?,
                    })
                })
                .transpose()?,
        };
        let plan = match (target_bytes, choices) {
            // A negative target is refused as 0 is: the planner's message names the least.
            (Some(target), None) => MemoryPlan::for_step(&step, target.max(0) as u64),
            (None, Some(choices)) => {
                let choices = choices
                    .iter()
                    .enumerate()
                    .map(|(i, c)| choice(i, c))
                    .collect::<PyResult<Vec<_>>>()?;
                MemoryPlan::with_choices(&step, &choices)
            }
            _ => {
                return Err(PyValueError::new_err(
                    "pass exactly one of target_bytes= (plan for it) or choices= (predict them)",
                ));
            }
        }
        .map_err(|e| match e {
            TensorError::InvalidArgument { message, .. } => PyValueError::new_err(message),
            other => to_py(other),
        })?;
        let out = PyDict::new(py);
        let names: Vec<String> = plan.choices().iter().map(Choice::to_string).collect();
        out.set_item("choices", names)?;
        out.set_item("target_bytes", plan.target_bytes())?;
        out.set_item("peak_bytes", plan.peak_bytes())?;
        out.set_item("least_bytes", plan.least_bytes())?;
        out.set_item("plain_bytes", plan.plain_bytes())?;
        out.set_item("extra_ms", plan.extra_ms())?;
        let per_region: Vec<f64> = plan.regions().iter().map(|r| r.extra_ms).collect();
        out.set_item("region_extra_ms", per_region)?;
        out.set_item("step_ms", plan.step_ms())?;
        out.set_item("offload_fits", plan.offload_fits())?;
        out.set_item("reached", plan.reached())?;
        Ok(out)
    })
}

fn region(i: usize, row: &RegionRow) -> PyResult<RegionCost> {
    let &(
        forward_ms,
        saved,
        backward_ms,
        offloadable,
        unsaved_input,
        recomputable,
        grads,
        sel,
        cached,
        offload_ms,
        selective_offload_ms,
    ) = row;
    let named = |what: &str| format!("region {i}'s {what}");
    let ms = |what: &str, value: Option<f64>| -> PyResult<Option<f64>> {
        match value {
            Some(v) if !(v.is_finite() && v >= 0.0) => Err(PyValueError::new_err(format!(
                "{} must be a finite number of ms >= 0, got {v}",
                named(what)
            ))),
            v => Ok(v),
        }
    };
    let offload_extra_ms = ms("offload_ms", offload_ms)?;
    let selective_offload_extra_ms = ms("selective_offload_ms", selective_offload_ms)?;
    let unsaved = bytes(&named("input_bytes"), unsaved_input)?;
    Ok(RegionCost {
        forward_ms,
        saved_bytes: bytes(&named("saved_bytes"), saved)?,
        // ferry.plan counts region inputs with the shared bytes.
        input_bytes: 0,
        backward_ms,
        offloadable_bytes: offloadable
            .map(|b| bytes(&named("offloadable_bytes"), b))
            .transpose()?,
        unsaved_input_bytes: unsaved,
        recomputable,
        grad_bytes: bytes(&named("grad_bytes"), grads)?,
        selective: sel
            .map(|(held, extra_ms)| -> PyResult<Selective> {
                let held_bytes = bytes(&named("selective held bytes"), held)?;
                Ok(Selective {
                    held_bytes,
                    extra_ms,
                    // What a selective offload moves: the kept outputs, all but the input.
                    offloadable_bytes: held_bytes.saturating_sub(unsaved),
                    offload_extra_ms: selective_offload_extra_ms,
                })
            })
            .transpose()?,
        cached_bytes: bytes(&named("cached_bytes"), cached)?,
        offload_extra_ms,
    })
}

fn bytes(what: &str, value: i64) -> PyResult<u64> {
    u64::try_from(value)
        .map_err(|_| PyValueError::new_err(format!("{what} is {value}; bytes must be >= 0")))
}

fn choice(i: usize, name: &str) -> PyResult<Choice> {
    match name {
        "keep" => Ok(Choice::Keep),
        "offload" => Ok(Choice::Offload),
        "recompute" => Ok(Choice::Recompute),
        "selective" => Ok(Choice::Selective),
        "selective_offload" => Ok(Choice::SelectiveOffload),
        other => Err(PyValueError::new_err(format!(
            "region {i}: choice {other:?} is not one of \"keep\", \"offload\", \"recompute\", \
             \"selective\", \"selective_offload\""
        ))),
    }
}
