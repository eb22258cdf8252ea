//! Reading values out to the host: on a GPU the elements are copied into a `Vec` (not a move:
//! nothing is recorded, and the tensor stays where it is).

use ferry_memory::{DType, Element};

use crate::{Result, Tensor, TensorError, backend};

impl Tensor {
    /// The elements in row-major order. Works on any device: reading values out is not a move.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        // Not `contiguous()`: reading values out must not record a graph node.
        let contiguous = if self.is_contiguous() {
            self.clone()
        } else {
            backend::contiguous(self)?
        };
        let data = backend::read_elements::<T>(&contiguous)?;
        Ok(data)
    }

    /// The elements converted to `f64`, whatever the dtype.
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        let t = if self.dtype() == DType::F64 {
            self.clone()
        } else {
            self.to_dtype(DType::F64)?
        };
        t.to_vec::<f64>()
    }

    /// The single value of a one-element tensor, as `f64`.
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(TensorError::InvalidArgument {
                op: "item",
                message: format!(
                    "the tensor has {} elements; item() needs exactly one (reduce with .sum() first)",
                    self.numel()
                ),
            });
        }
        Ok(self.to_vec_f64()?[0])
    }
}
