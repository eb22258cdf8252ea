use ferry::autograd::no_grad;
use ferry::optim::{Adam, Optimizer, Sgd};
use ferry::{BackwardOptions, DType};
use ferry_graph::GraphError;
use ferry_tensor::{Device, Result, Tensor, TensorError};
use ferry_tests::{assert_close, device_test, randn, uniform, values};

/// The in-place error a backward failed with, reached through the chain
/// `TensorError::Graph(GraphError::Backward { source })`, and the whole message.
fn modified_in_place(err: &TensorError) -> (&TensorError, String) {
    let TensorError::Graph(GraphError::Backward { source, .. }) = err else {
        panic!("expected a failed backward, got {err:?}");
    };
    let inner = source
        .downcast_ref::<TensorError>()
        .unwrap_or_else(|| panic!("expected a TensorError inside, got {source:?}"));
    assert!(
        matches!(inner, TensorError::ModifiedInPlace { .. }),
        "{inner:?}"
    );
    (inner, err.to_string())
}

/// Asserts `err` is an in-place error of `op` about `tensor` of `shape`, and that the message
/// names the op and both fixes.
#[track_caller]
fn assert_modified(err: &TensorError, op: &str, tensor: &str, shape: &[usize]) {
    let (inner, message) = modified_in_place(err);
    let TensorError::ModifiedInPlace {
        op: got_op,
        tensor: got_tensor,
        shape: got_shape,
        saved_version,
        version,
    } = inner
    else {
        unreachable!()
    };
    assert_eq!((*got_op, got_tensor.as_str()), (op, tensor), "{message}");
    assert_eq!(got_shape.as_slice(), shape, "{message}");
    assert!(version > saved_version, "{message}");
    for needle in [format!("`{op}`"), tensor.to_string(), ".copy()".into()] {
        assert!(
            message.contains(&needle),
            "{needle:?} missing in: {message}"
        );
    }
    assert!(message.contains("after backward"), "{message}");
}

/// y = x·w saves x (w's gradient needs it); writing into x before backward is caught.
fn saved_input(device: Device) -> Result<()> {
    let x = randn(device, &[2, 3])?;
    let w = randn(device, &[2, 3])?.with_grad()?;
    let y = x.mul(&w)?;
    x.assign(&randn(device, &[2, 3])?)?;
    let err = y.sum()?.backward().unwrap_err();
    assert_modified(&err, "mul", "input 0", &[2, 3]);
    assert!(w.grad().is_none(), "no gradient from a failed backward");

    // A write through a view reaches the same storage, so it is caught too.
    let (x, w) = (randn(device, &[4])?, randn(device, &[4])?.with_grad()?);
    let y = x.mul(&w)?;
    x.narrow(0, 1, 2)?.assign(&randn(device, &[2])?)?;
    assert_modified(&y.sum()?.backward().unwrap_err(), "mul", "input 0", &[4]);
    Ok(())
}
device_test!(writing_a_saved_input_fails_backward, saved_input);

/// A leaf is written under no_grad (as optimizers do); log saved it, so backward refuses.
fn saved_leaf(device: Device) -> Result<()> {
    let w = uniform(device, &[3], 0.5, 2.0)?.with_grad()?;
    let y = w.log()?;
    // With grad mode on, writing into a tensor that requires grad is refused outright.
    assert!(matches!(
        w.assign(&w.detach()),
        Err(TensorError::InvalidArgument { op: "assign", .. })
    ));
    {
        let _off = no_grad();
        w.assign(&uniform(device, &[3], 0.5, 2.0)?)?;
    }
    assert_modified(&y.sum()?.backward().unwrap_err(), "log", "input 0", &[3]);
    Ok(())
}
device_test!(writing_a_saved_leaf_fails_backward, saved_leaf);

/// exp saves its output; writing into that output is caught as well.
fn saved_output(device: Device) -> Result<()> {
    let x = randn(device, &[2, 2])?.with_grad()?;
    let y = x.exp()?;
    {
        let _off = no_grad();
        y.assign(&y.zeros_like()?)?;
    }
    let err = y.mul_scalar(2.0)?.sum()?.backward().unwrap_err();
    assert_modified(&err, "exp", "the output", &[2, 2]);
    Ok(())
}
device_test!(writing_a_saved_output_fails_backward, saved_output);

/// What no node saved may be written: add saves nothing, and x·w with only w requiring grad
/// saves x but not w. The gradients come out right.
fn unsaved_writes(device: Device) -> Result<()> {
    let a = randn(device, &[3])?;
    let w = randn(device, &[3])?.with_grad()?;
    let y = a.add(&w)?.sum()?;
    a.assign(&randn(device, &[3])?)?;
    y.backward()?;
    assert_close(&values(&w.grad().unwrap()), &[1.0; 3], 0.0);

    // d(Σ x·w)/dw = x, read from the saved x; w itself was not saved.
    let x = randn(device, &[3])?;
    let y = x.mul(&w)?.sum()?;
    {
        let _off = no_grad();
        w.assign(&randn(device, &[3])?)?;
    }
    w.set_grad(None);
    y.backward()?;
    assert_close(&values(&w.grad().unwrap()), &values(&x), 0.0);
    Ok(())
}
device_test!(writing_what_no_node_saved_is_fine, unsaved_writes);

/// Two layers, so the second weight is saved (the first layer's output requires grad).
fn two_layer_loss(x: &Tensor, w1: &Tensor, w2: &Tensor) -> Result<Tensor> {
    x.matmul(w1)?.tanh()?.matmul(w2)?.powf(2.0)?.mean()
}

/// The classic mistake: stepping the optimizer between a forward and its backward. The step
/// writes the weights the forward saved, and backward says so instead of returning gradients
/// of weights that no longer exist. Stepping after backward, as a training loop does, is fine.
fn optimizer_step(device: Device) -> Result<()> {
    let x = randn(device, &[4, 3])?;
    let w1 = randn(device, &[3, 5])?.with_grad()?;
    let w2 = randn(device, &[5, 2])?.with_grad()?;
    let mut sgd = Sgd::new([w1.clone(), w2.clone()], 0.05)?;

    let mut losses = Vec::new();
    for _ in 0..3 {
        sgd.zero_grad();
        let loss = two_layer_loss(&x, &w1, &w2)?;
        loss.backward()?;
        sgd.step()?; // after backward: the graph is gone, nothing saved is stale
        losses.push(loss.item()?);
    }
    assert!(losses[2] < losses[0], "training went on: {losses:?}");

    let loss = two_layer_loss(&x, &w1, &w2)?;
    sgd.step()?; // still holds the last gradients: writes w1 and w2 in place
    let err = loss.backward().unwrap_err();
    assert_modified(&err, "matmul", "input 1", &[5, 2]);

    // The fused Adam step writes in place too.
    let mut adam = Adam::new([w1.clone(), w2.clone()], 0.01)?;
    let loss = two_layer_loss(&x, &w1, &w2)?;
    loss.backward()?;
    let loss = two_layer_loss(&x, &w1, &w2)?;
    adam.step()?;
    assert_modified(&loss.backward().unwrap_err(), "matmul", "input 1", &[5, 2]);
    Ok(())
}
device_test!(
    optimizer_step_between_forward_and_backward_is_caught,
    optimizer_step
);

/// A graph kept with retain_graph keeps its saved tensors: a write after the first backward
/// makes the second fail, while a graph freed by its backward has nothing left to go stale.
fn after_backward(device: Device) -> Result<()> {
    let x = randn(device, &[3])?;
    let w = randn(device, &[3])?.with_grad()?;
    let x_before = values(&x);
    x.mul(&w)?.sum()?.backward()?;
    x.assign(&randn(device, &[3])?)?;
    // The write came after the only backward: the gradient is that of the old x.
    assert_close(&values(&w.grad().unwrap()), &x_before, 0.0);

    let y = x.mul(&w)?.sum()?;
    let ones = Tensor::ones(&[], DType::F64, device)?;
    let retain = BackwardOptions {
        retain_graph: true,
        ..BackwardOptions::default()
    };
    y.backward_with(ones, retain)?;
    x.assign(&randn(device, &[3])?)?;
    assert_modified(&y.backward().unwrap_err(), "mul", "input 0", &[3]);
    Ok(())
}
device_test!(
    writing_after_backward_is_fine_unless_the_graph_is_kept,
    after_backward
);
