//! cuDNN's backend (graph) API in RAII descriptors: tensors and operations are added to a
//! [`Graph`], which is finalized into an operation graph, ranked by cuDNN's heuristics (mode A,
//! then the fallback list) and made into an execution [`Plan`], the first engine configuration
//! that finalizes winning. A plan runs with a variant pack of the graph's non-virtual tensors.
//!
//! Every failing call names the cuDNN function, the attribute or descriptor it was setting, the
//! status and cuDNN's own last error text, so a graph cuDNN refuses says where.

use std::ffi::{CStr, c_char, c_void};

use cudarc::cudnn::sys::{
    self, cudnnBackendAttributeName_t as Attr, cudnnBackendAttributeType_t as Type,
    cudnnBackendDescriptorType_t as Kind, cudnnBackendHeurMode_t, cudnnDataType_t,
    cudnnPointwiseMode_t, cudnnReduceTensorOp_t, cudnnRngDistribution_t, cudnnStatus_t,
};

use crate::CudaLibError;

/// Alignment promised to cuDNN for every non-virtual tensor's address (checked by the caller).
pub(super) const BYTE_ALIGNMENT: usize = 16;

/// cuDNN's text for the last failed call on this thread, with a leading separator, or nothing.
fn last_error() -> String {
    let mut text = [0 as c_char; 1024];
    // SAFETY: cuDNN writes at most `text.len()` bytes, NUL-terminated; the buffer is zeroed so
    // it is a valid C string even if cuDNN writes nothing.
    let message = unsafe {
        sys::cudnnGetLastErrorString(text.as_mut_ptr(), text.len());
        CStr::from_ptr(text.as_ptr())
    };
    let message = message.to_string_lossy();
    if message.trim().is_empty() {
        String::new()
    } else {
        format!(" ({})", message.trim())
    }
}

fn check(
    status: cudnnStatus_t,
    call: &'static str,
    what: impl FnOnce() -> String,
) -> Result<(), CudaLibError> {
    if status == cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    Err(CudaLibError::Cudnn {
        call,
        message: format!("{status:?} on {}{}", what(), last_error()),
    })
}

/// A Rust type laid out as the C element type of one cuDNN attribute type.
///
/// # Safety
/// `TYPE` must name the attribute type whose elements have `Self`'s size and representation.
unsafe trait AttrValue: Copy {
    const TYPE: Type;
}

/// A descriptor handed to cuDNN as `CUDNN_TYPE_BACKEND_DESCRIPTOR` (owned by a [`Descriptor`]).
#[derive(Debug, Clone, Copy)]
#[repr(transparent)]
pub(super) struct Raw(sys::cudnnBackendDescriptor_t);

/// A device or host address handed to cuDNN as `CUDNN_TYPE_VOID_PTR`.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(super) struct Address(pub *mut c_void);

macro_rules! attr_values {
    ($($rust:ty => $c:ident),* $(,)?) => {$(
        // SAFETY: each C type here is a 64-bit integer, float, double, bool, pointer or a C
        // enum (4 bytes, as the `#[repr(u32)]` enums of cudarc's bindings), laid out as `$rust`.
        unsafe impl AttrValue for $rust {
            const TYPE: Type = Type::$c;
        }
    )*};
}

attr_values! {
    i64 => CUDNN_TYPE_INT64,
    f32 => CUDNN_TYPE_FLOAT,
    f64 => CUDNN_TYPE_DOUBLE,
    bool => CUDNN_TYPE_BOOLEAN,
    Address => CUDNN_TYPE_VOID_PTR,
    Raw => CUDNN_TYPE_BACKEND_DESCRIPTOR,
    sys::cudnnHandle_t => CUDNN_TYPE_HANDLE,
    cudnnDataType_t => CUDNN_TYPE_DATA_TYPE,
    cudnnPointwiseMode_t => CUDNN_TYPE_POINTWISE_MODE,
    cudnnReduceTensorOp_t => CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
    cudnnBackendHeurMode_t => CUDNN_TYPE_HEUR_MODE,
    cudnnRngDistribution_t => CUDNN_TYPE_RNG_DISTRIBUTION,
}

/// One backend descriptor, destroyed on drop.
pub(super) struct Descriptor {
    raw: Raw,
    kind: Kind,
}

impl Drop for Descriptor {
    fn drop(&mut self) {
        // SAFETY: created by cudnnBackendCreateDescriptor and destroyed once; a failure only
        // leaks the descriptor.
        let _ = unsafe { sys::cudnnBackendDestroyDescriptor(self.raw.0) };
    }
}

impl Descriptor {
    pub(super) fn new(kind: Kind) -> Result<Self, CudaLibError> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: cuDNN writes one descriptor into `raw`.
        let status = unsafe { sys::cudnnBackendCreateDescriptor(kind, &mut raw) };
        check(status, "cudnnBackendCreateDescriptor", || {
            format!("{kind:?}")
        })?;
        Ok(Self {
            raw: Raw(raw),
            kind,
        })
    }

    fn set<T: AttrValue>(&self, name: Attr, values: &[T]) -> Result<&Self, CudaLibError> {
        // SAFETY: `values` holds `len` elements of the C type `T::TYPE` names (AttrValue's
        // contract); cuDNN copies them during the call.
        let status = unsafe {
            sys::cudnnBackendSetAttribute(
                self.raw.0,
                name,
                T::TYPE,
                values.len() as i64,
                values.as_ptr().cast(),
            )
        };
        check(status, "cudnnBackendSetAttribute", || {
            format!("{name:?} of {:?}", self.kind)
        })?;
        Ok(self)
    }

    fn finalize(&self) -> Result<(), CudaLibError> {
        // SAFETY: the descriptor is live; cuDNN validates its attributes.
        let status = unsafe { sys::cudnnBackendFinalize(self.raw.0) };
        check(status, "cudnnBackendFinalize", || {
            format!("{:?}", self.kind)
        })
    }

    /// Reads up to `out.len()` elements of attribute `name` (none: only the count) and returns
    /// how many cuDNN has.
    fn get<T: AttrValue>(&self, name: Attr, out: &mut [T]) -> Result<usize, CudaLibError> {
        let mut count = 0i64;
        let elements = if out.is_empty() {
            std::ptr::null_mut()
        } else {
            out.as_mut_ptr().cast()
        };
        // SAFETY: `out` has room for `out.len()` elements of the C type `T::TYPE` names
        // (AttrValue's contract); cuDNN writes at most that many and the count.
        let status = unsafe {
            sys::cudnnBackendGetAttribute(
                self.raw.0,
                name,
                T::TYPE,
                out.len() as i64,
                &mut count,
                elements,
            )
        };
        check(status, "cudnnBackendGetAttribute", || {
            format!("{name:?} of {:?}", self.kind)
        })?;
        Ok(count.max(0) as usize)
    }
}

/// What a tensor of the graph is to cuDNN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Role {
    /// Device memory given at execution.
    Memory,
    /// An intermediate value cuDNN keeps to itself (fused away).
    Virtual,
    /// A host scalar given by value at execution.
    ByValue,
}

/// A tensor descriptor of a [`Graph`] (owned by it) with what the graph needs of it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Tensor {
    raw: Raw,
    pub dims: [i64; 4],
    pub strides: [i64; 4],
}

/// Row-major strides of `dims`.
pub(super) fn dense(dims: [i64; 4]) -> [i64; 4] {
    [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1]
}

/// Operations under construction, with every descriptor they use kept alive.
pub(super) struct Graph {
    owned: Vec<Descriptor>,
    ops: Vec<Raw>,
    /// Values of by-value scalars, 4 bytes each (f32 or i32 bits), by uid.
    scalars: Vec<(i64, u32)>,
    next_virtual: i64,
}

impl Graph {
    /// A graph whose virtual tensors get uids from `first_virtual` up (above every uid the
    /// caller gives its memory and scalar tensors).
    pub(super) fn new(first_virtual: i64) -> Self {
        Self {
            owned: Vec::new(),
            ops: Vec::new(),
            scalars: Vec::new(),
            next_virtual: first_virtual,
        }
    }

    fn keep(&mut self, descriptor: Descriptor) -> Raw {
        let raw = descriptor.raw;
        self.owned.push(descriptor);
        raw
    }

    fn tensor(
        &mut self,
        uid: i64,
        dtype: cudnnDataType_t,
        dims: [i64; 4],
        strides: [i64; 4],
        role: Role,
    ) -> Result<Tensor, CudaLibError> {
        let d = Descriptor::new(Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
        d.set(Attr::CUDNN_ATTR_TENSOR_DATA_TYPE, &[dtype])?
            .set(Attr::CUDNN_ATTR_TENSOR_DIMENSIONS, &dims)?
            .set(Attr::CUDNN_ATTR_TENSOR_STRIDES, &strides)?
            .set(Attr::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[uid])?
            .set(
                Attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT,
                &[BYTE_ALIGNMENT as i64],
            )?
            .set(Attr::CUDNN_ATTR_TENSOR_IS_VIRTUAL, &[role == Role::Virtual])?;
        if role == Role::ByValue {
            d.set(Attr::CUDNN_ATTR_TENSOR_IS_BY_VALUE, &[true])?;
        }
        d.finalize()?;
        Ok(Tensor {
            raw: self.keep(d),
            dims,
            strides,
        })
    }

    /// A tensor in device memory, given at execution under `uid`.
    pub(super) fn memory(
        &mut self,
        uid: i64,
        dtype: cudnnDataType_t,
        dims: [i64; 4],
        strides: [i64; 4],
    ) -> Result<Tensor, CudaLibError> {
        self.tensor(uid, dtype, dims, strides, Role::Memory)
    }

    /// An intermediate tensor with its own uid.
    pub(super) fn virtual_tensor(
        &mut self,
        dtype: cudnnDataType_t,
        dims: [i64; 4],
        strides: [i64; 4],
    ) -> Result<Tensor, CudaLibError> {
        let uid = self.next_virtual;
        self.next_virtual += 1;
        self.tensor(uid, dtype, dims, strides, Role::Virtual)
    }

    /// A by-value f32 scalar (a `[1, 1, 1, 1]` tensor) holding `value`.
    pub(super) fn scalar_f32(&mut self, uid: i64, value: f32) -> Result<Tensor, CudaLibError> {
        self.scalars.push((uid, value.to_bits()));
        let one = [1; 4];
        self.tensor(
            uid,
            cudnnDataType_t::CUDNN_DATA_FLOAT,
            one,
            one,
            Role::ByValue,
        )
    }

    /// A by-value i32 scalar holding `value`.
    pub(super) fn scalar_i32(&mut self, uid: i64, value: i32) -> Result<Tensor, CudaLibError> {
        self.scalars.push((uid, value as u32));
        let one = [1; 4];
        self.tensor(
            uid,
            cudnnDataType_t::CUDNN_DATA_INT32,
            one,
            one,
            Role::ByValue,
        )
    }

    fn push_op(&mut self, op: Descriptor) -> Result<(), CudaLibError> {
        op.finalize()?;
        let raw = self.keep(op);
        self.ops.push(raw);
        Ok(())
    }

    /// `c = a · b` over the last two axes, batched (and broadcast) over the first two, in f32.
    pub(super) fn matmul(&mut self, a: Tensor, b: Tensor, c: Tensor) -> Result<(), CudaLibError> {
        let desc = Descriptor::new(Kind::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
        desc.set(
            Attr::CUDNN_ATTR_MATMUL_COMP_TYPE,
            &[cudnnDataType_t::CUDNN_DATA_FLOAT],
        )?;
        desc.finalize()?;
        let desc = self.keep(desc);
        let op = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
        op.set(Attr::CUDNN_ATTR_OPERATION_MATMUL_ADESC, &[a.raw])?
            .set(Attr::CUDNN_ATTR_OPERATION_MATMUL_BDESC, &[b.raw])?
            .set(Attr::CUDNN_ATTR_OPERATION_MATMUL_CDESC, &[c.raw])?
            .set(Attr::CUDNN_ATTR_OPERATION_MATMUL_DESC, &[desc])?;
        self.push_op(op)
    }

    /// `y = mode(x[, b][, t])` elementwise, computed in `math`; `axis` for index generation.
    pub(super) fn pointwise(
        &mut self,
        mode: cudnnPointwiseMode_t,
        math: cudnnDataType_t,
        inputs: (Tensor, Option<Tensor>, Option<Tensor>),
        y: Tensor,
        axis: Option<i64>,
    ) -> Result<(), CudaLibError> {
        let desc = Descriptor::new(Kind::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
        desc.set(Attr::CUDNN_ATTR_POINTWISE_MODE, &[mode])?
            .set(Attr::CUDNN_ATTR_POINTWISE_MATH_PREC, &[math])?;
        if let Some(axis) = axis {
            desc.set(Attr::CUDNN_ATTR_POINTWISE_AXIS, &[axis])?;
        }
        desc.finalize()?;
        let desc = self.keep(desc);
        let (x, b, t) = inputs;
        let op = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
        op.set(Attr::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &[desc])?
            .set(Attr::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, &[x.raw])?;
        if let Some(b) = b {
            op.set(Attr::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, &[b.raw])?;
        }
        if let Some(t) = t {
            op.set(Attr::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, &[t.raw])?;
        }
        op.set(Attr::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, &[y.raw])?
            .set(Attr::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, &[1.0f32])?
            .set(Attr::CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, &[1.0f32])?;
        self.push_op(op)
    }

    /// `y = reduce(x)` over the axes where `y` has extent 1 (or fewer heads), in f32.
    pub(super) fn reduction(
        &mut self,
        operator: cudnnReduceTensorOp_t,
        x: Tensor,
        y: Tensor,
    ) -> Result<(), CudaLibError> {
        let desc = Descriptor::new(Kind::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
        desc.set(Attr::CUDNN_ATTR_REDUCTION_OPERATOR, &[operator])?
            .set(
                Attr::CUDNN_ATTR_REDUCTION_COMP_TYPE,
                &[cudnnDataType_t::CUDNN_DATA_FLOAT],
            )?;
        desc.finalize()?;
        let desc = self.keep(desc);
        let op = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
        op.set(Attr::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, &[x.raw])?
            .set(Attr::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, &[y.raw])?
            .set(Attr::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &[desc])?;
        self.push_op(op)
    }

    /// `y` = Bernoulli draws, 1 with probability `keep`, from the Philox stream of the device
    /// scalars `seed` and `offset`.
    pub(super) fn bernoulli(
        &mut self,
        keep: f64,
        seed: Tensor,
        offset: Tensor,
        y: Tensor,
    ) -> Result<(), CudaLibError> {
        let desc = Descriptor::new(Kind::CUDNN_BACKEND_RNG_DESCRIPTOR)?;
        desc.set(
            Attr::CUDNN_ATTR_RNG_DISTRIBUTION,
            &[cudnnRngDistribution_t::CUDNN_RNG_DISTRIBUTION_BERNOULLI],
        )?
        .set(Attr::CUDNN_ATTR_RNG_BERNOULLI_DIST_PROBABILITY, &[keep])?;
        desc.finalize()?;
        let desc = self.keep(desc);
        let op = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_RNG_DESCRIPTOR)?;
        op.set(Attr::CUDNN_ATTR_OPERATION_RNG_YDESC, &[y.raw])?
            .set(Attr::CUDNN_ATTR_OPERATION_RNG_DESC, &[desc])?
            .set(Attr::CUDNN_ATTR_OPERATION_RNG_SEED, &[seed.raw])?
            .set(Attr::CUDNN_ATTR_OPERATION_RNG_OFFSET_DESC, &[offset.raw])?;
        self.push_op(op)
    }

    /// `y` = `x` seen with `y`'s dims and strides (a transpose when they swap axes).
    pub(super) fn reshape(&mut self, x: Tensor, y: Tensor) -> Result<(), CudaLibError> {
        let op = Descriptor::new(Kind::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR)?;
        op.set(Attr::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, &[x.raw])?
            .set(Attr::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, &[y.raw])?;
        self.push_op(op)
    }

    /// Finalizes the operation graph on `handle` and makes a plan of the first engine
    /// configuration (heuristics mode A, then fallback) that cuDNN accepts. `Ok(Err(reason))`
    /// when cuDNN has no engine for the graph.
    pub(super) fn plan(
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
pub(super) struct Plan {
    plan: Descriptor,
    /// Bytes of workspace the plan needs.
    pub workspace: usize,
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
    /// `memory` must give a device address for every [`Role::Memory`] tensor of the graph, each
    /// with room for the tensor's extent and [`BYTE_ALIGNMENT`]-aligned, and `workspace` at least
    /// [`Plan::workspace`] bytes; all must stay allocated until the work on the handle's stream
    /// has finished.
    pub(super) unsafe fn execute(
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
