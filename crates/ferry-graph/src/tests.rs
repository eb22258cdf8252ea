//! The engine and pruning, on `f64` scalars.

use std::sync::Arc;

use crate::*;

/// A recorded scalar op: value plus node.
struct V {
    x: f64,
    node: Option<NodeHandle<f64>>,
}

/// A rule that saves `bytes` bytes and scales the gradient by `local[i]` per input.
struct Scale {
    local: Vec<f64>,
    bytes: usize,
}

impl Backward<f64> for Scale {
    fn backward(
        &self,
        _ctx: &BackwardContext<'_, f64>,
        grad: &f64,
        wanted: &[bool],
    ) -> Result<InputGrads<f64>, BoxError> {
        Ok(self
            .local
            .iter()
            .zip(wanted)
            .map(|(d, w)| w.then(|| grad * d))
            .collect())
    }

    fn saved(&self) -> SavedBuffers {
        let mut saved = SavedBuffers::new();
        if self.bytes > 0 {
            saved.push(SavedBuffer {
                key: None,
                bytes: self.bytes,
            });
        }
        saved
    }
}

fn leaf(g: &Graph, x: f64) -> (V, GradSlot<f64>) {
    let slot = GradSlot::default();
    let node = g.leaf(NodeMeta::scalar("leaf"), slot.clone());
    (
        V {
            x,
            node: Some(node),
        },
        slot,
    )
}

fn constant(x: f64) -> V {
    V { x, node: None }
}

fn mul(g: &Graph, a: &V, b: &V) -> V {
    let rule = Scale {
        local: vec![b.x, a.x], // d(ab)/da = b, d(ab)/db = a
        bytes: 16,
    };
    let node = g.record(
        NodeMeta::scalar("mul"),
        Arc::new(rule),
        &[a.node.as_ref(), b.node.as_ref()],
    );
    V {
        x: a.x * b.x,
        node: Some(node),
    }
}

fn grad(slot: &GradSlot<f64>) -> Option<f64> {
    *slot.lock()
}

fn run(v: &V) -> Result<BackwardReport, GraphError> {
    v.node
        .as_ref()
        .unwrap()
        .backward(1.0, BackwardOptions::default())
}

#[test]
fn leaf_used_twice_accumulates() {
    let g = Graph::new();
    let (x, dx) = leaf(&g, 3.0);
    let y = mul(&g, &x, &x); // d(x²)/dx = 2x
    run(&y).unwrap();
    assert_eq!(grad(&dx), Some(6.0));
}

#[test]
fn diamond_collects_every_path_before_passing_on() {
    let g = Graph::new();
    let (a, da) = leaf(&g, 2.0);
    let b = mul(&g, &a, &constant(3.0));
    let c = mul(&g, &a, &constant(5.0));
    let d = mul(&g, &b, &c); // d = 15a², dd/da = 30a
    let report = run(&d).unwrap();
    assert_eq!(grad(&da), Some(60.0));
    assert_eq!(report.visited, 4);
    assert_eq!(report.leaves_reached, 1);
}

#[test]
fn inputs_without_grad_get_no_edge_and_no_gradient() {
    let g = Graph::new();
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let seen_in_rule = Arc::clone(&seen);
    let rule = move |grad: &f64, wanted: &[bool]| -> Result<InputGrads<f64>, BoxError> {
        seen_in_rule.lock().extend_from_slice(wanted);
        Ok(wanted.iter().map(|w| w.then_some(*grad)).collect())
    };
    let (a, da) = leaf(&g, 1.0);
    let out = g.record(
        NodeMeta::scalar("add"),
        Arc::new(rule),
        &[None, a.node.as_ref()],
    );
    out.backward(2.0, BackwardOptions::default()).unwrap();
    assert_eq!(*seen.lock(), vec![false, true]);
    assert_eq!(grad(&da), Some(2.0));
}

#[test]
fn second_backward_without_retain_graph_is_an_error_that_names_the_fix() {
    let g = Graph::new();
    let (x, _) = leaf(&g, 3.0);
    let y = mul(&g, &x, &x);
    run(&y).unwrap();
    assert_eq!(g.saved_bytes(), 0, "backward frees what the graph saved");
    let err = run(&y).unwrap_err();
    assert!(matches!(err, GraphError::BuffersFreed { op: "mul" }));
    assert!(err.to_string().contains("retain_graph: true"), "{err}");
}

#[test]
fn retain_graph_allows_a_second_backward_that_accumulates() {
    let g = Graph::new();
    let (x, dx) = leaf(&g, 3.0);
    let y = mul(&g, &x, &x);
    let keep = BackwardOptions {
        retain_graph: true,
        ..Default::default()
    };
    y.node.as_ref().unwrap().backward(1.0, keep).unwrap();
    assert_eq!(g.saved_bytes(), 16);
    run(&y).unwrap();
    assert_eq!(grad(&dx), Some(12.0));
}

#[test]
fn dropping_the_last_tensor_prunes_the_chain_and_its_saved_bytes() {
    let g = Graph::new();
    let (x, _) = leaf(&g, 1.5);
    let baseline = (g.live_nodes(), g.saved_bytes());
    let mut y = mul(&g, &x, &constant(2.0));
    for _ in 0..10 {
        y = mul(&g, &y, &constant(1.1));
    }
    assert_eq!(g.live_nodes(), baseline.0 + 11);
    assert_eq!(g.saved_bytes(), baseline.1 + 11 * 16);
    drop(y);
    assert_eq!((g.live_nodes(), g.saved_bytes()), baseline);
    drop(x);
    assert_eq!(g.live_nodes(), 0);
}

#[test]
fn a_node_held_by_a_downstream_node_survives_its_tensor() {
    let g = Graph::new();
    let (x, dx) = leaf(&g, 2.0);
    let y = mul(&g, &x, &x);
    let z = mul(&g, &y, &constant(3.0));
    drop(y); // z's node still needs y's node
    assert_eq!(g.live_nodes(), 3);
    run(&z).unwrap(); // dz/dx = 6x
    assert_eq!(grad(&dx), Some(12.0));
}

#[test]
fn cloned_handles_keep_the_node_alive() {
    let g = Graph::new();
    let (x, _) = leaf(&g, 2.0);
    let y = mul(&g, &x, &x);
    let alias = y.node.clone().unwrap();
    drop(y);
    assert_eq!(g.live_nodes(), 2);
    drop(alias);
    assert_eq!(g.live_nodes(), 1);
}

#[test]
fn failing_rules_and_wrong_arity_are_errors() {
    let g = Graph::new();
    let (x, _) = leaf(&g, 2.0);
    let fails =
        |_: &f64, _: &[bool]| -> Result<InputGrads<f64>, BoxError> { Err("device lost".into()) };
    let node = g.record(
        NodeMeta::scalar("boom"),
        Arc::new(fails),
        &[x.node.as_ref()],
    );
    let err = node.backward(1.0, BackwardOptions::default()).unwrap_err();
    assert_eq!(err.to_string(), "backward of `boom` failed: device lost");

    let short =
        |_: &f64, _: &[bool]| -> Result<InputGrads<f64>, BoxError> { Ok(InputGrads::new()) };
    let node = g.record(
        NodeMeta::scalar("short"),
        Arc::new(short),
        &[x.node.as_ref()],
    );
    let err = node.backward(1.0, BackwardOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            GraphError::GradientArity {
                expected: 1,
                got: 0,
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn trace_lists_each_node_in_order_with_what_it_received_and_passed() {
    let g = Graph::new();
    let (a, _) = leaf(&g, 2.0);
    let b = mul(&g, &a, &constant(3.0));
    let options = BackwardOptions {
        trace: true,
        ..Default::default()
    };
    let report = b.node.as_ref().unwrap().backward(1.0, options).unwrap();
    let ops: Vec<_> = report.trace.iter().map(|s| s.meta.op).collect();
    assert_eq!(ops, ["mul", "leaf"]);
    assert_eq!(report.trace[0].passed, vec![(0, "3.000000".to_string())]);
    assert_eq!(report.trace[1].received, "3.000000");
}

#[test]
fn dot_snapshot() {
    let g = Graph::new();
    let (a, _) = leaf(&g, 2.0);
    let b = mul(&g, &a, &a);
    let mut meta = NodeMeta::op("to_device", &[2, 3], "f32", ferry_memory::Device::Cpu);
    meta.kind = NodeKind::Transfer {
        from: ferry_memory::Device::Cuda(0),
        to: ferry_memory::Device::Cpu,
    };
    let rule = Scale {
        local: vec![1.0],
        bytes: 0,
    };
    let moved = g.record(meta, Arc::new(rule), &[b.node.as_ref()]);
    let cut = DetachCut {
        label: "b.detach()".into(),
        node: b.node.clone().unwrap(),
    };
    let dot = dot(&[&moved], &[cut]);
    let expected = r##"digraph autograd {
  rankdir=BT;
  node [fontname="monospace", fontsize=10];
  n0 [label="to_device\n[2, 3] f32 cpu\nsaved 0 B\ncuda:0 -> cpu", shape=box, style="filled,bold", fillcolor="orange"];
  n1 [label="mul\n[] f64 cpu\nsaved 16 B", shape=box];
  n2 [label="leaf\n[] f64 cpu", shape=ellipse, style=filled, fillcolor="lightblue"];
  n0 -> n1 [color="darkorange", penwidth=2, style=bold];
  n1 -> n2 [label="0"];
  n1 -> n2 [label="1"];
  cut0 [label="b.detach()", shape=note, style=filled, fillcolor="#eeeeee"];
  cut0 -> n1 [style=dashed, color=red, arrowhead=tee, label="detach"];
}
"##;
    assert_eq!(dot, expected);
    assert_eq!(moved.to_dot().matches(" -> n").count(), 3);
}

#[test]
fn the_graph_is_usable_from_several_threads() {
    let g = Graph::new();
    let (x, dx) = leaf(&g, 1.0);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..100 {
                    let y = mul(&g, &x, &constant(2.0));
                    drop(y);
                }
            });
        }
    });
    assert_eq!(g.live_nodes(), 1);
    let y = mul(&g, &x, &constant(2.0));
    run(&y).unwrap();
    assert_eq!(grad(&dx), Some(2.0));
}

#[test]
fn independent_graphs_count_apart_and_merge_when_an_op_joins_them() {
    let (g1, g2) = (Graph::new(), Graph::new());
    let (a, _) = leaf(&g1, 2.0);
    let (b, _) = leaf(&g2, 3.0);
    let a2 = mul(&g1, &a, &constant(2.0));
    assert_eq!((g1.live_nodes(), g2.live_nodes()), (2, 1));
    assert!(!g1.same_graph(&g2));
    let joined = record(
        NodeMeta::scalar("add"),
        Arc::new(Scale {
            local: vec![1.0, 1.0],
            bytes: 8,
        }),
        &[a2.node.as_ref(), b.node.as_ref()],
    );
    assert!(g1.same_graph(&g2), "an op on both merges them");
    assert_eq!(g1.stats(), g2.stats());
    assert_eq!(g1.live_nodes(), 4);
    assert_eq!(g1.saved_bytes(), 16 + 8);
    assert_eq!(Graph::stats_of(&[g1.clone(), g2.clone()]).live_nodes, 4);
    drop(joined);
    assert_eq!((g1.live_nodes(), g1.stats().pruned), (3, 1));
}

#[test]
fn a_buffer_saved_by_two_nodes_counts_once() {
    struct Keyed(usize);
    impl Backward<f64> for Keyed {
        fn backward(
            &self,
            _: &BackwardContext<'_, f64>,
            grad: &f64,
            _: &[bool],
        ) -> Result<InputGrads<f64>, BoxError> {
            Ok(smallvec::smallvec![Some(*grad)])
        }
        fn saved(&self) -> SavedBuffers {
            smallvec::smallvec![SavedBuffer {
                key: Some(self.0),
                bytes: 400,
            }]
        }
    }
    let g = Graph::new();
    let (x, _) = leaf(&g, 1.0);
    let first = g.record(
        NodeMeta::scalar("tanh"),
        Arc::new(Keyed(7)),
        &[x.node.as_ref()],
    );
    let second = g.record(
        NodeMeta::scalar("matmul"),
        Arc::new(Keyed(7)),
        &[Some(&first)],
    );
    assert_eq!(g.saved_bytes(), 400);
    assert_eq!(
        first.saved_bytes() + second.saved_bytes(),
        800,
        "each node says what it holds"
    );
    // Of what is saved, the buffers asked about: key 7 once however often it is asked for;
    // a key nothing saves is none.
    assert_eq!(g.saved_bytes_of(&[7, 7, 9]), 400);
    assert_eq!(g.saved_bytes_of(&[9]), 0);
    drop(second);
    assert_eq!(g.saved_bytes(), 400, "the first node still holds it");
    drop(first);
    assert_eq!(g.saved_bytes(), 0);
    assert_eq!(
        g.saved_bytes_of(&[7]),
        0,
        "released with the last node saving it"
    );
}

#[test]
fn a_long_chain_frees_without_recursing() {
    let g = Graph::new();
    let (x, _) = leaf(&g, 1.0);
    let mut y = mul(&g, &x, &constant(1.0));
    for _ in 0..200_000 {
        y = mul(&g, &y, &constant(1.0));
    }
    let before = pruned_on_this_thread();
    // A thread with a small stack: a recursive drop of 200k nodes would overflow it.
    std::thread::Builder::new()
        .stack_size(64 << 10)
        .spawn(move || drop(y))
        .unwrap()
        .join()
        .unwrap();
    assert_eq!(g.live_nodes(), 1);
    assert_eq!(
        pruned_on_this_thread(),
        before,
        "the other thread did the pruning"
    );
}

#[test]
fn pruned_on_this_thread_counts_what_a_drop_freed() {
    let g = Graph::new();
    let (x, _) = leaf(&g, 1.0);
    let y = mul(&g, &mul(&g, &x, &constant(2.0)), &constant(3.0));
    let before = pruned_on_this_thread();
    drop(y);
    assert_eq!(pruned_on_this_thread() - before, 2);
}

#[test]
fn grad_returns_gradients_of_chosen_nodes_and_leaves_grad_untouched() {
    let g = Graph::new();
    let (a, da) = leaf(&g, 2.0);
    let (b, db) = leaf(&g, 5.0);
    let c = mul(&g, &a, &constant(3.0)); // c = 3a
    let d = mul(&g, &c, &b); // d = 3ab
    let (grads, report) = crate::grad(
        &[(d.node.as_ref().unwrap(), 1.0)],
        &[c.node.as_ref().unwrap(), a.node.as_ref().unwrap()],
        BackwardOptions::default(),
    )
    .unwrap();
    assert_eq!(grads, vec![Some(5.0), Some(15.0)]); // dd/dc = b, dd/da = 3b
    assert_eq!((grad_of(&da), grad_of(&db)), (None, None));
    assert_eq!(report.visited, 3, "b's leaf is not on a path to the inputs");
}

fn grad_of(slot: &GradSlot<f64>) -> Option<f64> {
    *slot.lock()
}

#[test]
fn hooks_observe_replace_retain_and_run_after_accumulation() {
    let g = Graph::new();
    let (x, dx) = leaf(&g, 2.0);
    let y = mul(&g, &x, &constant(3.0));
    let z = mul(&g, &y, &constant(4.0));
    let y_node = y.node.clone().unwrap();
    let doubled = y_node.register_hook(|g: &f64| Ok(Some(g * 2.0)));
    let retained = y_node.retain_grad();
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let seen_in_hook = Arc::clone(&seen);
    let _after = x
        .node
        .as_ref()
        .unwrap()
        .register_post_accumulate_hook(move |total: &f64| {
            seen_in_hook.lock().push(*total);
            Ok(())
        });
    let keep = BackwardOptions {
        retain_graph: true,
        trace: true,
        ..Default::default()
    };
    let report = z.node.as_ref().unwrap().backward(1.0, keep).unwrap();
    assert_eq!(
        *retained.lock(),
        Some(8.0),
        "dz/dy = 4, doubled by the hook"
    );
    assert_eq!(grad_of(&dx), Some(24.0));
    assert_eq!(report.trace[1].hooks.len(), 2, "{:?}", report.trace[1]);
    assert!(doubled.remove());
    z.node.as_ref().unwrap().backward(1.0, keep).unwrap();
    assert_eq!(grad_of(&dx), Some(36.0), "12 more without the hook");
    assert_eq!(*seen.lock(), vec![24.0, 36.0]);
    assert_eq!(*retained.lock(), Some(12.0));
}

#[test]
fn backward_frees_each_node_as_it_goes() {
    let g = Graph::new();
    let (x, _) = leaf(&g, 2.0);
    let y = mul(&g, &x, &x);
    let z = mul(&g, &y, &y);
    assert_eq!(g.saved_bytes(), 32);
    let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let (seen2, g2) = (Arc::clone(&seen), g.clone());
    // When y's gradient arrives, z has run: its saved bytes are already gone.
    let _h = y.node.as_ref().unwrap().register_hook(move |_| {
        seen2.lock().push(g2.saved_bytes());
        Ok(None)
    });
    let report = run(&z).unwrap();
    assert_eq!(*seen.lock(), vec![16]);
    assert_eq!((report.freed_bytes, g.saved_bytes()), (32, 0));
}

/// A rule that notes, in a shared log, when it is asked to prefetch and when it runs; a
/// prefetch brings `bytes` back.
struct Logged {
    name: &'static str,
    bytes: usize,
    log: Arc<parking_lot::Mutex<Vec<String>>>,
}

impl Backward<f64> for Logged {
    fn backward(
        &self,
        _ctx: &BackwardContext<'_, f64>,
        grad: &f64,
        _wanted: &[bool],
    ) -> Result<InputGrads<f64>, BoxError> {
        self.log.lock().push(format!("run {}", self.name));
        Ok(smallvec::smallvec![Some(*grad)])
    }

    fn saved(&self) -> SavedBuffers {
        smallvec::smallvec![SavedBuffer {
            key: None,
            bytes: 8,
        }]
    }

    fn prefetch(&self) -> usize {
        self.log.lock().push(format!("prefetch {}", self.name));
        self.bytes
    }
}

/// A chain of `Logged` rules, recorded in the order given: `(name, bytes a prefetch brings)`.
fn logged_chain(
    rules: &[(&'static str, usize)],
) -> (Vec<NodeHandle<f64>>, Arc<parking_lot::Mutex<Vec<String>>>) {
    let log = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let g = Graph::new();
    let (x, _slot) = leaf(&g, 1.0);
    let mut nodes = Vec::new();
    let mut prev = x.node.clone().unwrap();
    for &(name, bytes) in rules {
        let rule = Logged {
            name,
            bytes,
            log: Arc::clone(&log),
        };
        let node = g.record(NodeMeta::scalar(name), Arc::new(rule), &[Some(&prev)]);
        nodes.push(node.clone());
        prev = node;
    }
    nodes.push(x.node.unwrap());
    (nodes, log)
}

#[test]
fn backward_prefetches_two_nodes_ahead_or_a_window_of_bytes_while_a_save_is_offloaded() {
    // No other test in this binary holds an OffloadedSave, so the count is ours (one test, so
    // its cases run one after the other). Without one, backward asks nothing of the rules.
    let alike = [
        ("a", 64 << 20),
        ("b", 64 << 20),
        ("c", 64 << 20),
        ("d", 64 << 20),
    ];
    let (nodes, log) = logged_chain(&alike);
    nodes[3].backward(1.0, BackwardOptions::default()).unwrap();
    assert_eq!(*log.lock(), ["run d", "run c", "run b", "run a"]);

    let (nodes, log) = logged_chain(&alike);
    let token = OffloadedSave::new();
    assert!(OffloadedSave::live() >= 1);
    nodes[3].backward(1.0, BackwardOptions::default()).unwrap();
    drop(token);
    // Each node is asked once, before it runs: with buffers alike, two nodes before its turn.
    assert_eq!(
        *log.lock(),
        [
            "prefetch d",
            "prefetch c",
            "prefetch b",
            "run d",
            "prefetch a",
            "run c",
            "run b",
            "run a"
        ]
    );

    let mixed = [
        ("a", 1 << 20),
        ("b", 1 << 20),
        ("c", 1 << 20),
        ("d", 1 << 20),
        ("e", 64 << 20),
    ];
    let (nodes, log) = logged_chain(&mixed);
    let token = OffloadedSave::new();
    nodes[4].backward(1.0, BackwardOptions::default()).unwrap();
    drop(token);
    // After a buffer of 64 MiB, four of 1 MiB fit the window it sets: all are asked for before
    // the first node runs.
    assert_eq!(
        *log.lock(),
        [
            "prefetch e",
            "prefetch d",
            "prefetch c",
            "prefetch b",
            "prefetch a",
            "run e",
            "run d",
            "run c",
            "run b",
            "run a"
        ]
    );
}

#[test]
fn a_leaf_accumulates_as_soon_as_its_gradient_is_complete() {
    // a and b are made first, so every rule is recorded after them; b's gradient is complete
    // once v has run, while u (recorded before v) still waits.
    let g = Graph::new();
    let (a, _) = leaf(&g, 2.0);
    let (b, db) = leaf(&g, 5.0);
    let u = mul(&g, &a, &constant(3.0));
    let v = mul(&g, &b, &constant(2.0));
    let w = mul(&g, &u, &v);
    let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let (in_u, in_b) = (Arc::clone(&order), Arc::clone(&order));
    let _u = u.node.as_ref().unwrap().register_hook(move |_: &f64| {
        in_u.lock().push("u runs");
        Ok(None)
    });
    let _b = b
        .node
        .as_ref()
        .unwrap()
        .register_post_accumulate_hook(move |_: &f64| {
            in_b.lock().push("b accumulated");
            Ok(())
        });
    run(&w).unwrap();
    assert_eq!(*order.lock(), vec!["b accumulated", "u runs"]);
    assert_eq!(grad(&db), Some(12.0), "dw/db = u·2 = 6·2");
}
