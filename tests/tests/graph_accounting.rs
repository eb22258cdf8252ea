//! Live-node, saved-byte and recorded counts of the process-wide graph. The counts are shared by
//! every test in this binary, so each test holds `LOCK` for its whole run.

use std::sync::{Arc, Mutex, MutexGuard};

use ferry_tensor::gradcheck::{GradcheckOptions, gradcheck};
use ferry_tensor::{BackwardOptions, DType, Device, Tensor, graph};

// Training steps give back their graph; GraphWatch catches a running total that keeps it.
mod leak_check;

static LOCK: Mutex<()> = Mutex::new(());

/// Serialises the tests; a failed test's poison must not fail the others.
fn serial() -> MutexGuard<'static, ()> {
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What the graph holds right now: (live nodes, saved bytes, nodes recorded so far).
fn counts() -> (usize, usize, u64) {
    let g = graph();
    (g.live_nodes(), g.saved_bytes(), g.recorded_total())
}

fn leaf(values: &[f64]) -> Tensor {
    Tensor::from_slice(values, &[values.len()])
        .unwrap()
        .with_grad()
        .unwrap()
}

#[test]
fn nothing_is_recorded_under_no_grad() {
    let _serial = serial();
    let x = leaf(&[1.0, 2.0, 3.0]);
    let before = counts();
    let y = {
        let _guard = ferry_tensor::no_grad();
        x.mul(&x).unwrap().exp().unwrap().sum().unwrap()
    };
    assert!(!y.requires_grad() && y.node().is_none());
    let z = ferry_tensor::with_no_grad(|| x.matmul(&x.reshape(&[3, 1]).unwrap()));
    assert!(z.is_err(), "[3] · [3, 1] is a shape error");
    let w = ferry_tensor::with_no_grad(|| x.reshape(&[1, 3]).unwrap().softmax(1).unwrap());
    assert!(!w.requires_grad());
    assert_eq!(counts(), before, "no_grad recorded nodes");
    // Grad mode is back on after the guard: the same op records again.
    let v = x.exp().unwrap();
    assert!(v.requires_grad());
    assert_eq!(graph().recorded_total(), before.2 + 1);
}

#[test]
fn ops_on_tensors_without_grad_record_nothing() {
    let _serial = serial();
    let before = counts();
    let a = Tensor::randn(&[3, 4], DType::F64, Device::Cpu).unwrap();
    let b = a
        .t()
        .unwrap()
        .matmul(&a)
        .unwrap()
        .softmax(1)
        .unwrap()
        .sum()
        .unwrap();
    assert!(!b.requires_grad());
    assert_eq!(counts(), before);
}

#[test]
fn failed_ops_record_nothing() {
    let _serial = serial();
    let x = leaf(&[1.0, 2.0]);
    let before = counts();
    assert!(x.add(&leaf(&[1.0, 2.0, 3.0])).is_err());
    assert!(x.sum_axis(3, false).is_err());
    assert!(x.narrow(0, 1, 5).is_err());
    // The failed add's operand was itself a fresh leaf (recorded, then dropped).
    let (live, saved, recorded) = counts();
    assert_eq!((live, saved), (before.0, before.1));
    assert_eq!(recorded, before.2 + 1, "only the extra leaf was recorded");
}

#[test]
fn detach_records_nothing_and_lets_history_go() {
    let _serial = serial();
    let x = leaf(&[0.5, 1.5]);
    let base = counts();
    let y = x.exp().unwrap(); // exp saves its output: 16 bytes
    assert_eq!(counts(), (base.0 + 1, base.1 + 16, base.2 + 1));
    let d = y.detach();
    let e = d.mul(&d).unwrap().sum().unwrap();
    assert!(!d.requires_grad() && d.node().is_none() && !e.requires_grad());
    assert_eq!(
        graph().recorded_total(),
        base.2 + 1,
        "detach and ops on it recorded nothing"
    );
    drop(y);
    assert_eq!(
        (graph().live_nodes(), graph().saved_bytes()),
        (base.0, base.1),
        "the exp node was pruned"
    );
    assert_eq!(
        d.to_vec::<f64>().unwrap(),
        [0.5f64.exp(), 1.5f64.exp()],
        "detached data outlives its history"
    );
}

#[test]
fn dropping_a_chain_returns_to_baseline() {
    let _serial = serial();
    let (a, b) = (leaf(&[1.0, 2.0, 3.0, 4.0]), leaf(&[0.5, 0.5, 0.5, 0.5]));
    let base = counts();
    // mul saves a and b (2 × 32 B), exp saves its output (32 B), sum saves nothing.
    let y = a.mul(&b).unwrap().exp().unwrap().sum().unwrap();
    assert_eq!(counts(), (base.0 + 3, base.1 + 96, base.2 + 3));
    y.backward_with(
        Tensor::ones(&[], DType::F64, Device::Cpu).unwrap(),
        BackwardOptions {
            retain_graph: true,
            trace: false,
        },
    )
    .unwrap();
    assert_eq!(
        graph().saved_bytes(),
        base.1 + 96,
        "retain_graph keeps the buffers"
    );
    y.backward().unwrap();
    assert_eq!(graph().saved_bytes(), base.1, "a plain backward frees them");
    assert_eq!(
        graph().live_nodes(),
        base.0 + 3,
        "while y lives, its nodes do"
    );
    drop(y);
    assert_eq!(counts(), (base.0, base.1, base.2 + 3));
    assert!(a.grad().is_some() && b.grad().is_some());
    drop((a, b));
    assert_eq!(
        graph().live_nodes(),
        base.0 - 2,
        "dropping the leaves removes their nodes"
    );
}

#[test]
fn an_intermediate_held_alone_keeps_only_its_history() {
    let _serial = serial();
    let x = leaf(&[1.0, 2.0]);
    let base = counts();
    let h = x.tanh().unwrap();
    let y = h.mul_scalar(2.0).unwrap().sum().unwrap();
    assert_eq!(graph().live_nodes(), base.0 + 3);
    drop(y); // mul_scalar and sum go; tanh stays because h holds it
    assert_eq!(graph().live_nodes(), base.0 + 1);
    assert_eq!(graph().saved_bytes(), base.1 + 16);
    drop(h);
    assert_eq!(counts().0, base.0);
    assert_eq!(counts().1, base.1);
}

#[test]
fn reading_and_reducing_views_record_one_node_each() {
    let _serial = serial();
    let x = Tensor::from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])
        .unwrap()
        .with_grad()
        .unwrap();
    let t = x.t().unwrap(); // not contiguous
    let before = counts();
    assert_eq!(t.to_vec::<f64>().unwrap(), [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    assert!(format!("{t:?}").contains("requires_grad"));
    assert_eq!(counts(), before, "reading values out is not an op");
    let s = t.sum_axis(0, false).unwrap();
    let c = t.to_dtype(DType::F32).unwrap();
    let j = Tensor::cat(&[&t, &t], 0).unwrap();
    assert_eq!(
        graph().recorded_total(),
        before.2 + 3,
        "kernels must not record the copies they make"
    );
    drop((s, c, j));
    assert_eq!(counts().0, before.0);
}

#[test]
fn gradcheck_leaves_the_graph_as_it_found_it() {
    let _serial = serial();
    let before = counts();
    let x = Tensor::randn(&[3, 2], DType::F64, Device::Cpu).unwrap();
    let mismatches = gradcheck(
        |xs| xs[0].tanh()?.matmul(&xs[0].t()?),
        &[x],
        GradcheckOptions::default(),
    )
    .unwrap();
    assert!(mismatches.is_empty(), "{mismatches:?}");
    let after = counts();
    assert_eq!((after.0, after.1), (before.0, before.1));
}

#[test]
fn set_grad_none_releases_the_gradient_buffer() {
    let _serial = serial();
    let x = leaf(&[1.0, 2.0]);
    x.exp().unwrap().sum().unwrap().backward().unwrap();
    let buffer = Arc::downgrade(x.grad().unwrap().storage());
    assert!(buffer.upgrade().is_some());
    x.set_grad(None);
    assert!(x.grad().is_none());
    assert!(
        buffer.upgrade().is_none(),
        "the gradient's storage is freed"
    );
}
