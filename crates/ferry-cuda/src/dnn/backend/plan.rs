//! From a [`Graph`] to an execution [`Plan`]: the operation graph finalized on a handle,
//! cuDNN's heuristics asked for ranked engine configurations (mode A, then the fallback list),
//! the first configuration that finalizes made the plan; and a plan run with a variant pack.

use std::ffi::c_void;

use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as Attr, cudnnBackendDescriptorType_t as Kind,
    cudnnBackendHeurMode_t,
};

use super::{Address, Descriptor, Graph, Raw, check};
use crate::CudaLibError;

impl Graph {
    /// Finalizes the operation graph on `handle` and makes a plan of the first engine
    /// configuration (heuristics mode A, then fallback) that cuDNN accepts. `Ok(Err(reason))`
    /// when cuDNN has no engine for the graph.
    pub(in crate::dnn) fn plan(
        mut self,
        handle: sys::cudnnHandle_t,
    ) -> Result<Result<Plan, String>, CudaLibError> {
        let graph = Descriptor::new(Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph
            .set(Attr::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, &[handle])?
            .set(Attr::CUDNN_ATTR_OPERATIONGRAPH_OPS, &self.ops)?;
        if let Err(e) = graph.finalize() {
            return Ok(Err(format!("cuDNN refused the operation graph: {e}")));
        }
        let mut refusals = Vec::new();
        for mode in [
            cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
            cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
        ] {
            let configs = match ranked_configs(&graph, mode) {
                Ok(configs) => configs,
                Err(e) => {
                    refusals.push(format!("heuristics {mode:?}: {e}"));
                    continue;
                }
            };
            for (rank, config) in configs.into_iter().enumerate() {
                let plan = Descriptor::new(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
                plan.set(Attr::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, &[handle])?
                    .set(Attr::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[config.raw])?;
                if let Err(e) = plan.finalize() {
                    refusals.push(format!("{mode:?} engine #{rank}: {e}"));
                    continue;
                }
                let mut workspace = [0i64];
                plan.get(
                    Attr::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                    &mut workspace,
                )?;
                self.owned.push(graph);
                self.owned.push(config);
                return Ok(Ok(Plan {
                    plan,
                    workspace: workspace[0].max(0) as usize,
                    scalars: self.scalars,
                    _kept: self.owned,
                }));
            }
        }
        if refusals.is_empty() {
            refusals.push("the heuristics offered no engine".to_string());
        }
        Ok(Err(format!(
            "no cuDNN engine runs this graph: {}",
            refusals.join("; ")
        )))
    }
}

/// The engine configurations cuDNN's heuristics rank for `graph` in `mode`, best first.
fn ranked_configs(
    graph: &Descriptor,
    mode: cudnnBackendHeurMode_t,
) -> Result<Vec<Descriptor>, CudaLibError> {
    let heuristics = Descriptor::new(Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heuristics
        .set(Attr::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[graph.raw])?
        .set(Attr::CUDNN_ATTR_ENGINEHEUR_MODE, &[mode])?;
    heuristics.finalize()?;
    let results = Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS;
    let count = heuristics.get::<Raw>(results, &mut [])?;
    let mut configs = (0..count)
        .map(|_| Descriptor::new(Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
        .collect::<Result<Vec<_>, _>>()?;
    // cuDNN fills the engine configurations it is handed.
    let mut raws: Vec<Raw> = configs.iter().map(|c| c.raw).collect();
    let written = heuristics.get(results, &mut raws)?;
    configs.truncate(written.min(count));
    Ok(configs)
}

/// A finalized execution plan with every descriptor it was built from.
pub(in crate::dnn) struct Plan {
    plan: Descriptor,
    /// Bytes of workspace the plan needs.
    pub(in crate::dnn) workspace: usize,
    scalars: Vec<(i64, u32)>,
    _kept: Vec<Descriptor>,
}

// SAFETY: the descriptors are not changed after the plan is built; the plan runs on the one
// handle it was built with (plans are cached per handle), which one call holds at a time.
unsafe impl Send for Plan {}
// SAFETY: see Send; shared references only read the plan to execute it under that handle.
unsafe impl Sync for Plan {}

impl Plan {
    /// Runs the plan on `handle` (the one it was built with, its stream set by the caller).
    ///
    /// # Safety
    /// `memory` must give a device address for every [`Role::Memory`](super::Role::Memory) tensor of the graph, each
    /// with room for the tensor's extent and [`BYTE_ALIGNMENT`](super::BYTE_ALIGNMENT)-aligned, and `workspace` at least
    /// [`Plan::workspace`] bytes; all must stay allocated until the work on the handle's stream
    /// has finished.
    pub(in crate::dnn) unsafe fn execute(
        &self,
        handle: sys::cudnnHandle_t,
        memory: &[(i64, u64)],
        workspace: u64,
    ) -> Result<(), CudaLibError> {
        let mut uids = Vec::with_capacity(memory.len() + self.scalars.len());
        let mut addresses = Vec::with_capacity(uids.capacity());
        for &(uid, address) in memory {
            uids.push(uid);
            addresses.push(Address(address as *mut c_void));
        }
        for (uid, bits) in &self.scalars {
            uids.push(*uid);
            addresses.push(Address((bits as *const u32).cast_mut().cast()));
        }
        let pack = Descriptor::new(Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        pack.set(Attr::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, &uids)?
            .set(Attr::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, &addresses)?
            .set(
                Attr::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
                &[Address(workspace as *mut c_void)],
            )?;
        pack.finalize()?;
        // SAFETY: the caller vouches for the addresses (see the function's contract); the
        // scalars live in `self`, which outlives the call (cuDNN reads by-value scalars when
        // it enqueues the work).
        let status = unsafe { sys::cudnnBackendExecute(handle, self.plan.raw.0, pack.raw.0) };
        check(status, "cudnnBackendExecute", || {
            "the execution plan".to_string()
        })
    }
}
