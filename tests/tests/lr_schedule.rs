//! Learning-rate schedules driving real optimizers: the rate of each update, exact updates
//! under a schedule, and a resumed run that picks the schedule up from the step count.

use ferry::optim::{
    Adam, Constant, Cosine, LrSchedule, Optimizer, Scheduled, Sgd, StepDecay, Warmup,
};
use ferry_tensor::{Device, Result, Tensor};
use ferry_tests::{device_test, tensor, values};

/// One parameter `[1]` whose gradient is set to `[1]` before each step.
fn unit_param(device: Device) -> Result<Tensor> {
    tensor(device, &[1.0], &[1])?.with_grad()
}

fn step_with_unit_grad(opt: &mut dyn Optimizer, p: &Tensor) -> Result<()> {
    p.set_grad(Some(tensor(p.device(), &[1.0], &[1])?));
    opt.step()
}

/// Plain SGD with gradient 1 moves the parameter by exactly the rate of each update.
fn scheduled_sgd_takes_the_scheduled_rates(device: Device) -> Result<()> {
    let p = unit_param(device)?;
    let schedule = StepDecay::new(1.0, 1, 0.5)?.with_warmup(2);
    let mut opt = Scheduled::new(Sgd::new([p.clone()], 123.0)?, schedule);
    assert_eq!(opt.learning_rate(), 0.0, "set at once to lr(0)");
    let mut want = 1.0;
    // Rates: warmup 0, 0.5, then 1, 0.5, 0.25.
    for expected_lr in [0.0, 0.5, 1.0, 0.5, 0.25] {
        step_with_unit_grad(&mut opt, &p)?;
        assert_eq!(opt.learning_rate(), expected_lr);
        want -= expected_lr;
        assert_eq!(values(&p), [want]);
    }
    assert_eq!(opt.steps(), 5);
    Ok(())
}
device_test!(
    scheduled_sgd_takes_the_scheduled_rates,
    scheduled_sgd_takes_the_scheduled_rates
);

#[test]
fn apply_sets_the_rate_of_the_next_update_on_any_optimizer() -> Result<()> {
    let p = unit_param(Device::Cpu)?;
    let mut adam = Adam::new([p.clone()], 1.0)?;
    let schedule = Warmup::new(4, Constant::new(2.0)?).start_factor(0.25)?;
    for t in 0..6u64 {
        let lr = schedule.apply(&mut adam);
        assert_eq!(lr, schedule.lr(t));
        assert_eq!(adam.learning_rate(), lr);
        step_with_unit_grad(&mut adam, &p)?;
    }
    // 2·(0.25 + 0.75·t/4) during the warmup, then 2.
    let rates: Vec<f64> = (0..6).map(|t| schedule.lr(t)).collect();
    assert_eq!(rates, [0.5, 0.875, 1.25, 1.625, 2.0, 2.0]);
    // A schedule behind a pointer, chosen at run time.
    let boxed: Box<dyn LrSchedule> = Box::new(Cosine::new(0.1, 10)?);
    assert_eq!(boxed.lr(0), 0.1);
    assert_eq!(boxed.lr(10), 0.0);
    Ok(())
}

#[test]
fn a_resumed_run_continues_the_schedule_from_the_saved_step() -> Result<()> {
    let schedule = Cosine::new(1.0, 8)?.floor(0.5)?.with_warmup(2);
    let p = unit_param(Device::Cpu)?;
    let mut first = Scheduled::new(Sgd::new([p.clone()], 1.0)?, schedule);
    for _ in 0..5 {
        step_with_unit_grad(&mut first, &p)?;
    }
    let saved: Vec<(String, Tensor)> = first
        .state_dict()
        .into_iter()
        .map(|(k, t)| Ok((k, t.copy()?)))
        .collect::<Result<_>>()?;

    let q = unit_param(Device::Cpu)?;
    let mut resumed = Scheduled::new(Sgd::new([q.clone()], 1.0)?, schedule);
    assert_eq!(resumed.learning_rate(), 0.0);
    resumed.load_state_dict(&saved).expect("same optimizer");
    assert_eq!(resumed.steps(), 5);
    assert_eq!(
        resumed.learning_rate(),
        schedule.lr(5),
        "the rate of update 5"
    );
    // Both now take the same update.
    step_with_unit_grad(&mut first, &p)?;
    step_with_unit_grad(&mut resumed, &q)?;
    assert_eq!(first.learning_rate(), resumed.learning_rate());
    assert_eq!(resumed.into_inner().steps(), 6);
    Ok(())
}
