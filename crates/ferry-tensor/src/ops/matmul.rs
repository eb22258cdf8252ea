//! Matrix products, 2-D and batched with broadcast batch dimensions.

use crate::autograd::record;
use crate::kept::kept;
use crate::layout::broadcast_shapes;
use crate::{Result, Tensor, TensorError, backend, rules};

impl Tensor {
    /// `self [.., m, k] · rhs [.., k, n]`; batch dimensions broadcast. Transposed views are
    /// read in place, without copies.
    ///
    /// Inside an autocast scope ([`crate::autocast`]) an `f32` product runs in the scope's
    /// precision and comes back as `f32`.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        if let Some(out) = crate::autocast::matmul(self, rhs)? {
            return Ok(out);
        }
        self.same_kind("matmul", rhs)?;
        let (a, b) = (self.shape(), rhs.shape());
        if a.len() < 2 || b.len() < 2 || a[a.len() - 1] != b[b.len() - 2] {
            return Err(TensorError::ShapeMismatch {
                op: "matmul",
                lhs: self.dims(),
                rhs: rhs.dims(),
                hint: "need [.., m, k] and [.., k, n] (reshape vectors to matrices first)",
            });
        }
        let batch = broadcast_shapes("matmul", &a[..a.len() - 2], &b[..b.len() - 2])?;
        let full = |t: &Tensor, rows: usize, cols: usize| {
            let mut shape = batch.to_vec();
            shape.extend([rows, cols]);
            t.layout()
                .broadcast_to(&shape)
                .expect("batch dims broadcast")
        };
        let la = full(self, a[a.len() - 2], a[a.len() - 1]);
        let lb = full(rhs, b[b.len() - 2], b[b.len() - 1]);
        let mut shape = batch.to_vec();
        shape.extend([a[a.len() - 2], b[b.len() - 1]]);
        let [out] = kept("matmul", &shape, || {
            Ok([backend::matmul(self, &la, rhs, &lb, &batch)?])
        })?;
        Ok(record(out, "matmul", &[self, rhs], || {
            rules::matmul(self, rhs)
        }))
    }
}
