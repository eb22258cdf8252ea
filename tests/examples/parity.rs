//! Evaluates every parity case of the op registry (`ferry_tests::registry`) on a device, with
//! gradients, and writes inputs, outputs and gradients as JSON for tests/torch/parity.py to check
//! against PyTorch. The cases, their inputs and their names come from the registry alone.
//!
//! `cargo run --release -p ferry-tests --example parity -- [cuda:0|cpu] OUT.json`

use ferry::prelude::*;
use ferry::{DType, Result};
use ferry_tests::registry::{self, Case};
use serde_json::{Value, json};

fn as_json(t: &Tensor) -> Result<Value> {
    Ok(json!({ "shape": t.shape(), "data": t.to_vec_f64()? }))
}

fn run_case(case: &Case, device: Device) -> Result<Value> {
    let inputs = case.make_inputs(device, DType::F32, true)?;
    let out = (case.call)(&inputs)?;
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
        "input_is_float": case.inputs.iter().map(|i| i.is_float()).collect::<Vec<_>>(),
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
    let results: Vec<Value> = registry::cases()
        .iter()
        .filter(|c| c.parity)
        .map(|c| run_case(c, device))
        .collect::<Result<_>>()?;
    std::fs::write(
        &out_path,
        serde_json::to_string(&json!({ "device": device.to_string(), "cases": results }))?,
    )?;
    println!("wrote {} cases on {device} to {out_path}", results.len());
    Ok(())
}
