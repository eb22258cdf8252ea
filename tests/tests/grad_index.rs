//! Indexing ops (index_select, index_add, gather, scatter_add, embedding) and layer_norm:
//! values against naive references, numerical gradients (first and second order), what their
//! nodes save, errors that name the range or the fix, and the LayerNorm / Embedding modules.

use ferry::nn::{Embedding, LayerNorm, Module};
use ferry_tensor::gradcheck::{GradcheckOptions, gradgradcheck};
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{
    assert_close, check_grad, device_test, indices, on, randn, seed, strides, values,
};

/// An `i64` index tensor on `device`.
fn index(device: Device, data: &[i64], shape: &[usize]) -> Result<Tensor> {
    on(device, Tensor::from_slice(data, shape)?)
}

/// The message of an error `r` must be.
fn error_of<T: std::fmt::Debug>(r: Result<T>) -> String {
    r.expect_err("an error was expected").to_string()
}

fn index_select_values_and_grads(device: Device) -> Result<()> {
    let x = randn(device, &[4, 3, 5])?;
    let xs = values(&x);
    let st = strides(&[4, 3, 5]);
    for (axis, idx) in [
        (0usize, vec![3i64, 0, 3]),
        (1, vec![2, 2, 1, 0]),
        (2, vec![4]),
    ] {
        let ix = index(device, &idx, &[idx.len()])?;
        let out = x.index_select(axis as isize, &ix)?;
        let mut shape = vec![4, 3, 5];
        shape[axis] = idx.len();
        assert_eq!(out.shape(), shape.as_slice());
        let want: Vec<f64> = indices(&shape)
            .iter()
            .map(|at| {
                let mut src = at.clone();
                src[axis] = idx[at[axis]] as usize;
                xs[src.iter().zip(&st).map(|(a, s)| a * s).sum::<usize>()]
            })
            .collect();
        assert_close(&values(&out), &want, 0.0);
        // Repeated indices: their gradients add up.
        check_grad(
            &format!("index_select axis {axis} {idx:?}"),
            |x| x[0].index_select(axis as isize, &ix),
            [x.clone()],
        )?;
    }
    // A transposed (non-contiguous) input and a negative axis.
    let xt = randn(device, &[5, 4])?.t()?;
    let ix = index(device, &[1, 1, 4, 0], &[4])?;
    check_grad(
        "index_select of a transposed view",
        |x| x[0].index_select(-1, &ix),
        [xt],
    )?;
    // Integer tensors select too (no gradient).
    let ints = index(device, &[10, 11, 12, 13, 14, 15], &[3, 2])?;
    let picked = ints.index_select(0, &index(device, &[2, 0], &[2])?)?;
    assert_eq!(picked.to_vec::<i64>()?, [14, 15, 10, 11]);
    Ok(())
}
device_test!(index_select, index_select_values_and_grads);

fn index_add_values_and_grads(device: Device) -> Result<()> {
    let x = randn(device, &[5, 3])?;
    let src = randn(device, &[4, 3])?;
    let ix = index(device, &[1, 4, 1, 0], &[4])?;
    let out = x.index_add(0, &ix, &src)?;
    let (xs, ss) = (values(&x), values(&src));
    let mut want = xs.clone();
    for (j, &row) in [1usize, 4, 1, 0].iter().enumerate() {
        for c in 0..3 {
            want[row * 3 + c] += ss[j * 3 + c];
        }
    }
    assert_close(&values(&out), &want, 1e-12);
    check_grad(
        "index_add along 0",
        |t| t[0].index_add(0, &ix, &t[1]),
        [x.clone(), src.clone()],
    )?;
    let ix1 = index(device, &[2, 2], &[2])?;
    check_grad(
        "index_add along 1",
        |t| t[0].index_add(1, &ix1, &t[1]),
        [randn(device, &[2, 3, 4])?, randn(device, &[2, 2, 4])?],
    )?;
    Ok(())
}
device_test!(index_add, index_add_values_and_grads);

fn gather_values_and_grads(device: Device) -> Result<()> {
    let x = randn(device, &[3, 4, 5])?;
    let xs = values(&x);
    let st = strides(&[3, 4, 5]);
    // An index shorter than x along the other axes, with repeats.
    let ishape = [2, 3, 4];
    let n: usize = ishape.iter().product();
    for axis in 0..3usize {
        let len = [3, 4, 5][axis] as i64;
        let idx: Vec<i64> = (0..n as i64).map(|p| (p * 7 + 3) % len).collect();
        let ix = index(device, &idx, &ishape)?;
        let out = x.gather(axis as isize, &ix)?;
        assert_eq!(out.shape(), ishape);
        let want: Vec<f64> = indices(&ishape)
            .iter()
            .zip(&idx)
            .map(|(at, &k)| {
                let mut src = at.clone();
                src[axis] = k as usize;
                xs[src.iter().zip(&st).map(|(a, s)| a * s).sum::<usize>()]
            })
            .collect();
        assert_close(&values(&out), &want, 0.0);
        check_grad(
            &format!("gather axis {axis}"),
            |x| x[0].gather(axis as isize, &ix),
            [x.clone()],
        )?;
    }
    // A non-contiguous source: the kernels read it through its strides.
    let xt = randn(device, &[4, 3])?.t()?; // [3, 4]
    let ix = index(device, &[3, 0, 1, 1, 2, 2], &[3, 2])?;
    let want: Vec<f64> = {
        let v = values(&xt);
        [3usize, 0, 1, 1, 2, 2]
            .iter()
            .enumerate()
            .map(|(p, &k)| v[(p / 2) * 4 + k])
            .collect()
    };
    assert_close(&values(&xt.gather(1, &ix)?), &want, 0.0);
    check_grad("gather of a transposed view", |x| x[0].gather(1, &ix), [xt])?;
    Ok(())
}
device_test!(gather, gather_values_and_grads);

fn scatter_add_values_and_grads(device: Device) -> Result<()> {
    let x = randn(device, &[3, 5])?;
    // src larger than the index: only the covered part takes part (and gets a gradient).
    let src = randn(device, &[3, 4])?;
    let idx = [4i64, 0, 4, 1, 1, 1, 0, 2, 3];
    let ix = index(device, &idx, &[3, 3])?;
    let out = x.scatter_add(1, &ix, &src)?;
    let (mut want, ss) = (values(&x), values(&src));
    for (p, &k) in idx.iter().enumerate() {
        let (i, j) = (p / 3, p % 3);
        want[i * 5 + k as usize] += ss[i * 4 + j];
    }
    assert_close(&values(&out), &want, 1e-12);
    check_grad(
        "scatter_add along 1 with src wider than the index",
        |t| t[0].scatter_add(1, &ix, &t[1]),
        [x.clone(), src.clone()],
    )?;
    let ix0 = index(device, &[2, 0, 2, 2, 1, 0], &[2, 3])?;
    check_grad(
        "scatter_add along 0",
        |t| t[0].scatter_add(0, &ix0, &t[1]),
        [randn(device, &[3, 3])?, randn(device, &[2, 3])?],
    )?;
    // gather undoes scatter_add's reading: d/dsrc of scatter_add is a gather.
    let g = randn(device, &[3, 5])?;
    let dsrc = g.gather(1, &ix)?;
    let gs = values(&g);
    let want: Vec<f64> = idx
        .iter()
        .enumerate()
        .map(|(p, &k)| gs[(p / 3) * 5 + k as usize])
        .collect();
    assert_close(&values(&dsrc), &want, 0.0);
    Ok(())
}
device_test!(scatter_add, scatter_add_values_and_grads);

fn indexing_second_order(device: Device) -> Result<()> {
    let ix = index(device, &[2, 0, 2], &[3])?;
    let options = GradcheckOptions::default();
    // Squared so the second derivative is not zero.
    let f = |t: &[Tensor]| {
        let s = t[0].index_select(0, &ix)?;
        s.mul(&s)
    };
    let bad = gradgradcheck(f, &[randn(device, &[3, 2])?], options)?;
    assert!(bad.is_empty(), "index_select: {bad:#?} (seed {})", seed());
    let gx = index(device, &[1, 0, 1, 1], &[2, 2])?;
    let f = |t: &[Tensor]| {
        let s = t[0].gather(1, &gx)?.scatter_add(1, &gx, &t[1])?;
        s.mul(&s)
    };
    let bad = gradgradcheck(
        f,
        &[randn(device, &[2, 2])?, randn(device, &[2, 2])?],
        options,
    )?;
    assert!(
        bad.is_empty(),
        "gather/scatter_add: {bad:#?} (seed {})",
        seed()
    );
    Ok(())
}
device_test!(indexing_gradgrad, indexing_second_order);

fn embedding_rows(device: Device) -> Result<()> {
    let w = randn(device, &[6, 3])?;
    let ws = values(&w);
    let idx = [5i64, 0, 5, 2, 2, 2];
    let ix = index(device, &idx, &[2, 3])?;
    let out = Tensor::embedding(&w, &ix)?;
    assert_eq!(out.shape(), [2, 3, 3]);
    let want: Vec<f64> = idx
        .iter()
        .flat_map(|&k| ws[k as usize * 3..k as usize * 3 + 3].to_vec())
        .collect();
    assert_close(&values(&out), &want, 0.0);
    check_grad("embedding", |t| Tensor::embedding(&t[0], &ix), [w.clone()])?;
    // Row k's gradient counts how often k was looked up.
    let leaf = w.with_grad()?;
    Tensor::embedding(&leaf, &ix)?.sum()?.backward()?;
    let counts = [1.0, 0.0, 3.0, 0.0, 0.0, 2.0];
    let want: Vec<f64> = counts.iter().flat_map(|&c| [c; 3]).collect();
    assert_close(&values(&leaf.grad().unwrap()), &want, 0.0);
    // A 0-d index gives one row of [dim].
    let one = Tensor::embedding(&w, &index(device, &[4], &[])?)?;
    assert_eq!(one.shape(), [3]);
    Ok(())
}
device_test!(embedding, embedding_rows);

fn f32_and_half_indexing(device: Device) -> Result<()> {
    // Accumulation in 16-bit floats (atomics on a 32-bit word on CUDA): neighbours in one word
    // must not lose each other's additions.
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let x = Tensor::zeros(&[4], dtype, device)?;
        let src = Tensor::ones(&[8], dtype, device)?;
        let ix = index(device, &[0, 1, 2, 3, 1, 0, 1, 3], &[8])?;
        let out = x.index_add(0, &ix, &src)?;
        assert_eq!(out.to_vec_f64()?, [2.0, 3.0, 1.0, 2.0], "{dtype}");
        let out = x.scatter_add(0, &ix, &src)?;
        assert_eq!(out.to_vec_f64()?, [2.0, 3.0, 1.0, 2.0], "{dtype}");
        let w = Tensor::arange(0.0, 8.0, dtype, device)?.reshape(&[4, 2])?;
        let e = Tensor::embedding(&w, &index(device, &[3, 0], &[2])?)?;
        assert_eq!(e.to_vec_f64()?, [6.0, 7.0, 0.0, 1.0], "{dtype}");
    }
    Ok(())
}
device_test!(indexing_dtypes, f32_and_half_indexing);

fn index_errors(device: Device) -> Result<()> {
    let x = randn(device, &[4, 3])?;
    // Out of range, both sides: the message names the range and the axis.
    for bad in [4i64, -1] {
        let ix = index(device, &[0, bad], &[2])?;
        let msg = error_of(x.index_select(0, &ix));
        assert!(
            msg.contains("0..4") && msg.contains(&bad.to_string()),
            "{msg}"
        );
        let msg = error_of(Tensor::embedding(&x, &ix));
        assert!(msg.contains("0..4"), "{msg}");
        let src = randn(device, &[2, 3])?;
        assert!(error_of(x.index_add(0, &ix, &src)).contains("0..4"));
    }
    let gi = index(device, &[0, 3, 1, 2], &[2, 2])?;
    let msg = error_of(x.gather(1, &gi));
    assert!(msg.contains("0..3") && msg.contains("axis 1"), "{msg}");
    let msg = error_of(x.scatter_add(1, &gi, &randn(device, &[2, 2])?));
    assert!(msg.contains("0..3"), "{msg}");
    // The index must be i64.
    let fl = randn(device, &[2])?;
    let msg = error_of(x.index_select(0, &fl));
    assert!(msg.contains("I64"), "{msg}");
    // Shapes.
    let two_d = index(device, &[0, 1], &[1, 2])?;
    assert!(error_of(x.index_select(0, &two_d)).contains("1-D"));
    assert!(error_of(x.gather(0, &index(device, &[0], &[1])?)).contains("dimensions"));
    let too_wide = index(device, &[0; 8], &[2, 4])?;
    assert!(error_of(x.gather(0, &too_wide)).contains("no longer"));
    let ix = index(device, &[0, 1], &[2])?;
    assert!(error_of(x.index_add(0, &ix, &randn(device, &[3, 3])?)).contains("one entry"));
    assert!(error_of(Tensor::embedding(&randn(device, &[4])?, &ix)).contains("num_embeddings"));
    // Integer tensors do not accumulate.
    let ints = index(device, &[1, 2, 3], &[3])?;
    let msg = error_of(ints.index_add(0, &ix, &index(device, &[1, 1], &[2])?));
    assert!(msg.contains("F32"), "{msg}");
    // The index and the tensor on different devices.
    if device != Device::Cpu {
        let host = Tensor::from_slice(&[0i64], &[1])?;
        assert!(error_of(x.index_select(0, &host)).contains("move one"));
    }
    Ok(())
}
device_test!(indexing_errors, index_errors);

/// Naive layer norm of `[rows, cols]` values, in f64.
fn layer_norm_reference(
    x: &[f64],
    cols: usize,
    w: Option<&[f64]>,
    b: Option<&[f64]>,
    eps: f64,
) -> Vec<f64> {
    x.chunks(cols)
        .flat_map(|r| {
            let mean = r.iter().sum::<f64>() / cols as f64;
            let var = r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / cols as f64;
            r.iter()
                .enumerate()
                .map(move |(j, v)| {
                    let y = (v - mean) / (var + eps).sqrt();
                    y * w.map_or(1.0, |w| w[j]) + b.map_or(0.0, |b| b[j])
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

fn layer_norm_values_and_grads(device: Device) -> Result<()> {
    let x = randn(device, &[2, 3, 8])?;
    let w = randn(device, &[8])?;
    let b = randn(device, &[8])?;
    let eps = 1e-5;
    let out = x.layer_norm(&[8], Some(&w), Some(&b), eps)?;
    assert_eq!(out.shape(), [2, 3, 8]);
    let want = layer_norm_reference(&values(&x), 8, Some(&values(&w)), Some(&values(&b)), eps);
    assert_close(&values(&out), &want, 1e-10);
    check_grad(
        "layer_norm with weight and bias",
        |t| t[0].layer_norm(&[8], Some(&t[1]), Some(&t[2]), eps),
        [x.clone(), w.clone(), b.clone()],
    )?;
    check_grad(
        "layer_norm without affine",
        |t| t[0].layer_norm(&[8], None, None, eps),
        [x.clone()],
    )?;
    check_grad(
        "layer_norm with a weight only",
        |t| t[0].layer_norm(&[8], Some(&t[1]), None, 0.1),
        [x.clone(), w.clone()],
    )?;
    check_grad(
        "layer_norm with a bias only",
        |t| t[0].layer_norm(&[8], None, Some(&t[1]), eps),
        [x.clone(), b.clone()],
    )?;
    // Over the last two axes, on a transposed input.
    let xt = randn(device, &[4, 3, 2])?.transpose(0, 2)?; // [2, 3, 4]
    let w2 = randn(device, &[3, 4])?;
    let want = layer_norm_reference(&values(&xt), 12, Some(&values(&w2)), None, eps);
    assert_close(
        &values(&xt.layer_norm(&[3, 4], Some(&w2), None, eps)?),
        &want,
        1e-10,
    );
    check_grad(
        "layer_norm over [3, 4] of a transposed view",
        |t| t[0].layer_norm(&[3, 4], Some(&t[1]), None, eps),
        [xt, w2],
    )?;
    // Only the weight wants a gradient (x is data): the fused backward's column sums alone.
    let data = x.detach();
    check_grad(
        "layer_norm, gradient of the weight and bias only",
        |t| data.layer_norm(&[8], Some(&t[0]), Some(&t[1]), eps),
        [w.clone(), b.clone()],
    )?;
    // Long rows: more columns than a block has threads.
    let long = randn(device, &[3, 700])?;
    let want = layer_norm_reference(&values(&long), 700, None, None, eps);
    assert_close(
        &values(&long.layer_norm(&[700], None, None, eps)?),
        &want,
        1e-9,
    );
    Ok(())
}
device_test!(layer_norm, layer_norm_values_and_grads);

fn layer_norm_second_order(device: Device) -> Result<()> {
    let f = |t: &[Tensor]| t[0].layer_norm(&[5], Some(&t[1]), Some(&t[2]), 1e-3);
    let inputs = [
        randn(device, &[3, 5])?,
        randn(device, &[5])?,
        randn(device, &[5])?,
    ];
    let bad = gradgradcheck(f, &inputs, GradcheckOptions::default())?;
    assert!(bad.is_empty(), "{bad:#?} (seed {})", seed());
    Ok(())
}
device_test!(layer_norm_gradgrad, layer_norm_second_order);

/// Large rows and many rows in f32 against an f64 reference: the kernels' block sums and the
/// chunked column sums of the weight and bias gradients.
fn layer_norm_f32_and_half(device: Device) -> Result<()> {
    let (rows, cols) = (300, 1000);
    let x64 = randn(device, &[rows, cols])?
        .mul_scalar(3.0)?
        .add_scalar(1.0)?;
    let w64 = randn(device, &[cols])?;
    let b64 = randn(device, &[cols])?;
    let g64 = randn(device, &[rows, cols])?;
    let grads = |dtype: DType| -> Result<Vec<Vec<f64>>> {
        let (x, w, b) = (
            x64.to_dtype(dtype)?.with_grad()?,
            w64.to_dtype(dtype)?.with_grad()?,
            b64.to_dtype(dtype)?.with_grad()?,
        );
        let y = x.layer_norm(&[cols], Some(&w), Some(&b), 1e-5)?;
        y.mul(&g64.to_dtype(dtype)?)?.sum()?.backward()?;
        Ok(vec![
            values(&y),
            values(&x.grad().unwrap()),
            values(&w.grad().unwrap()),
            values(&b.grad().unwrap()),
        ])
    };
    let exact = grads(DType::F64)?;
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 3e-2), (DType::F16, 5e-3)] {
        let got = grads(dtype)?;
        for (what, (a, e)) in ["y", "dx", "dweight", "dbias"]
            .iter()
            .zip(got.iter().zip(&exact))
        {
            let err: f64 = a
                .iter()
                .zip(e)
                .map(|(a, e)| (a - e).powi(2))
                .sum::<f64>()
                .sqrt();
            let norm: f64 = e.iter().map(|e| e * e).sum::<f64>().sqrt();
            assert!(
                err / norm < tol,
                "{dtype} {what}: relative error {} >= {tol}",
                err / norm
            );
        }
    }
    Ok(())
}
device_test!(layer_norm_dtypes, layer_norm_f32_and_half);

fn layer_norm_saves_x_and_statistics(device: Device) -> Result<()> {
    let x = Tensor::randn(&[4, 8], DType::F32, device)?.with_grad()?;
    let w = Tensor::randn(&[8], DType::F32, device)?.with_grad()?;
    let b = Tensor::randn(&[8], DType::F32, device)?.with_grad()?;
    let y = x.layer_norm(&[8], Some(&w), Some(&b), 1e-5)?;
    // x (128 bytes), the weight (32) and mean + rstd per row in f32 (4 rows: 32); not y.
    assert_eq!(y.graph().unwrap().saved_bytes(), 128 + 32 + 32);
    // Only the parameters want gradients: the weight is not needed (dx is not computed).
    // (The first node goes first: the leaves w and b would join the two graphs.)
    drop(y);
    let data = Tensor::randn(&[4, 8], DType::F32, device)?;
    let y = data.layer_norm(&[8], Some(&w), Some(&b), 1e-5)?;
    assert_eq!(y.graph().unwrap().saved_bytes(), 128 + 32);
    // Indexing keeps the index alone.
    let ix = index(device, &[1, 3, 1], &[3])?;
    let table = Tensor::randn(&[8], DType::F32, device)?.with_grad()?;
    let s = table.index_select(0, &ix)?;
    assert_eq!(s.graph().unwrap().saved_bytes(), 3 * 8);
    Ok(())
}
device_test!(layer_norm_saved_state, layer_norm_saves_x_and_statistics);

fn layer_norm_errors(device: Device) -> Result<()> {
    let x = randn(device, &[2, 4])?;
    let msg = error_of(x.layer_norm(&[3], None, None, 1e-5));
    assert!(msg.contains("trailing") && msg.contains("&[4]"), "{msg}");
    let msg = error_of(x.layer_norm(&[4], Some(&randn(device, &[3])?), None, 1e-5));
    assert!(msg.contains("normalized_shape"), "{msg}");
    let msg = error_of(x.layer_norm(&[4], None, None, -1.0));
    assert!(msg.contains("eps"), "{msg}");
    let w32 = Tensor::ones(&[4], DType::F32, device)?;
    assert!(error_of(x.layer_norm(&[4], Some(&w32), None, 1e-5)).contains("to_dtype"));
    let ints = index(device, &[1, 2], &[2])?;
    assert!(error_of(ints.layer_norm(&[2], None, None, 1e-5)).contains("F32"));
    assert!(
        error_of(LayerNorm::with_options(
            &[0],
            1e-5,
            true,
            DType::F32,
            device
        ))
        .contains("zero")
    );
    Ok(())
}
device_test!(layer_norm_bad_arguments, layer_norm_errors);

fn modules(device: Device) -> Result<()> {
    ferry::manual_seed(3);
    let ln = LayerNorm::new(6, device)?;
    let names: Vec<String> = ln.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["weight", "bias"]);
    let x = Tensor::randn(&[2, 5, 6], DType::F32, device)?;
    let y = ln.forward(&x)?;
    // Ones and zeros at first: each row has mean 0 and variance ≈ 1.
    for row in values(&y).chunks(6) {
        let mean = row.iter().sum::<f64>() / 6.0;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 6.0;
        assert!(
            mean.abs() < 1e-5 && (var - 1.0).abs() < 1e-3,
            "{mean} {var}"
        );
    }
    y.sum()?.backward()?;
    assert!(ln.parameters().iter().all(|p| p.grad().is_some()));
    let plain = LayerNorm::with_options(&[5, 6], 1e-5, false, DType::F32, device)?;
    assert!(plain.parameters().is_empty());
    assert_eq!(plain.forward(&x)?.shape(), [2, 5, 6]);

    let emb = Embedding::new(10, 4, device)?;
    assert_eq!((emb.num_embeddings(), emb.dim()), (10, 4));
    let ids = index(device, &[9, 0, 9, 3, 3, 3], &[3, 2])?;
    let out = emb.forward(&ids)?;
    assert_eq!(out.shape(), [3, 2, 4]);
    out.sum()?.backward()?;
    let g = values(&emb.weight().grad().unwrap());
    assert_eq!(&g[9 * 4..10 * 4], [2.0; 4]);
    assert_eq!(&g[3 * 4..4 * 4], [3.0; 4]);
    assert_eq!(&g[4..8], [0.0; 4]);
    let names: Vec<String> = emb.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["weight"]);
    let msg = error_of(emb.forward(&index(device, &[10], &[1])?));
    assert!(msg.contains("0..10"), "{msg}");
    Ok(())
}
device_test!(layer_norm_and_embedding_modules, modules);
