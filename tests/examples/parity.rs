//! Evaluates a set of expressions covering every op on a device, with gradients, and writes
//! inputs, outputs and gradients as JSON for tests/torch/parity.py to check against PyTorch.
//!
//! `cargo run --release -p ferry-tests --example parity -- [cuda:0|cpu] OUT.json`

use ferry::prelude::*;
use ferry::{DType, Result};
use serde_json::{Value, json};

/// One expression: its inputs' shapes (`None` marks an `i64` class-index input) and its body.
struct Case {
    name: &'static str,
    inputs: &'static [(&'static [usize], bool)],
    f: fn(&[Tensor]) -> Result<Tensor>,
}

const F: bool = true; // a float input that gets a gradient
const I: bool = false; // i64 class indices in 0..5

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "add_broadcast",
            inputs: &[(&[3, 1], F), (&[1, 4], F)],
            f: |x| x[0].add(&x[1]),
        },
        Case {
            name: "sub_broadcast",
            inputs: &[(&[2, 3, 4], F), (&[4], F)],
            f: |x| x[0].sub(&x[1]),
        },
        Case {
            name: "mul_transposed",
            inputs: &[(&[4, 3], F), (&[3, 4], F)],
            f: |x| x[0].t()?.mul(&x[1]),
        },
        Case {
            name: "div_abs",
            inputs: &[(&[5], F), (&[5], F)],
            f: |x| x[0].div(&x[1].abs()?.add_scalar(1.0)?),
        },
        Case {
            name: "scalar_ops",
            inputs: &[(&[6], F)],
            f: |x| x[0].mul_scalar(2.5)?.sub_scalar(1.5)?.div_scalar(3.0),
        },
        Case {
            name: "neg_exp",
            inputs: &[(&[2, 5], F)],
            f: |x| x[0].neg()?.exp(),
        },
        Case {
            name: "log",
            inputs: &[(&[7], F)],
            f: |x| x[0].abs()?.add_scalar(0.5)?.log(),
        },
        Case {
            name: "relu",
            inputs: &[(&[3, 4], F)],
            f: |x| x[0].relu(),
        },
        Case {
            name: "tanh",
            inputs: &[(&[3, 4], F)],
            f: |x| x[0].tanh(),
        },
        Case {
            name: "sigmoid",
            inputs: &[(&[3, 4], F)],
            f: |x| x[0].sigmoid(),
        },
        Case {
            name: "sqrt",
            inputs: &[(&[9], F)],
            f: |x| x[0].abs()?.add_scalar(0.1)?.sqrt(),
        },
        Case {
            name: "powf",
            inputs: &[(&[9], F)],
            f: |x| x[0].abs()?.add_scalar(0.5)?.powf(2.5),
        },
        Case {
            name: "sum_all",
            inputs: &[(&[4, 5], F)],
            f: |x| x[0].sum(),
        },
        Case {
            name: "mean_all",
            inputs: &[(&[4, 5], F)],
            f: |x| x[0].mean(),
        },
        Case {
            name: "sum_axis_keepdim",
            inputs: &[(&[4, 5, 3], F)],
            f: |x| x[0].sum_axis(1, true),
        },
        Case {
            name: "mean_axis",
            inputs: &[(&[4, 5, 3], F)],
            f: |x| x[0].mean_axis(-1, false),
        },
        Case {
            name: "max_axis",
            inputs: &[(&[6, 7], F)],
            f: |x| x[0].max_axis(1, false),
        },
        Case {
            name: "argmax",
            inputs: &[(&[6, 7], F)],
            f: |x| x[0].argmax(0, false)?.to_dtype(DType::F32),
        },
        Case {
            name: "matmul",
            inputs: &[(&[8, 16], F), (&[16, 4], F)],
            f: |x| x[0].matmul(&x[1]),
        },
        Case {
            name: "matmul_batched_broadcast",
            inputs: &[(&[3, 8, 16], F), (&[16, 4], F)],
            f: |x| x[0].matmul(&x[1]),
        },
        Case {
            name: "matmul_transposed",
            inputs: &[(&[16, 8], F), (&[4, 16], F)],
            f: |x| x[0].t()?.matmul(&x[1].t()?),
        },
        Case {
            name: "linear",
            inputs: &[(&[8, 16], F), (&[4, 16], F), (&[4], F)],
            f: |x| x[0].linear(&x[1], Some(&x[2])),
        },
        Case {
            name: "linear_relu",
            inputs: &[(&[8, 16], F), (&[4, 16], F), (&[4], F)],
            f: |x| x[0].linear_relu(&x[1], Some(&x[2])),
        },
        Case {
            name: "transpose_reshape_narrow",
            inputs: &[(&[4, 6], F)],
            f: |x| x[0].transpose(0, 1)?.reshape(&[3, 8])?.narrow(1, 2, 4),
        },
        Case {
            name: "chunk_cat",
            inputs: &[(&[6, 4], F)],
            f: |x| {
                let c = x[0].chunk(3, 0)?;
                Tensor::cat(&[&c[2], &c[0]], 1)
            },
        },
        Case {
            name: "unsqueeze_broadcast_squeeze",
            inputs: &[(&[5], F)],
            f: |x| {
                x[0].unsqueeze(0)?
                    .broadcast_to(&[3, 5])?
                    .sum_axis(0, true)?
                    .squeeze(0)
            },
        },
        Case {
            name: "cast_f16_round_trip",
            inputs: &[(&[10], F), (&[10], F)],
            f: |x| x[0].to_dtype(DType::F16)?.to_dtype(DType::F32)?.mul(&x[1]),
        },
        Case {
            name: "softmax",
            inputs: &[(&[4, 9], F)],
            f: |x| x[0].softmax(1),
        },
        Case {
            name: "log_softmax_axis0",
            inputs: &[(&[4, 9], F)],
            f: |x| x[0].log_softmax(0),
        },
        Case {
            name: "cross_entropy",
            inputs: &[(&[8, 5], F), (&[8], I)],
            f: |x| x[0].cross_entropy(&x[1]),
        },
        Case {
            name: "index_select",
            inputs: &[(&[6, 4], F), (&[7], I)],
            f: |x| x[0].index_select(0, &x[1]),
        },
        Case {
            name: "index_add",
            inputs: &[(&[5, 3], F), (&[4], I), (&[4, 3], F)],
            f: |x| x[0].index_add(0, &x[1], &x[2]),
        },
        Case {
            name: "gather",
            inputs: &[(&[4, 6], F), (&[4, 3], I)],
            f: |x| x[0].gather(1, &x[1]),
        },
        Case {
            name: "scatter_add",
            inputs: &[(&[4, 6], F), (&[4, 3], I), (&[4, 5], F)],
            f: |x| x[0].scatter_add(1, &x[1], &x[2]),
        },
        Case {
            name: "embedding",
            inputs: &[(&[5, 3], F), (&[2, 4], I)],
            f: |x| Tensor::embedding(&x[0], &x[1]),
        },
        Case {
            name: "layer_norm_affine",
            inputs: &[(&[4, 16], F), (&[16], F), (&[16], F)],
            f: |x| x[0].layer_norm(&[16], Some(&x[1]), Some(&x[2]), 1e-5),
        },
        Case {
            name: "layer_norm_plain_3d",
            inputs: &[(&[2, 3, 8], F)],
            f: |x| x[0].layer_norm(&[3, 8], None, None, 1e-5),
        },
        Case {
            name: "comparisons",
            inputs: &[(&[12], F), (&[12], F)],
            f: |x| {
                let gt = x[0].gt(&x[1])?.to_dtype(DType::F32)?;
                let le = x[0].le(&x[1])?.to_dtype(DType::F32)?;
                let eq = x[0].eq(&x[0])?.to_dtype(DType::F32)?;
                gt.mul_scalar(4.0)?.add(&le.mul_scalar(2.0)?)?.add(&eq)
            },
        },
        Case {
            name: "gelu",
            inputs: &[(&[4, 6], F)],
            f: |x| x[0].mul_scalar(2.0)?.gelu(),
        },
        Case {
            name: "gelu_tanh",
            inputs: &[(&[4, 6], F)],
            f: |x| x[0].mul_scalar(2.0)?.gelu_tanh(),
        },
        Case {
            name: "silu",
            inputs: &[(&[4, 6], F)],
            f: |x| x[0].mul_scalar(2.0)?.silu(),
        },
        Case {
            name: "sin_cos",
            inputs: &[(&[10], F), (&[10], F)],
            f: |x| x[0].mul_scalar(3.0)?.sin()?.add(&x[0].cos()?.mul(&x[1])?),
        },
        Case {
            name: "clamp",
            inputs: &[(&[20], F)],
            f: |x| x[0].mul_scalar(2.0)?.clamp(-1.0, 0.5),
        },
        Case {
            name: "maximum_broadcast",
            inputs: &[(&[3, 1], F), (&[1, 4], F)],
            f: |x| x[0].maximum(&x[1]),
        },
        Case {
            name: "minimum_ties",
            inputs: &[(&[16], F)],
            f: |x| x[0].minimum(&x[0].clamp(-0.5, 0.5)?),
        },
        Case {
            name: "maximum_ties",
            inputs: &[(&[16], F)],
            f: |x| x[0].maximum(&x[0].clamp(-0.5, 0.5)?),
        },
        Case {
            name: "where_broadcast",
            inputs: &[(&[3, 4], F), (&[4], F), (&[3, 1], F)],
            f: |x| {
                let zero = Tensor::zeros(&[], DType::F32, x[0].device())?;
                Tensor::where_cond(&x[0].gt(&zero)?, &x[0].mul(&x[1])?, &x[2])
            },
        },
        Case {
            name: "masked_fill",
            inputs: &[(&[3, 4], F), (&[4], I)],
            f: |x| {
                let two = Tensor::full(&[], 2.0, DType::I64, x[1].device())?;
                x[0].masked_fill(&x[1].gt(&two)?, -2.0)
            },
        },
        Case {
            name: "permute",
            inputs: &[(&[2, 3, 4], F), (&[4, 2, 3], F)],
            f: |x| x[0].permute(&[2, 0, 1])?.mul(&x[1]),
        },
        Case {
            name: "stack",
            inputs: &[(&[2, 3], F), (&[3, 2], F)],
            f: |x| Tensor::stack(&[&x[0], &x[1].t()?], 1),
        },
        Case {
            name: "conv2d_stride_pad_dilation_groups",
            inputs: &[(&[2, 4, 7, 8], F), (&[6, 2, 3, 2], F), (&[6], F)],
            f: |x| {
                let o = ferry::nn::Conv2dOptions::default()
                    .stride(2)
                    .padding(1)
                    .dilation(2)
                    .groups(2);
                x[0].conv2d(&x[1], Some(&x[2]), o)
            },
        },
        Case {
            name: "conv2d_plain",
            inputs: &[(&[1, 3, 6, 5], F), (&[4, 3, 3, 3], F)],
            f: |x| x[0].conv2d(&x[1], None, ferry::nn::Conv2dOptions::default()),
        },
        Case {
            name: "max_pool2d",
            inputs: &[(&[2, 3, 7, 6], F)],
            f: |x| x[0].max_pool2d([3, 3], [2, 2], [1, 1]),
        },
        Case {
            name: "avg_pool2d",
            inputs: &[(&[2, 3, 7, 6], F)],
            f: |x| x[0].avg_pool2d([3, 3], [2, 2], [1, 1]),
        },
        Case {
            // PyTorch cannot draw ferry's mask: parity.py rebuilds it from this output's zeros
            // and checks the kept values and the gradient against x / (1 - p) with that mask.
            name: "dropout",
            inputs: &[(&[64, 32], F)],
            f: |x| x[0].dropout(0.25, true),
        },
    ]
}

fn as_json(t: &Tensor) -> Result<Value> {
    Ok(json!({ "shape": t.shape(), "data": t.to_vec_f64()? }))
}

fn run_case(case: &Case, device: Device) -> Result<Value> {
    let inputs: Vec<Tensor> = case
        .inputs
        .iter()
        .map(|&(shape, float)| {
            let host = if float {
                Tensor::randn(shape, DType::F32, Device::Cpu)?
            } else {
                Tensor::rand(shape, DType::F64, Device::Cpu)?
                    .mul_scalar(5.0)?
                    .to_dtype(DType::I64)?
            };
            let there = host.to(device)?;
            if float { there.with_grad() } else { Ok(there) }
        })
        .collect::<Result<_>>()?;
    let out = (case.f)(&inputs)?;
    let probe = Tensor::randn(out.shape(), DType::F32, Device::Cpu)?;
    if out.requires_grad() {
        out.mul(&probe.to(device)?)?.sum()?.backward()?;
    }
    let grads: Vec<Value> = inputs
        .iter()
        .map(|t| t.grad().map_or(Ok(Value::Null), |g| as_json(&g)))
        .collect::<Result<_>>()?;
    Ok(json!({
        "name": case.name,
        "inputs": inputs.iter().map(as_json).collect::<Result<Vec<_>>>()?,
        "input_is_float": case.inputs.iter().map(|&(_, f)| f).collect::<Vec<_>>(),
        "output": as_json(&out)?,
        "probe": as_json(&probe)?,
        "grads": grads,
    }))
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let device: Device = args.next().unwrap_or_else(|| "cuda:0".into()).parse()?;
    let out_path = args.next().unwrap_or_else(|| "parity.json".into());
    ferry::manual_seed(7);
    let results: Vec<Value> = cases()
        .iter()
        .map(|c| run_case(c, device))
        .collect::<Result<_>>()?;
    std::fs::write(
        &out_path,
        serde_json::to_string(&json!({ "device": device.to_string(), "cases": results }))?,
    )?;
    println!("wrote {} cases on {device} to {out_path}", results.len());
    Ok(())
}
