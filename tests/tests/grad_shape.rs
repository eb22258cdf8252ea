use ferry_tensor::gradcheck::GradcheckOptions;
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{check_grad, check_grad_with, device_test, randn};

fn views(device: Device) -> Result<()> {
    let x = randn(device, &[2, 3, 4])?;
    let xt = randn(device, &[4, 3, 2])?.transpose(0, 2)?;
    for input in [x, xt] {
        // Products with a fixed weight make each output element's gradient distinct.
        check_grad("transpose(0, 2)", |x| x[0].transpose(0, 2), [input.clone()])?;
        check_grad(
            "transpose(-1, 1)",
            |x| x[0].transpose(-1, 1),
            [input.clone()],
        )?;
        check_grad("reshape [6, 4]", |x| x[0].reshape(&[6, 4]), [input.clone()])?;
        check_grad("reshape [24]", |x| x[0].reshape(&[24]), [input.clone()])?;
        check_grad(
            "reshape of a transposed view",
            |x| x[0].t()?.reshape(&[2, 12]),
            [input.clone()],
        )?;
        check_grad("contiguous", |x| x[0].t()?.contiguous(), [input.clone()])?;
        for axis in [0, 1, 2] {
            check_grad(
                &format!("narrow axis {axis}"),
                |x| x[0].narrow(axis, 1, 1),
                [input.clone()],
            )?;
        }
        check_grad(
            "narrow to the end",
            |x| x[0].narrow(-1, 1, 3),
            [input.clone()],
        )?;
        check_grad("unsqueeze(1)", |x| x[0].unsqueeze(1), [input.clone()])?;
        check_grad("unsqueeze(-1)", |x| x[0].unsqueeze(-1), [input.clone()])?;
        check_grad(
            "squeeze∘unsqueeze",
            |x| x[0].unsqueeze(0)?.squeeze(0),
            [input.clone()],
        )?;
    }
    check_grad(
        "squeeze",
        |x| x[0].squeeze(1),
        &[randn(device, &[3, 1, 2])?],
    )?;
    check_grad(
        "broadcast_to [3,1] -> [2,3,4]",
        |x| x[0].broadcast_to(&[2, 3, 4]),
        &[randn(device, &[3, 1])?],
    )?;
    check_grad(
        "broadcast_to [] -> [2,2]",
        |x| x[0].broadcast_to(&[2, 2]),
        &[randn(device, &[])?],
    )?;
    Ok(())
}
device_test!(views_and_reshapes, views);

fn chunk_and_cat(device: Device) -> Result<()> {
    // Chunks recombined with different weights, so a mixed-up slice would show.
    let x = randn(device, &[2, 10])?;
    check_grad(
        "chunk(3, 1)",
        |x| {
            let c = x[0].chunk(3, 1)?;
            Tensor::cat(&[&c[2], &c[0].mul_scalar(2.0)?, &c[1].mul_scalar(-3.0)?], 1)
        },
        &[x],
    )?;
    let xt = randn(device, &[10, 2])?.t()?;
    check_grad(
        "chunk of a transposed view",
        |x| x[0].chunk(4, -1)?[1].exp(),
        &[xt],
    )?;

    let parts = [
        randn(device, &[2, 1, 4])?,
        randn(device, &[4, 3, 2])?.transpose(0, 2)?,
        randn(device, &[2, 2, 4])?,
    ];
    check_grad(
        "cat of 3 along the middle axis",
        |x| Tensor::cat(&[&x[0], &x[1], &x[2]], 1),
        &parts,
    )?;
    check_grad(
        "cat along the last axis",
        |x| Tensor::cat(&[&x[0], &x[0].exp()?], -1),
        &[randn(device, &[3, 2])?],
    )?;
    Ok(())
}
device_test!(chunk_cat, chunk_and_cat);

fn casts(device: Device) -> Result<()> {
    // f32 keeps ~7 digits: a larger step and looser tolerances. Central differences are exact
    // on the quadratic, so what remains is f32 rounding.
    let loose = GradcheckOptions {
        eps: 1e-2,
        atol: 1e-3,
        rtol: 1e-3,
    };
    let x = randn(device, &[3, 4])?;
    check_grad_with(
        "to_dtype f64 -> f32 -> f64",
        |x| {
            let x32 = x[0].to_dtype(DType::F32)?;
            x32.mul(&x32)?.to_dtype(DType::F64)
        },
        &[x],
        loose,
    )?;
    // Casting to the same dtype is the identity, gradient included.
    check_grad(
        "to_dtype f64 -> f64",
        |x| x[0].to_dtype(DType::F64)?.exp(),
        &[randn(device, &[3])?],
    )
}
device_test!(to_dtype_round_trip, casts);

/// `n` random class indices below `classes`, as i64.
fn targets(device: Device, n: usize, classes: usize) -> Result<Tensor> {
    Tensor::rand(&[n], DType::F64, device)?
        .mul_scalar(classes as f64)?
        .to_dtype(DType::I64)
}

fn softmax_family(device: Device) -> Result<()> {
    let x = randn(device, &[3, 5])?.mul_scalar(2.0)?;
    let xt = randn(device, &[5, 3])?.t()?;
    for input in [x, xt] {
        for axis in [0, 1, -1] {
            check_grad(
                &format!("softmax({axis})"),
                |x| x[0].softmax(axis),
                [input.clone()],
            )?;
            check_grad(
                &format!("log_softmax({axis})"),
                |x| x[0].log_softmax(axis),
                [input.clone()],
            )?;
        }
    }
    check_grad(
        "softmax of a 3-D tensor",
        |x| x[0].softmax(1),
        &[randn(device, &[2, 3, 4])?],
    )?;
    check_grad(
        "softmax of a vector",
        |x| x[0].softmax(0),
        &[randn(device, &[4])?],
    )?;
    let t = targets(device, 4, 5)?;
    check_grad(
        "cross_entropy",
        |x| x[0].cross_entropy(&t),
        &[randn(device, &[4, 5])?],
    )?;
    check_grad(
        "cross_entropy of a transposed view",
        |x| x[0].t()?.cross_entropy(&t),
        &[randn(device, &[5, 4])?],
    )?;
    Ok(())
}
device_test!(softmax_log_softmax_cross_entropy, softmax_family);

/// Three views narrowed out of one product (a fused q/k/v projection's heads), used apart: the
/// gradients are right, overlapping views included, and the second and third views add into
/// the gradient the first one started instead of passing padded buffers of their own.
fn narrowed_views_share_one_gradient(device: Device) -> Result<()> {
    let (x, w) = (randn(device, &[4, 3])?, randn(device, &[3, 9])?);
    let heads = |t: &Tensor| -> Result<[Tensor; 3]> {
        Ok([t.narrow(1, 0, 3)?, t.narrow(1, 3, 3)?, t.narrow(1, 6, 3)?])
    };
    check_grad(
        "three heads of one product",
        |v| {
            let [q, k, h] = heads(&v[0].matmul(&v[1])?)?;
            q.mul(&k)?.add(&h.tanh()?)
        },
        [x.clone(), w.clone()],
    )?;
    check_grad(
        "overlapping views of one product",
        |v| {
            let p = v[0].matmul(&v[1])?;
            p.narrow(1, 0, 5)?.mul(&p.narrow(1, 2, 5)?)
        },
        [x.clone(), w.clone()],
    )?;

    let (x, w) = (x.with_grad()?, w.with_grad()?);
    let [q, k, h] = heads(&x.matmul(&w)?)?;
    let report = q.mul(&k)?.add(&h)?.sum()?.backward_traced()?;
    let narrows: Vec<usize> = report
        .trace
        .iter()
        .filter(|step| step.meta.op == "narrow")
        .map(|step| step.passed.len())
        .collect();
    assert_eq!(narrows.len(), 3, "{:#?}", report.trace);
    assert_eq!(
        narrows.iter().filter(|&&n| n == 0).count(),
        2,
        "two of three views add in place: {narrows:?}"
    );
    Ok(())
}
device_test!(narrowed_views, narrowed_views_share_one_gradient);

/// One gradient handed to two inputs (`add`'s backward) is never written in place by a view of
/// one of them: the other input's gradient stays its own. The view is recorded first, so
/// backward reaches it after `add` has handed out the shared gradient.
fn a_shared_gradient_is_left_alone(device: Device) -> Result<()> {
    let x = randn(device, &[4, 3])?.with_grad()?;
    let (c, d) = (randn(device, &[2, 3])?, randn(device, &[4, 3])?);
    let (u, v) = (x.mul_scalar(2.0)?, x.mul_scalar(3.0)?);
    let viewed = u.narrow(0, 1, 2)?.mul(&c)?.sum()?;
    let loss = viewed.add(&u.add(&v)?.mul(&d)?.sum()?)?;
    loss.backward()?;
    // d/dx = 2 (d + c placed at rows 1..3) + 3 d.
    let (c, d) = (c.to_vec_f64()?, d.to_vec_f64()?);
    let want: Vec<f64> = (0..12)
        .map(|i| {
            let (row, col) = (i / 3, i % 3);
            let placed = if (1..3).contains(&row) {
                c[(row - 1) * 3 + col]
            } else {
                0.0
            };
            2.0 * (d[i] + placed) + 3.0 * d[i]
        })
        .collect();
    ferry_tests::assert_close(&x.grad().unwrap().to_vec_f64()?, &want, 1e-12);
    Ok(())
}
device_test!(shared_gradient, a_shared_gradient_is_left_alone);
