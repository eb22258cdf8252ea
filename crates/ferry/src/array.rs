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
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use ferry_memory::{Element, HostBuffer};
use ferry_tensor::{DType, Result, Tensor, TensorError};
use ndarray::{ArrayBase, ArrayD, Data, Dimension, IxDyn};
use ndarray_npy::npy::header::{Header, Layout};
use ndarray_npy::{WritableElement, WriteNpyError, WriteNpyExt};

use crate::durable::{DurableError, TempFile};

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
    /// The array was written and renamed into place, whole, but the directory could not be
    /// fsynced: the file is there now, yet the rename may not survive a power cut.
    #[error(
        "{}: saved, but fsyncing its directory {} failed ({source}): the file is in place and whole, but may not survive a power cut; save again, or sync the filesystem, before relying on it",
        path.display(),
        dir.display()
    )]
    NotDurable {
        /// The file, in place.
        path: PathBuf,
        /// The directory whose fsync failed.
        dir: PathBuf,
        /// What the OS said.
        source: io::Error,
    },
    /// The file is not a well-formed `.npy` file (bad magic, header, length, ...).
    #[error("{} is not a valid .npy file: {reason}", path.display())]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
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

impl From<DurableError> for NpyError {
    fn from(e: DurableError) -> Self {
        match e {
            DurableError::Io { path, source } => NpyError::Io { path, source },
            DurableError::NotDurable { path, dir, source } => {
                NpyError::NotDurable { path, dir, source }
            }
        }
    }
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

/// Writes `t` durably: into a temporary file beside `path`, fsynced, renamed over `path`, and
/// the directory fsynced.
fn write<T: Element + WritableElement>(t: &Tensor, path: &Path) -> Result<(), NpyError> {
    let array = to_ndarray::<T>(t)?;
    let temp = TempFile::create(path)?;
    let io_error = |source| NpyError::Io {
        path: temp.path.clone(),
        source,
    };
    let mut out = BufWriter::with_capacity(1 << 20, &temp.file);
    array
        .write_npy(&mut out)
        .map_err(|source| NpyError::Write {
            path: path.into(),
            source,
        })?;
    out.flush().map_err(io_error)?;
    drop(out);
    temp.file.sync_all().map_err(io_error)?;
    temp.persist(path)?;
    Ok(())
}

/// Writes a host tensor to `path` in NumPy's `.npy` format (f32, f64, i64 and u8; cast 16-bit
/// floats to f32 first). The same errors as [`to_ndarray`] apply.
///
/// The save is durable as a checkpoint's is: the bytes go to a temporary file beside `path`,
/// which is fsynced and renamed over it, and the directory is fsynced, so `path` holds the old
/// file or the new one, whole, even after a crash. Should only the directory's fsync fail, the
/// error is [`NpyError::NotDurable`]: the new file is in place, its durability unknown.
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

/// The largest header ferry reads: NumPy itself writes a few hundred bytes, and refuses to
/// read headers over 10,000 bytes by default.
const MAX_NPY_HEADER: usize = 1 << 20;
/// Deepest bracket nesting accepted in a header (NumPy's deepest: a structured dtype of a few
/// levels): the dictionary parser recurses once per level.
const MAX_NPY_NESTING: usize = 32;
/// Bytes read at a time into the tensor.
const READ_CHUNK: usize = 4 << 20;

/// Reads an `.npy` file (f32, f64, i64 or u8, little-endian, C or Fortran order) into a host
/// tensor. A malformed or truncated file is an error, never a panic, and nothing is allocated
/// for the data before the header's shape is checked against the file's length. C-order data
/// (NumPy's default) is read straight into the tensor's buffer: no second copy.
pub fn load_npy(path: impl AsRef<Path>) -> Result<Tensor, NpyError> {
    let path = path.as_ref();
    let io_error = |source| NpyError::Io {
        path: path.into(),
        source,
    };
    let invalid = |reason: String| NpyError::Invalid {
        path: path.into(),
        reason,
    };
    let file = File::open(path).map_err(io_error)?;
    let file_len = file.metadata().map_err(io_error)?.len();
    let mut file = BufReader::with_capacity(1 << 16, file);
    let (header, data_start) = read_npy_header(&mut file, file_len, path)?;

    let descr = header.type_descriptor.to_string();
    let dtype = header
        .type_descriptor
        .as_string()
        .and_then(|d| npy_dtype(d))
        .ok_or_else(|| NpyError::UnsupportedElement {
            path: path.into(),
            descr: descr.clone(),
        })?;
    let shape = header.shape;
    // Every non-zero dimension counts: an empty array's strides must be addressable too.
    let nbytes = shape
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(dtype.size(), |n, &d| n.checked_mul(d))
        .map(|n| if shape.contains(&0) { 0 } else { n })
        .ok_or_else(|| {
            invalid(format!(
                "shape {shape:?} of {descr} holds more bytes than can be counted"
            ))
        })?;
    let available = file_len - data_start;
    if nbytes as u64 != available {
        let what = if (nbytes as u64) > available {
            "it is truncated"
        } else {
            "trailing bytes"
        };
        return Err(invalid(format!(
            "shape {shape:?} of {descr} needs {nbytes} bytes of data, the file holds {available} ({what})"
        )));
    }
    let mut buffer = HostBuffer::zeroed(nbytes).map_err(TensorError::from)?;
    for chunk in buffer.as_bytes_mut().chunks_mut(READ_CHUNK) {
        file.read_exact(chunk).map_err(io_error)?;
    }
    match header.layout {
        Layout::Standard => Ok(Tensor::from_host_buffer(buffer, dtype, &shape)?),
        Layout::Fortran => {
            // Column-major data is the row-major data of the reversed shape with its axes
            // reversed (first swapped with last, and so on inwards), then packed: one copy.
            let reversed: Vec<usize> = shape.iter().rev().copied().collect();
            let mut t = Tensor::from_host_buffer(buffer, dtype, &reversed)?;
            let n = shape.len();
            for i in 0..n / 2 {
                t = t.transpose(i as isize, (n - 1 - i) as isize)?;
            }
            Ok(ferry_tensor::with_no_grad(|| t.contiguous())?)
        }
    }
}

/// Reads and parses the header of an `.npy` file of `file_len` bytes; returns it and where the
/// data starts. Lengths are checked against the file before anything is read or allocated.
fn read_npy_header(
    file: &mut impl Read,
    file_len: u64,
    path: &Path,
) -> Result<(Header, u64), NpyError> {
    let io_error = |source| NpyError::Io {
        path: path.into(),
        source,
    };
    let invalid = |reason: String| NpyError::Invalid {
        path: path.into(),
        reason,
    };
    let short = |what: &str| {
        invalid(format!(
            "the file has {file_len} bytes, too few for {what} (it is truncated or not a .npy file)"
        ))
    };
    // Magic string, version, then the header's length: 2 bytes in version 1, 4 in 2 and 3.
    let mut preamble = [0u8; 12];
    if file_len < 10 {
        return Err(short("the magic string, version and header length"));
    }
    file.read_exact(&mut preamble[..10]).map_err(io_error)?;
    if &preamble[..6] != b"\x93NUMPY" {
        return Err(invalid(
            "it does not start with the magic string \\x93NUMPY".into(),
        ));
    }
    let (prefix, header_len) = match preamble[6] {
        1 => (
            10,
            usize::from(u16::from_le_bytes([preamble[8], preamble[9]])),
        ),
        2 | 3 => {
            if file_len < 12 {
                return Err(short("a version 2 or 3 header length"));
            }
            file.read_exact(&mut preamble[10..]).map_err(io_error)?;
            let len = u32::from_le_bytes([preamble[8], preamble[9], preamble[10], preamble[11]]);
            (12, usize::try_from(len).unwrap_or(usize::MAX))
        }
        major => {
            return Err(invalid(format!(
                "format version {major}.{} is not one NumPy writes (1.0, 2.0, 3.0)",
                preamble[7]
            )));
        }
    };
    if header_len > MAX_NPY_HEADER {
        return Err(invalid(format!(
            "its header claims {header_len} bytes, more than ferry reads ({MAX_NPY_HEADER}); NumPy writes a few hundred"
        )));
    }
    let data_start = (prefix + header_len) as u64;
    if data_start > file_len {
        return Err(short(&format!("the {header_len}-byte header it declares")));
    }
    let mut head = preamble[..prefix].to_vec();
    head.resize(prefix + header_len, 0);
    file.read_exact(&mut head[prefix..]).map_err(io_error)?;
    let nesting = head[prefix..]
        .iter()
        .scan(0usize, |depth, b| {
            match b {
                b'(' | b'[' | b'{' => *depth += 1,
                b')' | b']' | b'}' => *depth = depth.saturating_sub(1),
                _ => {}
            }
            Some(*depth)
        })
        .max()
        .unwrap_or(0);
    if nesting > MAX_NPY_NESTING {
        return Err(invalid(format!(
            "its header nests brackets {nesting} deep (at most {MAX_NPY_NESTING} are read)"
        )));
    }
    let header = Header::from_reader(&mut head.as_slice())
        .map_err(|e| invalid(format!("its header: {e}")))?;
    Ok((header, data_start))
}

/// ferry's dtype for a NumPy type descriptor: little-endian (`<`, or `=` on this
/// little-endian host) or byte-sized (`|`).
fn npy_dtype(descr: &str) -> Option<DType> {
    let body = descr
        .strip_prefix('<')
        .or_else(|| descr.strip_prefix('='))
        .or_else(|| descr.strip_prefix('|').filter(|b| *b == "u1"))?;
    Some(match body {
        "f4" => DType::F32,
        "f8" => DType::F64,
        "i8" => DType::I64,
        "u1" => DType::U8,
        _ => return None,
    })
}
