//! The graph's own cost, without tensors: threads each record a four-op chain on their own
//! leaf, run backward and drop it, on `f64` values. It measures recording, pruning and the
//! engine, and how they scale with threads (docs/architecture.md has the figures).
//!
//! `cargo run --release -p ferry-graph --example graph_scaling -- [threads...]`; with
//! `FERRY_PLAIN_LOOP=1` each thread runs plain arithmetic on data of its own instead (no
//! allocation, no sharing): the machine's own scaling, the ceiling for any library.

use std::sync::Arc;
use std::time::Instant;

use ferry_graph::{BackwardOptions, BoxError, GradSlot, Graph, InputGrads, NodeHandle, NodeMeta};

fn scale(by: f64) -> impl Fn(&f64, &[bool]) -> Result<InputGrads<f64>, BoxError> {
    move |g: &f64, _: &[bool]| Ok(smallvec::smallvec![Some(g * by)])
}

/// Steps per second of one thread of plain arithmetic: four passes over 4096 floats, about
/// what a 64x64 step's kernels do, with nothing allocated or shared.
fn plain(steps: usize) -> f64 {
    let mut data = vec![1.0f32; 4096];
    let start = Instant::now();
    for step in 0..steps {
        for pass in 0..4 {
            let k = (step + pass) as f32 * 1e-9;
            data.iter_mut().for_each(|v| *v = *v * 0.999 + k);
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    assert!(std::hint::black_box(data[7]).is_finite());
    steps as f64 / elapsed
}

/// Steps per second of one thread: a leaf, four ops on it, backward, drop.
fn run(steps: usize) -> f64 {
    if std::env::var_os("FERRY_PLAIN_LOOP").is_some() {
        return plain(steps / 10);
    }
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
