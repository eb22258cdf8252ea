//! One forward pass per recording op, each with the storages its rule must keep and the ones
//! it must let go; shared by the suite (weak references and saved bytes, in parallel) and the
//! serialised memory_accounting binary (the same, plus allocated bytes read from the device's
//! allocator or the host's statistics).
//!
//! Each case drops every handle of its own; only the outputs' nodes stay, so what is alive
//! afterwards is alive because of the graph.

use std::sync::{Arc, Weak};

use ferry::{DeviceMove, MoveOptions};
use ferry_graph::NodeHandle;
use ferry_tensor::{DType, Device, Result, Storage, Tensor};

/// Reads allocated bytes from somewhere (the device's allocator, the host's statistics).
pub trait Meter {
    /// Bytes allocated right now.
    fn allocated(&self) -> Result<usize>;
    /// What a storage of `bytes` on `device` adds to [`Meter::allocated`] (0 for devices this
    /// meter does not see).
    fn block(&self, device: Device, bytes: usize) -> usize;
}

/// A named forward pass.
pub type Case = (&'static str, fn(Device) -> Result<Forward>);

/// What a forward pass left: its outputs, and the storages it watches.
pub struct Forward {
    outputs: Vec<Tensor>,
    watched: Vec<Watched>,
    /// Storages a rule saves that the test cannot name (max's indices, cross-entropy's
    /// log-probabilities): device and bytes.
    unnamed: Vec<(Device, usize)>,
}

struct Watched {
    name: &'static str,
    storage: Weak<Storage>,
    device: Device,
    bytes: usize,
    kept: bool,
}

impl Forward {
    /// A forward that left `outputs`, watching nothing yet.
    pub fn of(outputs: impl IntoIterator<Item = Tensor>) -> Self {
        Self {
            outputs: outputs.into_iter().collect(),
            watched: Vec::new(),
            unnamed: Vec::new(),
        }
    }

    /// Watches `t`'s storage: the graph must keep it exactly when `kept`.
    pub fn watch(mut self, name: &'static str, t: &Tensor, kept: bool) -> Self {
        self.watched.push(Watched {
            name,
            storage: Arc::downgrade(t.storage()),
            device: t.device(),
            bytes: t.storage().bytes(),
            kept,
        });
        self
    }

    /// The rule must keep `t`'s storage.
    fn keeps(self, name: &'static str, t: &Tensor) -> Self {
        self.watch(name, t, true)
    }

    /// The graph must not keep `t`'s storage.
    fn frees(self, name: &'static str, t: &Tensor) -> Self {
        self.watch(name, t, false)
    }

    /// A rule keeps a storage of `bytes` on `device` that the test cannot reach.
    pub fn keeps_unnamed(mut self, device: Device, bytes: usize) -> Self {
        self.unnamed.push((device, bytes));
        self
    }
}

/// Runs `case` on `device` and checks that exactly the declared storages outlive the forward
/// (weak references), that the graph's saved bytes are their bytes, and, with a meter, that
/// the allocated bytes are theirs too; then that dropping the graph frees everything.
pub fn check(device: Device, case: &Case, meter: Option<&dyn Meter>) -> Result<()> {
    let (name, forward) = case;
    check_forward(name, device, || forward(device), meter)
}

/// [`check`] of a forward pass given as a closure (the op registry's cases).
pub fn check_forward(
    name: &str,
    device: Device,
    forward: impl FnOnce() -> Result<Forward>,
    meter: Option<&dyn Meter>,
) -> Result<()> {
    let before = meter.map(Meter::allocated).transpose()?;
    let Forward {
        outputs,
        watched,
        unnamed,
    } = forward()?;
    let nodes: Vec<NodeHandle<Tensor>> = outputs.iter().filter_map(|t| t.node().cloned()).collect();
    assert_eq!(
        nodes.len(),
        outputs.len(),
        "{name} on {device}: an output recorded no node"
    );
    let graph = outputs[0].graph().expect("a recorded output has a graph");
    drop(outputs);

    let mut kept: Vec<&Watched> = Vec::new();
    for w in &watched {
        let alive = w.storage.upgrade().is_some();
        assert_eq!(
            alive,
            w.kept,
            "{name} on {device}: `{}` {}",
            w.name,
            if w.kept {
                "was freed, but the rule needs it"
            } else {
                "is still alive, but the rule does not declare it"
            }
        );
        // Views share a storage: count each once.
        if w.kept && !kept.iter().any(|k| Weak::ptr_eq(&k.storage, &w.storage)) {
            kept.push(w);
        }
    }
    let kept_bytes: usize = kept.iter().map(|w| w.bytes).sum::<usize>()
        + unnamed.iter().map(|&(_, bytes)| bytes).sum::<usize>();
    assert_eq!(
        graph.saved_bytes(),
        kept_bytes,
        "{name} on {device}: saved_bytes is not the bytes of the storages the graph keeps"
    );
    if let (Some(meter), Some(before)) = (meter, before) {
        let expected: usize = kept
            .iter()
            .map(|w| meter.block(w.device, w.bytes))
            .chain(unnamed.iter().map(|&(d, bytes)| meter.block(d, bytes)))
            .sum();
        assert_eq!(
            meter.allocated()?,
            before + expected,
            "{name} on {device}: allocated bytes after the forward, against {before} before"
        );
    }

    drop(nodes);
    assert_eq!(
        (graph.live_nodes(), graph.saved_bytes()),
        (0, 0),
        "{name} on {device}: the graph outlived its outputs"
    );
    for w in &watched {
        assert!(
            w.storage.upgrade().is_none(),
            "{name} on {device}: `{}` outlived the graph",
            w.name
        );
    }
    if let (Some(meter), Some(before)) = (meter, before) {
        assert_eq!(
            meter.allocated()?,
            before,
            "{name} on {device}: allocated bytes after the graph dropped"
        );
    }
    Ok(())
}

/// The chain: a large leaf `x` (1M f32), `mul_scalar`, `add_scalar`, `add(x)`, `exp`.
/// While the caller holds `x` and the result, only they are alive (PyTorch keeps the same
/// two), and the graph's saved bytes are exp's output alone. After backward, the saved output
/// is released and only `x`, its gradient and the result remain.
pub fn chain_keeps_only_the_leaf_and_exp(device: Device, meter: Option<&dyn Meter>) -> Result<()> {
    const N: usize = 1 << 20;
    let before = meter.map(Meter::allocated).transpose()?;
    let x = leaf(device, &[N])?;
    let a = x.mul_scalar(2.0)?;
    let b = a.add_scalar(1.0)?;
    let c = b.add(&x)?;
    let y = c.exp()?;
    let dead: Vec<(&str, Weak<Storage>)> = [("mul_scalar", &a), ("add_scalar", &b), ("add", &c)]
        .into_iter()
        .map(|(n, t)| (n, Arc::downgrade(t.storage())))
        .collect();
    drop((a, b, c));
    for (op, storage) in &dead {
        assert!(
            storage.upgrade().is_none(),
            "{op}'s output is kept alive on {device}"
        );
    }
    let graph = y.graph().expect("y has history");
    assert_eq!(graph.saved_bytes(), 4 * N, "exp's output, and nothing else");
    assert_eq!(graph.live_nodes(), 5, "the leaf and four ops");
    if let (Some(meter), Some(before)) = (meter, before) {
        assert_eq!(
            meter.allocated()?,
            before + 2 * meter.block(device, 4 * N),
            "x and exp's output on {device}"
        );
    }

    let y_storage = Arc::downgrade(y.storage());
    y.sum()?.backward()?;
    assert_eq!(graph.saved_bytes(), 0, "backward released exp's output");
    assert!(y_storage.upgrade().is_some(), "the caller still holds y");
    let grad = x.grad().expect("x got a gradient");
    assert_eq!(grad.shape(), &[N]);
    if let (Some(meter), Some(before)) = (meter, before) {
        assert_eq!(
            meter.allocated()?,
            before + 3 * meter.block(device, 4 * N),
            "x, its gradient and y on {device}"
        );
    }
    drop((grad, y));
    x.set_grad(None);
    drop(x);
    assert_eq!((graph.live_nodes(), graph.saved_bytes()), (0, 0));
    if let (Some(meter), Some(before)) = (meter, before) {
        assert_eq!(meter.allocated()?, before, "everything freed on {device}");
    }
    Ok(())
}

fn leaf(device: Device, shape: &[usize]) -> Result<Tensor> {
    Tensor::randn(shape, DType::F32, device)?.with_grad()
}

fn data(device: Device, shape: &[usize]) -> Result<Tensor> {
    Tensor::randn(shape, DType::F32, device)
}

/// Values in [0.5, 1.5): safe for log, sqrt, division.
fn positive(device: Device, shape: &[usize], grad: bool) -> Result<Tensor> {
    let t = Tensor::rand(shape, DType::F32, device)?.add_scalar(0.5)?;
    if grad { t.with_grad() } else { Ok(t) }
}

type BinaryFn = fn(&Tensor, &Tensor) -> Result<Tensor>;

/// `a [6, 8] ∘ b [8]` (broadcast), with `a` and `b` requiring grad as asked.
fn binary_op(
    device: Device,
    f: BinaryFn,
    grads: (bool, bool),
    keeps: (bool, bool),
) -> Result<Forward> {
    let a = positive(device, &[6, 8], grads.0)?;
    let b = positive(device, &[8], grads.1)?;
    let y = f(&a, &b)?;
    Ok(Forward::of([y.clone()])
        .watch("a", &a, keeps.0)
        .watch("b", &b, keeps.1)
        .frees("output", &y))
}

/// add and sub keep nothing; mul keeps each operand for the other's gradient; div keeps the
/// divisor always and the dividend when the divisor needs a gradient.
pub fn binary() -> Vec<Case> {
    vec![
        ("add a", |d| {
            binary_op(d, Tensor::add, (true, false), (false, false))
        }),
        ("add b", |d| {
            binary_op(d, Tensor::add, (false, true), (false, false))
        }),
        ("add ab", |d| {
            binary_op(d, Tensor::add, (true, true), (false, false))
        }),
        ("sub a", |d| {
            binary_op(d, Tensor::sub, (true, false), (false, false))
        }),
        ("sub b", |d| {
            binary_op(d, Tensor::sub, (false, true), (false, false))
        }),
        ("sub ab", |d| {
            binary_op(d, Tensor::sub, (true, true), (false, false))
        }),
        ("mul a", |d| {
            binary_op(d, Tensor::mul, (true, false), (false, true))
        }),
        ("mul b", |d| {
            binary_op(d, Tensor::mul, (false, true), (true, false))
        }),
        ("mul ab", |d| {
            binary_op(d, Tensor::mul, (true, true), (true, true))
        }),
        ("div a", |d| {
            binary_op(d, Tensor::div, (true, false), (false, true))
        }),
        ("div b", |d| {
            binary_op(d, Tensor::div, (false, true), (true, true))
        }),
        ("div ab", |d| {
            binary_op(d, Tensor::div, (true, true), (true, true))
        }),
        ("mul x x", |d| {
            // One storage saved twice counts once.
            let x = leaf(d, &[6, 8])?;
            let y = x.mul(&x)?;
            Ok(Forward::of([y.clone()]).keeps("x", &x).frees("output", &y))
        }),
    ]
}

#[derive(Clone, Copy)]
enum Keeps {
    Nothing,
    Input,
    Output,
}

fn unary_op(device: Device, f: fn(&Tensor) -> Result<Tensor>, keeps: Keeps) -> Result<Forward> {
    let x = positive(device, &[6, 8], true)?;
    let y = f(&x)?;
    Ok(Forward::of([y.clone()])
        .watch("input", &x, matches!(keeps, Keeps::Input))
        .watch("output", &y, matches!(keeps, Keeps::Output)))
}

/// Derivatives cheapest from the output keep the output; log, abs and powf keep the input;
/// neg and the scalar affine ops keep nothing.
pub fn unary() -> Vec<Case> {
    vec![
        ("neg", |d| unary_op(d, Tensor::neg, Keeps::Nothing)),
        ("exp", |d| unary_op(d, Tensor::exp, Keeps::Output)),
        ("log", |d| unary_op(d, Tensor::log, Keeps::Input)),
        ("relu", |d| unary_op(d, Tensor::relu, Keeps::Output)),
        ("tanh", |d| unary_op(d, Tensor::tanh, Keeps::Output)),
        ("sigmoid", |d| unary_op(d, Tensor::sigmoid, Keeps::Output)),
        ("sqrt", |d| unary_op(d, Tensor::sqrt, Keeps::Output)),
        ("abs", |d| unary_op(d, Tensor::abs, Keeps::Input)),
        ("add_scalar", |d| {
            unary_op(d, |x| x.add_scalar(1.5), Keeps::Nothing)
        }),
        ("mul_scalar", |d| {
            unary_op(d, |x| x.mul_scalar(-2.0), Keeps::Nothing)
        }),
        ("powf", |d| unary_op(d, |x| x.powf(1.5), Keeps::Input)),
        ("log of a view", |d| {
            // A saved view keeps its whole storage (as in PyTorch), and counts it whole.
            let x = positive(d, &[6, 8], true)?;
            let v = x.narrow(0, 2, 3)?;
            let y = v.log()?;
            Ok(Forward::of([y.clone()]).keeps("x", &x).frees("output", &y))
        }),
    ]
}

/// Sums and means keep shapes only; max keeps one i64 index per output element.
pub fn reductions() -> Vec<Case> {
    vec![
        ("sum", |d| {
            let x = leaf(d, &[6, 8])?;
            let y = x.sum()?;
            Ok(Forward::of([y.clone()]).frees("x", &x).frees("output", &y))
        }),
        ("sum_axis", |d| {
            let x = leaf(d, &[6, 8])?;
            let y = x.sum_axis(1, false)?;
            let k = x.sum_axis(0, true)?;
            Ok(Forward::of([y.clone(), k.clone()])
                .frees("x", &x)
                .frees("output", &y)
                .frees("keepdim output", &k))
        }),
        ("mean", |d| {
            let x = leaf(d, &[6, 8])?;
            let y = x.mean()?;
            let m = x.mean_axis(0, false)?;
            Ok(Forward::of([y.clone(), m.clone()])
                .frees("x", &x)
                .frees("output", &y)
                .frees("mean_axis output", &m))
        }),
        ("max_axis", |d| {
            let x = leaf(d, &[6, 8])?;
            let y = x.max_axis(1, false)?;
            Ok(Forward::of([y.clone()])
                .frees("x", &x)
                .frees("output", &y)
                .keeps_unnamed(d, 6 * 8))
        }),
        ("max_axis keepdim", |d| {
            let x = leaf(d, &[6, 8])?;
            let y = x.max_axis(0, true)?;
            Ok(Forward::of([y.clone()])
                .frees("x", &x)
                .frees("output", &y)
                .keeps_unnamed(d, 8 * 8))
        }),
    ]
}

fn matmul_op(device: Device, a: &[usize], b: &[usize], grads: (bool, bool)) -> Result<Forward> {
    let make = |shape, grad| {
        if grad {
            leaf(device, shape)
        } else {
            data(device, shape)
        }
    };
    let (a, b) = (make(a, grads.0)?, make(b, grads.1)?);
    let y = a.matmul(&b)?;
    // da = g·bᵀ needs b; db = aᵀ·g needs a.
    Ok(Forward::of([y.clone()])
        .watch("a", &a, grads.1)
        .watch("b", &b, grads.0)
        .frees("output", &y))
}

/// matmul keeps b for a's gradient and a for b's, 2-D, batched and broadcast.
pub fn matmul() -> Vec<Case> {
    vec![
        ("matmul a", |d| {
            matmul_op(d, &[3, 4], &[4, 5], (true, false))
        }),
        ("matmul b", |d| {
            matmul_op(d, &[3, 4], &[4, 5], (false, true))
        }),
        ("matmul ab", |d| {
            matmul_op(d, &[3, 4], &[4, 5], (true, true))
        }),
        ("batched matmul ab", |d| {
            matmul_op(d, &[2, 3, 4], &[2, 4, 5], (true, true))
        }),
        ("broadcast batched matmul a", |d| {
            matmul_op(d, &[2, 3, 4], &[4, 5], (true, false))
        }),
        ("matmul of a transposed view", |d| {
            let a = leaf(d, &[3, 4])?;
            let b = data(d, &[5, 4])?;
            let y = a.matmul(&b.t()?)?;
            Ok(Forward::of([y.clone()])
                .frees("a", &a)
                .keeps("b", &b)
                .frees("output", &y))
        }),
    ]
}

/// Views, copies, concatenation and casts keep shapes (and dtypes) only.
pub fn shapes() -> Vec<Case> {
    vec![
        ("transpose", |d| {
            let x = leaf(d, &[3, 4])?;
            let y = x.transpose(0, 1)?;
            Ok(Forward::of([y.clone()]).frees("x", &x).frees("output", &y))
        }),
        ("reshape view", |d| {
            let x = leaf(d, &[3, 4])?;
            let y = x.reshape(&[2, 6])?;
            Ok(Forward::of([y.clone()]).frees("x", &x).frees("output", &y))
        }),
        ("reshape copy", |d| {
            let x = leaf(d, &[3, 4])?;
            let y = x.t()?.reshape(&[12])?;
            Ok(Forward::of([y.clone()]).frees("x", &x).frees("output", &y))
        }),
        ("narrow", |d| {
            let x = leaf(d, &[6, 4])?;
            let y = x.narrow(0, 1, 3)?;
            Ok(Forward::of([y.clone()]).frees("x", &x).frees("output", &y))
        }),
        ("chunk", |d| {
            let x = leaf(d, &[6, 4])?;
            let parts = x.chunk(3, 0)?;
            Ok(Forward::of(parts).frees("x", &x))
        }),
        ("cat", |d| {
            let (a, b, c) = (leaf(d, &[2, 4])?, data(d, &[3, 4])?, leaf(d, &[1, 4])?);
            let y = Tensor::cat(&[&a, &b, &c], 0)?;
            Ok(Forward::of([y.clone()])
                .frees("a", &a)
                .frees("b", &b)
                .frees("c", &c)
                .frees("output", &y))
        }),
        ("broadcast_to", |d| {
            let x = leaf(d, &[1, 4])?;
            let y = x.broadcast_to(&[3, 4])?;
            Ok(Forward::of([y.clone()]).frees("x", &x).frees("output", &y))
        }),
        ("contiguous", |d| {
            let x = leaf(d, &[3, 4])?;
            let y = x.t()?.contiguous()?;
            Ok(Forward::of([y.clone()]).frees("x", &x).frees("output", &y))
        }),
        ("copy", |d| {
            let x = leaf(d, &[3, 4])?;
            let y = x.copy()?;
            Ok(Forward::of([y.clone()]).frees("x", &x).frees("output", &y))
        }),
        ("to_dtype", |d| {
            let x = leaf(d, &[3, 4])?;
            let y = x.to_dtype(DType::F64)?;
            Ok(Forward::of([y.clone()]).frees("x", &x).frees("output", &y))
        }),
    ]
}

/// softmax and log_softmax keep their output; cross-entropy keeps the logits, the targets (one
/// i64 per row) and a log-sum-exp per row (one f32), never a second `[rows, classes]` tensor.
pub fn softmax_family() -> Vec<Case> {
    vec![
        ("softmax", |d| {
            let x = leaf(d, &[4, 6])?;
            let y = x.softmax(-1)?;
            Ok(Forward::of([y.clone()]).frees("x", &x).keeps("output", &y))
        }),
        ("log_softmax", |d| {
            let x = leaf(d, &[4, 6])?;
            let y = x.log_softmax(1)?;
            Ok(Forward::of([y.clone()]).frees("x", &x).keeps("output", &y))
        }),
        ("cross_entropy", |d| {
            let logits = leaf(d, &[4, 6])?;
            let targets = Tensor::from_vec(vec![0i64, 5, 2, 3], &[4])?.to(d)?;
            let loss = logits.cross_entropy(&targets)?;
            Ok(Forward::of([loss.clone()])
                .keeps("logits", &logits)
                .frees("loss", &loss)
                .keeps("targets", &targets)
                .keeps_unnamed(d, 4 * 4))
        }),
    ]
}

/// Device moves keep nothing (the source's device and dtype are all the way home needs), also
/// inside chains; a linear layer keeps its input and its activation.
pub fn moves_and_chains() -> Vec<Case> {
    vec![
        ("to cpu", |d| {
            let x = leaf(d, &[3, 4])?;
            let y = x.to(Device::Cpu)?;
            Ok(Forward::of([y.clone()]).frees("x", &x).frees("output", &y))
        }),
        ("to this device from cpu", |d| {
            let x = leaf(Device::Cpu, &[3, 4])?;
            let y = x.to(d)?;
            Ok(Forward::of([y.clone()]).frees("x", &x).frees("output", &y))
        }),
        ("to cpu with a cast", |d| {
            let x = leaf(d, &[3, 4])?;
            let (y, _) = x.to_with(Device::Cpu, MoveOptions::dtype(DType::F64))?;
            Ok(Forward::of([y.clone()]).frees("x", &x).frees("output", &y))
        }),
        ("exp, to cpu, log", |d| {
            let x = leaf(d, &[3, 4])?;
            let e = x.exp()?;
            let m = e.to(Device::Cpu)?;
            let y = m.log()?;
            Ok(Forward::of([y.clone()])
                .frees("x", &x)
                .keeps("exp output", &e)
                .keeps("moved", &m)
                .frees("output", &y))
        }),
        ("elementwise chain", |d| {
            let x = leaf(d, &[64])?;
            let (a, b) = (x.mul_scalar(2.0)?, x.add_scalar(0.5)?);
            let c = a.add(&b)?;
            let y = c.exp()?;
            Ok(Forward::of([y.clone()])
                .frees("x", &x)
                .frees("mul_scalar", &a)
                .frees("add_scalar", &b)
                .frees("add", &c)
                .keeps("exp", &y))
        }),
        ("linear, bias, relu", |d| {
            let (x, w, b) = (data(d, &[8, 16])?, leaf(d, &[16, 4])?, leaf(d, &[4])?);
            let h = x.matmul(&w)?;
            let s = h.add(&b)?;
            let y = s.relu()?;
            Ok(Forward::of([y.clone()])
                .keeps("input", &x)
                .frees("weight", &w)
                .frees("bias", &b)
                .frees("matmul", &h)
                .frees("add", &s)
                .keeps("relu", &y))
        }),
    ]
}
