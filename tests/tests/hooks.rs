use std::sync::{Arc, Mutex};

use ferry::{BackwardOptions, DeviceMove};
use ferry_graph::GraphError;
use ferry_tensor::{DType, Device, Result, Tensor, TensorError};
use ferry_tests::{assert_close, device_test, randn, tensor, values};

/// Gradients a hook saw, in order.
type Seen = Arc<Mutex<Vec<Vec<f64>>>>;

fn recorder() -> Seen {
    Arc::new(Mutex::new(Vec::new()))
}

/// y = 3x, loss = Σ y²: the hook on y sees dloss/dy = 2y, and x.grad = 3·2y = 18x. A hook that
/// halves the gradient halves x.grad.
fn observe_and_replace(device: Device) -> Result<()> {
    let x = randn(device, &[4])?.with_grad()?;
    let y = x.mul_scalar(3.0)?;
    // Three backward calls through y's node: its rule must stay.
    let backward = |loss: Tensor| {
        let ones = Tensor::ones(&[], DType::F64, device)?;
        let retain = BackwardOptions {
            retain_graph: true,
            ..BackwardOptions::default()
        };
        loss.backward_with(ones, retain)
    };
    let seen = recorder();
    let log = Arc::clone(&seen);
    let observer = y.register_hook(move |g| {
        log.lock().unwrap().push(values(g));
        Ok(None)
    })?;
    backward(y.mul(&y)?.sum()?)?;
    let ys = values(&y);
    let two_y: Vec<f64> = ys.iter().map(|v| 2.0 * v).collect();
    assert_eq!(seen.lock().unwrap().len(), 1);
    assert_close(&seen.lock().unwrap()[0], &two_y, 1e-12);
    let eighteen_x: Vec<f64> = values(&x).iter().map(|v| 18.0 * v).collect();
    assert_close(&values(&x.grad().unwrap()), &eighteen_x, 1e-12);

    // A second hook replaces; hooks run in registration order, so the observer still sees 2y.
    x.set_grad(None);
    let halve = y.register_hook(|g| Ok(Some(g.mul_scalar(0.5)?)))?;
    backward(y.mul(&y)?.sum()?)?;
    assert_eq!(seen.lock().unwrap().len(), 2);
    assert_close(&seen.lock().unwrap()[1], &two_y, 1e-12);
    let nine_x: Vec<f64> = eighteen_x.iter().map(|v| v / 2.0).collect();
    assert_close(&values(&x.grad().unwrap()), &nine_x, 1e-12);

    // Removed, a hook neither runs nor changes the gradient again.
    assert!(halve.remove());
    assert!(observer.remove());
    x.set_grad(None);
    backward(y.mul(&y)?.sum()?)?;
    assert_eq!(seen.lock().unwrap().len(), 2, "a removed hook ran");
    assert_close(&values(&x.grad().unwrap()), &eighteen_x, 1e-12);

    // A handle whose node is gone removes nothing.
    let z = x.exp()?;
    let handle = z.register_hook(|_| Ok(None))?;
    drop(z);
    assert!(!handle.remove());
    Ok(())
}
device_test!(hooks_observe_replace_and_are_removed, observe_and_replace);

/// A hook that returns a gradient of another shape (or fails) stops backward with an error
/// naming the op and the fix, and nothing reaches the leaf.
fn bad_hooks(device: Device) -> Result<()> {
    let x = randn(device, &[2, 3])?.with_grad()?;
    let y = x.tanh()?;
    let handle = y.register_hook(|g| Ok(Some(g.sum()?)))?;
    let err = y.sum()?.backward().unwrap_err();
    let TensorError::Graph(GraphError::Hook { op, source }) = &err else {
        panic!("expected a hook error, got {err:?}");
    };
    assert_eq!(*op, "tanh");
    let inner = source.downcast_ref::<TensorError>().expect("a TensorError");
    assert!(
        matches!(inner, TensorError::ShapeMismatch { op: "register_hook", lhs, rhs, .. }
            if lhs.as_slice() == [2, 3] && rhs.is_empty()),
        "{inner:?}"
    );
    assert!(err.to_string().contains("shape, dtype and device"), "{err}");
    assert!(x.grad().is_none());
    assert!(handle.remove());

    // A wrong dtype is refused the same way.
    let y = x.tanh()?;
    let _cast = y.register_hook(|g| Ok(Some(g.to_dtype(DType::F32)?)))?;
    assert!(y.sum()?.backward().is_err());

    // A hook's own error is passed on.
    let y = x.tanh()?;
    let _fails = y.register_hook(|_| {
        Err(TensorError::InvalidArgument {
            op: "test hook",
            message: "refused".into(),
        })
    })?;
    let err = y.sum()?.backward().unwrap_err();
    assert!(err.to_string().contains("refused"), "{err}");

    // Tensors without history have no gradient to hook.
    let plain = randn(device, &[2])?;
    assert!(matches!(
        plain.register_hook(|_| Ok(None)),
        Err(TensorError::NoGraphFor {
            op: "register_hook"
        })
    ));
    assert!(matches!(
        plain.retain_grad(),
        Err(TensorError::NoGraphFor { .. })
    ));
    assert!(y.register_post_accumulate_grad_hook(|_| Ok(())).is_err());
    Ok(())
}
device_test!(hooks_returning_a_wrong_gradient_are_errors, bad_hooks);

/// On a leaf the hook runs before accumulation: what it returns is what `.grad` adds, and the
/// trace lists it before the post-accumulate hook.
fn leaf_hooks(device: Device) -> Result<()> {
    let x = tensor(device, &[1.0, 2.0], &[2])?.with_grad()?;
    let seen = recorder();
    let log = Arc::clone(&seen);
    let _scale = x.register_hook(|g| Ok(Some(g.mul_scalar(10.0)?)))?;
    let _after = x.register_post_accumulate_grad_hook(move |total| {
        log.lock().unwrap().push(values(total));
        Ok(())
    })?;
    // d(Σ x²)/dx = 2x = [2, 4], scaled to [20, 40] before it lands in .grad.
    let report = x.mul(&x)?.sum()?.backward_traced()?;
    assert_close(&values(&x.grad().unwrap()), &[20.0, 40.0], 1e-12);
    let leaf = report.trace.last().expect("the leaf is visited last");
    assert_eq!(leaf.meta.op, "leaf");
    assert_eq!(leaf.hooks.len(), 2, "{:?}", leaf.hooks);
    assert!(
        leaf.hooks[0].starts_with("hook replaced"),
        "{:?}",
        leaf.hooks
    );
    assert_eq!(leaf.hooks[1], "post-accumulate hook ran");
    // A second backward adds the replaced gradient to what is there: [20, 40] + [20, 40].
    x.mul(&x)?.sum()?.backward()?;
    assert_close(&values(&x.grad().unwrap()), &[40.0, 80.0], 1e-12);
    assert_eq!(
        *seen.lock().unwrap(),
        vec![vec![20.0, 40.0], vec![40.0, 80.0]]
    );
    Ok(())
}
device_test!(leaf_hooks_run_before_accumulation, leaf_hooks);

/// `retain_grad` keeps a non-leaf's gradient and accumulates it across backward calls, like a
/// leaf's. y = 2x, loss = Σ y²: dloss/dy = 2y per call.
fn retained(device: Device) -> Result<()> {
    let x = randn(device, &[3])?.with_grad()?;
    let y = x.mul_scalar(2.0)?;
    assert!(
        y.grad().is_none(),
        "a non-leaf keeps no gradient by default"
    );
    y.retain_grad()?;
    x.retain_grad()?; // a no-op on a leaf
    let loss = y.mul(&y)?.sum()?;
    let retain = BackwardOptions {
        retain_graph: true,
        ..BackwardOptions::default()
    };
    let ones = || Tensor::ones(&[], DType::F64, device);
    loss.backward_with(ones()?, retain)?;
    let two_y: Vec<f64> = values(&y).iter().map(|v| 2.0 * v).collect();
    assert_close(&values(&y.grad().unwrap()), &two_y, 1e-12);
    loss.backward_with(ones()?, retain)?;
    let four_y: Vec<f64> = two_y.iter().map(|v| 2.0 * v).collect();
    assert_close(&values(&y.grad().unwrap()), &four_y, 1e-12);
    // x.grad = 2 · (2y + 2y) = 16x.
    let sixteen_x: Vec<f64> = values(&x).iter().map(|v| 16.0 * v).collect();
    assert_close(&values(&x.grad().unwrap()), &sixteen_x, 1e-12);
    // set_grad(None) clears a retained gradient too.
    y.set_grad(None);
    assert!(y.grad().is_none());
    Ok(())
}
device_test!(retain_grad_accumulates_across_backwards, retained);

/// A leaf used on three paths gets one accumulation, so its post-accumulate hook runs once per
/// backward, with the running total. d(x² + eˣ + x)/dx = 2x + eˣ + 1.
fn post_accumulate(device: Device) -> Result<()> {
    let x = randn(device, &[3])?.with_grad()?;
    let calls = recorder();
    let log = Arc::clone(&calls);
    let _hook = x.register_post_accumulate_grad_hook(move |total| {
        log.lock().unwrap().push(values(total));
        Ok(())
    })?;
    let f = || x.mul(&x)?.add(&x.exp()?)?.add(&x)?.sum();
    let expected: Vec<f64> = values(&x).iter().map(|v| 2.0 * v + v.exp() + 1.0).collect();
    f()?.backward()?;
    f()?.backward()?;
    let calls = calls.lock().unwrap();
    assert_eq!(calls.len(), 2, "once per backward");
    assert_close(&calls[0], &expected, 1e-12);
    let twice: Vec<f64> = expected.iter().map(|v| 2.0 * v).collect();
    assert_close(&calls[1], &twice, 1e-12);
    Ok(())
}
device_test!(
    post_accumulate_hook_runs_once_with_the_total,
    post_accumulate
);

/// What bucketed all-reduce does with post-accumulate hooks: parameters join a bucket as their
/// gradients become final, and a full bucket is flattened into one buffer (sent, in DDP).
#[derive(Default)]
struct Buckets {
    capacity: usize,
    pending: Vec<(&'static str, Tensor)>,
    flushed: Vec<(Vec<&'static str>, Tensor)>,
}

impl Buckets {
    fn push(&mut self, name: &'static str, grad: &Tensor) -> Result<()> {
        self.pending.push((name, grad.detach()));
        let held: usize = self.pending.iter().map(|(_, g)| g.numel()).sum();
        if held >= self.capacity {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        let names = self.pending.iter().map(|(n, _)| *n).collect();
        let flat: Vec<Tensor> = self
            .pending
            .drain(..)
            .map(|(_, g)| g.reshape(&[g.numel()]))
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = flat.iter().collect();
        self.flushed.push((names, Tensor::cat(&refs, 0)?));
        Ok(())
    }
}

fn bucketed(device: Device) -> Result<()> {
    let params = [
        ("w1", randn(device, &[3, 5])?.with_grad()?),
        ("b1", randn(device, &[5])?.with_grad()?),
        ("w2", randn(device, &[5, 2])?.with_grad()?),
        ("b2", randn(device, &[2])?.with_grad()?),
    ];
    // A bucket holds the last layer exactly (5·2 + 2 elements).
    let buckets = Arc::new(Mutex::new(Buckets {
        capacity: 12,
        ..Buckets::default()
    }));
    for (name, p) in &params {
        let (name, buckets) = (*name, Arc::clone(&buckets));
        let _kept =
            p.register_post_accumulate_grad_hook(move |g| buckets.lock().unwrap().push(name, g))?;
    }
    let [(_, w1), (_, b1), (_, w2), (_, b2)] = &params;
    let x = randn(device, &[4, 3])?;
    for step in 0..2 {
        for (_, p) in &params {
            p.set_grad(None);
        }
        let hidden = x.matmul(w1)?.add(b1)?.tanh()?;
        hidden.matmul(w2)?.add(b2)?.powf(2.0)?.mean()?.backward()?;
        let mut buckets = buckets.lock().unwrap();
        if !buckets.pending.is_empty() {
            buckets.flush()?;
        }
        let flushed = std::mem::take(&mut buckets.flushed);
        assert_eq!(flushed.len(), 2, "step {step}: two buckets");
        // The last layer's gradients are ready first, as backward runs from the loss back.
        let mut first = flushed[0].0.clone();
        first.sort_unstable();
        assert_eq!(first, ["b2", "w2"], "step {step}");
        let mut second = flushed[1].0.clone();
        second.sort_unstable();
        assert_eq!(second, ["b1", "w1"], "step {step}");
        // Each bucket holds the final gradients, in the order they arrived.
        for (names, flat) in &flushed {
            let expected: Vec<f64> = names
                .iter()
                .flat_map(|n| {
                    let p = &params.iter().find(|(name, _)| name == n).unwrap().1;
                    values(&p.grad().unwrap())
                })
                .collect();
            assert_close(&values(flat), &expected, 0.0);
        }
    }
    Ok(())
}
device_test!(post_accumulate_hooks_fill_buckets_in_order, bucketed);

/// Hooks on both sides of a device move: the host side sees host gradients, the source leaf its
/// own device's, and a replacement on the host side reaches the source (x.grad = 2c).
fn across_a_move(device: Device) -> Result<()> {
    let x = randn(device, &[2, 3])?.with_grad()?;
    let host = x.cpu()?;
    let c = randn(Device::Cpu, &[2, 3])?;
    let devices: Arc<Mutex<Vec<(&str, Device)>>> = Arc::default();
    let log = Arc::clone(&devices);
    let _host = host.register_hook(move |g| {
        log.lock().unwrap().push(("host", g.device()));
        Ok(Some(g.mul_scalar(2.0)?))
    })?;
    let log = Arc::clone(&devices);
    let _source = x.register_hook(move |g| {
        log.lock().unwrap().push(("source", g.device()));
        Ok(None)
    })?;
    let log = Arc::clone(&devices);
    let _accumulated = x.register_post_accumulate_grad_hook(move |g| {
        log.lock().unwrap().push(("accumulated", g.device()));
        Ok(())
    })?;
    host.mul(&c)?.sum()?.backward()?;
    assert_eq!(
        *devices.lock().unwrap(),
        [
            ("host", Device::Cpu),
            ("source", device),
            ("accumulated", device)
        ]
    );
    let grad = x.grad().unwrap();
    assert_eq!(grad.device(), device);
    let two_c: Vec<f64> = values(&c).iter().map(|v| 2.0 * v).collect();
    assert_close(&values(&grad), &two_c, 1e-12);
    Ok(())
}
device_test!(hooks_across_a_device_move, across_a_move);
