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

mod plan;

pub(super) use plan::Plan;

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
}
