//! Scalar math the op table's CPU rows call (GELU in both forms and their slopes, SiLU's slope,
//! maximum's gradient share), computed in `f64` where the element type is narrower.

use ferry_memory::Element;
use num_traits::Float;

/// `√(2/π)`, the tanh approximation's scale.
pub(crate) const K: f64 = 0.797_884_560_802_865_4;
/// The tanh approximation's cubic coefficient.
pub(crate) const C: f64 = 0.044_715;
/// `1/√(2π)`, the standard normal density at 0.
pub(crate) const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;

/// The error function, to double precision: `2/√π e^{-x²} Σ 2ⁿ x^{2n+1} / (1·3·…·(2n+1))`,
/// a series of positive terms (no cancellation) that converges for every `x`; beyond
/// `|x| = 6` erf is ±1 to within 2e-17.
pub(crate) fn erf(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    if x.abs() >= 6.0 {
        return x.signum();
    }
    let x2 = x * x;
    let (mut term, mut sum) = (x, x);
    let mut n = 0.0;
    loop {
        n += 1.0;
        term *= 2.0 * x2 / (2.0 * n + 1.0);
        sum += term;
        if term.abs() <= sum.abs() * 1e-17 {
            break;
        }
    }
    2.0 / std::f64::consts::PI.sqrt() * (-x2).exp() * sum
}

fn to_f64<T: Element>(v: T) -> f64 {
    <T as Element>::to_f64(v)
}

fn from_f64<T: Element>(v: f64) -> T {
    <T as Element>::from_f64(v)
}

/// GELU's tanh form on the CPU, computed in `f64` for every element type.
pub(crate) fn gelu_tanh_cpu<T: Element>(v: T) -> T {
    let x = to_f64(v);
    from_f64(0.5 * x * (1.0 + (K * (x + C * x * x * x)).tanh()))
}

/// Exact GELU on the CPU.
pub(crate) fn gelu_erf_cpu<T: Element>(v: T) -> T {
    let x = to_f64(v);
    from_f64(0.5 * x * (1.0 + erf(x * std::f64::consts::FRAC_1_SQRT_2)))
}

/// d/dx of the tanh form: `½(1 + t) + ½ x (1 - t²) u'` with `u = K(x + C x³)`, `t = tanh u`.
fn gelu_tanh_slope(x: f64) -> f64 {
    let t = (K * (x + C * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * K * (1.0 + 3.0 * C * x * x)
}

/// d/dx of exact GELU: `Φ(x) + x φ(x)`.
fn gelu_erf_slope(x: f64) -> f64 {
    0.5 * (1.0 + erf(x * std::f64::consts::FRAC_1_SQRT_2)) + x * INV_SQRT_2PI * (-0.5 * x * x).exp()
}

pub(crate) fn gelu_tanh_backward_cpu<T: Element>(g: T, x: T) -> T {
    from_f64(to_f64(g) * gelu_tanh_slope(to_f64(x)))
}

pub(crate) fn gelu_erf_backward_cpu<T: Element>(g: T, x: T) -> T {
    from_f64(to_f64(g) * gelu_erf_slope(to_f64(x)))
}

pub(crate) fn silu_backward_cpu<T: Element + Float>(g: T, x: T) -> T {
    let s = T::one() / (T::one() + (-x).exp());
    g * s * (T::one() + x * (T::one() - s))
}

pub(crate) fn max_share_cpu<T: Element + Float>(a: T, b: T) -> T {
    if a > b {
        T::one()
    } else if a == b {
        from_f64(0.5)
    } else {
        T::zero()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_matches_reference_values() {
        // erf at a few points, to 16 digits (Abramowitz & Stegun table 7.1 / high-precision).
        let cases = [
            (0.0, 0.0),
            (0.1, 0.112_462_916_018_284_9),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (3.0, 0.999_977_909_503_001_4),
            (-1.5, -0.966_105_146_475_310_8),
        ];
        for (x, want) in cases {
            let got = erf(x);
            assert!((got - want).abs() <= 2e-15, "erf({x}) = {got}, want {want}");
        }
        assert_eq!(erf(7.0), 1.0);
        assert_eq!(erf(-9.0), -1.0);
        assert!(erf(f64::NAN).is_nan());
    }

    #[test]
    fn slopes_match_central_differences() {
        let h = 1e-6;
        for x in [-3.0, -1.2, -0.3, 0.0, 0.4, 1.7, 4.0] {
            let g = |f: fn(f64) -> f64| (f(x + h) - f(x - h)) / (2.0 * h);
            let erf_form = g(gelu_erf_cpu::<f64>);
            let tanh_form = g(gelu_tanh_cpu::<f64>);
            assert!((gelu_erf_slope(x) - erf_form).abs() < 1e-8, "gelu' at {x}");
            assert!(
                (gelu_tanh_slope(x) - tanh_form).abs() < 1e-8,
                "gelu_tanh' at {x}"
            );
        }
    }
}
