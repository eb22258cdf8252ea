//! The graph's own cost, without tensors: threads each record a four-op chain on their own
//! leaf, run backward and drop it, on `f64` values. It measures recording, pruning and the
//! engine, and how they scale with threads (docs/architecture.md has the figures).
//!
//! `cargo run --release -p ferry-graph --example graph_scaling -- [threads...]`

use std::sync::Arc;
use std::time::Instant;

use ferry_graph::{BackwardOptions, BoxError, GradSlot, Graph, InputGrads, NodeHandle, NodeMeta};

fn scale(by: f64) -> impl Fn(&f64, &[bool]) -> Result<InputGrads<f64>, BoxError> {
    move |g: &f64, _: &[bool]| Ok(smallvec::smallvec![Some(g * by)])
}

/// Steps per second of one thread: a leaf, four ops on it, backward, drop.
fn run(steps: usize) -> f64 {
    let g = Graph::new();
    let slot = GradSlot::default();
    let leaf = g.leaf(NodeMeta::scalar("leaf"), slot.clone());
    let start = Instant::now();
    for _ in 0..steps {
        let mut node: NodeHandle<f64> = leaf.clone();
        for by in [2.0, 3.0, 0.5, 1.5] {
            node = g.record(NodeMeta::scalar("mul"), Arc::new(scale(by)), &[Some(&node)]);
        }
        node.backward(1.0, BackwardOptions::default()).unwrap();
    }
    let elapsed = start.elapsed().as_secs_f64();
    assert!(slot.lock().is_some());
    steps as f64 / elapsed
}

fn main() {
    let threads: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("thread counts"))
        .collect();
    let threads = if threads.is_empty() {
        vec![1, 2, 4, 8, 16]
    } else {
        threads
    };
    let steps = 200_000;
    run(steps / 10);
    let one = run(steps);
    println!("threads  steps/s (all threads)  per step  efficiency");
    for n in threads {
        let start = Instant::now();
        std::thread::scope(|s| {
            for _ in 0..n {
                s.spawn(|| run(steps));
            }
        });
        let rate = (n * steps) as f64 / start.elapsed().as_secs_f64();
        println!(
            "{n:>7}  {rate:>21.0}  {:>6.2} us  {:>10.2}",
            1e6 / rate * n as f64,
            rate / (n as f64 * one)
        );
    }
}
