use ferry_tensor::{Device, Result, Tensor};
use ferry_tests::{away_from_zero, check_grad, device_test, randn, uniform};

/// Operand shapes that broadcast: equal, [3,1]·[1,4], [4]·[2,3,4], scalar tensors on either side.
const PAIRS: [(&[usize], &[usize]); 6] = [
    (&[2, 3], &[2, 3]),
    (&[3, 1], &[1, 4]),
    (&[4], &[2, 3, 4]),
    (&[2, 3, 4], &[4]),
    (&[], &[2, 3]),
    (&[2, 3], &[]),
];

type Binary = fn(&Tensor, &Tensor) -> Result<Tensor>;

fn binary_ops() -> [(&'static str, Binary); 4] {
    [
        ("add", Tensor::add),
        ("sub", Tensor::sub),
        ("mul", Tensor::mul),
        ("div", Tensor::div),
    ]
}

/// The right operand of `div` stays at least 0.5 away from 0.
fn rhs_for(op: &str, device: Device, shape: &[usize]) -> Result<Tensor> {
    if op == "div" {
        away_from_zero(device, shape, 0.5)
    } else {
        randn(device, shape)
    }
}

fn binary_broadcasting(device: Device) -> Result<()> {
    for (name, op) in binary_ops() {
        for (sa, sb) in PAIRS {
            let (a, b) = (randn(device, sa)?, rhs_for(name, device, sb)?);
            check_grad(
                &format!("{name} {sa:?} {sb:?}"),
                |x| op(&x[0], &x[1]),
                &[a, b],
            )?;
        }
    }
    Ok(())
}
device_test!(binary_broadcasting_inputs, binary_broadcasting);

/// Transposed, narrowed and broadcast views as operands, read in place by the kernels.
fn binary_non_contiguous(device: Device) -> Result<()> {
    for (name, op) in binary_ops() {
        let transposed = randn(device, &[4, 3])?.t()?; // [3, 4], strides [1, 3]
        let narrowed = rhs_for(name, device, &[3, 7])?.narrow(1, 2, 4)?; // [3, 4], offset 2
        check_grad(
            &format!("{name} transposed, narrowed"),
            |x| op(&x[0], &x[1]),
            &[transposed, narrowed],
        )?;

        // A broadcast view as the input itself (stride 0), and a broadcast made inside f.
        let broadcast = randn(device, &[1, 4])?.broadcast_to(&[3, 4])?;
        let b = rhs_for(name, device, &[3, 4])?;
        check_grad(
            &format!("{name} broadcast view"),
            |x| op(&x[1], &x[0]),
            &[broadcast, b],
        )?;
        let (col, b) = (
            randn(device, &[3, 1])?,
            rhs_for(name, device, &[3, 4])?.t()?.contiguous()?.t()?,
        );
        check_grad(
            &format!("{name} broadcast_to inside f"),
            |x| op(&x[0].broadcast_to(&[3, 4])?, &x[1]),
            &[col, b],
        )?;
    }
    Ok(())
}
device_test!(binary_non_contiguous_inputs, binary_non_contiguous);

fn scalar_ops(device: Device) -> Result<()> {
    let x = randn(device, &[2, 3])?;
    let xt = randn(device, &[3, 2])?.t()?;
    for input in [x, xt] {
        check_grad("add_scalar", |x| x[0].add_scalar(1.5), [input.clone()])?;
        check_grad("sub_scalar", |x| x[0].sub_scalar(-0.25), [input.clone()])?;
        check_grad("mul_scalar", |x| x[0].mul_scalar(-3.0), [input.clone()])?;
        check_grad("div_scalar", |x| x[0].div_scalar(4.0), [input.clone()])?;
    }
    Ok(())
}
device_test!(scalar_variants, scalar_ops);

type Unary = fn(&Tensor) -> Result<Tensor>;
type Input = fn(Device, &[usize]) -> Result<Tensor>;

/// Each activation on a contiguous input, a transposed view and a 0-d tensor, on a domain
/// where it is smooth.
fn unary_ops(device: Device) -> Result<()> {
    let ops: [(&str, Unary, Input); 9] = [
        ("neg", Tensor::neg, |d, s| randn(d, s)),
        ("exp", Tensor::exp, |d, s| randn(d, s)),
        ("log", Tensor::log, |d, s| uniform(d, s, 0.3, 3.0)),
        ("relu", Tensor::relu, |d, s| away_from_zero(d, s, 0.1)),
        ("tanh", Tensor::tanh, |d, s| randn(d, s)),
        ("sigmoid", Tensor::sigmoid, |d, s| randn(d, s)),
        ("sqrt", Tensor::sqrt, |d, s| uniform(d, s, 0.3, 3.0)),
        ("abs", Tensor::abs, |d, s| away_from_zero(d, s, 0.1)),
        ("exp∘tanh", |t| t.tanh()?.exp(), |d, s| randn(d, s)),
    ];
    for (name, op, input) in ops {
        check_grad(name, |x| op(&x[0]), &[input(device, &[2, 3])?])?;
        check_grad(
            &format!("{name} of a transposed view"),
            |x| op(&x[0]),
            &[input(device, &[4, 3])?.t()?],
        )?;
        check_grad(
            &format!("{name} of a 0-d tensor"),
            |x| op(&x[0]),
            &[input(device, &[])?],
        )?;
    }
    Ok(())
}
device_test!(unary_activations, unary_ops);

fn powf(device: Device) -> Result<()> {
    for p in [2.0, 3.0, 0.5, -1.5, 1.0] {
        let x = uniform(device, &[3, 4], 0.3, 2.0)?;
        check_grad(&format!("powf({p})"), |x| x[0].powf(p), &[x])?;
        let xt = uniform(device, &[4, 3], 0.3, 2.0)?.t()?;
        check_grad(&format!("powf({p}) transposed"), |x| x[0].powf(p), &[xt])?;
    }
    // Integer powers are defined for negative bases too.
    check_grad(
        "powf(3) of negatives",
        |x| x[0].powf(3.0),
        &[away_from_zero(device, &[5], 0.2)?],
    )?;
    Ok(())
}
device_test!(powf_scalar_exponent, powf);

/// A composite of several ops where one input feeds two branches.
fn composite(device: Device) -> Result<()> {
    let (a, b) = (randn(device, &[3, 4])?, uniform(device, &[4], 0.5, 2.0)?);
    check_grad(
        "a·sigmoid(a) / b + a",
        |x| x[0].mul(&x[0].sigmoid()?)?.div(&x[1])?.add(&x[0]),
        &[a, b],
    )
}
device_test!(composite_with_shared_input, composite);
