//! Which scope covers which thread. `no_grad()` and `inference_mode()` are thread-local
//! switches; what `inference_mode()` adds is that the tensors made inside it are inference
//! data, and no op reading inference data records, on whichever thread it runs. So:
//! - data made inside `inference_mode()`: a pool's workers record nothing on it;
//! - data made elsewhere, under `no_grad()` on the caller: workers *do* record, unless the task
//!   runs under the caller's mode, carried with `GradMode::current()` and `mode.run(..)`.

use std::thread::{self, ThreadId};

use ferry::autograd::{GradMode, inference_mode, is_grad_enabled, no_grad};
use ferry_tensor::{Device, Result, Tensor, TensorError};
use ferry_tests::{device_test, randn};
use rayon::prelude::*;

/// A pool of its own: tasks `install`ed from the test thread run on its workers, never on the
/// test thread itself.
fn pool() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("a thread pool")
}

/// Nodes recorded so far in `w`'s graph.
fn recorded(w: &Tensor) -> u64 {
    w.graph().expect("w requires grad").recorded_total()
}

/// Rows of `batch` times `w`, each on a pool worker: what each produced, where, and whether
/// that worker's own grad mode was on.
fn rows_on_workers(batch: &Tensor, w: &Tensor) -> Result<Vec<(Tensor, ThreadId, bool)>> {
    pool().install(|| {
        (0..batch.shape()[0])
            .into_par_iter()
            .map(|i| {
                let out = batch.narrow(0, i, 1)?.matmul(w)?.tanh()?;
                Ok((out, thread::current().id(), is_grad_enabled()))
            })
            .collect()
    })
}

fn inference_data_on_workers(device: Device) -> Result<()> {
    let w = randn(device, &[3, 2])?.with_grad()?;
    let before = recorded(&w);
    let caller = thread::current().id();
    {
        let _scope = inference_mode();
        let batch = randn(device, &[6, 3])?;
        assert!(batch.is_inference());
        for (out, worker, worker_records) in rows_on_workers(&batch, &w)? {
            assert_ne!(worker, caller, "the row ran on a pool worker");
            assert!(worker_records, "the worker is not in the scope itself");
            assert!(!out.requires_grad(), "a worker recorded on inference data");
            assert!(
                out.is_inference(),
                "results of inference data are inference data"
            );
        }
    }
    assert_eq!(recorded(&w), before, "nothing joined w's graph");

    // After the scope, normal tensors record again, here and on the workers.
    let batch = randn(device, &[2, 3])?;
    assert!(!batch.is_inference());
    assert!(batch.matmul(&w)?.requires_grad());
    for (out, _, _) in rows_on_workers(&batch, &w)? {
        assert!(out.requires_grad());
    }
    // One matmul here, then matmul and tanh per row (narrowing a plain batch records nothing).
    assert_eq!(recorded(&w), before + 1 + 2 * 2);
    Ok(())
}
device_test!(
    inference_data_records_nothing_on_pool_workers,
    inference_data_on_workers
);

/// `no_grad()` turns recording off on the caller only: the same op on a worker records, which
/// is why a pool task must carry the caller's mode (or work on inference data).
fn no_grad_on_workers(device: Device) -> Result<()> {
    let w = randn(device, &[3, 2])?.with_grad()?;
    let _off = no_grad();
    let batch = randn(device, &[4, 3])?;
    assert!(
        !batch.is_inference(),
        "no_grad does not make inference data"
    );
    assert!(
        !batch.matmul(&w)?.requires_grad(),
        "the caller records nothing"
    );

    let before = recorded(&w);
    let on_workers = rows_on_workers(&batch, &w)?;
    assert!(
        on_workers
            .iter()
            .all(|(out, _, records)| *records && out.requires_grad()),
        "a worker outside the no_grad scope records"
    );
    assert_eq!(recorded(&w), before + 4 * 2);

    // The caller's mode carried into each task: nothing records.
    let mode = GradMode::current();
    assert!(!mode.enabled);
    let before = recorded(&w);
    let carried: Vec<Tensor> = pool().install(|| {
        (0..4)
            .into_par_iter()
            .map(|i| mode.run(|| batch.narrow(0, i, 1)?.matmul(&w)?.tanh()))
            .collect::<Result<_>>()
    })?;
    assert!(carried.iter().all(|out| !out.requires_grad()));
    assert_eq!(recorded(&w), before);
    Ok(())
}
device_test!(
    no_grad_stays_on_its_thread_unless_carried,
    no_grad_on_workers
);

/// An inference mode carried into a task makes the worker's new tensors inference data too.
fn carried_inference(device: Device) -> Result<()> {
    let _scope = inference_mode();
    let mode = GradMode::current();
    let made: Vec<(bool, bool)> = pool().install(|| {
        (0..2)
            .into_par_iter()
            .map(|_| {
                let plain = randn(device, &[2])?;
                let carried = mode.run(|| randn(device, &[2]))?;
                Ok((plain.is_inference(), carried.is_inference()))
            })
            .collect::<Result<_>>()
    })?;
    assert_eq!(made, [(false, true), (false, true)]);
    Ok(())
}
device_test!(
    carried_inference_mode_makes_inference_data,
    carried_inference
);

/// Inference data cannot require grad, inside the scope or after it; the error names the way
/// out, `.copy()` outside the scope, and that way works.
fn with_grad_refused(device: Device) -> Result<()> {
    let kept = {
        let _scope = inference_mode();
        let t = randn(device, &[3])?;
        let err = t.with_grad().unwrap_err();
        assert!(
            matches!(
                err,
                TensorError::InvalidArgument {
                    op: "with_grad",
                    ..
                }
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains(".copy()"), "{err}");
        // Not even a copy made inside the scope.
        assert!(t.copy()?.with_grad().is_err());
        t
    };
    assert!(
        kept.is_inference(),
        "inference data stays so after the scope"
    );
    let err = kept.with_grad().unwrap_err();
    assert!(err.to_string().contains(".copy()"), "{err}");

    let w = kept.copy()?.with_grad()?;
    assert!(!w.is_inference());
    let y = w.mul(&w)?.sum()?;
    y.backward()?;
    assert_eq!(w.grad().unwrap().to_vec_f64()?, {
        let v = kept.to_vec_f64()?;
        v.iter().map(|x| 2.0 * x).collect::<Vec<_>>()
    });
    Ok(())
}
device_test!(with_grad_on_inference_data_names_copy, with_grad_refused);
