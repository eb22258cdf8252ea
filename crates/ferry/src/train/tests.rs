use super::*;
use crate::nn::Linear;
use crate::optim::{Sgd, StepDecay};

/// `steps` batches of 8 points of y = 3x - 1000 (large targets: large gradients).
struct Far {
    steps: usize,
}

impl Task for Far {
    fn steps_per_epoch(&self) -> usize {
        self.steps
    }

    fn batches(
        &self,
        _epoch: usize,
        _seed: u64,
    ) -> Box<dyn Iterator<Item = ferry_tensor::Result<HostBatch>> + '_> {
        Box::new((0..self.steps).map(|_| {
            let x: Vec<f32> = (0..8).map(|i| i as f32 / 8.0).collect();
            let y: Vec<f32> = x.iter().map(|x| 3.0 * x - 1000.0).collect();
            Ok((Tensor::from_vec(x, &[8, 1])?, Tensor::from_vec(y, &[8, 1])?))
        }))
    }

    fn loss(&self, model: &dyn Module, x: &Tensor, y: &Tensor) -> ferry_tensor::Result<Scored> {
        Ok(Scored {
            loss: model.forward(x)?.sub(y)?.powf(2.0)?.mean()?,
            correct: Tensor::scalar(0.0f32),
            predictions: x.shape()[0],
        })
    }

    fn evaluate(&self, _model: &mut dyn Module) -> ferry_tensor::Result<f64> {
        Ok(0.0)
    }
}

fn weights(model: &Linear) -> Vec<f64> {
    model
        .parameters()
        .iter()
        .flat_map(|p| p.to_vec_f64().unwrap())
        .collect()
}

/// One step of SGD at rate 1 on a loss far from its minimum: clipped, the parameters move by
/// at most the clipping norm; unclipped, by far more.
#[test]
fn clipping_bounds_each_update() {
    let moved = |clip: Option<f64>| {
        crate::manual_seed(0);
        let mut model = Linear::new(1, 1, Device::Cpu).unwrap();
        let before = weights(&model);
        let mut opt = Sgd::new(model.parameters(), 1.0).unwrap();
        let mut trainer = Trainer::new(1, Device::Cpu);
        if let Some(max_norm) = clip {
            trainer = trainer.clip_grad_norm(max_norm);
        }
        trainer
            .fit(&mut model, &mut opt, None, &Far { steps: 1 }, &mut ())
            .unwrap();
        let after = weights(&model);
        before
            .iter()
            .zip(&after)
            .map(|(a, b)| (a - b).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    let clipped = moved(Some(0.01));
    assert!(
        clipped <= 0.01 * (1.0 + 1e-4) && clipped > 0.009,
        "{clipped}"
    );
    assert!(moved(None) > 100.0);
}

/// A schedule counted in steps sets the rate of every step of the run; counted in epochs, one
/// rate per epoch.
#[test]
fn schedules_count_steps_or_epochs() {
    let last_rate = |every| {
        crate::manual_seed(0);
        let mut model = Linear::new(1, 1, Device::Cpu).unwrap();
        let mut opt = Sgd::new(model.parameters(), 1.0).unwrap();
        Trainer::new(2, Device::Cpu)
            .schedule(StepDecay::new(1e-6, 1, 0.5).unwrap(), every)
            .fit(&mut model, &mut opt, None, &Far { steps: 3 }, &mut ())
            .unwrap();
        (opt.learning_rate(), opt.steps())
    };
    // Six steps: the last is step 5 of the run, in epoch 2 (index 1).
    assert_eq!(last_rate(Every::Step), (1e-6 * 0.5f64.powi(5), 6));
    assert_eq!(last_rate(Every::Epoch), (1e-6 * 0.5, 6));
}
