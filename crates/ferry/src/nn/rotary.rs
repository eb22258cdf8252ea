//! Rotary position embeddings: queries and keys rotated by their position.

use ferry_tensor::{DType, Device, Result, Tensor, TensorError};
use ferry_transfer::DeviceMove;

/// How the rotation frequencies are stretched for contexts longer than the model was trained
/// on (transformers' `rope_scaling`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// The frequencies as they are.
    None,
    /// Llama 3.1's: low frequencies divided by `factor`, high ones kept, the band between
    /// blended.
    Llama3 {
        /// How much longer the context is.
        factor: f64,
        /// Wavelengths beyond `original_context / low_freq_factor` are stretched in full.
        low_freq_factor: f64,
        /// Wavelengths below `original_context / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context the model was first trained on.
        original_context: usize,
    },
}

/// The rotation of pairs `(x[i], x[i + d/2])` of each head by angle `position × θ^(-2i/d)`, as
/// transformers' Llama applies it ("rotate half"): `x cos + rotate_half(x) sin`, with the
/// tables computed in `f32` and rounded to the input's dtype.
#[derive(Debug, Clone, PartialEq)]
pub struct Rotary {
    head_dim: usize,
    inv_freq: Vec<f32>,
}

impl Rotary {
    /// Rotations for heads of `head_dim` (even) with base `theta`.
    pub fn new(head_dim: usize, theta: f64, scaling: RopeScaling) -> Result<Self> {
        if head_dim == 0 || !head_dim.is_multiple_of(2) || theta.is_nan() || theta <= 1.0 {
            return Err(TensorError::InvalidArgument {
                op: "Rotary",
                message: format!(
                    "rotary embeddings need an even head dim and a base above 1; got head dim \
                     {head_dim}, base {theta}"
                ),
            });
        }
        let base = theta as f32;
        let inv_freq = (0..head_dim / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32))
            .map(|f| scaled(f, scaling))
            .collect();
        Ok(Self { head_dim, inv_freq })
    }

    /// The angle per position of each pair, `head_dim / 2` of them.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The cosine and sine tables, `[len, head_dim]` each, for positions `start..start + len`,
    /// of `dtype` on `device`.
    pub fn tables(
        &self,
        start: usize,
        len: usize,
        dtype: DType,
        device: Device,
    ) -> Result<(Tensor, Tensor)> {
        let d = self.head_dim;
        let (mut cos, mut sin) = (Vec::with_capacity(len * d), Vec::with_capacity(len * d));
        for p in start..start + len {
            // Each half of a row repeats the other: pair i is (i, i + d/2).
            for _ in 0..2 {
                for &f in &self.inv_freq {
                    let angle = p as f32 * f;
                    cos.push(angle.cos());
                    sin.push(angle.sin());
                }
            }
        }
        let table = |values: Vec<f32>| -> Result<Tensor> {
            Tensor::from_vec(values, &[len, d])?
                .to_dtype(dtype)?
                .to(device)
        };
        Ok((table(cos)?, table(sin)?))
    }

    /// `x` (`[.., len, head_dim]`) rotated by the tables of [`Rotary::tables`] (`[len,
    /// head_dim]`, broadcast over the leading axes; reshaped to `[len, 1, head_dim]` they rotate
    /// a `[B, len, heads, head_dim]` projection before its heads are moved out). Tables of another
    /// float dtype are cast to `x`'s: the rotation runs in `x`'s precision (a `bf16` query under
    /// autocast is rotated in `bf16`, with no round trip through `f32`). One kernel each way on
    /// a GPU ([`Tensor::rotary_embedding`]).
    pub fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        if x.shape().last() != Some(&self.head_dim) {
            return Err(TensorError::InvalidArgument {
                op: "Rotary",
                message: format!(
                    "the last axis must be the head dim {}, got shape {:?}",
                    self.head_dim,
                    x.shape()
                ),
            });
        }
        let (cos, sin) = match cos.dtype() == x.dtype() {
            true => (cos.clone(), sin.clone()),
            false => (cos.to_dtype(x.dtype())?, sin.to_dtype(x.dtype())?),
        };
        x.rotary_embedding(&cos, &sin)
    }
}

/// One inverse frequency after `scaling` (transformers' `_compute_llama3_parameters`).
fn scaled(inv_freq: f32, scaling: RopeScaling) -> f32 {
    let RopeScaling::Llama3 {
        factor,
        low_freq_factor,
        high_freq_factor,
        original_context,
    } = scaling
    else {
        return inv_freq;
    };
    let (factor, low, high, context) = (
        factor as f32,
        low_freq_factor as f32,
        high_freq_factor as f32,
        original_context as f32,
    );
    let wavelen = 2.0 * std::f32::consts::PI / inv_freq;
    if wavelen > context / low {
        inv_freq / factor
    } else if wavelen < context / high {
        inv_freq
    } else {
        let smooth = (context / wavelen - low) / (high - low);
        (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_half_a_head_apart_turn_by_position_times_frequency() {
        let rotary = Rotary::new(4, 100.0, RopeScaling::None).unwrap();
        assert_eq!(rotary.inv_freq(), [1.0, 0.1]);
        let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[1, 4])
            .unwrap()
            .broadcast_to(&[3, 4])
            .unwrap();
        let (cos, sin) = rotary.tables(0, 3, DType::F32, Device::Cpu).unwrap();
        let y = rotary
            .apply(&x, &cos, &sin)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        for p in 0..3 {
            for (i, (a, b)) in [(1.0f32, 3.0f32), (2.0, 4.0)].into_iter().enumerate() {
                let angle = p as f32 * [1.0, 0.1][i];
                let (c, s) = (angle.cos(), angle.sin());
                assert!((y[p * 4 + i] - (a * c - b * s)).abs() < 1e-6, "{y:?}");
                assert!((y[p * 4 + i + 2] - (b * c + a * s)).abs() < 1e-6, "{y:?}");
            }
        }
        // Position 0 leaves the input as it is; a later start shifts the angles.
        assert_eq!(y[..4], [1.0, 2.0, 3.0, 4.0]);
        let (cos2, _) = rotary.tables(2, 1, DType::F32, Device::Cpu).unwrap();
        assert_eq!(
            cos2.to_vec::<f32>().unwrap(),
            cos.narrow(0, 2, 1).unwrap().to_vec::<f32>().unwrap()
        );
    }

    #[test]
    fn llama3_scaling_stretches_low_frequencies_only() {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8192,
        };
        let plain = Rotary::new(128, 500_000.0, RopeScaling::None).unwrap();
        let long = Rotary::new(128, 500_000.0, scaling).unwrap();
        let (p, l) = (plain.inv_freq(), long.inv_freq());
        // The highest frequency (wavelength 2π) is kept, the lowest divided by the factor.
        assert_eq!(l[0], p[0]);
        assert!((l[63] - p[63] / 8.0).abs() <= f32::EPSILON * p[63]);
        // In between, each lies between the two.
        assert!(l.iter().zip(p).all(|(l, p)| *l <= *p && *l >= p / 8.0));
    }

    #[test]
    fn odd_head_dims_are_refused() {
        let err = Rotary::new(5, 10_000.0, RopeScaling::None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("even head dim"), "{err}");
    }
}
