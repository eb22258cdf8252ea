//! Element types and the trait that ties a Rust type to its [`DType`].

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::MemoryError;

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// 64-bit signed integer.
    I64,
    /// 8-bit unsigned integer.
    U8,
}

impl DType {
    /// Every dtype, in a fixed order.
    pub const ALL: [DType; 6] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::U8,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// The short name (`f32`, `bf16`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I64 => "i64",
            DType::U8 => "u8",
        }
    }

    /// Whether gradients can flow through values of this type.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = MemoryError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| MemoryError::BadDType {
                text: s.to_string(),
            })
    }
}

/// A Rust type that is the element of some [`DType`].
pub trait Element: bytemuck::Pod + Copy + Send + Sync + PartialOrd + fmt::Debug + 'static {
    /// The matching dtype.
    const DTYPE: DType;
    /// Converts to `f64` (exact for every type but `i64` beyond 2^53).
    fn to_f64(self) -> f64;
    /// Converts from `f64`, rounding to nearest (saturating for integers).
    fn from_f64(value: f64) -> Self;
}

macro_rules! element {
    ($t:ty, $dtype:ident, |$v:ident| $from:expr, |$w:ident| $to:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$dtype;
            fn to_f64(self) -> f64 {
                let $w = self;
                $to
            }
            fn from_f64($v: f64) -> Self {
                $from
            }
        }
    };
}

element!(f32, F32, |v| v as f32, |w| w as f64);
element!(f64, F64, |v| v, |w| w);
element!(f16, F16, |v| f16::from_f64(v), |w| w.to_f64());
element!(bf16, BF16, |v| bf16_from_f64(v), |w| w.to_f64());
element!(i64, I64, |v| v as i64, |w| w as f64);
element!(u8, U8, |v| v as u8, |w| w as f64);

/// `v` rounded to the nearest bf16, ties to even. `half`'s `bf16::from_f64` drops the low 32
/// mantissa bits before rounding, so values just above a tie round down; going through f32 with
/// round-to-odd keeps every bit that decides the final rounding.
fn bf16_from_f64(v: f64) -> bf16 {
    let f = v as f32;
    if !f.is_finite() || f64::from(f) == v {
        return bf16::from_f32(f);
    }
    let mut bits = f.to_bits();
    if f64::from(f).abs() > v.abs() {
        bits -= 1; // rounded away from zero: step back to the truncation
    }
    bf16::from_f32(f32::from_bits(bits | 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sizes_match_rust_types() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert_eq!(DType::BF16.size(), std::mem::size_of::<bf16>());
        assert_eq!(DType::I64.size(), std::mem::size_of::<i64>());
        assert!(
            "f8".parse::<DType>()
                .unwrap_err()
                .to_string()
                .contains("f32, f64")
        );
    }

    #[test]
    fn conversions_round_and_saturate() {
        assert_eq!(
            f16::from_f64(1.0 / 3.0).to_f64(),
            <f16 as Element>::from_f64(1.0 / 3.0).to_f64()
        );
        assert_eq!(<u8 as Element>::from_f64(300.0), 255);
        assert_eq!(<u8 as Element>::from_f64(-2.0), 0);
    }

    #[test]
    fn bf16_from_f64_rounds_once() {
        // 1 + 2^-8 is a tie between 1 and 1 + 2^-7; a hair above it must round up.
        let just_above_tie = 1.0 + 2f64.powi(-8) + 2f64.powi(-40);
        assert_eq!(
            <bf16 as Element>::from_f64(just_above_tie).to_f64(),
            1.0 + 2f64.powi(-7)
        );
        assert_eq!(
            <bf16 as Element>::from_f64(1.0 + 2f64.powi(-8)).to_f64(),
            1.0
        ); // tie to even
    }
}
