//! The NCCL names of ferry's dtypes and reductions, and the communicator's rendezvous id.

use std::ffi::c_char;
use std::fmt;

use cudarc::nccl::sys::{self, ncclDataType_t, ncclRedOp_t};

use ferry_memory::DType;

use super::library::{check, ensure_nccl};
use crate::CudaLibError;

/// How a reduction combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// The sum.
    Sum,
    /// The product.
    Prod,
    /// The largest value.
    Max,
    /// The smallest value.
    Min,
    /// The sum divided by the number of ranks (for gradients averaged over replicas).
    Avg,
}

impl ReduceOp {
    /// Every operation, in a fixed order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    /// The short name (`sum`, `avg`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Avg => "avg",
        }
    }

    pub(super) fn to_nccl(self) -> ncclRedOp_t {
        match self {
            ReduceOp::Sum => ncclRedOp_t::ncclSum,
            ReduceOp::Prod => ncclRedOp_t::ncclProd,
            ReduceOp::Max => ncclRedOp_t::ncclMax,
            ReduceOp::Min => ncclRedOp_t::ncclMin,
            ReduceOp::Avg => ncclRedOp_t::ncclAvg,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// NCCL's type for a dtype. NCCL has every dtype ferry has (bf16 since NCCL 2.10); a dtype
/// added to ferry must be added here, where the match stops compiling until it is.
pub(super) fn nccl_dtype(dtype: DType) -> ncclDataType_t {
    match dtype {
        DType::F32 => ncclDataType_t::ncclFloat32,
        DType::F64 => ncclDataType_t::ncclFloat64,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::BF16 => ncclDataType_t::ncclBfloat16,
        DType::I64 => ncclDataType_t::ncclInt64,
        DType::U8 => ncclDataType_t::ncclUint8,
    }
}

/// The rendezvous token of a communicator (`ncclUniqueId`): made once by one rank, given to
/// every rank of the same communicator ([`Communicator::for_rank`]).
///
/// [`Communicator::for_rank`]: crate::Communicator::for_rank
#[derive(Clone, Copy)]
pub struct UniqueId(pub(super) sys::ncclUniqueId);

impl UniqueId {
    /// Bytes in an id.
    pub const BYTES: usize = 128;

    /// A fresh id (`ncclGetUniqueId`): it also names the host and port the ranks meet at, so
    /// make it on the host of rank 0.
    pub fn new() -> Result<Self, CudaLibError> {
        ensure_nccl()?;
        let mut id = sys::ncclUniqueId {
            internal: [0; Self::BYTES],
        };
        // SAFETY: NCCL is loaded; `id` is a valid out-pointer.
        check("ncclGetUniqueId", unsafe { sys::ncclGetUniqueId(&mut id) })?;
        Ok(Self(id))
    }

    /// The id's bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> [u8; 128] {
        self.0.internal.map(|c| c as u8)
    }

    /// An id from the bytes [`UniqueId::to_bytes`] gave; any other length is an error.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, CudaLibError> {
        let bytes: [u8; Self::BYTES] =
            bytes
                .try_into()
                .map_err(|_| CudaLibError::CollectiveArgument {
                    op: "UniqueId::from_bytes",
                    reason: format!(
                        "an NCCL unique id is {} bytes, {} were given; pass exactly what UniqueId::to_bytes returned",
                        Self::BYTES,
                        bytes.len()
                    ),
                })?;
        Ok(Self(sys::ncclUniqueId {
            internal: bytes.map(|b| b as c_char),
        }))
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_maps_to_the_nccl_type_of_its_width() {
        let expected = [
            (DType::F32, ncclDataType_t::ncclFloat32),
            (DType::F64, ncclDataType_t::ncclFloat64),
            (DType::F16, ncclDataType_t::ncclFloat16),
            (DType::BF16, ncclDataType_t::ncclBfloat16),
            (DType::I64, ncclDataType_t::ncclInt64),
            (DType::U8, ncclDataType_t::ncclUint8),
        ];
        assert_eq!(expected.len(), DType::ALL.len());
        for (dtype, nccl) in expected {
            assert_eq!(nccl_dtype(dtype), nccl, "{dtype}");
        }
        // The values are NCCL's ABI (nccl.h), stable since bf16 was added in 2.10.
        assert_eq!(nccl_dtype(DType::BF16) as u32, 9);
        assert_eq!(nccl_dtype(DType::U8) as u32, 1);
    }

    #[test]
    fn every_reduce_op_maps_to_its_nccl_op() {
        let ops: Vec<u32> = ReduceOp::ALL.iter().map(|op| op.to_nccl() as u32).collect();
        assert_eq!(ops, [0, 1, 2, 3, 4]); // sum, prod, max, min, avg in nccl.h
        assert_eq!(ReduceOp::Avg.to_nccl(), ncclRedOp_t::ncclAvg);
        assert_eq!(ReduceOp::Max.to_string(), "max");
    }
}
