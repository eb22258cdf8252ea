use approx::assert_relative_eq;

use super::ddp::bucket_plan;
use super::*;
use crate::nn::{Linear, Module, ReLU, Sequential, cross_entropy};
use crate::optim::{Optimizer, Sgd};
use ferry_tensor::{DType, Device, Tensor};

fn values(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

#[test]
fn host_collectives_combine_every_rank() {
    let out = run_replicas(ProcessGroup::host(3), |g| {
        let r = g.rank() as f64;
        let t = Tensor::from_vec(vec![r + 1.0, 10.0 * r], &[2])?;
        let sum = t.copy()?;
        g.all_reduce(&sum, ReduceOp::Sum)?;
        let avg = t.copy()?;
        g.all_reduce(&avg, ReduceOp::Avg)?;
        let max = t.copy()?;
        g.all_reduce(&max, ReduceOp::Max)?;
        let b = t.copy()?;
        g.broadcast(&b, 2)?;
        let gathered = g.all_gather(&t)?;
        g.barrier()?;
        Ok((
            values(&sum),
            values(&avg),
            values(&max),
            values(&b),
            gathered,
        ))
    })
    .unwrap();
    for (sum, avg, max, b, gathered) in out {
        assert_eq!(sum, vec![6.0, 30.0]);
        assert_eq!(avg, vec![2.0, 10.0]);
        assert_eq!(max, vec![3.0, 20.0]);
        assert_eq!(b, vec![3.0, 20.0]);
        assert_eq!(gathered.shape(), &[3, 2]);
        assert_eq!(values(&gathered), vec![1.0, 0.0, 2.0, 10.0, 3.0, 20.0]);
    }
}

#[test]
fn a_failing_rank_releases_the_others_with_an_error() {
    let err = run_replicas(ProcessGroup::host(2), |g| {
        if g.rank() == 1 {
            return Err(ferry_tensor::TensorError::InvalidArgument {
                op: "test",
                message: "rank 1 gives up".into(),
            });
        }
        let t = Tensor::ones(&[4], DType::F32, Device::Cpu)?;
        g.all_reduce(&t, ReduceOp::Sum)?; // would wait forever without the abort
        Ok(())
    })
    .unwrap_err();
    assert!(err.to_string().contains("rank"), "{err}");
}

#[test]
fn collectives_check_their_arguments() {
    let groups = ProcessGroup::host(1);
    let g = &groups[0];
    let t = Tensor::ones(&[2, 3], DType::F32, Device::Cpu).unwrap();
    let err = g.broadcast(&t, 1).unwrap_err().to_string();
    assert!(err.contains("root 1"), "{err}");
    let err = g
        .all_reduce(&t.transpose(0, 1).unwrap(), ReduceOp::Sum)
        .unwrap_err()
        .to_string();
    assert!(err.contains("contiguous"), "{err}");
    let err = ProcessGroup::nccl(&[Device::Cpu]).unwrap_err().to_string();
    assert!(err.contains("ProcessGroup::host"), "{err}");
}

#[test]
fn buckets_run_backwards_within_the_byte_bound_and_one_dtype_each() {
    let p = |n: usize, dtype| Tensor::zeros(&[n], dtype, Device::Cpu).unwrap();
    let params = vec![
        p(100, DType::F32),
        p(100, DType::F32),
        p(50, DType::F64),
        p(300, DType::F32),
        p(10, DType::F32),
    ];
    let plan = bucket_plan(&params, 800);
    assert_eq!(
        plan,
        vec![
            (vec![4], DType::F32),
            (vec![3], DType::F32),
            (vec![2], DType::F64),
            (vec![1, 0], DType::F32),
        ]
    );
}

/// A 2-layer MLP over given weights.
fn mlp(ws: &[Tensor]) -> Sequential {
    let layer = |w: &Tensor, b: &Tensor| {
        Linear::from_tensors(w.detach().copy().unwrap(), Some(b.detach().copy().unwrap())).unwrap()
    };
    Sequential::new()
        .push(layer(&ws[0], &ws[1]))
        .push(ReLU)
        .push(layer(&ws[2], &ws[3]))
}

fn init() -> Vec<Tensor> {
    ferry_tensor::manual_seed(7);
    vec![
        Tensor::randn(&[16, 8], DType::F32, Device::Cpu).unwrap(),
        Tensor::randn(&[16], DType::F32, Device::Cpu).unwrap(),
        Tensor::randn(&[4, 16], DType::F32, Device::Cpu).unwrap(),
        Tensor::randn(&[4], DType::F32, Device::Cpu).unwrap(),
    ]
}

fn batch(step: usize) -> (Tensor, Tensor) {
    ferry_tensor::manual_seed(100 + step as u64);
    let x = Tensor::randn(&[12, 8], DType::F32, Device::Cpu).unwrap();
    let y: Vec<i64> = (0..12).map(|i| ((i * 7 + step) % 4) as i64).collect();
    (x, Tensor::from_vec(y, &[12]).unwrap())
}

#[test]
fn two_host_replicas_match_one_model_on_the_whole_batch_and_each_other() {
    const STEPS: usize = 4;
    let start = init();
    // One model, the whole batch each step.
    let reference = mlp(&start);
    let mut opt = Sgd::new(reference.parameters(), 0.1).unwrap();
    for step in 0..STEPS {
        let (x, y) = batch(step);
        reference.zero_grad();
        cross_entropy(&reference.forward(&x).unwrap(), &y)
            .unwrap()
            .backward()
            .unwrap();
        opt.step().unwrap();
    }
    let batches: Vec<_> = (0..STEPS).map(batch).collect();
    // Two replicas, half the batch each; rank 1 starts from other weights, which the
    // broadcast replaces. Small buckets, so several start during backward.
    let replicas = run_replicas(ProcessGroup::host(2), |group| {
        let rank = group.rank();
        let ws: Vec<Tensor> = if rank == 0 {
            start.clone()
        } else {
            start.iter().map(|w| w.mul_scalar(3.0).unwrap()).collect()
        };
        let model = mlp(&ws);
        let ddp = DataParallel::new(model.parameters(), group, DdpOptions { bucket_bytes: 300 })?;
        assert_eq!(ddp.buckets(), 3);
        let mut opt = Sgd::new(model.parameters(), 0.1)?;
        let mut stats = Vec::new();
        for (x, y) in &batches {
            let x = x.narrow(0, rank * 6, 6)?;
            let y = y.narrow(0, rank * 6, 6)?;
            model.zero_grad();
            cross_entropy(&model.forward(&x)?, &y)?.backward()?;
            stats.push(ddp.finish()?);
            opt.step()?;
        }
        Ok((model.parameters(), stats))
    })
    .unwrap();
    let (ours, stats) = &replicas[0];
    for s in stats {
        assert_eq!(s.buckets, 3, "{s:?}");
        assert_eq!(s.started_in_backward, 3, "{s:?}");
        assert_eq!(s.missing, 0);
    }
    for (a, b) in ours.iter().zip(&replicas[1].0) {
        assert_eq!(values(a), values(b), "replicas differ");
    }
    for (a, r) in ours.iter().zip(reference.parameters()) {
        for (x, y) in values(a).iter().zip(values(&r)) {
            assert_relative_eq!(*x, y, epsilon = 1e-5, max_relative = 1e-4);
        }
    }
}

#[test]
fn a_second_backward_before_finish_is_an_error_unless_inside_no_sync() {
    run_replicas(ProcessGroup::host(1), |group| {
        let model = mlp(&init());
        let ddp = DataParallel::new(model.parameters(), group, DdpOptions::default())?;
        let (x, y) = batch(0);
        let loss = || cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        ddp.no_sync(|| loss().backward())?;
        loss().backward()?; // the last of the accumulated passes starts the buckets
        let stats = ddp.finish()?;
        assert_eq!(stats.buckets, 1);
        let accumulated = values(&model.parameters()[3].grad().unwrap());
        // Twice one pass's gradient (one rank: the average is the sum itself).
        model.zero_grad();
        loss().backward()?;
        ddp.finish()?;
        let once = values(&model.parameters()[3].grad().unwrap());
        for (a, o) in accumulated.iter().zip(&once) {
            assert_relative_eq!(*a, 2.0 * o, epsilon = 1e-6);
        }
        loss().backward()?;
        let err = loss().backward().unwrap_err().to_string();
        assert!(err.contains("no_sync"), "{err}");
        Ok(())
    })
    .unwrap();
}
