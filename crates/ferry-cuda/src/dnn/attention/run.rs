//! Running a pass: the operands gathered by graph uid as they are checked, the plan found in
//! the device's cache (or built and kept there), the workspace and scratch memory allocated on
//! the call's stream, and the plan executed on a pooled handle.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cudnn::result as dnn;
use ferry_memory::DType;
use ferry_memory::cuda::{CudaDevice, DeviceBuffer, Stream};
use parking_lot::Mutex;

use super::super::backend::Plan;
use super::super::library::ensure_cudnn_graphs;
use super::super::{DnnDevice, DnnHandle};
use super::checks::{check_rng, known_limit, operand};
use super::{Causal, DropoutRng, SDPA_MIN_CUDNN, SdpaInput, SdpaSpec, graph, uid};
use crate::CudaLibError;
use crate::profile::profiled;

/// Strides in elements of each operand as the graph declares them (zero for those a pass does
/// not use); part of a plan's key.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub(super) struct Strides {
    pub q: [i64; 4],
    pub k: [i64; 4],
    pub v: [i64; 4],
    pub o: [i64; 4],
    pub stats: [i64; 4],
    pub d_o: [i64; 4],
    pub dq: [i64; 4],
    pub dk: [i64; 4],
    pub dv: [i64; 4],
}

impl Strides {
    fn of(&mut self, id: i64) -> &mut [i64; 4] {
        match id {
            uid::Q => &mut self.q,
            uid::K => &mut self.k,
            uid::V => &mut self.v,
            uid::O => &mut self.o,
            uid::STATS => &mut self.stats,
            uid::D_O => &mut self.d_o,
            uid::DQ => &mut self.dq,
            uid::DK => &mut self.dk,
            uid::DV => &mut self.dv,
            _ => unreachable!("uid {id} is not an attention operand"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Pass {
    Forward,
    Backward,
}

/// What a plan is built for: the spec (floats by their bits), the pass, the strides and the
/// handle it runs on (an execution plan records its handle, so each handle of the pool gets
/// its own plans, as PyTorch keeps its cuDNN attention graphs per thread).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct PlanKey {
    handle: usize,
    pass: Pass,
    shape: [usize; 6],
    dtype: DType,
    causal: Causal,
    scale: u32,
    dropout: u32,
    strides: Strides,
}

pub(super) fn plan_key(spec: &SdpaSpec, handle: usize, pass: Pass, strides: Strides) -> PlanKey {
    let s = spec;
    PlanKey {
        handle,
        pass,
        shape: [s.batch, s.heads, s.kv_heads, s.q_len, s.kv_len, s.head_dim],
        dtype: s.dtype,
        causal: s.causal,
        scale: s.scale.to_bits(),
        dropout: s.dropout.to_bits(),
        strides,
    }
}

/// A device's attention plans (a device slot): each built plan, or the reason cuDNN had no
/// engine for it, so an unsupported shape is refused at once on later calls.
#[derive(Default)]
struct AttentionPlans {
    plans: Mutex<HashMap<PlanKey, Arc<Result<Plan, String>>>>,
}

/// The loaded cuDNN's version once its graph API is known to be there and new enough.
pub(super) fn usable_cudnn() -> Result<usize, CudaLibError> {
    ensure_cudnn_graphs()?;
    let version = dnn::get_version();
    if version < SDPA_MIN_CUDNN {
        return Err(CudaLibError::AttentionUnsupported {
            reason: format!(
                "the loaded cuDNN is {version}, and its fused attention needs 9.0 or newer"
            ),
        });
    }
    Ok(version)
}

/// The value masked scores are set to: older cuDNN wants the lowest float, not -inf (as
/// cudnn-frontend does).
pub(super) fn masked_value(version: usize) -> f32 {
    if version < 91000 {
        f32::MIN
    } else {
        f32::NEG_INFINITY
    }
}

/// A cuDNN error met building a graph, with the graph's pass and shape added.
fn in_graph(err: CudaLibError, pass: Pass, spec: &SdpaSpec) -> CudaLibError {
    match err {
        CudaLibError::Cudnn { call, message } => CudaLibError::Cudnn {
            call,
            message: format!("{message}, building the attention {pass:?} graph of {spec:?}"),
        },
        other => other,
    }
}

/// The plan of `pass` for `spec` and `strides` on `handle`, from the device's cache or built
/// (outside the lock: finalizing a plan can take milliseconds) and kept there.
fn find_plan(
    device: &CudaDevice,
    handle: &DnnHandle,
    spec: &SdpaSpec,
    pass: Pass,
    strides: Strides,
    version: usize,
) -> Result<Arc<Result<Plan, String>>, CudaLibError> {
    let key = plan_key(spec, handle.0 as usize, pass, strides);
    let plans = device.local::<AttentionPlans>();
    if let Some(plan) = plans.plans.lock().get(&key) {
        return Ok(plan.clone());
    }
    let neg = masked_value(version);
    let graph = match pass {
        Pass::Forward => graph::forward(spec, &strides, neg),
        Pass::Backward => graph::backward(spec, &strides, neg),
    }
    .map_err(|e| in_graph(e, pass, spec))?;
    let plan = Arc::new(graph.plan(handle.0).map_err(|e| in_graph(e, pass, spec))?);
    plans.plans.lock().insert(key, plan.clone());
    Ok(plan)
}

/// The checks every call begins with: cuDNN's graph API is there and new enough (its version
/// returned), the device is usable, the spec is consistent and cuDNN takes it.
pub(super) fn ready(device: &CudaDevice, spec: &SdpaSpec) -> Result<usize, CudaLibError> {
    let version = usable_cudnn()?;
    device.check()?;
    spec.check()?;
    spec.supported()?;
    Ok(version)
}

/// One call's operands: device addresses by graph uid, the declared strides, and the buffers
/// to order on the call's stream.
pub(super) struct Operands<'a> {
    spec: SdpaSpec,
    memory: Vec<(i64, u64)>,
    pub strides: Strides,
    used: Vec<&'a DeviceBuffer>,
}

impl<'a> Operands<'a> {
    pub(super) fn new(spec: &SdpaSpec) -> Self {
        Self {
            spec: *spec,
            memory: Vec::new(),
            strides: Strides::default(),
            used: Vec::new(),
        }
    }

    /// Checks operand `id` against its buffer (see [`operand`]; its extents are the spec's
    /// for that operand) and records it.
    pub(super) fn add(
        &mut self,
        id: i64,
        name: &'static str,
        x: SdpaInput<'a>,
    ) -> Result<(), CudaLibError> {
        let s = &self.spec;
        let (dims, elem) = match id {
            uid::STATS => (s.stats_dims(), 4),
            uid::K | uid::V | uid::DK | uid::DV => (s.kv_dims(), s.dtype.size()),
            _ => (s.q_dims(), s.dtype.size()),
        };
        *self.strides.of(id) = operand(name, x.buffer, x.offset_bytes, x.strides, dims, elem)?;
        self.memory
            .push((id, x.buffer.device_ptr() + x.offset_bytes as u64));
        self.used.push(x.buffer);
        Ok(())
    }

    /// Checks and records dropout's seed and offset, then that every operand and the stream
    /// are on `device`.
    pub(super) fn finish(
        &mut self,
        device: &CudaDevice,
        op: &'static str,
        rng: Option<DropoutRng<'a>>,
        stream: &Stream,
    ) -> Result<(), CudaLibError> {
        check_rng(&self.spec, rng)?;
        if let (Some(rng), true) = (rng, self.spec.dropout > 0.0) {
            self.memory.push((uid::SEED, rng.seed.device_ptr()));
            self.memory.push((uid::OFFSET, rng.offset.device_ptr()));
            self.used.extend([rng.seed, rng.offset]);
        }
        let devices = self.used.iter().map(|b| b.device());
        Ok(device.check_operands(op, devices.chain([stream.device()]))?)
    }
}

/// Runs `pass` of `spec` over the checked `operands` on `stream`.
pub(super) fn run(
    device: &CudaDevice,
    spec: &SdpaSpec,
    pass: Pass,
    version: usize,
    mut operands: Operands<'_>,
    stream: &Stream,
) -> Result<(), CudaLibError> {
    let major = device.info().compute_capability.0;
    if let Some(reason) = known_limit(spec, pass == Pass::Backward, version, major) {
        return Err(CudaLibError::AttentionUnsupported { reason });
    }
    device.bind()?;
    let dnn_device = device.local::<DnnDevice>();
    let lease = dnn_device.handle_on(stream)?;
    let handle = lease.0;
    let plan = find_plan(device, &lease, spec, pass, operands.strides, version)?;
    let plan = match &*plan {
        Ok(plan) => plan,
        Err(reason) => {
            return Err(CudaLibError::AttentionUnsupported {
                reason: format!("{reason} (attention {pass:?} of {spec:?})"),
            });
        }
    };
    let workspace = device.alloc(plan.workspace, stream)?;
    let mut scratch = Vec::new();
    if pass == Pass::Backward {
        let rows: usize = [spec.batch, spec.heads, spec.q_len].iter().product();
        scratch.push((uid::ROW_SUM, device.alloc(rows * 4, stream)?));
        let accum = rows * spec.head_dim * 4;
        // cuDNN zeroes its dQ accumulator itself from 9.6 on.
        let accum = if version < 90600 {
            device.alloc_zeroed(accum, stream)?
        } else {
            device.alloc(accum, stream)?
        };
        scratch.push((uid::DQ_ACCUM, accum));
    }
    for (id, buffer) in &scratch {
        operands.memory.push((*id, buffer.device_ptr()));
    }
    let used = operands.used.iter().copied();
    for buffer in used
        .chain(scratch.iter().map(|(_, b)| b))
        .chain([&workspace])
    {
        buffer.record_stream(stream);
    }
    // Ordering a buffer on the host may have made another GPU's context current.
    device.bind()?;
    let name = || format!("cudnn sdpa {pass:?} {spec:?}").into();
    // SAFETY: every operand's extent and alignment were checked against its buffer (`add`) and
    // match the graph's tensors (same spec and strides, the plan's key); the scratch buffers
    // have the extents of the graph's ROW_SUM and DQ_ACCUM (dense f32 [B, H, T, 1] and
    // [B, H, T, D]); all of them and the workspace are marked used on `stream`, so their memory
    // is not reused before the work finishes; the handle is this call's, its stream set above.
    profiled(device, stream, name, || unsafe {
        plan.execute(handle, &operands.memory, workspace.device_ptr())
    })
}
