use ferry_tensor::{BackwardOptions, DType, Device, Result, Tensor, TensorError};
use ferry_tests::{assert_close, device_test, randn, tensor, values};

fn leaf_used_twice(device: Device) -> Result<()> {
    let x = tensor(device, &[1.5, -2.0, 3.0], &[3])?.with_grad()?;
    x.mul(&x)?.sum()?.backward()?;
    // d/dx Σ x·x = 2x: both edges into the leaf accumulate
    assert_eq!(values(&x.grad().unwrap()), [3.0, -4.0, 6.0]);

    // Through separate branches that meet again: d/dx (eˣ + 3x) = eˣ + 3
    let y = tensor(device, &[0.0, 1.0], &[2])?.with_grad()?;
    y.exp()?.add(&y.mul_scalar(3.0)?)?.sum()?.backward()?;
    assert_close(
        &values(&y.grad().unwrap()),
        &[4.0, std::f64::consts::E + 3.0],
        1e-12,
    );
    Ok(())
}
device_test!(leaf_used_twice_accumulates, leaf_used_twice);

fn two_backwards(device: Device) -> Result<()> {
    let x = tensor(device, &[1.0, 2.0], &[2])?.with_grad()?;
    // Two graphs, one backward each: d/dx Σ x³ = 3x², twice.
    x.powf(3.0)?.sum()?.backward()?;
    x.powf(3.0)?.sum()?.backward()?;
    assert_eq!(values(&x.grad().unwrap()), [6.0, 24.0]);

    // One graph, retained: the second pass adds another 2x.
    x.set_grad(None);
    let y = x.mul(&x)?.sum()?;
    y.backward_with(
        Tensor::ones(&[], DType::F64, device)?,
        BackwardOptions {
            retain_graph: true,
            ..Default::default()
        },
    )?;
    y.backward()?;
    assert_eq!(values(&x.grad().unwrap()), [4.0, 8.0]);
    Ok(())
}
device_test!(two_backward_calls_accumulate, two_backwards);

fn retain_graph(device: Device) -> Result<()> {
    let x = randn(device, &[3])?.with_grad()?;
    let y = x.exp()?.sum()?;
    y.backward()?;
    let err = y.backward().unwrap_err();
    assert!(matches!(err, TensorError::Graph(_)), "{err:?}");
    let message = err.to_string();
    assert!(
        message.contains("retain_graph"),
        "the error must name the fix: {message}"
    );
    assert!(
        message.contains("exp") || message.contains("sum"),
        "and the op that lost its buffers: {message}"
    );

    let z = x.exp()?.sum()?;
    let keep = BackwardOptions {
        retain_graph: true,
        ..Default::default()
    };
    z.backward_with(Tensor::ones(&[], DType::F64, device)?, keep)?;
    z.backward_with(Tensor::ones(&[], DType::F64, device)?, keep)?;
    z.backward()?; // the last one may free
    assert!(z.backward().is_err());
    Ok(())
}
device_test!(retain_graph_semantics, retain_graph);

fn set_grad_none(device: Device) -> Result<()> {
    let x = tensor(device, &[2.0], &[1])?.with_grad()?;
    x.mul_scalar(5.0)?.sum()?.backward()?;
    assert_eq!(values(&x.grad().unwrap()), [5.0]);
    x.set_grad(None);
    assert!(x.grad().is_none());
    // The next backward starts from nothing, not from the freed 5.
    x.mul_scalar(2.0)?.sum()?.backward()?;
    assert_eq!(values(&x.grad().unwrap()), [2.0]);
    // A clone is the same tensor: it sees the same gradient.
    assert_eq!(values(&x.clone().grad().unwrap()), [2.0]);
    Ok(())
}
device_test!(set_grad_none_frees_the_gradient, set_grad_none);

fn only_where_required(device: Device) -> Result<()> {
    let x = tensor(device, &[1.0, 2.0], &[2])?.with_grad()?;
    let c = tensor(device, &[3.0, 4.0], &[2])?; // a constant: no grad
    let y = x.mul(&c)?.sum()?;
    let report = y.backward_with(
        Tensor::ones(&[], DType::F64, device)?,
        BackwardOptions {
            trace: true,
            ..Default::default()
        },
    )?;
    assert_eq!(values(&x.grad().unwrap()), [3.0, 4.0]); // d/dx Σ x·c = c
    assert!(c.grad().is_none() && !c.requires_grad());
    // The mul node passed a gradient to slot 0 (x) only: the branch for c never ran.
    let mul = report
        .trace
        .iter()
        .find(|s| s.meta.op == "mul")
        .expect("mul was visited");
    assert_eq!(
        mul.passed.iter().map(|(slot, _)| *slot).collect::<Vec<_>>(),
        [0]
    );
    assert_eq!(report.leaves_reached, 1);
    // Intermediates keep no gradient; only leaves do.
    assert!(y.grad().is_none() && !y.is_leaf() && x.is_leaf());
    Ok(())
}
device_test!(gradients_only_where_required, only_where_required);

fn detach(device: Device) -> Result<()> {
    let x = tensor(device, &[1.0, 2.0], &[2])?.with_grad()?;
    let d = x.mul(&x)?.detach();
    assert!(!d.requires_grad() && d.node().is_none() && d.is_leaf());
    assert_eq!(values(&d), [1.0, 4.0]);
    let err = d.sum()?.backward().unwrap_err();
    assert!(matches!(err, TensorError::NoGraph), "{err:?}");
    // A detached factor is a constant: d/dx (x · detach(x)) = detach(x), not 2x.
    x.mul(&x.detach())?.sum()?.backward()?;
    assert_eq!(values(&x.grad().unwrap()), [1.0, 2.0]);
    Ok(())
}
device_test!(detach_has_no_grad_path, detach);

fn explicit_output_gradient(device: Device) -> Result<()> {
    let x = tensor(device, &[1.0, 2.0, 3.0], &[3])?.with_grad()?;
    let y = x.mul_scalar(2.0)?;
    let g = tensor(device, &[1.0, 10.0, 100.0], &[3])?;
    y.backward_with(g, BackwardOptions::default())?;
    assert_eq!(values(&x.grad().unwrap()), [2.0, 20.0, 200.0]); // g · dy/dx = 2g
    Ok(())
}
device_test!(backward_with_explicit_gradient, explicit_output_gradient);

#[test]
fn dot_snapshot_of_leaf_mul_sum() {
    let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0], &[3])
        .unwrap()
        .with_grad()
        .unwrap();
    let y = x.mul(&x).unwrap().sum().unwrap();
    let dot = y.node().unwrap().to_dot();
    // mul saves both operands, here one storage of 3 f32 = 12 bytes, kept once; edges run the
    // way gradients flow.
    let expected = r#"digraph autograd {
  rankdir=BT;
  node [fontname="monospace", fontsize=10];
  n0 [label="sum\n[] f32 cpu\nsaved 0 B", shape=box];
  n1 [label="mul\n[3] f32 cpu\nsaved 12 B", shape=box];
  n2 [label="leaf\n[3] f32 cpu", shape=ellipse, style=filled, fillcolor="lightblue"];
  n0 -> n1;
  n1 -> n2 [label="0"];
  n1 -> n2 [label="1"];
}
"#;
    assert_eq!(dot, expected, "\n{dot}");
}

fn traced(device: Device) -> Result<()> {
    let x = tensor(device, &[0.0, 1.0, 2.0], &[3])?.with_grad()?;
    let h = x.exp()?;
    let y = h.sum()?;
    let report = y.backward_traced()?;
    let ops: Vec<&str> = report.trace.iter().map(|s| s.meta.op).collect();
    assert_eq!(ops, ["sum", "exp", "leaf"]);
    // sum passes ones on; exp passes eˣ · 1; the leaf receives eˣ.
    assert!(
        report.trace[0].passed[0].1.starts_with("[3] f64"),
        "{:?}",
        report.trace[0]
    );
    let dot = ferry_tensor::to_dot(&[&y], &[("h.detach()", &h)]);
    for needle in [
        "sum",
        "exp",
        "leaf",
        "detach",
        "h.detach()",
        &device.to_string(),
    ] {
        assert!(dot.contains(needle), "{needle} missing from\n{dot}");
    }
    Ok(())
}
device_test!(backward_traced_reports_each_node_in_order, traced);
