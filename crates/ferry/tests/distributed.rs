//! Data parallelism on GPUs over NCCL: collectives on tensors and `DataParallel` training, on
//! one GPU (a group of one rank) and on two (skipped, with a note, on a machine with one).

use ferry::distributed::{DataParallel, DdpOptions, ProcessGroup, ReduceOp, run_replicas};
use ferry::nn::{Linear, Module, ReLU, Sequential, cross_entropy};
use ferry::optim::{Optimizer, Sgd};
use ferry::{DType, Device, DeviceMove, Tensor};

fn host(t: &Tensor) -> Vec<f32> {
    t.to(Device::Cpu).unwrap().to_vec::<f32>().unwrap()
}

fn cuda_count() -> usize {
    ferry::memory::cuda::devices().map_or(0, |d| d.len())
}

/// A 3-layer MLP on `device` over copies of `ws` (made on the host).
fn mlp(ws: &[Tensor], device: Device) -> Sequential {
    let layer = |w: &Tensor, b: &Tensor| {
        Linear::from_tensors(w.to(device).unwrap(), Some(b.to(device).unwrap())).unwrap()
    };
    Sequential::new()
        .push(layer(&ws[0], &ws[1]))
        .push(ReLU)
        .push(layer(&ws[2], &ws[3]))
        .push(ReLU)
        .push(layer(&ws[4], &ws[5]))
}

fn weights() -> Vec<Tensor> {
    ferry::tensor::manual_seed(11);
    let shapes: [&[usize]; 6] = [&[256, 64], &[256], &[256, 256], &[256], &[10, 256], &[10]];
    shapes
        .iter()
        .map(|s| {
            Tensor::randn(s, DType::F32, Device::Cpu)
                .unwrap()
                .mul_scalar(0.1)
                .unwrap()
        })
        .collect()
}

fn batches(steps: usize, rows: usize) -> Vec<(Tensor, Tensor)> {
    ferry::tensor::manual_seed(12);
    (0..steps)
        .map(|s| {
            let x = Tensor::randn(&[rows, 64], DType::F32, Device::Cpu).unwrap();
            let y: Vec<i64> = (0..rows).map(|i| ((i * 3 + s) % 10) as i64).collect();
            (x, Tensor::from_vec(y, &[rows]).unwrap())
        })
        .collect()
}

/// One model trained on whole batches on `device` (plain SGD, so the comparison tolerates only
/// rounding); its parameters after each step.
fn reference(steps: &[(Tensor, Tensor)], device: Device) -> Vec<Vec<Vec<f32>>> {
    let model = mlp(&weights(), device);
    let mut opt = Sgd::new(model.parameters(), 0.05).unwrap();
    steps
        .iter()
        .map(|(x, y)| {
            model.zero_grad();
            let logits = model.forward(&x.to(device).unwrap()).unwrap();
            cross_entropy(&logits, &y.to(device).unwrap())
                .unwrap()
                .backward()
                .unwrap();
            opt.step().unwrap();
            model.parameters().iter().map(host).collect()
        })
        .collect()
}

fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{x} vs {y}");
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn collectives_of_a_one_rank_group_on_the_gpu() {
    let groups = ProcessGroup::nccl(&[Device::Cuda(0)]).unwrap();
    let g = &groups[0];
    assert_eq!(
        (g.rank(), g.world_size(), g.device()),
        (0, 1, Device::Cuda(0))
    );
    let t = Tensor::arange(0.0, 12.0, DType::F32, Device::Cuda(0)).unwrap();
    g.all_reduce(&t, ReduceOp::Avg).unwrap();
    assert_eq!(host(&t), (0..12).map(|i| i as f32).collect::<Vec<_>>());
    // A view inside a larger storage: only its range.
    let view = t.narrow(0, 4, 4).unwrap();
    g.all_reduce(&view, ReduceOp::Sum).unwrap();
    g.broadcast(&view, 0).unwrap();
    let gathered = g.all_gather(&view).unwrap();
    assert_eq!(gathered.shape(), &[1, 4]);
    assert_eq!(host(&gathered), vec![4.0, 5.0, 6.0, 7.0]);
    g.barrier().unwrap();
    let cpu = Tensor::ones(&[2], DType::F32, Device::Cpu).unwrap();
    let err = g.all_reduce(&cpu, ReduceOp::Sum).unwrap_err().to_string();
    assert!(err.contains("cuda:0"), "{err}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn data_parallel_of_one_rank_trains_as_the_plain_model() {
    let steps = batches(3, 128);
    let expected = reference(&steps, Device::Cuda(0));
    let groups = ProcessGroup::nccl(&[Device::Cuda(0)]).unwrap();
    let got = run_replicas(groups, |group| {
        let model = mlp(&weights(), Device::Cuda(0));
        let ddp = DataParallel::new(
            model.parameters(),
            group,
            DdpOptions {
                bucket_bytes: 100 << 10,
            },
        )?;
        assert!(ddp.buckets() >= 2);
        let mut opt = Sgd::new(model.parameters(), 0.05)?;
        let mut after = Vec::new();
        for (x, y) in &steps {
            model.zero_grad();
            let logits = model.forward(&x.to(Device::Cuda(0))?)?;
            cross_entropy(&logits, &y.to(Device::Cuda(0))?)?.backward()?;
            let stats = ddp.finish()?;
            assert_eq!(stats.buckets, ddp.buckets());
            opt.step()?;
            after.push(model.parameters().iter().map(host).collect::<Vec<_>>());
        }
        Ok(after)
    })
    .unwrap();
    for (g, e) in got[0].iter().zip(&expected) {
        for (a, b) in g.iter().zip(e) {
            close(a, b, 1e-6);
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn two_gpu_replicas_stay_identical_and_match_the_whole_batch() {
    if cuda_count() < 2 {
        eprintln!("skipped: data parallelism over two GPUs needs two CUDA devices");
        return;
    }
    let steps = batches(4, 256);
    let expected = reference(&steps, Device::Cuda(0));
    let devices = [Device::Cuda(0), Device::Cuda(1)];
    let groups = ProcessGroup::nccl(&devices).unwrap();
    let got = run_replicas(groups, |group| {
        let (rank, device) = (group.rank(), group.device());
        // Rank 1 starts from other weights: the broadcast must replace them.
        let ws: Vec<Tensor> = if rank == 0 {
            weights()
        } else {
            weights()
                .iter()
                .map(|w| w.mul_scalar(-2.0).unwrap())
                .collect()
        };
        let model = mlp(&ws, device);
        let ddp = DataParallel::new(
            model.parameters(),
            group,
            DdpOptions {
                bucket_bytes: 64 << 10,
            },
        )?;
        let mut opt = Sgd::new(model.parameters(), 0.05)?;
        let mut after = Vec::new();
        for (x, y) in &steps {
            let half = x.shape()[0] / 2;
            let x = x.narrow(0, rank * half, half)?.to(device)?;
            let y = y.narrow(0, rank * half, half)?.to(device)?;
            model.zero_grad();
            cross_entropy(&model.forward(&x)?, &y)?.backward()?;
            let stats = ddp.finish()?;
            assert!(stats.started_in_backward >= 1, "{stats:?}");
            opt.step()?;
            after.push(model.parameters().iter().map(host).collect::<Vec<_>>());
        }
        Ok(after)
    })
    .unwrap();
    for (step, ((a, b), e)) in got[0].iter().zip(&got[1]).zip(&expected).enumerate() {
        for ((pa, pb), pe) in a.iter().zip(b).zip(e) {
            assert_eq!(pa, pb, "the replicas differ after step {step}");
            close(pa, pe, 1e-4);
        }
    }
}
