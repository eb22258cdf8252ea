//! Training steps give back their graph, and `ferry::debug::GraphWatch` catches a loop that
//! keeps it (the `total = total + loss` accumulation). Each test watches its own model's graph,
//! so they run in parallel with the rest of the suite.

use ferry::debug::GraphWatch;
use ferry::nn::{self, Linear, Module, ReLU, Sequential};
use ferry::optim::{Adam, Optimizer};
use ferry_tensor::{DType, Device, Tensor};

use ferry::Graph;

/// (live nodes, saved bytes, recorded) of the graphs the parameters belong to.
fn counts(params: &[Tensor]) -> (usize, usize, u64) {
    let graphs: Vec<Graph> = params.iter().filter_map(Tensor::graph).collect();
    let s = Graph::stats_of(&graphs);
    (s.live_nodes, s.saved_bytes, s.recorded)
}

fn setup() -> (Sequential, Adam, Tensor, Tensor) {
    ferry::manual_seed(5);
    let model = Sequential::new()
        .push(Linear::new(8, 16, Device::Cpu).unwrap())
        .push(ReLU)
        .push(Linear::new(16, 4, Device::Cpu).unwrap());
    let opt = Adam::new(model.parameters(), 1e-2).unwrap();
    let x = Tensor::rand(&[10, 8], DType::F32, Device::Cpu).unwrap();
    let y = Tensor::from_slice(&[0i64, 1, 2, 3, 0, 1, 2, 3, 0, 1], &[10]).unwrap();
    (model, opt, x, y)
}

fn step(model: &Sequential, opt: &mut Adam, x: &Tensor, y: &Tensor) -> Tensor {
    opt.zero_grad();
    let loss = nn::cross_entropy(&model.forward(x).unwrap(), y).unwrap();
    loss.backward().unwrap();
    opt.step().unwrap();
    loss
}

#[test]
fn a_training_step_leaves_nothing_of_its_graph_alive() {
    let (model, mut opt, x, y) = setup();
    let params = model.parameters();
    let (live, saved, recorded) = counts(&params);
    let watch = GraphWatch::new(&params);
    let mut total = 0.0;
    for _ in 0..3 {
        total += step(&model, &mut opt, &x, &y).item().unwrap();
    }
    let (live_after, saved_after, recorded_after) = counts(&params);
    assert!(recorded_after > recorded, "the steps recorded nodes");
    assert_eq!(
        (live_after, saved_after),
        (live, saved),
        "a step outlived itself"
    );
    let delta = watch.check().expect("no leak");
    assert_eq!(delta.live_nodes, 0);
    assert_eq!(delta.recorded, recorded_after - recorded);
    assert!(total.is_finite());
}

#[test]
fn graph_watch_catches_a_running_total_without_detach() {
    let (model, mut opt, x, y) = setup();
    let params = model.parameters();
    let watch = GraphWatch::new(&params);
    let mut total = Tensor::zeros(&[], DType::F32, Device::Cpu).unwrap();
    for _ in 0..3 {
        total = total.add(&step(&model, &mut opt, &x, &y)).unwrap();
    }
    let leak = watch
        .check()
        .expect_err("the running total keeps three graphs");
    assert!(leak.delta.live_nodes > 0);
    let message = leak.to_string();
    assert!(
        message.contains("loss.detach()") && message.contains("loss.item()"),
        "{message}"
    );
    // The fix: drop the total (or accumulate detached values) and the graphs go.
    drop(total);
    watch.check().expect("dropping the total frees the graphs");
    let mut detached = Tensor::zeros(&[], DType::F32, Device::Cpu).unwrap();
    for _ in 0..3 {
        detached = detached
            .add(&step(&model, &mut opt, &x, &y).detach())
            .unwrap();
    }
    watch.check().expect("a detached total keeps nothing");
    assert!(detached.item().unwrap().is_finite());
}
