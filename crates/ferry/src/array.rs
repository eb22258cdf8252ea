//! ndarray interop and `.npy` files.
//!
//! Leaving ferry for an `ndarray` is explicit about the two things it cannot take along: the
//! device (a CUDA tensor is an error naming `.to(Device::Cpu)`) and the graph (a tensor that
//! requires grad is an error naming `.detach()`). Nothing moves or detaches behind your back.
//!
//! ```
//! use ferry::prelude::*;
//! use ferry::ndarray::ArrayD;
//!
//! let t = Tensor::arange(0.0, 6.0, DType::F32, Device::Cpu)?.reshape(&[2, 3])?;
//! let a: ArrayD<f32> = ferry::to_ndarray(&t.t()?)?;
//! assert_eq!(a.shape(), &[3, 2]);
//! assert_eq!(a[[2, 1]], 5.0);
//! let back = ferry::from_ndarray(&a)?;
//! assert_eq!(back.to_vec::<f32>()?, [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
//! # Ok::<(), ferry::TensorError>(())
//! ```

use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};

use ferry_memory::{Element, HostBuffer};
use ferry_tensor::{DType, Result, Tensor, TensorError};
use ndarray::{ArrayBase, ArrayD, ArrayViewD, Data, Dimension, IxDyn};
use ndarray_npy::{ViewElement, ViewNpyError, ViewNpyExt, WritableElement, WriteNpyError};

/// Errors reading or writing `.npy` files.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NpyError {
    /// The tensor cannot leave ferry as it is (on a GPU, requires grad, a dtype `.npy` lacks).
    #[error(transparent)]
    Tensor(#[from] TensorError),
    /// The file could not be opened, read or created.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// Writing the array failed.
    #[error("writing {}: {source}", path.display())]
    Write {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: WriteNpyError,
    },
    /// The file is not a well-formed `.npy` file (bad magic, header, length, ...).
    #[error("{} is not a valid .npy file: {source}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        source: ViewNpyError,
    },
    /// A well-formed file whose element type ferry does not read.
    #[error(
        "{}: element type {descr} is not one ferry reads; save it as float32, float64, int64 or uint8 (little-endian)",
        path.display()
    )]
    UnsupportedElement {
        /// The file.
        path: PathBuf,
        /// The file's type descriptor.
        descr: String,
    },
}

/// Checks that `t` can leave ferry: on the host, and without gradient history.
fn check_leaving(t: &Tensor, op: &'static str) -> Result<()> {
    if t.device().is_cuda() {
        return Err(TensorError::NotOnHost {
            op,
            device: t.device(),
        });
    }
    if t.requires_grad() {
        return Err(TensorError::RequiresGrad { op });
    }
    Ok(())
}

/// The elements of a host tensor as an `ndarray` of `T` (a copy, row-major, any layout).
///
/// Errors: the tensor is on a GPU (`.to(Device::Cpu)` first), requires grad (`.detach()`
/// first), or holds another dtype than `T`.
pub fn to_ndarray<T: Element>(t: &Tensor) -> Result<ArrayD<T>> {
    check_leaving(t, "to_ndarray")?;
    if t.dtype() != T::DTYPE {
        return Err(TensorError::DTypeMismatch {
            op: "to_ndarray",
            lhs: t.dtype(),
            rhs: T::DTYPE,
            rhs_upper: T::DTYPE.name().to_uppercase(),
        });
    }
    let values = t.to_vec::<T>()?;
    Ok(ArrayD::from_shape_vec(IxDyn(t.shape()), values)
        .expect("a tensor's element count matches its shape"))
}

/// A host tensor holding a copy of `array` (any layout, any dimensionality).
pub fn from_ndarray<T, S, D>(array: &ArrayBase<S, D>) -> Result<Tensor>
where
    T: Element,
    S: Data<Elem = T>,
    D: Dimension,
{
    match array.as_slice() {
        Some(values) => Tensor::from_slice(values, array.shape()),
        None => Tensor::from_vec(array.iter().copied().collect(), array.shape()),
    }
}

fn write<T: Element + WritableElement>(t: &Tensor, path: &Path) -> Result<(), NpyError> {
    let array = to_ndarray::<T>(t)?;
    ndarray_npy::write_npy(path, &array).map_err(|source| NpyError::Write {
        path: path.into(),
        source,
    })
}

/// Writes a host tensor to `path` in NumPy's `.npy` format (f32, f64, i64 and u8; cast 16-bit
/// floats to f32 first). The same errors as [`to_ndarray`] apply.
pub fn save_npy(t: &Tensor, path: impl AsRef<Path>) -> Result<(), NpyError> {
    let path = path.as_ref();
    check_leaving(t, "save_npy")?;
    match t.dtype() {
        DType::F32 => write::<f32>(t, path),
        DType::F64 => write::<f64>(t, path),
        DType::I64 => write::<i64>(t, path),
        DType::U8 => write::<u8>(t, path),
        dtype => Err(TensorError::UnsupportedDType {
            op: "save_npy",
            dtype,
            hint: ".npy has no bfloat16 and ferry writes no float16: cast with `.to_dtype(DType::F32)` first",
        }
        .into()),
    }
}

/// Tries to view `bytes` as an `.npy` file of `T`; `Ok(None)` when the element type differs.
fn view<T: Element + ViewElement>(bytes: &[u8], path: &Path) -> Result<Option<Tensor>, NpyError> {
    match ArrayViewD::<T>::view_npy(bytes) {
        Ok(array) => Ok(Some(from_ndarray(&array)?)),
        Err(ViewNpyError::WrongDescriptor(_)) => Ok(None),
        Err(source) => Err(NpyError::Invalid {
            path: path.into(),
            source,
        }),
    }
}

/// Reads an `.npy` file (f32, f64, i64 or u8, little-endian, C or Fortran order) into a host
/// tensor. A malformed or truncated file is an error, never a panic.
pub fn load_npy(path: impl AsRef<Path>) -> Result<Tensor, NpyError> {
    let path = path.as_ref();
    let io_error = |source| NpyError::Io {
        path: path.into(),
        source,
    };
    let mut file = File::open(path).map_err(io_error)?;
    let len = file.metadata().map_err(io_error)?.len();
    // An aligned buffer, so the data can be viewed in place however long the header is, and no
    // allocation sized by the header's claims before they are checked against the file.
    let mut bytes = HostBuffer::zeroed(usize::try_from(len).unwrap_or(usize::MAX))
        .map_err(TensorError::from)?;
    file.read_exact(bytes.as_bytes_mut()).map_err(io_error)?;
    let bytes = bytes.as_bytes();
    if let Some(t) = view::<f32>(bytes, path)? {
        return Ok(t);
    }
    if let Some(t) = view::<f64>(bytes, path)? {
        return Ok(t);
    }
    if let Some(t) = view::<i64>(bytes, path)? {
        return Ok(t);
    }
    if let Some(t) = view::<u8>(bytes, path)? {
        return Ok(t);
    }
    let descr = match ArrayViewD::<f32>::view_npy(bytes) {
        Err(ViewNpyError::WrongDescriptor(descr)) => descr.to_string(),
        _ => "unknown".into(),
    };
    Err(NpyError::UnsupportedElement {
        path: path.into(),
        descr,
    })
}
