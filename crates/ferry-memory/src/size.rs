//! Byte counts, checked, and written for people. Byte counts of shaped data: the one place
//! where an element count is multiplied by an element size. Every allocation of shaped data takes
//! its size from here, so a shape too large to address is refused before any memory is asked for
//! (a wrapped product would allocate a few bytes that a kernel then overruns). Byte figures in
//! messages (`1.50 GiB`) come from here too, so errors and the CUDA layer share a leaf module.

use crate::DType;

/// The most bytes one buffer may hold: `isize::MAX`, the bound Rust puts on every allocation
/// and on pointer offsets (and so on the strides handed to GEMM kernels).
pub const MAX_BYTES: usize = isize::MAX as usize;

/// Elements in `shape`: 0 when a dimension is 0 (whatever the others), `None` when the product
/// overflows a `usize`.
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    if shape.contains(&0) {
        return Some(0);
    }
    shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
}

/// Bytes `numel` elements of `dtype` take, or `None` beyond [`MAX_BYTES`].
pub fn checked_bytes(numel: usize, dtype: DType) -> Option<usize> {
    numel
        .checked_mul(dtype.size())
        .filter(|&bytes| bytes <= MAX_BYTES)
}

/// Bytes a contiguous `shape` of `dtype` takes, or `None` when the element count overflows or
/// the bytes exceed [`MAX_BYTES`].
pub fn shape_bytes(shape: &[usize], dtype: DType) -> Option<usize> {
    checked_bytes(checked_numel(shape)?, dtype)
}

/// Bytes as a short human figure (`1.50 GiB`), for error messages.
pub fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// Bytes from a size written by a person: a plain number of bytes (`1073741824`), or a number
/// (decimals allowed) with a binary unit `K`, `M`, `G` or `T`, optionally followed by `B` or
/// `iB`, in any case: `8G`, `8GiB`, `512m`, `1.5G`. `None` for anything else or an overflow.
pub fn parse_bytes(text: &str) -> Option<usize> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    if number.is_empty() || number.starts_with('.') {
        return None;
    }
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    if let Ok(whole) = number.parse::<usize>() {
        return whole.checked_mul(1usize << shift);
    }
    let value: f64 = number.parse().ok()?;
    let bytes = value * (1u64 << shift) as f64;
    (bytes.is_finite() && bytes < usize::MAX as f64).then_some(bytes as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_that_overflow_or_exceed_the_limit_are_refused() {
        assert_eq!(shape_bytes(&[2, 3], DType::F32), Some(24));
        assert_eq!(shape_bytes(&[], DType::F64), Some(8));
        // A zero dimension makes the rest irrelevant, however large.
        assert_eq!(
            shape_bytes(&[usize::MAX, 0, usize::MAX], DType::F64),
            Some(0)
        );
        // (2^61 + 1) * 8 wraps to 8 in unchecked arithmetic.
        assert_eq!(shape_bytes(&[(1 << 61) + 1], DType::F64), None);
        assert_eq!(shape_bytes(&[usize::MAX, 2], DType::U8), None);
        // Counting works but the bytes pass isize::MAX.
        assert_eq!(checked_numel(&[1 << 60]), Some(1 << 60));
        assert_eq!(shape_bytes(&[1 << 60], DType::F64), None);
        assert_eq!(shape_bytes(&[MAX_BYTES], DType::U8), Some(MAX_BYTES));
        assert_eq!(shape_bytes(&[MAX_BYTES / 2 + 1], DType::F16), None);
    }

    #[test]
    fn byte_figures_are_readable() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 << 20), "3.00 MiB");
        assert_eq!(human_bytes(200 << 30), "200.00 GiB");
    }
}
