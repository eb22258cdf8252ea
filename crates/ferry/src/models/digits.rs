//! Multi-layer perceptrons and the digits CNN.

use crate::nn::{
    Conv2d, Conv2dOptions, Dropout, Flatten, Linear, MaxPool2d, Module, ReLU, Sequential,
};
use crate::{Device, Result, Tensor, TensorError};

/// Features of a digits sample: an 8 x 8 image, row by row.
pub const DIGITS_FEATURES: usize = 64;
/// Hidden units of [`digits_mlp`].
pub const DIGITS_HIDDEN: usize = 128;
/// Classes of the digits data (0 to 9).
pub const DIGITS_CLASSES: usize = 10;

/// Linear layers between neighbouring `widths` (input first), each hidden one followed by ReLU
/// and, when `dropout > 0`, by dropout with that probability. Layers are created (and their
/// weights drawn) input first.
///
/// ```
/// use ferry::models::mlp;
/// use ferry::prelude::*;
///
/// let model = mlp(&[4, 8, 3], 0.0, Device::Cpu)?;
/// assert_eq!(model.num_parameters(), 4 * 8 + 8 + 8 * 3 + 3);
/// # Ok::<(), ferry::TensorError>(())
/// ```
pub fn mlp(widths: &[usize], dropout: f64, device: Device) -> Result<Sequential> {
    if widths.len() < 2 {
        return Err(TensorError::InvalidArgument {
            op: "models::mlp",
            message: format!(
                "{} width(s) given; pass at least the input and output widths",
                widths.len()
            ),
        });
    }
    let mut m = Sequential::new();
    for (i, pair) in widths.windows(2).enumerate() {
        if i > 0 {
            m = m.push(ReLU);
            if dropout > 0.0 {
                m = m.push(Dropout::new(dropout)?);
            }
        }
        m = m.push(Linear::new(pair[0], pair[1], device)?);
    }
    Ok(m)
}

/// The digits MLP 64-128-10, with dropout `dropout` after the hidden layer when it is above 0.
pub fn digits_mlp(device: Device, dropout: f64) -> Result<Sequential> {
    mlp(
        &[DIGITS_FEATURES, DIGITS_HIDDEN, DIGITS_CLASSES],
        dropout,
        device,
    )
}

/// The digits CNN: the 64 features as a 1 x 8 x 8 image, conv 3x3 (16, padding 1), ReLU, conv
/// 3x3 (32, padding 1), ReLU, max pool 2x2, flatten (512), linear 64, ReLU, dropout `dropout`
/// (when above 0), linear 10.
pub fn digits_cnn(device: Device, dropout: f64) -> Result<Sequential> {
    let same = Conv2dOptions::default().padding(1);
    let mut m = Sequential::new()
        .push(ImageOf8x8)
        .push(Conv2d::with_options(1, 16, [3, 3], same, device)?)
        .push(ReLU)
        .push(Conv2d::with_options(16, 32, [3, 3], same, device)?)
        .push(ReLU)
        .push(MaxPool2d::new(2))
        .push(Flatten)
        .push(Linear::new(32 * 4 * 4, 64, device)?)
        .push(ReLU);
    if dropout > 0.0 {
        m = m.push(Dropout::new(dropout)?);
    }
    Ok(m.push(Linear::new(64, DIGITS_CLASSES, device)?))
}

/// `[N, 64]` rows as `[N, 1, 8, 8]` images (a view).
#[derive(Debug, Clone, Copy)]
struct ImageOf8x8;

impl Module for ImageOf8x8 {
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        input.reshape(&[input.shape()[0], 1, 8, 8])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn mlp_layers_follow_the_widths() {
        let m = mlp(&[64, 128, 10], 0.5, Device::Cpu).unwrap();
        let shapes: Vec<(String, Vec<usize>)> = m
            .named_parameters()
            .into_iter()
            .map(|(n, t)| (n, t.shape().to_vec()))
            .collect();
        // Linear, ReLU, Dropout, Linear: the second linear layer is module 3.
        assert_eq!(
            shapes,
            [
                ("0.weight".to_string(), vec![128, 64]),
                ("0.bias".to_string(), vec![128]),
                ("3.weight".to_string(), vec![10, 128]),
                ("3.bias".to_string(), vec![10]),
            ]
        );
        let err = mlp(&[64], 0.0, Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("at least the input and output"), "{err}");
    }

    #[test]
    fn the_same_seed_builds_the_same_weights() {
        let weights = |seed| {
            crate::manual_seed(seed);
            let m = digits_cnn(Device::Cpu, 0.0).unwrap();
            m.parameters()[0].to_vec::<f32>().unwrap()
        };
        assert_eq!(weights(3), weights(3));
        assert_ne!(weights(3), weights(4));
    }

    #[test]
    fn the_cnn_maps_digits_rows_to_ten_logits() {
        let m = digits_cnn(Device::Cpu, 0.0).unwrap();
        let x = Tensor::rand(&[5, DIGITS_FEATURES], DType::F32, Device::Cpu).unwrap();
        assert_eq!(m.forward(&x).unwrap().shape(), &[5, DIGITS_CLASSES]);
    }
}
