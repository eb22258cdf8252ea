use ferry_tensor::{Device, Result};
use ferry_tests::{check_grad, device_test, distinct, randn};

fn sums_and_means(device: Device) -> Result<()> {
    let inputs = [
        randn(device, &[2, 3, 4])?,
        randn(device, &[4, 3, 2])?.transpose(0, 2)?, // [2, 3, 4], not contiguous
        randn(device, &[2, 5, 4])?.narrow(1, 1, 3)?, // [2, 3, 4], offset, gaps
        randn(device, &[3, 1])?.broadcast_to(&[2, 3, 4])?, // stride-0 dimensions
    ];
    for x in inputs {
        check_grad("sum", |x| x[0].sum(), [x.clone()])?;
        check_grad("mean", |x| x[0].mean(), [x.clone()])?;
        for axis in [0, 1, 2, -1, -3] {
            for keepdim in [false, true] {
                let what = format!("sum_axis({axis}, {keepdim}) of {:?}", x.layout());
                check_grad(&what, |x| x[0].sum_axis(axis, keepdim), [x.clone()])?;
                let what = format!("mean_axis({axis}, {keepdim}) of {:?}", x.layout());
                check_grad(&what, |x| x[0].mean_axis(axis, keepdim), [x.clone()])?;
            }
        }
    }
    check_grad(
        "sum of a 0-d tensor",
        |x| x[0].sum(),
        &[randn(device, &[])?],
    )?;
    // A reduction of a broadcast made inside f: the stride-0 axis sums back twice.
    check_grad(
        "sum_axis of broadcast_to",
        |x| x[0].broadcast_to(&[3, 2, 4])?.sum_axis(-1, false),
        &[randn(device, &[2, 1])?],
    )?;
    Ok(())
}
device_test!(sum_and_mean, sums_and_means);

fn maxima(device: Device) -> Result<()> {
    for axis in [0, 1, 2, -1] {
        for keepdim in [false, true] {
            let x = distinct(device, &[2, 3, 4])?;
            check_grad(
                &format!("max_axis({axis}, {keepdim})"),
                |x| x[0].max_axis(axis, keepdim),
                &[x],
            )?;
        }
    }
    let xt = distinct(device, &[4, 3])?.t()?;
    check_grad(
        "max_axis of a transposed view",
        |x| x[0].max_axis(1, false),
        &[xt],
    )?;
    // 1-D: the gradient must come back as [n], not [n, 1].
    check_grad(
        "max_axis of a vector",
        |x| x[0].max_axis(0, false),
        &[distinct(device, &[5])?],
    )?;
    Ok(())
}
device_test!(max_axis_distinct_values, maxima);

fn matmuls(device: Device) -> Result<()> {
    let cases = [
        ("2-D", randn(device, &[3, 4])?, randn(device, &[4, 5])?),
        (
            "batched",
            randn(device, &[2, 3, 4])?,
            randn(device, &[2, 4, 5])?,
        ),
        (
            "matrix · batch",
            randn(device, &[3, 4])?,
            randn(device, &[2, 4, 5])?,
        ),
        (
            "batch · matrix",
            randn(device, &[2, 3, 4])?,
            randn(device, &[4, 5])?,
        ),
        (
            "broadcast batch dims",
            randn(device, &[2, 1, 3, 4])?,
            randn(device, &[3, 4, 2])?,
        ),
        (
            "transposed operands",
            randn(device, &[4, 3])?.t()?,
            randn(device, &[5, 4])?.t()?,
        ),
        (
            "batched transposed",
            randn(device, &[2, 4, 3])?.transpose(-1, -2)?,
            randn(device, &[4, 2, 5])?.transpose(0, 1)?,
        ),
        (
            "row and column",
            randn(device, &[1, 4])?,
            randn(device, &[4, 1])?,
        ),
    ];
    for (what, a, b) in cases {
        check_grad(&format!("matmul {what}"), |x| x[0].matmul(&x[1]), &[a, b])?;
    }
    Ok(())
}
device_test!(matmul, matmuls);
