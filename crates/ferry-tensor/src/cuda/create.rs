//! Arrays made on a GPU: filled, ranges and random samples.

use ferry_memory::{DType, Device};

use super::kernels::Kernel;
use super::{Cuda, float_only, launch, with_output};
use crate::Result;
use crate::kernel::{Create, Dense};

impl Create for Cuda {
    fn full(&self, device: Device, shape: &[usize], dtype: DType, value: f64) -> Result<Dense> {
        with_output(device, "full", shape, dtype, |dev, out| {
            let n = crate::layout::numel(shape);
            let f = Kernel::Fill(dtype).load(dev)?;
            launch(dev, &f, n)
                .arg_buffer_mut(out)
                .arg_u64(n as u64)
                .arg_f64(value)
                .run()?;
            Ok(())
        })
    }

    fn arange(&self, device: Device, start: f64, len: usize, dtype: DType) -> Result<Dense> {
        with_output(device, "arange", &[len], dtype, |dev, out| {
            let f = Kernel::Arange(dtype).load(dev)?;
            launch(dev, &f, len)
                .arg_buffer_mut(out)
                .arg_u64(len as u64)
                .arg_f64(start)
                .run()?;
            Ok(())
        })
    }

    /// Uniform (or normal) samples; element i depends only on (seed, i).
    fn random(
        &self,
        device: Device,
        shape: &[usize],
        dtype: DType,
        seed: u64,
        normal: bool,
    ) -> Result<Dense> {
        let op = if normal { "randn" } else { "rand" };
        float_only(op, dtype)?;
        with_output(device, op, shape, dtype, |dev, out| {
            let n = crate::layout::numel(shape);
            let f = Kernel::Random(dtype).load(dev)?;
            launch(dev, &f, n)
                .arg_buffer_mut(out)
                .arg_u64(n as u64)
                .arg_u64(seed)
                .arg_i32(normal as i32)
                .run()?;
            Ok(())
        })
    }
}
