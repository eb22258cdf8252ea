//! An exponential moving average of the parameters, for evaluating and shipping weights that
//! are steadier than the last step's.

use ferry_tensor::{Result, Tensor, TensorError, with_no_grad};
use ferry_transfer::{DeviceMove, StateDict};

use super::axpy;
use crate::checkpoint::CheckpointError;
use crate::nn::check_state;

/// An exponential moving average of parameters (Polyak averaging): after each optimizer step,
/// [`Ema::update`] moves every average a fraction `1 - decay` of the way to its parameter, so the
/// averages weigh about the last `1 / (1 - decay)` steps. Late in training the averages usually
/// test better than the parameters themselves, and vary less from seed to seed.
///
/// Early updates use a smaller decay, `min(decay, (1 + n) / (10 + n))` after `n` updates, so the
/// initial weights are soon forgotten. Averages are kept on the parameters' device, in their
/// dtype, and updated under `no_grad`. [`Ema::with_averages`] evaluates with them;
/// [`Ema::state_dict`] goes into a checkpoint next to the model's.
///
/// ```
/// use ferry::nn::{Linear, Module};
/// use ferry::optim::{Adam, Ema, Optimizer};
/// use ferry::prelude::*;
///
/// let layer = Linear::new(3, 1, Device::Cpu)?;
/// let mut opt = Adam::new(layer.parameters(), 1e-2)?;
/// let mut ema = Ema::new(layer.parameters(), 0.99)?;
/// let x = Tensor::rand(&[8, 3], DType::F32, Device::Cpu)?;
/// for _ in 0..5 {
///     opt.zero_grad();
///     layer.forward(&x)?.powf(2.0)?.mean()?.backward()?;
///     opt.step()?;
///     ema.update()?;
/// }
/// let averaged = ema.with_averages(|| layer.forward(&x))??;
/// assert_eq!(averaged.shape(), &[8, 1]);
/// # Ok::<(), ferry::TensorError>(())
/// ```
#[derive(Debug)]
pub struct Ema {
    params: Vec<Tensor>,
    averages: Vec<Tensor>,
    decay: f64,
    updates: u64,
}

impl Ema {
    /// Averages of `params` (usually `model.parameters()`, after the model has moved to its
    /// device), starting at their current values. `decay` must be in `[0, 1)`.
    pub fn new(params: impl IntoIterator<Item = Tensor>, decay: f64) -> Result<Self> {
        if !(0.0..1.0).contains(&decay) {
            return Err(TensorError::InvalidArgument {
                op: "Ema::new",
                message: format!(
                    "decay {decay} is outside [0, 1); 0.99 averages about the last 100 steps, 0.999 the last 1,000"
                ),
            });
        }
        let params: Vec<Tensor> = params.into_iter().collect();
        let averages = with_no_grad(|| {
            params
                .iter()
                .map(|p| p.detach().copy())
                .collect::<Result<Vec<_>>>()
        })?;
        Ok(Self {
            params,
            averages,
            decay,
            updates: 0,
        })
    }

    /// The decay the averages approach.
    pub fn decay(&self) -> f64 {
        self.decay
    }

    /// Updates so far.
    pub fn updates(&self) -> u64 {
        self.updates
    }

    /// The decay the next update uses: `min(decay, (1 + n) / (10 + n))` after `n` updates.
    pub fn next_decay(&self) -> f64 {
        let n = self.updates as f64;
        self.decay.min((1.0 + n) / (10.0 + n))
    }

    /// The averages, one per parameter, in the parameters' order (the live tensors: later
    /// updates change them in place).
    pub fn averages(&self) -> &[Tensor] {
        &self.averages
    }

    /// Moves every average towards its parameter: `average += (1 - d) * (param - average)` with
    /// `d` = [`Ema::next_decay`]. Call it after each optimizer step.
    pub fn update(&mut self) -> Result<()> {
        let keep = self.next_decay();
        with_no_grad(|| {
            for (average, p) in self.averages.iter().zip(&self.params) {
                let toward = p.detach().sub(average)?;
                average.assign(&axpy(average, 1.0 - keep, &toward)?)?;
            }
            Ok::<_, TensorError>(())
        })?;
        self.updates += 1;
        Ok(())
    }

    /// Exchanges the values of the parameters and of their averages, in place: afterwards the
    /// model computes with the averaged weights. Calling it again swaps them back.
    pub fn swap(&mut self) -> Result<()> {
        with_no_grad(|| {
            for (average, p) in self.averages.iter().zip(&self.params) {
                let trained = p.detach().copy()?;
                p.assign(average)?;
                average.assign(&trained)?;
            }
            Ok(())
        })
    }

    /// Runs `f` with the averaged weights in the parameters, then puts the trained weights back,
    /// whatever `f` returned. The outer error is the swap's, the inner one `f`'s.
    pub fn with_averages<R>(&mut self, f: impl FnOnce() -> R) -> Result<R> {
        self.swap()?;
        let out = f();
        self.swap()?;
        Ok(out)
    }

    /// `updates` (`i64`), `decay` (`f64`) and `"{index}.average"` per parameter (detached views
    /// of the live averages: save or copy the dict before updating on).
    pub fn state_dict(&self) -> StateDict {
        let mut out = vec![
            ("updates".to_string(), Tensor::scalar(self.updates as i64)),
            ("decay".to_string(), Tensor::scalar(self.decay)),
        ];
        for (i, average) in self.averages.iter().enumerate() {
            out.push((format!("{i}.average"), average.detach()));
        }
        out
    }

    /// Restores a state dict: keys, shapes and dtypes are checked first, and on error nothing
    /// changes. Averages are copied to the parameters' device; the saved decay replaces this
    /// one.
    pub fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<(), CheckpointError> {
        let mut expected = vec![
            ("updates".to_string(), Tensor::scalar(0i64)),
            ("decay".to_string(), Tensor::scalar(0f64)),
        ];
        for (i, p) in self.params.iter().enumerate() {
            expected.push((format!("{i}.average"), p.detach()));
        }
        check_state("ema", &expected, state)?;
        let find = |key: &str| &state.iter().find(|(k, _)| k == key).expect("checked").1;
        let updates = find("updates").item()?;
        let decay = find("decay").item()?;
        if !(0.0..1.0).contains(&decay) || updates < 0.0 {
            return Err(TensorError::InvalidArgument {
                op: "Ema::load_state_dict",
                message: format!(
                    "the saved decay {decay} or update count {updates} is out of range; the state is damaged"
                ),
            }
            .into());
        }
        let averages = with_no_grad(|| {
            self.params
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let saved = find(&format!("{i}.average")).detach();
                    if saved.device() == p.device() {
                        saved.copy()
                    } else {
                        saved.to(p.device())
                    }
                })
                .collect::<Result<Vec<_>>>()
        })?;
        self.averages = averages;
        self.decay = decay;
        self.updates = updates as u64;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use approx::assert_relative_eq;
    use ferry_tensor::Device;

    use super::*;

    fn param(values: &[f32]) -> Tensor {
        Tensor::from_vec(values.to_vec(), &[values.len()])
            .unwrap()
            .with_grad()
            .unwrap()
    }

    fn set(p: &Tensor, values: &[f32]) {
        with_no_grad(|| p.assign(&Tensor::from_vec(values.to_vec(), &[values.len()])?)).unwrap();
    }

    #[test]
    fn updates_follow_the_warmed_up_decay() {
        let p = param(&[0.0, 10.0]);
        let mut ema = Ema::new([p.clone()], 0.9).unwrap();
        // Update 0 keeps (1 + 0) / (10 + 0) = 0.1 of the average.
        assert_relative_eq!(ema.next_decay(), 0.1);
        set(&p, &[1.0, 0.0]);
        ema.update().unwrap();
        let a = ema.averages()[0].to_vec::<f32>().unwrap();
        assert_relative_eq!(a[0], 0.9, epsilon = 1e-6);
        assert_relative_eq!(a[1], 1.0, epsilon = 1e-6);
        // From n = 80 on, (1 + n) / (10 + n) >= 0.9: the decay itself.
        ema.updates = 80;
        assert_relative_eq!(ema.next_decay(), 0.9);
        ema.update().unwrap();
        let a = ema.averages()[0].to_vec::<f32>().unwrap();
        assert_relative_eq!(a[0], 0.9 * 0.9 + 0.1, epsilon = 1e-6);
        assert_relative_eq!(a[1], 0.9, epsilon = 1e-6);
        assert_eq!(ema.updates(), 81);
    }

    #[test]
    fn the_parameters_stay_leaves_and_come_back_after_with_averages() {
        let p = param(&[2.0]);
        let mut ema = Ema::new([p.clone()], 0.5).unwrap();
        set(&p, &[4.0]);
        let seen = ema.with_averages(|| p.to_vec::<f32>().unwrap()[0]).unwrap();
        assert_eq!(seen, 2.0, "inside, the parameter holds the average");
        assert_eq!(p.to_vec::<f32>().unwrap(), [4.0]);
        assert_eq!(ema.averages()[0].to_vec::<f32>().unwrap(), [2.0]);
        assert!(p.is_leaf() && p.requires_grad());
        assert!(!ema.averages()[0].requires_grad());
    }

    #[test]
    fn a_bad_decay_is_an_error_that_names_the_range() {
        for decay in [1.0, -0.1, f64::NAN] {
            let err = Ema::new([param(&[1.0])], decay).unwrap_err().to_string();
            assert!(err.contains("[0, 1)"), "{err}");
        }
    }

    #[test]
    fn state_round_trips_and_a_mismatch_changes_nothing() {
        let p = param(&[1.0, 2.0]);
        let mut ema = Ema::new([p.clone()], 0.99).unwrap();
        set(&p, &[3.0, 5.0]);
        for _ in 0..3 {
            ema.update().unwrap();
        }
        let saved: StateDict = ema
            .state_dict()
            .into_iter()
            .map(|(k, t)| (k, t.copy().unwrap()))
            .collect();
        let mut other = Ema::new([param(&[0.0, 0.0])], 0.5).unwrap();
        other.load_state_dict(&saved).unwrap();
        assert_eq!(other.updates(), 3);
        assert_eq!(other.decay(), 0.99);
        assert_eq!(
            other.averages()[0].to_vec::<f32>().unwrap(),
            ema.averages()[0].to_vec::<f32>().unwrap()
        );
        let mut wrong = Ema::new([param(&[0.0, 0.0, 0.0])], 0.5).unwrap();
        let err = wrong.load_state_dict(&saved).unwrap_err().to_string();
        assert!(err.contains("0.average"), "{err}");
        assert_eq!(wrong.updates(), 0);
        assert_eq!(wrong.averages()[0].device(), Device::Cpu);
    }
}
