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

/// Last element index an `rows x cols` operand touches: `Ok(None)` when it is empty, an error
/// when the index cannot be computed in a `usize` (strides or offset too large).
fn last_index<T>(
    what: &'static str,
    m: &MatRef<'_, T>,
    rows: usize,
    cols: usize,
) -> Result<Option<usize>, MemoryError> {
    if rows == 0 || cols == 0 {
        return Ok(None);
    }
    (rows - 1)
        .checked_mul(m.row_stride)
        .and_then(|r| (cols - 1).checked_mul(m.col_stride)?.checked_add(r))
        .and_then(|reach| reach.checked_add(m.offset))
        .map(Some)
        .ok_or_else(|| MemoryError::GemmArgument {
            argument: what,
            reason: format!(
                "of {rows}x{cols} with offset {}, row stride {} and column stride {} reaches past usize::MAX elements; check the strides",
                m.offset, m.row_stride, m.col_stride
            ),
        })
}

/// A stride as the GEMM kernel takes it. One too large for an `isize` is an error unless its
/// dimension has a single index, where it is never stepped.
fn kernel_stride(what: &'static str, stride: usize, dim: usize) -> Result<isize, MemoryError> {
    match isize::try_from(stride) {
        Ok(s) => Ok(s),
        Err(_) if dim <= 1 => Ok(0),
        Err(_) => Err(MemoryError::GemmArgument {
            argument: what,
            reason: format!("stride {stride} exceeds isize::MAX"),
        }),
    }
}

fn check<T>(
    what: &'static str,
    m: &MatRef<'_, T>,
    rows: usize,
    cols: usize,
) -> Result<(), MemoryError> {
    match last_index(what, m, rows, cols)? {
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
    if m.checked_mul(n) != Some(dst.len()) {
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
    let (lhs_rows, lhs_cols) = (
        kernel_stride("lhs", lhs.row_stride, m)?,
        kernel_stride("lhs", lhs.col_stride, k)?,
    );
    let (rhs_rows, rhs_cols) = (
        kernel_stride("rhs", rhs.row_stride, k)?,
        kernel_stride("rhs", rhs.col_stride, n)?,
    );
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: `check` proved, in checked arithmetic, that every element each operand touches
    // lies inside its slice (so every stride that is stepped, times the element size, fits an
    // isize, as `kernel_stride` also checked); `dst` holds exactly m x n elements (so n fits an
    // isize), contiguous and uniquely borrowed; `read_dst` is false, so its previous contents are never
    // read.
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
            lhs_cols,
            lhs_rows,
            rhs.data.as_ptr().add(rhs.offset),
            rhs_cols,
            rhs_rows,
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

    #[test]
    fn sizes_that_wrap_are_errors_not_writes() {
        // m·n = 2^64 wraps to 0, which an unchecked comparison took for this empty `dst`; with
        // stride-0 operands the input checks pass, so only the product check stands between
        // this call and a write of 2^64 elements.
        let one = [1.0f64];
        let broadcast = MatRef {
            data: &one[..],
            offset: 0,
            row_stride: 0,
            col_stride: 0,
        };
        let err = matmul(1 << 33, 1 << 31, 1, broadcast, broadcast, &mut [], 1).unwrap_err();
        assert!(
            matches!(err, MemoryError::OperandOutOfBounds { operand: "dst", .. }),
            "{err}"
        );
        // A reach that overflows usize is refused and says which operand.
        let huge_stride = MatRef {
            row_stride: usize::MAX,
            ..broadcast
        };
        let err = matmul(3, 1, 1, huge_stride, broadcast, &mut [0.0; 3], 1).unwrap_err();
        assert!(
            matches!(
                err,
                MemoryError::GemmArgument {
                    argument: "lhs",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("usize::MAX"), "{err}");
        // An offset at the end of usize: no overflow, and out of bounds.
        let far = MatRef {
            offset: usize::MAX,
            ..broadcast
        };
        let err = matmul(1, 1, 1, far, broadcast, &mut [0.0], 1).unwrap_err();
        assert!(
            matches!(err, MemoryError::OperandOutOfBounds { operand: "lhs", .. }),
            "{err}"
        );
    }
}
