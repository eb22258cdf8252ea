//! Threads training their own models at once each read exact counts of their own graph: live
//! nodes, saved bytes, recorded and pruned nodes, `TransferReport::nodes_pruned` and
//! `GraphWatch` deltas describe the caller's graph whatever the other threads do. No lock
//! serialises these tests; they run in parallel with each other and with the rest of the suite.

use std::sync::Barrier;

use ferry::debug::GraphWatch;
use ferry::{DeviceMove, Graph, GraphStats};
use ferry_graph::pruned_on_this_thread;
use ferry_tensor::{Conv2dOptions, DType, Device, Result, Tensor};
use ferry_tests::{device_test, randn};

const THREADS: usize = 8;
const STEPS: usize = 40;

/// Runs `body(thread index)` on `THREADS` threads started together; fails with the first error.
fn on_threads(body: impl Fn(usize) -> Result<()> + Sync) -> Result<()> {
    let start = Barrier::new(THREADS);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|i| {
                let (body, start) = (&body, &start);
                // The only wait is before any assertion, so a failing thread cannot strand the
                // others.
                scope.spawn(move || {
                    start.wait();
                    body(i)
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().expect("a thread panicked"))
    })
}

fn stats(params: &[&Tensor]) -> GraphStats {
    let graphs: Vec<Graph> = params.iter().filter_map(|t| t.graph()).collect();
    Graph::stats_of(&graphs)
}

/// A two-layer model of one thread: x [8, 16] (data), w1 [16, 32], b1 [32], w2 [32, 4].
struct Model {
    x: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
}

/// Ops of one forward: matmul, add, relu, matmul, powf, sum, mul_scalar (mean's two).
const OPS: usize = 7;
/// Saved by one forward: x by the first matmul (512 B), relu's output (1024 B, saved again by
/// the second matmul and counted once), w2 by the second matmul (512 B), powf's input (128 B).
const SAVED: usize = 512 + 1024 + 512 + 128;

impl Model {
    fn new(device: Device) -> Result<Self> {
        let leaf = |shape: &[usize]| Tensor::randn(shape, DType::F32, device)?.with_grad();
        Ok(Self {
            x: Tensor::randn(&[8, 16], DType::F32, device)?,
            w1: leaf(&[16, 32])?,
            b1: leaf(&[32])?,
            w2: leaf(&[32, 4])?,
        })
    }

    fn params(&self) -> [&Tensor; 3] {
        [&self.w1, &self.b1, &self.w2]
    }

    fn loss(&self) -> Result<Tensor> {
        self.x
            .matmul(&self.w1)?
            .add(&self.b1)?
            .relu()?
            .matmul(&self.w2)?
            .powf(2.0)?
            .mean()
    }
}

fn one_model_per_thread(device: Device) -> Result<()> {
    on_threads(|thread| {
        let model = Model::new(device)?;
        let params = model.params();
        let start = stats(&params);
        assert_eq!((start.live_nodes, start.saved_bytes), (3, 0));
        for step in 0..STEPS {
            let at = format!("thread {thread}, step {step}");
            let before = stats(&params);
            let watch = GraphWatch::new(params);
            let loss = model.loss()?;
            let during = stats(&params);
            assert_eq!(during.live_nodes, before.live_nodes + OPS, "{at}");
            assert_eq!(during.saved_bytes, SAVED, "{at}");
            assert_eq!(during.recorded, before.recorded + OPS as u64, "{at}");
            assert_eq!(during.pruned, before.pruned, "{at}");
            let delta = watch.delta();
            assert_eq!(
                (delta.live_nodes, delta.saved_bytes, delta.recorded),
                (OPS as isize, SAVED as isize, OPS as u64),
                "{at}"
            );
            assert!(
                watch.check().is_err(),
                "{at}: the loss holds the step's graph"
            );

            loss.backward()?;
            assert_eq!(
                stats(&params).saved_bytes,
                0,
                "{at}: backward freed as it went"
            );
            let pruned_here = pruned_on_this_thread();
            drop(loss);
            assert_eq!(
                pruned_on_this_thread() - pruned_here,
                OPS as u64,
                "{at}: dropping the loss pruned exactly its graph"
            );
            let after = stats(&params);
            assert_eq!(
                (
                    after.live_nodes,
                    after.saved_bytes,
                    after.recorded,
                    after.pruned
                ),
                (
                    3,
                    0,
                    before.recorded + OPS as u64,
                    before.pruned + OPS as u64
                ),
                "{at}"
            );
            let delta = watch.check().expect("nothing of the step is alive");
            assert_eq!((delta.live_nodes, delta.recorded), (0, OPS as u64), "{at}");
            for p in params {
                assert!(p.grad().is_some(), "{at}");
                p.set_grad(None);
            }
        }
        let end = stats(&params);
        assert!(
            model
                .w1
                .graph()
                .unwrap()
                .same_graph(&model.w2.graph().unwrap())
        );
        assert_eq!(end.recorded, 3 + (STEPS * OPS) as u64);
        assert_eq!(end.pruned, (STEPS * OPS) as u64);
        Ok(())
    })
}
device_test!(
    each_thread_counts_its_own_graph_exactly,
    one_model_per_thread
);

/// Threads calling the device's libraries at once (products through cuBLAS, the fused linear
/// through cuBLASLt, convolutions through cuDNN where it loads, each on a handle of the device's
/// pool) get what one thread alone gets, step after step, forward and backward.
fn library_calls_from_many_threads(device: Device) -> Result<()> {
    let f32s = |shape: &[usize]| randn(device, shape)?.to_dtype(DType::F32);
    let (x, w, b) = (f32s(&[48, 96])?, f32s(&[80, 96])?, f32s(&[80])?);
    let (img, filt) = (f32s(&[2, 3, 12, 12])?, f32s(&[4, 3, 3, 3])?);
    let step = || -> Result<Vec<Vec<f32>>> {
        let (x, w, img) = (x.with_grad()?, w.with_grad()?, img.with_grad()?);
        let product = x.matmul(&w.t()?)?;
        let fused = x.linear_relu(&w, Some(&b))?;
        let conv = img.conv2d(&filt, None, Conv2dOptions::default().padding(1))?;
        product
            .sum()?
            .add(&fused.sum()?)?
            .add(&conv.sum()?)?
            .backward()?;
        [
            product,
            fused,
            conv,
            x.grad().unwrap(),
            w.grad().unwrap(),
            img.grad().unwrap(),
        ]
        .iter()
        .map(|t| t.to_vec::<f32>())
        .collect()
    };
    let alone = step()?;
    on_threads(|thread| {
        for round in 0..STEPS {
            let got = step()?;
            for (i, (a, e)) in got.iter().zip(&alone).enumerate() {
                let worst = a
                    .iter()
                    .zip(e)
                    .map(|(a, e)| (a - e).abs() / e.abs().max(1.0))
                    .fold(0.0f32, f32::max);
                assert!(
                    worst <= 1e-5,
                    "thread {thread}, round {round}, result {i}: off by {worst} from one thread's"
                );
            }
        }
        Ok(())
    })
}
device_test!(
    threads_calling_the_libraries_at_once_get_one_threads_results,
    library_calls_from_many_threads
);

fn transfer_reports(device: Device) -> Result<()> {
    on_threads(|thread| {
        let x = Tensor::randn(&[4, 8], DType::F32, device)?.with_grad()?;
        let g = x.graph().unwrap();
        for step in 0..STEPS {
            let at = format!("thread {thread}, step {step}");
            // relu, exp, tanh: three nodes only `h` holds.
            let h = x.relu()?.exp()?.tanh()?;
            assert_eq!(g.live_nodes(), 4, "{at}");
            let (y, report) = h.detach_into(Device::Cpu)?;
            assert_eq!(
                (report.nodes_recorded, report.nodes_pruned),
                (0, 3),
                "{at}: detach_into pruned the three nodes, none of another thread's"
            );
            assert!(!y.requires_grad());
            assert_eq!((g.live_nodes(), g.saved_bytes()), (1, 0), "{at}");

            // A move by value records its node on top of the history, which stays.
            let h = x.exp()?.sigmoid()?;
            let (z, report) = h.into_device(Device::Cpu)?;
            assert_eq!(
                (report.nodes_recorded, report.nodes_pruned),
                (1, 0),
                "{at}: into_device pruned nothing"
            );
            assert_eq!(g.live_nodes(), 4, "{at}");
            let pruned = pruned_on_this_thread();
            drop(z);
            assert_eq!(pruned_on_this_thread() - pruned, 3, "{at}");
            assert_eq!(g.live_nodes(), 1, "{at}");
        }
        assert_eq!(g.pruned_total(), (STEPS * 6) as u64);
        Ok(())
    })
}
device_test!(
    transfer_reports_count_only_what_the_call_pruned,
    transfer_reports
);

/// Half the threads leak (a running total that keeps each step's graph); the other half's
/// watches stay clean, and each leaky thread's watch reports exactly its own leak.
#[test]
fn a_graph_watch_sees_only_its_own_model() {
    on_threads(|thread| {
        let w = Tensor::randn(&[4, 1], DType::F32, Device::Cpu)?.with_grad()?;
        let x = Tensor::rand(&[8, 4], DType::F32, Device::Cpu)?;
        let watch = GraphWatch::new([&w]);
        let leaky = thread % 2 == 0;
        let mut total = Tensor::zeros(&[], DType::F32, Device::Cpu)?;
        for step in 1..=STEPS {
            // matmul (saves x, 128 B), powf (saves the product, 32 B), sum, mul_scalar.
            let loss = x.matmul(&w)?.powf(2.0)?.mean()?;
            loss.backward()?;
            if leaky {
                total = total.add(&loss)?; // keeps this step's graph: one more node
            } else {
                total = total.add(&loss.detach())?;
            }
            drop(loss);
            let delta = watch.delta();
            if leaky {
                // Backward freed the buffers; the nodes stay (matmul, powf, sum, mul_scalar,
                // and total's add per step).
                assert_eq!(
                    (delta.live_nodes, delta.saved_bytes, delta.recorded),
                    (5 * step as isize, 0, 5 * step as u64),
                    "leaky thread {thread}, step {step}"
                );
                assert!(watch.check().is_err());
            } else {
                let delta = watch.check().expect("a clean thread sees no leak");
                assert_eq!(
                    (delta.live_nodes, delta.recorded),
                    (0, 4 * step as u64),
                    "clean thread {thread}, step {step}"
                );
            }
        }
        drop(total);
        watch.check().expect("the total took its graphs along");
        Ok(())
    })
    .unwrap();
}

/// Two threads record on one shared leaf, so their work is one graph whose pieces merge while
/// both run; after they finish, the merged counts add up exactly.
#[test]
fn threads_sharing_a_leaf_see_one_merged_graph() {
    const SHARING: usize = 2;
    const ROUNDS: usize = 200;
    let w = Tensor::randn(&[4], DType::F32, Device::Cpu)
        .unwrap()
        .with_grad()
        .unwrap();
    let start = Barrier::new(SHARING);
    let kept: Vec<Tensor> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..SHARING)
            .map(|_| {
                let (w, start) = (&w, &start);
                scope.spawn(move || -> Result<Tensor> {
                    start.wait();
                    let mut last = None;
                    for _ in 0..ROUNDS {
                        // A new leaf (its own graph) joins w's graph through mul: 3 nodes.
                        let v = Tensor::randn(&[4], DType::F32, Device::Cpu)?.with_grad()?;
                        let y = v.mul(w)?.exp()?;
                        assert!(y.graph().unwrap().same_graph(&w.graph().unwrap()));
                        assert!(v.graph().unwrap().same_graph(&w.graph().unwrap()));
                        last = Some(y);
                    }
                    Ok(last.expect("at least one round"))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a thread panicked").unwrap())
            .collect()
    });
    let g = w.graph().unwrap();
    let per_round = 3;
    let recorded = (1 + SHARING * ROUNDS * per_round) as u64;
    // Alive: w, and per thread its last v, mul and exp. Saved: w once (both threads' muls
    // save it), and per thread its v (by mul) and exp's output, 16 B each.
    let live = 1 + SHARING * per_round;
    assert_eq!(
        g.stats(),
        GraphStats {
            live_nodes: live,
            saved_bytes: 16 + SHARING * 32,
            recorded,
            pruned: recorded - live as u64,
        }
    );
    for y in &kept {
        assert!(y.graph().unwrap().same_graph(&g));
    }
    // One backward through both threads' results reaches the shared leaf once per thread.
    kept[0]
        .add(&kept[1])
        .unwrap()
        .sum()
        .unwrap()
        .backward()
        .unwrap();
    assert_eq!(w.grad().unwrap().shape(), &[4]);
    drop(kept);
    assert_eq!((g.live_nodes(), g.saved_bytes()), (1, 0));
    assert_eq!(g.stats().recorded, recorded + 2, "add and sum");
}
