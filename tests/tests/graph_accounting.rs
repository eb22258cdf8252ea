//! Live-node, saved-byte and recorded counts of each test's own graph. Graphs are counted
//! apart, so these tests run in parallel with everything else, with no lock.

use std::sync::{Arc, Mutex};

use ferry_tensor::gradcheck::{GradcheckOptions, gradcheck};
use ferry_tensor::{BackwardOptions, DType, Device, Graph, Tensor};

/// What `g` holds right now: (live nodes, saved bytes, nodes recorded so far).
fn counts(g: &Graph) -> (usize, usize, u64) {
    let s = g.stats();
    (s.live_nodes, s.saved_bytes, s.recorded)
}

fn graph(t: &Tensor) -> Graph {
    t.graph().expect("the tensor has history")
}

fn leaf(values: &[f64]) -> Tensor {
    Tensor::from_slice(values, &[values.len()])
        .unwrap()
        .with_grad()
        .unwrap()
}

#[test]
fn nothing_is_recorded_under_no_grad() {
    let x = leaf(&[1.0, 2.0, 3.0]);
    let g = graph(&x);
    let before = counts(&g);
    let y = {
        let _guard = ferry_tensor::no_grad();
        x.mul(&x).unwrap().exp().unwrap().sum().unwrap()
    };
    assert!(!y.requires_grad() && y.node().is_none());
    let z = ferry_tensor::with_no_grad(|| x.matmul(&x.reshape(&[3, 1]).unwrap()));
    assert!(z.is_err(), "[3] · [3, 1] is a shape error");
    let w = ferry_tensor::with_no_grad(|| x.reshape(&[1, 3]).unwrap().softmax(1).unwrap());
    assert!(!w.requires_grad());
    assert_eq!(counts(&g), before, "no_grad recorded nodes");
    // Grad mode is back on after the guard: the same op records again.
    let v = x.exp().unwrap();
    assert!(v.requires_grad());
    assert_eq!(g.recorded_total(), before.2 + 1);
}

#[test]
fn ops_on_tensors_without_grad_record_nothing() {
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
    assert!(!b.requires_grad() && b.graph().is_none());
}

#[test]
fn failed_ops_record_nothing() {
    let x = leaf(&[1.0, 2.0]);
    let g = graph(&x);
    let before = counts(&g);
    let other = leaf(&[1.0, 2.0, 3.0]);
    assert!(x.add(&other).is_err());
    assert!(x.sum_axis(3, false).is_err());
    assert!(x.narrow(0, 1, 5).is_err());
    assert_eq!(counts(&g), before);
    assert!(!g.same_graph(&graph(&other)), "a failed op joins no graphs");
}

#[test]
fn detach_records_nothing_and_lets_history_go() {
    let x = leaf(&[0.5, 1.5]);
    let g = graph(&x);
    let base = counts(&g);
    let y = x.exp().unwrap(); // exp saves its output: 16 bytes
    assert_eq!(counts(&g), (base.0 + 1, base.1 + 16, base.2 + 1));
    let d = y.detach();
    let e = d.mul(&d).unwrap().sum().unwrap();
    assert!(!d.requires_grad() && d.node().is_none() && !e.requires_grad());
    assert_eq!(
        g.recorded_total(),
        base.2 + 1,
        "detach and ops on it recorded nothing"
    );
    drop(y);
    // The exp node went; `d` still holds the data it saved, but the graph no longer does.
    assert_eq!((g.live_nodes(), g.saved_bytes()), (base.0, base.1));
    assert_eq!(g.stats().pruned, 1);
    assert_eq!(
        d.to_vec::<f64>().unwrap(),
        [0.5f64.exp(), 1.5f64.exp()],
        "detached data outlives its history"
    );
}

#[test]
fn dropping_a_chain_returns_to_baseline() {
    let (a, b) = (leaf(&[1.0, 2.0, 3.0, 4.0]), leaf(&[0.5, 0.5, 0.5, 0.5]));
    let (ga, gb) = (graph(&a), graph(&b));
    let base = Graph::stats_of(&[ga.clone(), gb.clone()]);
    // mul saves a and b (2 × 32 B), exp saves its output (32 B), sum saves nothing.
    let y = a.mul(&b).unwrap().exp().unwrap().sum().unwrap();
    assert!(ga.same_graph(&gb), "the op joined the two leaves' graphs");
    let g = ga;
    assert_eq!(
        counts(&g),
        (
            base.live_nodes + 3,
            base.saved_bytes + 96,
            base.recorded + 3
        )
    );
    y.backward_with(
        Tensor::ones(&[], DType::F64, Device::Cpu).unwrap(),
        BackwardOptions {
            retain_graph: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(g.saved_bytes(), 96, "retain_graph keeps the buffers");
    y.backward().unwrap();
    assert_eq!(g.saved_bytes(), 0, "a plain backward frees them");
    assert_eq!(g.live_nodes(), 5, "while y lives, its nodes do");
    drop(y);
    assert_eq!(counts(&g), (2, 0, 5));
    assert!(a.grad().is_some() && b.grad().is_some());
    drop((a, b));
    assert_eq!(g.live_nodes(), 0, "dropping the leaves removes their nodes");
    assert_eq!(g.stats().pruned, 5);
}

#[test]
fn an_intermediate_held_alone_keeps_only_its_history() {
    let x = leaf(&[1.0, 2.0]);
    let g = graph(&x);
    let h = x.tanh().unwrap();
    let y = h.mul_scalar(2.0).unwrap().sum().unwrap();
    assert_eq!(g.live_nodes(), 4);
    drop(y); // mul_scalar and sum go; tanh stays because h holds it
    assert_eq!(g.live_nodes(), 2);
    assert_eq!(g.saved_bytes(), 16);
    drop(h);
    assert_eq!(counts(&g).0, 1);
    assert_eq!(counts(&g).1, 0);
}

#[test]
fn reading_and_reducing_views_record_one_node_each() {
    let x = Tensor::from_slice(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])
        .unwrap()
        .with_grad()
        .unwrap();
    let t = x.t().unwrap(); // not contiguous
    let g = graph(&x);
    let before = counts(&g);
    assert_eq!(t.to_vec::<f64>().unwrap(), [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    assert!(format!("{t:?}").contains("requires_grad"));
    assert_eq!(counts(&g), before, "reading values out is not an op");
    let s = t.sum_axis(0, false).unwrap();
    let c = t.to_dtype(DType::F32).unwrap();
    let j = Tensor::cat(&[&t, &t], 0).unwrap();
    assert_eq!(
        g.recorded_total(),
        before.2 + 3,
        "kernels must not record the copies they make"
    );
    drop((s, c, j));
    assert_eq!(counts(&g).0, before.0);
}

#[test]
fn gradcheck_leaves_nothing_of_its_graph_alive() {
    let x = Tensor::randn(&[3, 2], DType::F64, Device::Cpu).unwrap();
    let seen: Arc<Mutex<Vec<Graph>>> = Arc::default();
    let mismatches = gradcheck(
        |xs| {
            seen.lock().unwrap().extend(xs[0].graph());
            xs[0].tanh()?.matmul(&xs[0].t()?)
        },
        &[x],
        GradcheckOptions::default(),
    )
    .unwrap();
    assert!(mismatches.is_empty(), "{mismatches:?}");
    let graphs = seen.lock().unwrap().clone();
    assert!(
        !graphs.is_empty(),
        "gradcheck differentiated through its leaves"
    );
    let left = Graph::stats_of(&graphs);
    assert_eq!((left.live_nodes, left.saved_bytes), (0, 0));
}

#[test]
fn set_grad_none_releases_the_gradient_buffer() {
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
