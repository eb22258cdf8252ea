//! The safe boundary around the `gemm` crate's CPU matrix product, which takes raw pointers.

use half::f16;

use crate::MemoryError;

/// A row-major-or-not matrix operand: a slice plus offset and element strides.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a, T> {
    /// The backing elements.
    pub data: &'a [T],
    /// Index of element (0, 0).
    pub offset: usize,
    /// Elements between consecutive rows.
    pub row_stride: usize,
    /// Elements between consecutive columns.
    pub col_stride: usize,
}

/// Element types the CPU GEMM computes in natively.
pub trait GemmElement: Copy + 'static {
    /// The additive identity, for `beta` when the destination is overwritten.
    const ZERO: Self;
    /// The multiplicative identity, for `alpha`.
    const ONE: Self;
}

impl GemmElement for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}
impl GemmElement for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}
impl GemmElement for f16 {
    const ZERO: Self = f16::ZERO;
    const ONE: Self = f16::ONE;
}

/// Last element index an `rows x cols` operand touches, or `None` when it is empty.
fn last_index<T>(m: &MatRef<'_, T>, rows: usize, cols: usize) -> Option<usize> {
    (rows > 0 && cols > 0).then(|| m.offset + (rows - 1) * m.row_stride + (cols - 1) * m.col_stride)
}

fn check<T>(
    what: &'static str,
    m: &MatRef<'_, T>,
    rows: usize,
    cols: usize,
) -> Result<(), MemoryError> {
    match last_index(m, rows, cols) {
        Some(last) if last >= m.data.len() => Err(MemoryError::OperandOutOfBounds {
            operand: what,
            rows,
            cols,
            len: m.data.len(),
        }),
        _ => Ok(()),
    }
}

/// `dst (m x n, contiguous row-major) = lhs (m x k) · rhs (k x n)`, parallel over `threads`.
pub fn matmul<T: GemmElement>(
    m: usize,
    n: usize,
    k: usize,
    lhs: MatRef<'_, T>,
    rhs: MatRef<'_, T>,
    dst: &mut [T],
    threads: usize,
) -> Result<(), MemoryError> {
    check("lhs", &lhs, m, k)?;
    check("rhs", &rhs, k, n)?;
    if dst.len() != m * n {
        return Err(MemoryError::OperandOutOfBounds {
            operand: "dst",
            rows: m,
            cols: n,
            len: dst.len(),
        });
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        dst.fill(T::ZERO);
        return Ok(());
    }
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: `check` proved every element each operand touches lies inside its slice, and
    // `dst` is exactly m x n, contiguous and uniquely borrowed; `read_dst` is false, so its
    // previous contents are never read.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            false,
            lhs.data.as_ptr().add(lhs.offset),
            lhs.col_stride as isize,
            lhs.row_stride as isize,
            rhs.data.as_ptr().add(rhs.offset),
            rhs.col_stride as isize,
            rhs.row_stride as isize,
            T::ZERO,
            T::ONE,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row_major(data: &[f64], cols: usize) -> MatRef<'_, f64> {
        MatRef {
            data,
            offset: 0,
            row_stride: cols,
            col_stride: 1,
        }
    }

    #[test]
    fn small_product_and_transposed_operand() {
        // [1 2 3; 4 5 6] · [1 0; 0 1; 1 1] = [1+3, 2+3; 4+6, 5+6]
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let mut c = [0.0; 4];
        matmul(2, 2, 3, row_major(&a, 3), row_major(&b, 2), &mut c, 1).unwrap();
        assert_eq!(c, [4.0, 5.0, 10.0, 11.0]);
        // a·aᵀ with aᵀ as a strided view of a: [14 32; 32 77]
        let at = MatRef {
            data: &a[..],
            offset: 0,
            row_stride: 1,
            col_stride: 3,
        };
        matmul(2, 2, 3, row_major(&a, 3), at, &mut c, 1).unwrap();
        assert_eq!(c, [14.0, 32.0, 32.0, 77.0]);
    }

    #[test]
    fn operands_that_do_not_fit_are_errors() {
        let a = [1.0; 5];
        let mut c = [0.0; 4];
        let err = matmul(
            2,
            2,
            3,
            row_major(&a, 3),
            row_major(&[1.0; 6], 2),
            &mut c,
            1,
        )
        .unwrap_err();
        assert!(
            matches!(err, MemoryError::OperandOutOfBounds { operand: "lhs", .. }),
            "{err}"
        );
    }
}
