use ferry::autograd::{GradOptions, grad};
use ferry::{BackwardOptions, DeviceMove};
use ferry_tensor::autograd::BackwardFn;
use ferry_tensor::gradcheck::{GradcheckOptions, gradcheck, gradgradcheck};
use ferry_tensor::{DType, Device, Result, Rule, Save, Tensor, TensorError, record};
use ferry_tests::{
    assert_close, away_from_zero, device_test, distinct, randn, seed, tensor, uniform, values,
};

/// Gradgradcheck `f` at `inputs`; panics with the seed, the inputs and every mismatch.
fn check_gradgrad(
    what: &str,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: impl AsRef<[Tensor]>,
) -> Result<()> {
    check_gradgrad_with(what, f, inputs, GradcheckOptions::default())
}

fn check_gradgrad_with(
    what: &str,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: impl AsRef<[Tensor]>,
    options: GradcheckOptions,
) -> Result<()> {
    let inputs = inputs.as_ref();
    let mismatches = gradgradcheck(f, inputs, options)?;
    if !mismatches.is_empty() {
        let shown: Vec<String> = inputs.iter().map(|t| format!("  {t:?}")).collect();
        panic!(
            "gradgradcheck of {what} failed (replay with FERRY_SEED={}):\ninputs:\n{}\nmismatches: {mismatches:#?}",
            seed(),
            shown.join("\n")
        );
    }
    Ok(())
}

type Binary = fn(&Tensor, &Tensor) -> Result<Tensor>;

const BINARY: [(&str, Binary); 4] = [
    ("add", Tensor::add),
    ("sub", Tensor::sub),
    ("mul", Tensor::mul),
    ("div", Tensor::div),
];

/// The right operand of `div` stays at least 0.5 away from 0.
fn rhs_for(op: &str, device: Device, shape: &[usize]) -> Result<Tensor> {
    if op == "div" {
        away_from_zero(device, shape, 0.5)
    } else {
        randn(device, shape)
    }
}

fn binary(device: Device) -> Result<()> {
    let pairs: [(&[usize], &[usize]); 4] = [
        (&[2, 3], &[2, 3]),
        (&[3, 1], &[1, 2]),
        (&[3], &[2, 3]),
        (&[2, 3], &[]),
    ];
    for (name, op) in BINARY {
        for (sa, sb) in pairs {
            check_gradgrad(
                &format!("{name} {sa:?} {sb:?}"),
                |x| op(&x[0], &x[1]),
                [randn(device, sa)?, rhs_for(name, device, sb)?],
            )?;
        }
        // Transposed and narrowed views, read in place.
        let transposed = randn(device, &[3, 2])?.t()?;
        let narrowed = rhs_for(name, device, &[2, 5])?.narrow(1, 1, 3)?;
        check_gradgrad(
            &format!("{name} transposed, narrowed"),
            |x| op(&x[0], &x[1]),
            [transposed, narrowed],
        )?;
        // The same tensor on both sides: x∘x has a second derivative of its own (2 for mul).
        let same = rhs_for(name, device, &[4])?;
        check_gradgrad(&format!("{name}(x, x)"), |x| op(&x[0], &x[0]), [same])?;
    }
    Ok(())
}
device_test!(binary_ops_twice_differentiable, binary);

fn unary(device: Device) -> Result<()> {
    type Unary = fn(&Tensor) -> Result<Tensor>;
    let signed: [(&str, Unary); 6] = [
        ("neg", Tensor::neg),
        ("exp", Tensor::exp),
        ("tanh", Tensor::tanh),
        ("sigmoid", Tensor::sigmoid),
        ("add_scalar", |x| x.add_scalar(1.5)),
        ("mul_scalar", |x| x.mul_scalar(-2.5)),
    ];
    for (name, op) in signed {
        check_gradgrad(name, |x| op(&x[0]), [randn(device, &[2, 3])?])?;
        check_gradgrad(
            &format!("{name} of a transposed view"),
            |x| op(&x[0]),
            [randn(device, &[3, 2])?.t()?],
        )?;
    }
    // Kinks sit at 0: sampled at least 0.1 away, where the function is smooth.
    for (name, op) in [("relu", Tensor::relu as Unary), ("abs", Tensor::abs)] {
        check_gradgrad(name, |x| op(&x[0]), [away_from_zero(device, &[2, 3], 0.1)?])?;
        // A product makes the second derivative non-zero: d²(x·relu(x))/dx² = 2·[x > 0].
        check_gradgrad(
            &format!("x * {name}(x)"),
            |x| x[0].mul(&op(&x[0])?),
            [away_from_zero(device, &[2, 3], 0.1)?],
        )?;
    }
    // Defined for positive inputs only.
    let positive: [(&str, Unary); 4] = [
        ("log", Tensor::log),
        ("sqrt", Tensor::sqrt),
        ("powf(2.5)", |x| x.powf(2.5)),
        ("powf(-0.5)", |x| x.powf(-0.5)),
    ];
    for (name, op) in positive {
        check_gradgrad(name, |x| op(&x[0]), [uniform(device, &[2, 3], 0.5, 2.0)?])?;
    }
    check_gradgrad("powf(3)", |x| x[0].powf(3.0), [randn(device, &[2, 3])?])?;
    Ok(())
}
device_test!(unary_ops_twice_differentiable, unary);

fn reductions(device: Device) -> Result<()> {
    // Sums are linear: their second derivative is zero, and the check is that the backward is
    // itself recorded (the gradient with respect to the output gradient).
    let x = randn(device, &[2, 3, 2])?;
    check_gradgrad("sum", |x| x[0].sum(), [x.clone()])?;
    check_gradgrad("mean", |x| x[0].mean(), [x.clone()])?;
    for axis in [0, 1, -1] {
        check_gradgrad(
            &format!("sum_axis({axis})"),
            |x| x[0].sum_axis(axis, false),
            [x.clone()],
        )?;
        check_gradgrad(
            &format!("sum_axis({axis}, keepdim)"),
            |x| x[0].sum_axis(axis, true),
            [x.clone()],
        )?;
    }
    check_gradgrad(
        "mean_axis of a transposed view",
        |x| x[0].mean_axis(1, false),
        [randn(device, &[3, 2])?.t()?],
    )?;
    // Squares make the second derivative non-zero.
    check_gradgrad("sum(x²)", |x| x[0].mul(&x[0])?.sum(), [x.clone()])?;
    check_gradgrad("sum_axis(x²)", |x| x[0].mul(&x[0])?.sum_axis(1, false), [x])?;
    // Maxima of distinct values (0.1 apart): no tie switches under a finite-difference step.
    for axis in [0, 1, -1] {
        check_gradgrad(
            &format!("max_axis({axis})"),
            |x| x[0].max_axis(axis, false),
            [distinct(device, &[2, 3, 4])?],
        )?;
        check_gradgrad(
            &format!("max_axis({axis})²"),
            |x| x[0].max_axis(axis, true)?.powf(2.0),
            [distinct(device, &[3, 4])?],
        )?;
    }
    Ok(())
}
device_test!(reductions_twice_differentiable, reductions);

fn matmul(device: Device) -> Result<()> {
    let mm = |x: &[Tensor]| x[0].matmul(&x[1]);
    check_gradgrad(
        "matmul 2-D",
        mm,
        [randn(device, &[2, 3])?, randn(device, &[3, 4])?],
    )?;
    check_gradgrad(
        "matmul of transposed views",
        mm,
        [randn(device, &[3, 2])?.t()?, randn(device, &[4, 3])?.t()?],
    )?;
    check_gradgrad(
        "matmul batched",
        mm,
        [randn(device, &[2, 2, 3])?, randn(device, &[2, 3, 2])?],
    )?;
    check_gradgrad(
        "matmul with a broadcast batch",
        mm,
        [randn(device, &[2, 2, 3])?, randn(device, &[3, 2])?],
    )?;
    // One side fixed: a·w with only w differentiable still needs the rule's db to record.
    let a = randn(device, &[2, 3])?;
    check_gradgrad(
        "matmul, one input",
        |x| a.matmul(&x[0])?.tanh(),
        [randn(device, &[3, 2])?],
    )?;
    // x·x: each side's gradient depends on the other.
    check_gradgrad("x · x", |x| x[0].matmul(&x[0]), [randn(device, &[3, 3])?])?;
    Ok(())
}
device_test!(matmul_twice_differentiable, matmul);

/// Views and rearrangements are linear; each is followed by a square so the second derivative
/// flows through the view's rule twice.
fn views(device: Device) -> Result<()> {
    let sq = |t: Tensor| t.mul(&t);
    let x = randn(device, &[2, 3, 2])?;
    check_gradgrad("transpose", |x| x[0].transpose(0, 2), [x.clone()])?;
    check_gradgrad(
        "transpose, squared",
        |x| sq(x[0].transpose(0, 2)?),
        [x.clone()],
    )?;
    check_gradgrad("reshape", |x| x[0].reshape(&[3, 4]), [x.clone()])?;
    check_gradgrad(
        "reshape of a transposed view, squared",
        |x| sq(x[0].transpose(0, 1)?.reshape(&[12])?),
        [x.clone()],
    )?;
    for axis in [0, 1, 2] {
        check_gradgrad(
            &format!("narrow({axis})"),
            |x| x[0].narrow(axis, 1, 1),
            [x.clone()],
        )?;
        check_gradgrad(
            &format!("narrow({axis}), squared"),
            |x| sq(x[0].narrow(axis, 1, 1)?),
            [x.clone()],
        )?;
    }
    let cat = |x: &[Tensor]| Tensor::cat(&[&x[0], &x[1]], 1);
    let (a, b) = (randn(device, &[2, 1, 2])?, randn(device, &[2, 2, 2])?);
    check_gradgrad("cat", cat, [a.clone(), b.clone()])?;
    check_gradgrad("cat, squared", |x| sq(cat(x)?), [a, b])?;
    check_gradgrad(
        "broadcast_to",
        |x| x[0].broadcast_to(&[2, 3, 2]),
        [randn(device, &[3, 1])?],
    )?;
    check_gradgrad(
        "broadcast_to, squared",
        |x| sq(x[0].broadcast_to(&[2, 3, 2])?),
        [randn(device, &[3, 1])?],
    )?;
    check_gradgrad(
        "contiguous of a transposed view, squared",
        |x| sq(x[0].t()?.contiguous()?),
        [randn(device, &[2, 3])?],
    )?;
    check_gradgrad(
        "copy, squared",
        |x| sq(x[0].copy()?),
        [randn(device, &[2, 3])?],
    )?;
    check_gradgrad(
        "unsqueeze and squeeze, squared",
        |x| sq(x[0].unsqueeze(1)?.squeeze(0)?),
        [randn(device, &[1, 3])?],
    )?;
    Ok(())
}
device_test!(views_twice_differentiable, views);

/// f64 -> f32 -> f64: the cast's rule casts the gradient back, and that cast is recorded. The
/// f32 leg rounds to 2⁻²⁴, so the step is larger and the tolerances looser than in f64.
fn casts(device: Device) -> Result<()> {
    let loose = GradcheckOptions {
        eps: 1e-3,
        atol: 1e-3,
        rtol: 1e-3,
    };
    check_gradgrad_with(
        "to_dtype f32 and back",
        |x| x[0].to_dtype(DType::F32)?.to_dtype(DType::F64),
        [randn(device, &[2, 3])?],
        loose,
    )?;
    check_gradgrad_with(
        "tanh in f32",
        |x| x[0].to_dtype(DType::F32)?.tanh()?.to_dtype(DType::F64),
        [randn(device, &[2, 3])?],
        loose,
    )?;
    Ok(())
}
device_test!(casts_twice_differentiable, casts);

fn softmax_family(device: Device) -> Result<()> {
    let x = randn(device, &[2, 4])?;
    for axis in [-1, 0] {
        check_gradgrad(
            &format!("softmax({axis})"),
            |x| x[0].softmax(axis),
            [x.clone()],
        )?;
        check_gradgrad(
            &format!("log_softmax({axis})"),
            |x| x[0].log_softmax(axis),
            [x.clone()],
        )?;
    }
    check_gradgrad(
        "softmax of a transposed view",
        |x| x[0].softmax(-1),
        [randn(device, &[4, 2])?.t()?],
    )?;
    let targets = ferry_tests::on(device, Tensor::from_vec(vec![3i64, 0, 2], &[3])?)?;
    check_gradgrad(
        "cross_entropy",
        |x| x[0].cross_entropy(&targets),
        [randn(device, &[3, 4])?],
    )?;
    // The loss of a linear layer: second derivatives mix the weights and the inputs.
    check_gradgrad(
        "cross_entropy of a linear layer",
        |x| x[0].matmul(&x[1])?.cross_entropy(&targets),
        [randn(device, &[3, 2])?, randn(device, &[2, 4])?],
    )?;
    Ok(())
}
device_test!(softmax_family_twice_differentiable, softmax_family);

/// A move inside the function: to the same device here, and on a GPU through the host, where
/// the move's rule moves the gradient back and, under create_graph, records that move too.
fn device_moves(device: Device) -> Result<()> {
    check_gradgrad(
        "to the same device",
        |x| DeviceMove::to(&x[0], device)?.tanh(),
        [randn(device, &[2, 3])?],
    )?;
    check_gradgrad(
        "to the host, then a loss",
        |x| x[0].cpu()?.powf(3.0)?.sum(),
        [randn(device, &[2, 3])?],
    )?;
    check_gradgrad(
        "to the host and back, mixed with the source",
        |x| x[0].cpu()?.tanh()?.to(device)?.mul(&x[0]),
        [randn(device, &[2, 3])?],
    )?;

    // y = Σ x³ computed on the host: dy/dx = 3x², d(Σ dy/dx)/dx = 6x, both on x's device.
    let x = randn(device, &[4])?.with_grad()?;
    let loss = x.cpu()?.powf(3.0)?.sum()?;
    assert_eq!(loss.device(), Device::Cpu);
    let create = GradOptions {
        create_graph: true,
        ..GradOptions::default()
    };
    let dx = grad(&[&loss], &[&x], create)?
        .remove(0)
        .expect("x was used");
    assert_eq!(dx.device(), device, "the gradient comes home");
    assert!(dx.requires_grad(), "create_graph gives it history");
    let d2x = grad(&[&dx.sum()?], &[&x], GradOptions::default())?
        .remove(0)
        .expect("x was used");
    assert_eq!(d2x.device(), device, "the second derivative comes home too");
    let xs = values(&x);
    assert_close(
        &values(&dx),
        &xs.iter().map(|v| 3.0 * v * v).collect::<Vec<_>>(),
        1e-12,
    );
    assert_close(
        &values(&d2x),
        &xs.iter().map(|v| 6.0 * v).collect::<Vec<_>>(),
        1e-12,
    );
    Ok(())
}
device_test!(device_moves_twice_differentiable, device_moves);

/// `f(x) = ½ xᵀAx + Σ xᵢ³`: the Hessian is `(A + Aᵀ)/2 + diag(6x)`, so `Hv` by double backward
/// must equal that matrix times v, computed here by hand.
fn hessian_vector(device: Device) -> Result<()> {
    let n = 4;
    let a = randn(device, &[n, n])?;
    let v = randn(device, &[n, 1])?;
    let x = randn(device, &[n, 1])?.with_grad()?;
    let f = x
        .t()?
        .matmul(&a)?
        .matmul(&x)?
        .mul_scalar(0.5)?
        .sum()?
        .add(&x.powf(3.0)?.sum()?)?;
    let create = GradOptions {
        create_graph: true,
        ..GradOptions::default()
    };
    let g = grad(&[&f], &[&x], create)?.remove(0).expect("x was used");
    let hv = grad(&[&g.mul(&v)?.sum()?], &[&x], GradOptions::default())?
        .remove(0)
        .expect("x was used");
    assert_eq!(hv.shape(), &[n, 1]);

    let (av, vv, xv) = (values(&a), values(&v), values(&x));
    let expected: Vec<f64> = (0..n)
        .map(|i| {
            let sym: f64 = (0..n)
                .map(|j| 0.5 * (av[i * n + j] + av[j * n + i]) * vv[j])
                .sum();
            sym + 6.0 * xv[i] * vv[i]
        })
        .collect();
    assert_close(&values(&hv), &expected, 1e-10);
    // The gradient itself: (A + Aᵀ)x/2 + 3x².
    let expected_g: Vec<f64> = (0..n)
        .map(|i| {
            let sym: f64 = (0..n)
                .map(|j| 0.5 * (av[i * n + j] + av[j * n + i]) * xv[j])
                .sum();
            sym + 3.0 * xv[i] * xv[i]
        })
        .collect();
    assert_close(&values(&g), &expected_g, 1e-10);
    assert!(x.grad().is_none(), "grad leaves .grad alone");
    Ok(())
}
device_test!(
    hessian_vector_product_matches_the_analytic_hessian,
    hessian_vector
);

/// A third derivative: d³(x⁴)/dx³ = 24x, each order taken with create_graph.
fn third_order(device: Device) -> Result<()> {
    let x = tensor(device, &[0.5, -1.5, 2.0], &[3])?.with_grad()?;
    let create = GradOptions {
        create_graph: true,
        ..GradOptions::default()
    };
    let mut y = x.powf(4.0)?.sum()?;
    let mut orders = Vec::new();
    for _ in 0..3 {
        let g = grad(&[&y], &[&x], create.clone())?.remove(0).expect("used");
        y = g.sum()?;
        orders.push(values(&g));
    }
    let xs = [0.5, -1.5, 2.0];
    assert_close(&orders[0], &xs.map(|v: f64| 4.0 * v.powi(3)), 1e-12);
    assert_close(&orders[1], &xs.map(|v: f64| 12.0 * v * v), 1e-12);
    assert_close(&orders[2], &xs.map(|v| 24.0 * v), 1e-12);
    Ok(())
}
device_test!(third_derivative_by_repeated_grad, third_order);

fn grad_options(device: Device) -> Result<()> {
    let x = tensor(device, &[1.0, 2.0, 3.0], &[3])?.with_grad()?;
    let unused = tensor(device, &[4.0], &[1])?.with_grad()?;

    // allow_unused: None for an input the output does not depend on.
    let y = x.mul(&x)?.sum()?; // dy/dx = 2x
    let allow = GradOptions {
        allow_unused: true,
        ..GradOptions::default()
    };
    let grads = grad(&[&y], &[&x, &unused], allow)?;
    assert_close(&values(grads[0].as_ref().unwrap()), &[2.0, 4.0, 6.0], 1e-12);
    assert!(grads[1].is_none());

    // grad_outputs: a non-scalar output with its gradient given, d(3x)/dx · v = 3v.
    let y = x.mul_scalar(3.0)?;
    let v = tensor(device, &[1.0, -1.0, 0.5], &[3])?;
    let seeded = GradOptions {
        grad_outputs: Some(vec![v]),
        ..GradOptions::default()
    };
    let g = grad(&[&y], &[&x], seeded)?.remove(0).unwrap();
    assert_close(&values(&g), &[3.0, -3.0, 1.5], 1e-12);

    // Two outputs at once: their gradients add, d(Σx² + Σ5x)/dx = 2x + 5.
    let (y1, y2) = (x.mul(&x)?.sum()?, x.mul_scalar(5.0)?.sum()?);
    let g = grad(&[&y1, &y2], &[&x], GradOptions::default())?
        .remove(0)
        .unwrap();
    assert_close(&values(&g), &[7.0, 9.0, 11.0], 1e-12);

    // A non-leaf input: y = Σ h² with h = eˣ, dy/dh = 2h, and dy/dx = 2h·eˣ = 2e²ˣ in one call.
    let h = x.exp()?;
    let y = h.mul(&h)?.sum()?;
    let grads = grad(&[&y], &[&h, &x], GradOptions::default())?;
    let hs = values(&h);
    assert_close(
        &values(grads[0].as_ref().unwrap()),
        &hs.iter().map(|h| 2.0 * h).collect::<Vec<_>>(),
        1e-12,
    );
    assert_close(
        &values(grads[1].as_ref().unwrap()),
        &hs.iter().map(|h| 2.0 * h * h).collect::<Vec<_>>(),
        1e-10,
    );

    // No .grad anywhere was touched, leaves or not, and a gradient already there stays.
    assert!(x.grad().is_none() && unused.grad().is_none() && h.grad().is_none());
    x.mul_scalar(2.0)?.sum()?.backward()?;
    let y = x.mul(&x)?.sum()?;
    grad(&[&y], &[&x], GradOptions::default())?;
    assert_close(&values(&x.grad().unwrap()), &[2.0, 2.0, 2.0], 0.0);
    Ok(())
}
device_test!(grad_options_and_untouched_dot_grad, grad_options);

fn grad_errors(device: Device) -> Result<()> {
    let x = randn(device, &[3])?.with_grad()?;
    let unused = randn(device, &[3])?.with_grad()?;
    let y = x.exp()?.sum()?;

    let retain = GradOptions {
        retain_graph: true,
        ..GradOptions::default()
    };
    let err = grad(&[&y], &[&x, &unused], retain.clone()).unwrap_err();
    assert!(
        matches!(err, TensorError::UnusedInput { index: 1 }),
        "{err:?}"
    );
    assert!(err.to_string().contains("allow_unused: true"), "{err}");

    let plain = randn(device, &[3])?;
    let err = grad(&[&y], &[&x, &plain], retain.clone()).unwrap_err();
    assert!(
        matches!(
            err,
            TensorError::InputWithoutGrad {
                op: "grad",
                index: 1
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains(".with_grad()"), "{err}");

    // An output with no history, and a non-scalar output without grad_outputs.
    let err = grad(&[&plain.sum()?], &[&x], retain.clone()).unwrap_err();
    assert!(matches!(err, TensorError::NoGraphFor { .. }), "{err:?}");
    let err = grad(&[&x.exp()?], &[&x], retain).unwrap_err();
    assert!(
        matches!(err, TensorError::NonScalarBackward { .. }),
        "{err:?}"
    );

    // The failed calls freed nothing: the graph still runs.
    let g = grad(&[&y], &[&x], GradOptions::default())?
        .remove(0)
        .unwrap();
    assert_close(&values(&g), &values(&x.exp()?), 1e-12);
    Ok(())
}
device_test!(grad_errors_name_the_fix, grad_errors);

/// `backward_with(create_graph)`: `.grad` gets history, and its own backward gives the second
/// derivative. y = Σ x³: x.grad = 3x², then backward of Σ x.grad gives 6x.
fn double_backward(device: Device) -> Result<()> {
    let x = tensor(device, &[1.0, -2.0, 0.5], &[3])?.with_grad()?;
    let y = x.powf(3.0)?.sum()?;
    let ones = Tensor::ones(&[], DType::F64, device)?;
    y.backward_with(
        ones,
        BackwardOptions {
            create_graph: true,
            ..BackwardOptions::default()
        },
    )?;
    let g = x.grad().expect("first backward");
    assert!(g.requires_grad(), "create_graph gives .grad history");
    assert_close(&values(&g), &[3.0, 12.0, 0.75], 1e-12);

    x.set_grad(None);
    g.sum()?.backward()?;
    assert_close(&values(&x.grad().unwrap()), &[6.0, -12.0, 3.0], 1e-12);

    // Without create_graph, .grad has no history.
    let z = randn(device, &[3])?.with_grad()?;
    z.powf(3.0)?.sum()?.backward()?;
    assert!(!z.grad().unwrap().requires_grad());
    Ok(())
}
device_test!(backward_with_create_graph_double_backward, double_backward);

/// `x²` through a rule of its own, with the backward given.
fn square(x: &Tensor, backward: BackwardFn<()>) -> Result<Tensor> {
    let out = x.detach().mul(&x.detach())?;
    Ok(record(out, "square", &[x], || {
        Rule::new(Save::input(0), (), backward)
    }))
}

/// gradgradcheck fails a backward that is right to first order but records nothing where it
/// must: through the saved input (the second derivative in x is lost) or through the incoming
/// gradient (what `v`, the last input of the check, catches). gradcheck passes all three.
fn checker_catches_detached_backwards(device: Device) -> Result<()> {
    // d(x²) = 2x·g, recorded in both x and g.
    let right: BackwardFn<()> = |saved, _, g, _| {
        let dx = g.mul(&saved.input(0)?)?.mul_scalar(2.0)?;
        Ok(std::iter::once(Some(dx)).collect())
    };
    let detached_x: BackwardFn<()> = |saved, _, g, _| {
        let dx = g.mul(&saved.input(0)?.detach())?.mul_scalar(2.0)?;
        Ok(std::iter::once(Some(dx)).collect())
    };
    let detached_g: BackwardFn<()> = |saved, _, g, _| {
        let dx = g.detach().mul(&saved.input(0)?)?.mul_scalar(2.0)?;
        Ok(std::iter::once(Some(dx)).collect())
    };
    let x = randn(device, &[3])?;
    for backward in [right, detached_x, detached_g] {
        let first = gradcheck(
            |x| square(&x[0], backward),
            std::slice::from_ref(&x),
            GradcheckOptions::default(),
        )?;
        assert!(first.is_empty(), "{first:?}");
    }
    let second = |backward| {
        gradgradcheck(
            |x| square(&x[0], backward),
            std::slice::from_ref(&x),
            GradcheckOptions::default(),
        )
    };
    assert!(second(right)?.is_empty());
    let lost_x = second(detached_x)?;
    assert!(
        !lost_x.is_empty() && lost_x.iter().all(|m| m.input == 0),
        "{lost_x:?}"
    );
    let lost_g = second(detached_g)?;
    assert!(
        !lost_g.is_empty() && lost_g.iter().all(|m| m.input == 1),
        "{lost_g:?}"
    );
    Ok(())
}
device_test!(
    gradgradcheck_catches_backwards_that_record_nothing,
    checker_catches_detached_backwards
);
