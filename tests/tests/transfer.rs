use ferry::{DeviceMove, MoveOptions, TransferPath};
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{assert_close, randn, values};

const GPU: Device = Device::Cuda(0);

/// The other side of a move from `device`: the GPU from the host, the host from the GPU.
fn other(device: Device) -> Device {
    if device == Device::Cpu {
        GPU
    } else {
        Device::Cpu
    }
}

fn run(body: impl FnOnce() -> Result<()>) {
    ferry_tests::fresh_seed();
    if let Err(e) = body() {
        panic!("(replay with FERRY_SEED={}): {e}", ferry_tests::seed());
    }
}

/// `y = x.to(other)`, `Σ y·c`, backward: x.grad = c, on x's own device.
fn gradient_goes_home(from: Device) -> Result<()> {
    let x = randn(from, &[4, 5])?.with_grad()?;
    let c = randn(other(from), &[4, 5])?;
    let (y, report) = x.to_with(other(from), MoveOptions::default())?;
    assert_eq!(report.nodes_recorded, 1);
    assert_eq!(report.grad_bytes_copied, 0);
    assert_eq!(y.device(), other(from));
    y.mul(&c)?.sum()?.backward()?;
    let grad = x.grad().expect("the gradient reached the source");
    assert_eq!(grad.device(), from);
    assert_close(&values(&grad), &values(&c), 1e-12);
    Ok(())
}

#[test]
#[ignore = "needs a CUDA device"]
fn cpu_of_a_cuda_tensor_sends_the_gradient_back_to_cuda() {
    run(|| gradient_goes_home(GPU));
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_move_to_cuda_sends_the_gradient_back_to_the_host() {
    run(|| gradient_goes_home(Device::Cpu));
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_fused_dtype_casts_on_the_smaller_side_and_back_in_backward() {
    run(|| {
        let x = randn(GPU, &[64, 32])?.to_dtype(DType::F32)?.with_grad()?;
        let (y, report) = x.to_with(Device::Cpu, MoveOptions::dtype(DType::F16))?;
        assert_eq!(y.dtype(), DType::F16);
        assert_eq!(
            report.bytes_moved,
            64 * 32 * 2,
            "the cast ran on the GPU, before the move"
        );
        let expected = x.detach().cpu()?.to_dtype(DType::F16)?;
        assert_eq!(
            y.to_vec::<ferry::memory::f16>()?,
            expected.to_vec::<ferry::memory::f16>()?
        );
        y.to_dtype(DType::F32)?.mul_scalar(3.0)?.sum()?.backward()?;
        let grad = x.grad().unwrap();
        assert_eq!((grad.device(), grad.dtype()), (GPU, DType::F32));
        assert!(values(&grad).iter().all(|&g| g == 3.0));
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn moves_are_exact_for_every_dtype_and_layout() {
    run(|| {
        for dtype in DType::ALL {
            let host = randn(Device::Cpu, &[6, 7, 5])?
                .mul_scalar(20.0)?
                .to_dtype(dtype)?;
            let views = [host.clone(), host.transpose(0, 2)?, host.narrow(1, 2, 3)?];
            for view in views {
                let there = view.to(GPU)?;
                assert_eq!(there.device(), GPU);
                assert_eq!(there.shape(), view.shape());
                let back = there.cpu()?;
                assert_eq!(back.to_vec_f64()?, view.to_vec_f64()?, "{dtype}");
                let (late, report) = there.to_with(Device::Cpu, MoveOptions::non_blocking())?;
                assert_eq!(
                    late.to_vec_f64()?,
                    view.to_vec_f64()?,
                    "non-blocking {dtype}"
                );
                assert_eq!(report.path, TransferPath::DeviceToPinned);
            }
        }
        // Large enough to land in pinned memory.
        let big = randn(GPU, &[1024, 1024])?;
        let (host, report) = big.to_with(Device::Cpu, MoveOptions::default())?;
        assert_eq!(report.path, TransferPath::DeviceToPinned);
        assert_eq!(host.to_vec::<f64>()?, big.to_vec::<f64>()?);
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn copies_never_carry_gradients() {
    run(|| {
        let w = randn(GPU, &[8])?.with_grad()?;
        w.mul(&w)?.sum()?.backward()?;
        assert!(w.grad().is_some());
        let copy = w.detach().cpu()?;
        assert!(copy.grad().is_none() && !copy.requires_grad());
        let (moved, report) = w.to_with(Device::Cpu, MoveOptions::default())?;
        assert!(
            moved.grad().is_none(),
            "a moved leaf's copy starts without .grad"
        );
        assert_eq!(report.grad_bytes_copied, 0);
        Ok(())
    });
}

#[test]
#[ignore = "needs a CUDA device"]
fn ops_on_cuda_match_the_cpu() {
    run(|| {
        let a = randn(Device::Cpu, &[33, 17])?;
        let b = randn(Device::Cpu, &[17, 9])?;
        let f = |a: &Tensor, b: &Tensor| -> Result<Tensor> {
            let h = a.matmul(b)?.tanh()?;
            let s = h.softmax(1)?.add(&h.log_softmax(0)?)?;
            s.sum_axis(0, true)?
                .add(&h.max_axis(1, true)?.mul_scalar(0.5)?.sum()?)?
                .relu()
        };
        let on_cpu = f(&a, &b)?;
        let on_gpu = f(&a.to(GPU)?, &b.to(GPU)?)?;
        assert_close(&values(&on_gpu), &values(&on_cpu), 1e-9);
        Ok(())
    });
}
