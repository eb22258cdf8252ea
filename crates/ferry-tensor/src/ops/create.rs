//! Creating tensors directly on their device, and the seedable generator behind rand/randn.

use std::cell::RefCell;

use ferry_memory::{DType, Device};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha12Rng;

use crate::layout::shape_bytes;
use crate::{Result, Tensor, TensorError, backend};

thread_local! {
    // ChaCha12, the algorithm of rand's StdRng (the same seed gives the same stream), named
    // directly because its position can be read and set: `rng_state` and `set_rng_state`.
    static RNG: RefCell<ChaCha12Rng> = RefCell::new(ChaCha12Rng::from_os_rng());
}

/// Seeds this thread's generator: the rand/randn calls that follow repeat exactly.
pub fn manual_seed(seed: u64) {
    RNG.with(|r| *r.borrow_mut() = ChaCha12Rng::seed_from_u64(seed));
}

/// Where this thread's generator stands, to be put back with [`set_rng_state`]: a run that
/// stops and resumes draws the same dropout masks as one that never stopped. Written as 112
/// hex digits (`to_string`, `parse`), so it fits a checkpoint's text metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RngState {
    seed: [u8; 32],
    stream: u64,
    word_pos: u128,
}

/// This thread's generator's state.
pub fn rng_state() -> RngState {
    RNG.with(|r| {
        let rng = r.borrow();
        RngState {
            seed: rng.get_seed(),
            stream: rng.get_stream(),
            word_pos: rng.get_word_pos(),
        }
    })
}

/// Puts this thread's generator where [`rng_state`] found it.
pub fn set_rng_state(state: &RngState) {
    let mut rng = ChaCha12Rng::from_seed(state.seed);
    rng.set_stream(state.stream);
    rng.set_word_pos(state.word_pos);
    RNG.with(|r| *r.borrow_mut() = rng);
}

impl std::fmt::Display for RngState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let stream = self.stream.to_le_bytes();
        let word_pos = self.word_pos.to_le_bytes();
        let mut bytes = self.seed.iter().chain(&stream).chain(&word_pos);
        bytes.try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl std::str::FromStr for RngState {
    type Err = TensorError;

    fn from_str(text: &str) -> Result<Self> {
        let invalid = || TensorError::InvalidArgument {
            op: "RngState::from_str",
            message: format!("expected 112 hex digits, got {text:?}"),
        };
        if text.len() != 112 || !text.is_ascii() {
            return Err(invalid());
        }
        let bytes = (0..56)
            .map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16).map_err(|_| invalid()))
            .collect::<Result<Vec<u8>>>()?;
        let seed = bytes[..32].try_into().expect("32 bytes");
        let stream = u64::from_le_bytes(bytes[32..40].try_into().expect("8 bytes"));
        let word_pos = u128::from_le_bytes(bytes[40..].try_into().expect("16 bytes"));
        Ok(Self {
            seed,
            stream,
            word_pos,
        })
    }
}

impl Tensor {
    /// Every element `value`, created on `device`.
    pub fn full(shape: &[usize], value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        filled("full", shape, value, dtype, device)
    }

    /// All zeros.
    pub fn zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        filled("zeros", shape, 0.0, dtype, device)
    }

    /// All ones.
    pub fn ones(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        filled("ones", shape, 1.0, dtype, device)
    }

    /// Zeros with this tensor's shape, dtype and device.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Self::zeros(self.shape(), self.dtype(), self.device())
    }

    /// Ones with this tensor's shape, dtype and device.
    pub fn ones_like(&self) -> Result<Tensor> {
        Self::ones(self.shape(), self.dtype(), self.device())
    }

    /// `start, start + 1, ..` below `end`, as a 1-D tensor.
    pub fn arange(start: f64, end: f64, dtype: DType, device: Device) -> Result<Tensor> {
        if end < start || !(end - start).is_finite() {
            return Err(TensorError::InvalidArgument {
                op: "arange",
                message: format!("needs start <= end, got {start}..{end}"),
            });
        }
        let len = (end - start).ceil() as usize; // saturates: the size check refuses it
        shape_bytes("arange", &[len], dtype)?;
        backend::arange(start, len, dtype, device)
    }

    /// Uniform samples in `[0, 1)` from this thread's generator.
    pub fn rand(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        sample(shape, dtype, device, false)
    }

    /// Standard normal samples from this thread's generator.
    pub fn randn(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        sample(shape, dtype, device, true)
    }
}

/// Samples from a seed taken from this thread's generator (the host or the kernel draws them
/// from it), so `manual_seed` makes both devices repeatable.
fn sample(shape: &[usize], dtype: DType, device: Device, normal: bool) -> Result<Tensor> {
    let op = if normal { "randn" } else { "rand" };
    shape_bytes(op, shape, dtype)?;
    let seed = RNG.with(|rng| rng.borrow_mut().random::<u64>());
    backend::random(shape, dtype, device, seed, normal)
}

/// Every element `value`: sized (and refused when too large) before anything is allocated.
fn filled(
    op: &'static str,
    shape: &[usize],
    value: f64,
    dtype: DType,
    device: Device,
) -> Result<Tensor> {
    shape_bytes(op, shape, dtype)?;
    backend::full(shape, dtype, device, value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draws(n: usize) -> Vec<f32> {
        Tensor::rand(&[n], DType::F32, Device::Cpu)
            .unwrap()
            .to_vec::<f32>()
            .unwrap()
    }

    #[test]
    fn a_saved_state_repeats_the_draws_that_followed_it() {
        manual_seed(7);
        draws(5);
        let state = rng_state();
        let after: Vec<_> = (0..3).map(|_| draws(4)).collect();
        manual_seed(99);
        draws(2);
        let text = state.to_string();
        assert_eq!(text.len(), 112);
        set_rng_state(&text.parse().unwrap());
        let again: Vec<_> = (0..3).map(|_| draws(4)).collect();
        assert_eq!(after, again);
    }

    #[test]
    fn the_generator_keeps_std_rngs_stream() {
        manual_seed(3);
        let ours: u64 = RNG.with(|r| r.borrow_mut().random());
        let std: u64 = rand::rngs::StdRng::seed_from_u64(3).random();
        assert_eq!(ours, std);
    }

    #[test]
    fn a_damaged_state_is_an_error() {
        for text in ["", "zz", &"g".repeat(112), &"é".repeat(56)] {
            let err = text.parse::<RngState>().unwrap_err().to_string();
            assert!(err.contains("112 hex digits"), "{err}");
        }
    }
}
