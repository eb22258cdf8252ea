//! The chains whose memory `ferry bench autograd` measures, and ferry's side of that measure.
//!
//! Each chain is built the way a user writes it: the intermediates are temporaries, so what
//! stays allocated after the forward is what the user holds (leaves, inputs, the output) plus
//! what the graph saved. python/autograd.py's `CHAINS` builds the same chains in PyTorch.

use ferry::prelude::*;

use crate::harness;

/// Square tensors are SIDE x SIDE f32: 400 MiB, a multiple of the device allocator's 2 MiB
/// granule, so block rounding cannot pass for retention (10000 would round 400 MB up by 0.14%).
pub const SIDE: usize = 10_240;

/// What the user holds after a chain's forward.
pub struct Held {
    /// Leaves, inputs and targets: everything the user made.
    pub inputs: Vec<Tensor>,
    /// The chain's result.
    pub output: Tensor,
}

/// A standard chain of ops, built at any side length (the tests build them tiny on the CPU).
pub struct Chain {
    pub id: &'static str,
    /// The forward, as PyTorch code would read.
    pub forward: &'static str,
    /// What PyTorch's derivative rules keep alive with the held tensors.
    pub keeps: &'static str,
    /// Builds the chain on `device` with square tensors of side `n` (even).
    pub build: fn(Device, usize) -> ferry::Result<Held>,
    /// Bytes of the tensors listed in `keeps`, at side `n`.
    pub expected: fn(usize) -> usize,
}

/// Bytes of an `n x n` f32 tensor.
fn square(n: usize) -> usize {
    n * n * 4
}

fn held(inputs: Vec<Tensor>, output: Tensor) -> ferry::Result<Held> {
    Ok(Held { inputs, output })
}

fn leaf(shape: &[usize], device: Device) -> ferry::Result<Tensor> {
    Tensor::randn(shape, DType::F32, device)?.with_grad()
}

fn elementwise(device: Device, n: usize) -> ferry::Result<Held> {
    let x = leaf(&[n, n], device)?;
    let output = x.mul_scalar(2.0)?.add_scalar(1.0)?.add(&x)?.exp()?;
    held(vec![x], output)
}

fn linear_relu(device: Device, n: usize) -> ferry::Result<Held> {
    let (batch, width) = (n, n / 2);
    let x = Tensor::randn(&[batch, width], DType::F32, device)?;
    let (w1, b1) = (leaf(&[width, width], device)?, leaf(&[width], device)?);
    let (w2, b2) = (leaf(&[width, width], device)?, leaf(&[width], device)?);
    let h = x.matmul(&w1)?.add(&b1)?.relu()?;
    let output = h.matmul(&w2)?.add(&b2)?.relu()?;
    held(vec![x, w1, b1, w2, b2], output)
}

fn tanh(device: Device, n: usize) -> ferry::Result<Held> {
    let x = leaf(&[n, n], device)?;
    let output = x.tanh()?.mul_scalar(2.0)?.tanh()?;
    held(vec![x], output)
}

fn silu(device: Device, n: usize) -> ferry::Result<Held> {
    let x = leaf(&[n, n], device)?;
    let output = x.mul(&x.sigmoid()?)?;
    held(vec![x], output)
}

fn softmax(device: Device, n: usize) -> ferry::Result<Held> {
    let x = leaf(&[n, n], device)?;
    let output = x.softmax(-1)?;
    held(vec![x], output)
}

fn cross_entropy(device: Device, n: usize) -> ferry::Result<Held> {
    let x = leaf(&[n, n], device)?;
    let targets = Tensor::arange(0.0, n as f64, DType::I64, device)?;
    let output = x.cross_entropy(&targets)?;
    held(vec![x, targets], output)
}

fn views(device: Device, n: usize) -> ferry::Result<Held> {
    let (x, w) = (leaf(&[n, n], device)?, leaf(&[n / 2, n], device)?);
    let view = x.reshape(&[2 * n, n / 2])?.t()?.narrow(1, 0, n)?;
    let output = view.mul(&w)?;
    held(vec![x, w], output)
}

fn device_move(device: Device, n: usize) -> ferry::Result<Held> {
    let x = leaf(&[n, n], device)?;
    let output = x.exp()?.cpu()?.tanh()?.to(device)?;
    held(vec![x], output)
}

pub const CHAINS: [Chain; 8] = [
    Chain {
        id: "elementwise",
        forward: "(x * 2 + 1 + x).exp()",
        keeps: "x; the output (exp's saved result)",
        build: elementwise,
        expected: |n| 2 * square(n),
    },
    Chain {
        id: "linear_relu",
        forward: "relu(relu(x @ w1 + b1) @ w2 + b2), x [n, n/2] without grad",
        keeps: "x, w1, b1, w2, b2; h = the first relu's output (saved by relu and the second \
                matmul); the output",
        build: linear_relu,
        expected: |n| 2 * square(n) + 2 * (n / 2) * 4,
    },
    Chain {
        id: "tanh",
        forward: "(x.tanh() * 2).tanh()",
        keeps: "x; the first tanh's output; the output",
        build: tanh,
        expected: |n| 3 * square(n),
    },
    Chain {
        id: "silu",
        forward: "x * x.sigmoid()",
        keeps: "x; sigmoid's output (saved by sigmoid and mul); the output",
        build: silu,
        expected: |n| 3 * square(n),
    },
    Chain {
        id: "softmax",
        forward: "x.softmax(-1)",
        keeps: "x; the output (softmax's saved result)",
        build: softmax,
        expected: |n| 2 * square(n),
    },
    Chain {
        id: "cross_entropy",
        forward: "cross_entropy(x, arange(n)), n classes",
        keeps: "x, targets; log_softmax's output; the loss",
        build: cross_entropy,
        expected: |n| 2 * square(n) + n * 8 + 4,
    },
    Chain {
        id: "views",
        forward: "x.reshape(2n, n/2).t().narrow(1, 0, n) * w, w [n/2, n]",
        keeps: "x (the view mul saves is x's storage), w; the output",
        build: views,
        expected: |n| 2 * square(n),
    },
    Chain {
        id: "device_move",
        forward: "x.exp().cpu().tanh().cuda()",
        keeps: "x; exp's output (on the GPU); the output (tanh's output stays on the host)",
        build: device_move,
        expected: |n| 3 * square(n),
    },
];

/// The chains with these ids, in table order (all of them for none).
pub fn select(ids: &[String]) -> Result<Vec<&'static Chain>, String> {
    harness::select(&CHAINS, ids, "chain", |c| c.id)
}

/// One chain's device memory on one side, in bytes above what was allocated before its inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChainBytes {
    /// Allocated once the forward returned, the user holding [`Held`].
    pub retained: i64,
    /// The most allocated at once during `output.sum().backward()`.
    pub backward_peak: i64,
    /// Still allocated after everything was dropped: not 0 means something leaked.
    pub after_drop: i64,
    /// ferry only: `graph.saved_bytes()` after the forward (host bytes included).
    pub saved: Option<usize>,
}

/// ferry's side of `chain` on CUDA `device`: the user here, so it may reset the peak.
pub fn measure(chain: &Chain, device: Device) -> ferry::Result<ChainBytes> {
    let allocated = || -> ferry::Result<i64> {
        ferry::cuda::synchronize(device)?;
        Ok(ferry::cuda::memory_allocated(device)? as i64)
    };
    let base = allocated()?;
    let Held { inputs, output } = (chain.build)(device, SIDE)?;
    let retained = allocated()? - base;
    let saved = output.graph().map(|g| g.saved_bytes());
    let loss = output.sum()?;
    ferry::cuda::synchronize(device)?;
    ferry::cuda::reset_peak(device)?;
    loss.backward()?;
    ferry::cuda::synchronize(device)?;
    let backward_peak = ferry::cuda::max_memory_allocated(device)? as i64 - base;
    drop((loss, output, inputs));
    Ok(ChainBytes {
        retained,
        backward_peak,
        after_drop: allocated()? - base,
        saved,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// python/autograd.py must build the same chains at the same size.
    #[test]
    fn the_chains_match_autograd_py() {
        let script = include_str!("../../python/autograd.py");
        assert!(script.contains(&format!("SIDE = {}_{:03}", SIDE / 1000, SIDE % 1000)));
        for chain in &CHAINS {
            let entry = format!("\"{0}\": {0},", chain.id);
            assert!(script.contains(&entry), "autograd.py lacks `{entry}`");
        }
        assert_eq!(SIDE * SIDE * 4 % (2 << 20), 0, "not a multiple of 2 MiB");
        assert_eq!(select(&["views".into()]).unwrap()[0].id, "views");
        assert_eq!(select(&[]).unwrap().len(), CHAINS.len());
        let err = select(&["conv".into()]).err().unwrap();
        assert!(err.starts_with("no chain `conv`; the chains are elementwise, linear_relu"));
    }

    /// Every chain runs forward and backward, reaches its leaves, and saves no more than
    /// PyTorch's rules keep (the saved tensors are among the kept ones).
    #[test]
    fn every_chain_runs_and_saves_at_most_what_pytorch_keeps() {
        let n = 8;
        for chain in &CHAINS {
            let held = (chain.build)(Device::Cpu, n).unwrap();
            let saved = held.output.graph().unwrap().saved_bytes();
            let expected = (chain.expected)(n);
            assert!(saved > 0 && saved <= expected, "{}: {saved}", chain.id);
            held.output.sum().unwrap().backward().unwrap();
            for input in held.inputs.iter().filter(|t| t.requires_grad()) {
                let grad = input
                    .grad()
                    .unwrap_or_else(|| panic!("{}: no grad", chain.id));
                assert_eq!(grad.shape(), input.shape(), "{}", chain.id);
            }
        }
    }
}
