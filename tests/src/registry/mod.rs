//! Every op that records an autograd node, once: how to call it (input shapes and kinds, the
//! non-tensor arguments inside `call`), which op names its forward records, what the graph keeps
//! afterwards, and which checks apply. The suite's `registry` module walks it for gradcheck,
//! saved-state accounting and recorded names; the parity example runs its parity cases; and
//! tests/torch/registry.json, written from it and checked to be up to date, is what
//! tests/torch/parity.py reads. An op is checked because it is registered, not because someone
//! remembered it.
//!
//! Key decision: a case is an expression, not a bare op, so the PyTorch parity expressions (a few
//! compose ops, as models do) and the per-op checks share one list; `records` says exactly which
//! ops an expression covers, and the suite holds it to what the graph really recorded.

mod elementwise;
mod layers;
mod structure;

use ferry::DeviceMove;
use ferry_tensor::{DType, Device, Result, Tensor};

/// One input of a case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// Standard normal floats that get a gradient.
    Float(&'static [usize]),
    /// `i64` indices in `0..5`, no gradient (targets, index tensors, masks built from them).
    Index(&'static [usize]),
}

impl Input {
    /// The input's shape.
    pub fn shape(self) -> &'static [usize] {
        match self {
            Input::Float(s) | Input::Index(s) => s,
        }
    }

    /// Whether it is a float input that gets a gradient.
    pub fn is_float(self) -> bool {
        matches!(self, Input::Float(_))
    }
}

/// Which numerical gradient checks a case gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grad {
    /// gradcheck of the float inputs.
    First,
    /// gradcheck and gradgradcheck: the backward records ops of its own (`backward_records`)
    /// whose rules need checking too.
    Second,
    /// gradcheck with a large step and loose tolerances: the case computes in `f32`.
    Loose,
    /// None, for the reason given (no gradient, or a step gradcheck cannot resolve).
    Skip(&'static str),
}

/// What the graph keeps alive once the caller's handles are gone, with every float input
/// requiring grad, in `f32`.
#[derive(Debug, Clone, Copy)]
pub struct Keeps {
    /// The inputs whose storages the rules keep; every other input must be freed.
    pub inputs: &'static [usize],
    /// Whether the output's storage is kept.
    pub output: bool,
    /// Bytes of kept storages the caller cannot name (intermediates, indices, masks, statistics),
    /// from the inputs and the output.
    pub unnamed: fn(&[Tensor], &Tensor) -> usize,
}

impl Keeps {
    /// Nothing but shapes and scalars.
    pub const NOTHING: Keeps = Keeps {
        inputs: &[],
        output: false,
        unnamed: none,
    };

    /// The named inputs alone.
    pub const fn inputs(inputs: &'static [usize]) -> Keeps {
        Keeps {
            inputs,
            output: false,
            unnamed: none,
        }
    }

    /// The output alone.
    pub const OUTPUT: Keeps = Keeps {
        inputs: &[],
        output: true,
        unnamed: none,
    };
}

/// No unnamed bytes.
pub fn none(_: &[Tensor], _: &Tensor) -> usize {
    0
}

/// One registered expression.
#[derive(Clone, Copy)]
pub struct Case {
    /// Unique; the parity script's key.
    pub name: &'static str,
    /// The op names of the nodes the forward records, exactly (on a GPU in `f32`, where the
    /// fused paths run).
    pub records: &'static [&'static str],
    /// The same where the CPU records others (a fused GPU op composed from primitives).
    pub records_on_cpu: Option<&'static [&'static str]>,
    /// Op names that only a backward under `create_graph` records (fused backward kernels);
    /// each must appear in the gradient's graph.
    pub backward_records: &'static [&'static str],
    /// The inputs, in `call`'s order.
    pub inputs: &'static [Input],
    /// The expression.
    pub call: fn(&[Tensor]) -> Result<Tensor>,
    /// What the graph keeps; `None` where the forward records nothing.
    pub keeps: Option<Keeps>,
    /// Numerical gradient checks.
    pub grad: Grad,
    /// Whether tests/torch/parity.py mirrors it in PyTorch.
    pub parity: bool,
    /// Runs only on a GPU (it needs a stream).
    pub cuda_only: bool,
}

impl Case {
    /// A case recording `records`, with first-order gradcheck and parity, on every device.
    pub const fn new(
        name: &'static str,
        records: &'static [&'static str],
        inputs: &'static [Input],
        call: fn(&[Tensor]) -> Result<Tensor>,
        keeps: Keeps,
    ) -> Case {
        Case {
            name,
            records,
            records_on_cpu: None,
            backward_records: &[],
            inputs,
            call,
            keeps: Some(keeps),
            grad: Grad::First,
            parity: true,
            cuda_only: false,
        }
    }

    /// With second-order checks: the backward records `ops`.
    pub const fn backward(mut self, ops: &'static [&'static str]) -> Case {
        self.backward_records = ops;
        self.grad = Grad::Second;
        self
    }

    /// With a gradcheck for a case that computes in `f32`.
    pub const fn loose(mut self) -> Case {
        self.grad = Grad::Loose;
        self
    }

    /// Without gradient checks, for `why`.
    pub const fn no_gradcheck(mut self, why: &'static str) -> Case {
        self.grad = Grad::Skip(why);
        self
    }

    /// Recording nothing (no input reaches the output with a gradient).
    pub const fn records_nothing(mut self) -> Case {
        self.keeps = None;
        self.grad = Grad::Skip("the output has no gradient");
        self
    }

    /// Not mirrored by the parity script.
    pub const fn no_parity(mut self) -> Case {
        self.parity = false;
        self
    }

    /// Only on a GPU.
    pub const fn cuda_only(mut self) -> Case {
        self.cuda_only = true;
        self
    }

    /// Recording `ops` on the CPU instead.
    pub const fn on_cpu(mut self, ops: &'static [&'static str]) -> Case {
        self.records_on_cpu = Some(ops);
        self
    }

    /// The op names the forward records on `device`.
    pub fn records_on(&self, device: Device) -> &'static [&'static str] {
        match (device, self.records_on_cpu) {
            (Device::Cpu, Some(cpu)) => cpu,
            _ => self.records,
        }
    }

    /// Fresh inputs on `device`: floats in `dtype` (requiring grad when `grad`), indices as
    /// `i64`. Drawn on the host and moved, so a seed gives the same values on every device.
    pub fn make_inputs(&self, device: Device, dtype: DType, grad: bool) -> Result<Vec<Tensor>> {
        self.inputs
            .iter()
            .map(|input| {
                let host = match input {
                    Input::Float(shape) => Tensor::randn(shape, DType::F64, Device::Cpu)?,
                    Input::Index(shape) => Tensor::rand(shape, DType::F64, Device::Cpu)?
                        .mul_scalar(5.0)?
                        .to_dtype(DType::I64)?,
                };
                let host = if input.is_float() {
                    host.to_dtype(dtype)?
                } else {
                    host
                };
                let there = if device == Device::Cpu {
                    host
                } else {
                    host.to(device)?
                };
                if grad && input.is_float() {
                    there.with_grad()
                } else {
                    Ok(there)
                }
            })
            .collect()
    }
}

/// Op names the code passes to `record` that never reach a graph, and why: the walk checks that
/// no graph it builds, forward or backward, holds them.
pub const NEVER_RECORDED: &[(&str, &str)] = &[
    (
        "step",
        "piecewise constant: `Tensor::step` returns before recording",
    ),
    ("step_ge", "clamp_min's derivative, run without recording"),
    ("step_le", "clamp_max's derivative, run without recording"),
    (
        "max_share",
        "maximum's and minimum's derivative, run without recording",
    ),
    (
        "nll",
        "cross_entropy's composition for a device without the fused kernel (CPU and CUDA have it)",
    ),
];

/// Every registered case, in a fixed order.
pub fn cases() -> Vec<Case> {
    let mut all = elementwise::cases();
    all.extend(structure::cases());
    all.extend(layers::cases());
    all
}

/// The case named `name`.
pub fn case(name: &str) -> Option<Case> {
    cases().into_iter().find(|c| c.name == name)
}

/// Every op name the registry's forwards and backwards record.
pub fn recorded_names() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = cases()
        .iter()
        .flat_map(|c| {
            c.records
                .iter()
                .chain(c.records_on_cpu.unwrap_or(&[]))
                .chain(c.backward_records)
                .copied()
                .collect::<Vec<_>>()
        })
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// The registry as JSON (the text of tests/torch/registry.json): each case's name, what it
/// records, its inputs and its checks. Written by hand so the file's form is stable.
pub fn to_json() -> String {
    let quoted = |names: &[&str]| {
        let items: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
        format!("[{}]", items.join(", "))
    };
    let mut lines = Vec::new();
    for case in cases() {
        let inputs: Vec<String> = case
            .inputs
            .iter()
            .map(|i| {
                let kind = if i.is_float() { "float" } else { "index" };
                let dims: Vec<String> = i.shape().iter().map(usize::to_string).collect();
                format!("{{\"kind\": \"{kind}\", \"shape\": [{}]}}", dims.join(", "))
            })
            .collect();
        let grad = match case.grad {
            Grad::First => "first",
            Grad::Second => "second",
            Grad::Loose => "loose",
            Grad::Skip(_) => "none",
        };
        lines.push(format!(
            "    {{\"name\": \"{}\", \"records\": {}, \"backward_records\": {}, \"inputs\": [{}], \
             \"gradcheck\": \"{grad}\", \"parity\": {}, \"cuda_only\": {}}}",
            case.name,
            quoted(case.records),
            quoted(case.backward_records),
            inputs.join(", "),
            case.parity,
            case.cuda_only,
        ));
    }
    format!(
        "{{\n  \"generated_by\": \"cargo test -p ferry-tests --test suite registry (FERRY_WRITE_REGISTRY=1 rewrites it)\",\n  \"cases\": [\n{}\n  ]\n}}\n",
        lines.join(",\n")
    )
}

/// Where [`to_json`]'s text lives in the repository.
pub const JSON_PATH: &str = "tests/torch/registry.json";
