//! Ops that read one storage twice, or write several, never deadlock against other threads
//! writing the same storages; each race runs under a watchdog and checks that what it read
//! was consistent (never half-written).

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use ferry::{DeviceMove, move_state_dict};
use ferry_tensor::ops::optim::AdamStep;
use ferry_tensor::{DType, Device, Result, Tensor, no_grad};
use ferry_tests::{device_test, randn, values};

/// How long each side of a race loops.
const RUN_FOR: Duration = Duration::from_millis(800);
/// A race that has not finished by then is deadlocked.
const WATCHDOG: Duration = Duration::from_secs(20);

type Body = Box<dyn FnMut() -> Result<()> + Send>;

/// Runs each body in a loop on its own thread for [`RUN_FOR`]; fails when one errs, makes no
/// progress, or they have not all finished within [`WATCHDOG`] (the threads are detached, so a
/// deadlock fails the test instead of hanging it).
fn race(what: &str, bodies: Vec<(&'static str, Body)>) {
    let (tx, rx) = mpsc::channel();
    let count = bodies.len();
    for (role, mut body) in bodies {
        let tx = tx.clone();
        thread::spawn(move || {
            let start = Instant::now();
            let mut rounds = 0usize;
            let result = loop {
                if start.elapsed() >= RUN_FOR {
                    break Ok(rounds);
                }
                if let Err(e) = body() {
                    break Err(e.to_string());
                }
                rounds += 1;
            };
            let _ = tx.send((role, result));
        });
    }
    let deadline = Instant::now() + WATCHDOG;
    for _ in 0..count {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok((role, Ok(rounds))) => assert!(rounds > 0, "{what}: the {role} never got through"),
            Ok((role, Err(e))) => panic!("{what}: the {role} failed: {e}"),
            Err(_) => panic!("{what}: not finished after {WATCHDOG:?}: deadlocked"),
        }
    }
}

/// Runs `f` on a thread of its own, failing when it has not returned within [`WATCHDOG`].
fn within_watchdog<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(WATCHDOG)
        .unwrap_or_else(|_| panic!("{what}: not finished after {WATCHDOG:?}: deadlocked"))
}

/// A writer that fills `w` in place with 1s and 2s in turn, under `no_grad` as optimizers do.
fn alternating_writer(w: &Tensor) -> Result<Body> {
    let (ones, twos) = (
        Tensor::full(w.shape(), 1.0, w.dtype(), w.device())?,
        Tensor::full(w.shape(), 2.0, w.dtype(), w.device())?,
    );
    let (w, mut turn) = (w.clone(), false);
    Ok(Box::new(move || {
        let _guard = no_grad();
        turn = !turn;
        w.assign(if turn { &ones } else { &twos })
    }))
}

/// Asserts every value is the same and one of `allowed`: read from one state of the storage.
#[track_caller]
fn one_state(values: &[f64], allowed: &[f64]) {
    assert!(
        values.iter().all(|&v| v == values[0]) && allowed.contains(&values[0]),
        "values from a half-written storage (expected all one of {allowed:?}): {values:?}"
    );
}

fn mul_by_itself(device: Device) -> Result<()> {
    // A parameter, as in a training step: its square reads one storage twice.
    let w = Tensor::ones(&[16, 16], DType::F64, device)?.with_grad()?;
    let reader = {
        let w = w.clone();
        Box::new(move || {
            // Many products per check: the window between the two reads is what races.
            for _ in 0..64 {
                let square = w.mul(&w)?;
                one_state(&values(&square), &[1.0, 4.0]);
            }
            Ok(())
        }) as Body
    };
    race(
        "w.mul(&w) against assign into w",
        vec![("reader", reader), ("writer", alternating_writer(&w)?)],
    );
    Ok(())
}
device_test!(reading_a_storage_twice_while_it_is_written, mul_by_itself);

fn joined_with_itself(device: Device) -> Result<()> {
    let x = Tensor::ones(&[8, 4], DType::F32, device)?;
    let reader = {
        let x = x.clone();
        Box::new(move || {
            // Two parts and three: on a GPU three contiguous parts are gathered in one launch,
            // holding every part's storage at once; pack does the same. Each part is read in
            // one state (the parts may differ: some paths copy one part at a time).
            let parts = |t: &Tensor| -> Result<()> {
                for part in values(t).chunks(x.numel()) {
                    one_state(part, &[1.0, 2.0]);
                }
                Ok(())
            };
            for _ in 0..16 {
                parts(&Tensor::cat(&[&x, &x], 0)?)?;
                parts(&Tensor::cat(&[&x, &x, &x], 0)?)?;
                parts(&Tensor::pack(&[&x, &x], 64)?.0)?;
            }
            Ok(())
        }) as Body
    };
    race(
        "cat(&[&x, &x]) and pack against assign into x",
        vec![("reader", reader), ("writer", alternating_writer(&x)?)],
    );
    Ok(())
}
device_test!(
    joining_a_storage_with_itself_while_it_is_written,
    joined_with_itself
);

fn crossed_assigns(device: Device) -> Result<()> {
    // x <- y on one thread, y <- x on another: each reads the storage the other writes.
    let (x, y) = (
        Tensor::ones(&[32], DType::F64, device)?,
        Tensor::full(&[32], 2.0, DType::F64, device)?,
    );
    let copy_into = |dst: &Tensor, src: &Tensor| {
        let (dst, src) = (dst.clone(), src.clone());
        Box::new(move || dst.assign(&src)) as Body
    };
    race(
        "x.assign(&y) against y.assign(&x)",
        vec![("x <- y", copy_into(&x, &y)), ("y <- x", copy_into(&y, &x))],
    );
    one_state(&values(&x), &[1.0, 2.0]);
    one_state(&values(&y), &[1.0, 2.0]);
    Ok(())
}
device_test!(assigns_crossing_two_storages, crossed_assigns);

const STEP: AdamStep = AdamStep {
    lr: 0.1,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    weight_decay: 0.0,
    bias_correction1: 0.1,
    bias_correction2: 0.001,
    decoupled: 0,
    pad: 0,
};

fn optimizer_step_against_readers(device: Device) -> Result<()> {
    // Adam writes the parameter and both moments at once; a reader holds the first moment
    // while it asks for the parameter (the opposite order to the step's).
    let p = randn(device, &[64])?;
    let (m, v, g) = (
        Tensor::zeros(&[64], DType::F64, device)?,
        Tensor::zeros(&[64], DType::F64, device)?,
        randn(device, &[64])?,
    );
    let reader = {
        let (p, m) = (p.clone(), m.clone());
        Box::new(move || {
            m.mul(&p)?;
            p.add(&m)?;
            Ok(())
        }) as Body
    };
    let writer = {
        let (p, m, v) = (p.clone(), m.clone(), v.clone());
        Box::new(move || p.adam_update(&g, &m, &v, &STEP)) as Body
    };
    race(
        "adam_update against reads of its parameter and moment",
        vec![("reader", reader), ("optimizer", writer)],
    );
    assert!(values(&p).iter().all(|v| v.is_finite()));
    Ok(())
}
device_test!(
    optimizer_steps_against_readers,
    optimizer_step_against_readers
);

/// One Adam step on copies, with the gradient copied out first: the reference.
fn reference_step(p: &Tensor, g: &Tensor, m: &Tensor, v: &Tensor) -> Result<[Vec<f64>; 3]> {
    let (p, g, m, v) = (p.copy()?, g.copy()?, m.copy()?, v.copy()?);
    p.adam_update(&g, &m, &v, &STEP)?;
    Ok([values(&p), values(&m), values(&v)])
}

fn gradient_sharing_storage(device: Device) -> Result<()> {
    // A parameter that is its own gradient (the step reads and writes one storage), then a
    // gradient that is a view of the first moment. Both waited on their own lock before.
    let p = randn(device, &[3, 4])?;
    let (m, v) = (randn(device, &[3, 4])?, randn(device, &[3, 4])?.abs()?);
    let expected = reference_step(&p, &p, &m, &v)?;
    let (pc, mc, vc) = (p.clone(), m.clone(), v.clone());
    within_watchdog("adam_update(&p) with p as its own gradient", move || {
        pc.adam_update(&pc, &mc, &vc, &STEP)
    })?;
    assert_eq!([values(&p), values(&m), values(&v)], expected);
    let g = m.t()?.t()?; // a view sharing m's storage
    let expected = reference_step(&p, &g, &m, &v)?;
    let (pc, mc, vc) = (p.clone(), m.clone(), v.clone());
    within_watchdog("adam_update with a view of m as the gradient", move || {
        pc.adam_update(&g, &mc, &vc, &STEP)
    })?;
    assert_eq!([values(&p), values(&m), values(&v)], expected);
    Ok(())
}
device_test!(
    adam_with_a_gradient_sharing_storage,
    gradient_sharing_storage
);

/// A state dict with tied weights (one tensor under two names) moved while a writer fills that
/// tensor: downloads pack the group on the device, reading the storage twice at once.
#[test]
#[ignore = "needs a CUDA device"]
fn tied_weights_in_a_state_dict_while_written() {
    let gpu = Device::Cuda(0);
    for home in [gpu, Device::Cpu] {
        let target = if home == gpu { Device::Cpu } else { gpu };
        let w = Tensor::ones(&[64, 32], DType::F32, home).unwrap();
        let bias = Tensor::zeros(&[32], DType::F32, home).unwrap();
        let reader = {
            let dict = vec![
                ("embed".to_string(), w.clone()),
                ("bias".to_string(), bias),
                ("unembed".to_string(), w.clone()),
            ];
            Box::new(move || {
                let (moved, _) = move_state_dict(&dict, target)?;
                let (embed, unembed) = (values(&moved[0].1), values(&moved[2].1));
                one_state(&embed, &[1.0, 2.0]);
                one_state(&unembed, &[1.0, 2.0]);
                if home == gpu {
                    // Downloads pack the group in one gather: both names from one state.
                    assert_eq!(embed, unembed, "tied weights moved from two states");
                }
                assert_eq!(moved[0].1.device(), target);
                Ok(())
            }) as Body
        };
        race(
            &format!("move_state_dict of tied weights, {home} to {target}, against assign"),
            vec![
                ("mover", reader),
                ("writer", alternating_writer(&w).unwrap()),
            ],
        );
        // And a plain move afterwards still works.
        assert_eq!(w.to(target).unwrap().device(), target);
    }
}
