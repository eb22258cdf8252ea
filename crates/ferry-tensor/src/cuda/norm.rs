//! Layer normalization and RMSNorm on a GPU (kernels/norm.cu): one fused forward kernel each,
//! and for the backward one fused kernel for dx plus a two-step column reduction for the weight
//! (and bias) gradients (partial sums over chunks of rows, then their sum: deterministic, no
//! atomics).

use ferry_cuda::{CudaFunction, Kernels, Launch, exact_grid, grid_stride_blocks};
use ferry_memory::DType;
use ferry_memory::cuda::{CudaDevice, DeviceBuffer};

use super::kernels::NORM;
use super::{Cuda, MAX_ROW_BLOCKS, alloc, buffer, dense, device_of, float_only, launch, wrap};
use crate::Result;
use crate::kernel::{Dense, Norm, Operand, View};
use crate::op::stats_dtype;

/// Threads per row block: a power of two from 32 (the block sum goes warp by warp) to 256,
/// about one per column for short rows.
/// Clamped before rounding: the next power of two of a count near `usize::MAX` overflows.
fn row_threads(cols: usize) -> u32 {
    cols.clamp(32, 256).next_power_of_two() as u32
}
/// Columns and row-threads per block of the parameter-gradient kernel (NORM_COLS, NORM_ROWS).
const PARAM_COLS: u32 = 32;
const PARAM_ROWS: u32 = 8;

fn function(dev: &CudaDevice, name: &'static str) -> Result<CudaFunction> {
    Ok(dev.function(&NORM, name)?)
}

/// `$prefix` followed by the C name of a float dtype.
macro_rules! float_name {
    ($prefix:literal, $dtype:expr) => {
        match $dtype {
            DType::F64 => concat!($prefix, "double"),
            DType::F16 => concat!($prefix, "f16"),
            DType::BF16 => concat!($prefix, "bf16"),
            _ => concat!($prefix, "float"),
        }
    };
}

fn forward_kernel(d: DType) -> &'static str {
    float_name!("layer_norm_", d)
}
fn backward_kernel(d: DType) -> &'static str {
    float_name!("layer_norm_backward_", d)
}
fn params_kernel(d: DType) -> &'static str {
    float_name!("layer_norm_params_", d)
}
fn finish_kernel(d: DType) -> &'static str {
    float_name!("layer_norm_params_finish_", d)
}
fn rms_forward_kernel(d: DType) -> &'static str {
    float_name!("rms_norm_", d)
}
fn rms_backward_kernel(d: DType) -> &'static str {
    float_name!("rms_norm_backward_", d)
}
fn rms_params_kernel(d: DType) -> &'static str {
    float_name!("rms_norm_params_", d)
}
fn rms_finish_kernel(d: DType) -> &'static str {
    float_name!("rms_norm_params_finish_", d)
}

/// Runs a dx kernel `name` (one block per row, reading g, x, the weight if any and the
/// statistics) over `[rows, cols]`: the input's gradient.
fn dx_pass(
    dev: &CudaDevice,
    op: &'static str,
    name: &'static str,
    [g, x, stats]: [&DeviceBuffer; 3],
    w: Option<&DeviceBuffer>,
    dtype: DType,
    (rows, cols): (usize, usize),
) -> Result<Dense> {
    let mut dx = alloc(dev, op, &[rows, cols], dtype)?;
    if rows > 0 {
        let f = function(dev, name)?;
        let l = row_launch(dev, &f, rows, cols).arg_buffer(g).arg_buffer(x);
        opt(l, w)
            .arg_buffer(stats)
            .arg_buffer_mut(&mut dx)
            .arg_u64(rows as u64)
            .arg_u64(cols as u64)
            .run()?;
    }
    Ok(wrap(dev, dx, dtype, &[rows, cols]))
}

/// Runs a parameter-gradient kernel `name` (reading g, x and the statistics) over `[rows, cols]`
/// in chunks of at least 64 rows, at most 1024 chunks (enough blocks to fill the GPU, few partial
/// rows to sum afterwards): the `[chunks, sums, cols]` partial column sums (in `acc`) and the
/// number of chunks.
fn column_partials(
    dev: &CudaDevice,
    op: &'static str,
    name: &'static str,
    [g, x, stats]: [&DeviceBuffer; 3],
    (rows, cols): (usize, usize),
    (sums, acc): (usize, DType),
) -> Result<(DeviceBuffer, usize)> {
    let rows_per_chunk = rows.div_ceil(1024).max(64);
    let chunks = rows.div_ceil(rows_per_chunk);
    let mut partial = alloc(dev, op, &[chunks.max(1), sums, cols], acc)?;
    if chunks > 0 {
        let f = function(dev, name)?;
        // One block per 32 columns (the kernel has no grid-stride loop); chunks are at most 1024.
        let col_blocks = exact_grid(op, cols.div_ceil(PARAM_COLS as usize))?;
        dev.launch(
            &f,
            (col_blocks, chunks as u32, 1),
            (PARAM_COLS, PARAM_ROWS, 1),
            0,
            dev.default_stream(),
        )
        .arg_buffer(g)
        .arg_buffer(x)
        .arg_buffer(stats)
        .arg_buffer_mut(&mut partial)
        .arg_u64(rows as u64)
        .arg_u64(cols as u64)
        .arg_u64(rows_per_chunk as u64)
        .run()?;
    }
    Ok((partial, chunks))
}

/// Launches a row kernel (`kernels/norm.cu`: one block per row, grid-stride over rows).
fn row_launch<'a>(
    dev: &'a CudaDevice,
    f: &'a CudaFunction,
    rows: usize,
    cols: usize,
) -> Launch<'a> {
    let blocks = grid_stride_blocks(rows, MAX_ROW_BLOCKS);
    dev.launch(
        f,
        (blocks, 1, 1),
        (row_threads(cols), 1, 1),
        0,
        dev.default_stream(),
    )
}

/// A buffer argument, or a null pointer for an absent tensor.
fn opt<'a>(l: Launch<'a>, b: Option<&'a DeviceBuffer>) -> Launch<'a> {
    match b {
        Some(b) => l.arg_buffer(b),
        None => l.arg_u64(0),
    }
}

fn opt_mut<'a>(l: Launch<'a>, b: Option<&'a mut DeviceBuffer>) -> Launch<'a> {
    match b {
        Some(b) => l.arg_buffer_mut(b),
        None => l.arg_u64(0),
    }
}

impl Norm for Cuda {
    /// `y` and the `[rows, 2]` statistics (mean, rstd) of `x` (`[rows, cols]`).
    fn layer_norm(
        &self,
        x: &Operand<'_>,
        w: Option<&Operand<'_>>,
        b: Option<&Operand<'_>>,
        eps: f64,
    ) -> Result<(Dense, Dense)> {
        const OP: &str = "layer_norm";
        float_only(OP, x.dtype())?;
        let x = dense(x)?;
        let (w, b) = (w.map(dense).transpose()?, b.map(dense).transpose()?);
        let dev = device_of(&x)?;
        let (rows, cols) = (x.shape()[0], x.shape()[1]);
        let sd = stats_dtype(x.dtype());
        let mut y = alloc(&dev, OP, x.shape(), x.dtype())?;
        let mut stats = alloc(&dev, OP, &[rows, 2], sd)?;
        if rows > 0 {
            let f = function(&dev, forward_kernel(x.dtype()))?;
            let src = buffer(&x)?;
            let wb = w.as_ref().map(buffer).transpose()?;
            let bb = b.as_ref().map(buffer).transpose()?;
            let l = row_launch(&dev, &f, rows, cols).arg_buffer(&src);
            opt(opt(l, wb.as_deref()), bb.as_deref())
                .arg_buffer_mut(&mut y)
                .arg_buffer_mut(&mut stats)
                .arg_u64(rows as u64)
                .arg_u64(cols as u64)
                .arg_f64(eps)
                .run()?;
        }
        Ok((
            wrap(&dev, y, x.dtype(), x.shape()),
            wrap(&dev, stats, sd, &[rows, 2]),
        ))
    }

    /// `dx`, `dweight`, `dbias` (each only when `want` says so).
    fn layer_norm_backward(
        &self,
        g: &Operand<'_>,
        x: &Operand<'_>,
        w: Option<&Operand<'_>>,
        stats: &Operand<'_>,
        want: [bool; 3],
    ) -> Result<(Option<Dense>, Option<Dense>, Option<Dense>)> {
        const OP: &str = "layer_norm backward";
        float_only(OP, x.dtype())?;
        let (g, x, stats) = (dense(g)?, dense(x)?, dense(stats)?);
        let w = w.map(dense).transpose()?;
        let dev = device_of(&x)?;
        let dtype = x.dtype();
        let (rows, cols) = (x.shape()[0], x.shape()[1]);
        let (gb, xb, sb) = (buffer(&g)?, buffer(&x)?, buffer(&stats)?);
        let dx = if want[0] {
            let wb = w.as_ref().map(buffer).transpose()?;
            let bufs = [&*gb, &*xb, &*sb];
            Some(dx_pass(
                &dev,
                OP,
                backward_kernel(dtype),
                bufs,
                wb.as_deref(),
                dtype,
                (rows, cols),
            )?)
        } else {
            None
        };
        if !(want[1] || want[2]) {
            return Ok((dx, None, None));
        }
        // Per chunk of rows, the column sums of g x̂ and of g.
        let (partial, chunks) = column_partials(
            &dev,
            OP,
            params_kernel(dtype),
            [&*gb, &*xb, &*sb],
            (rows, cols),
            (2, stats_dtype(dtype)),
        )?;
        let mut dw = want[1]
            .then(|| alloc(&dev, OP, &[cols], dtype))
            .transpose()?;
        let mut db = want[2]
            .then(|| alloc(&dev, OP, &[cols], dtype))
            .transpose()?;
        let f = function(&dev, finish_kernel(dtype))?;
        let l = launch(&dev, &f, cols).arg_buffer(&partial);
        opt_mut(opt_mut(l, dw.as_mut()), db.as_mut())
            .arg_u64(chunks as u64)
            .arg_u64(cols as u64)
            .run()?;
        let dw = dw.map(|b| wrap(&dev, b, dtype, &[cols]));
        let db = db.map(|b| wrap(&dev, b, dtype, &[cols]));
        Ok((dx, dw, db))
    }

    /// `y` and the `[rows]` inverse root mean squares of `x` (`[rows, cols]`).
    fn rms_norm(
        &self,
        x: &Operand<'_>,
        w: Option<&Operand<'_>>,
        eps: f64,
    ) -> Result<(Dense, Dense)> {
        const OP: &str = "rms_norm";
        float_only(OP, x.dtype())?;
        let x = dense(x)?;
        let w = w.map(dense).transpose()?;
        let dev = device_of(&x)?;
        let (rows, cols) = (x.shape()[0], x.shape()[1]);
        let sd = stats_dtype(x.dtype());
        let mut y = alloc(&dev, OP, x.shape(), x.dtype())?;
        let mut rstd = alloc(&dev, OP, &[rows], sd)?;
        if rows > 0 {
            let f = function(&dev, rms_forward_kernel(x.dtype()))?;
            let src = buffer(&x)?;
            let wb = w.as_ref().map(buffer).transpose()?;
            let l = row_launch(&dev, &f, rows, cols).arg_buffer(&src);
            opt(l, wb.as_deref())
                .arg_buffer_mut(&mut y)
                .arg_buffer_mut(&mut rstd)
                .arg_u64(rows as u64)
                .arg_u64(cols as u64)
                .arg_f64(eps)
                .run()?;
        }
        Ok((
            wrap(&dev, y, x.dtype(), x.shape()),
            wrap(&dev, rstd, sd, &[rows]),
        ))
    }

    /// `dx` and `dweight`, each only when `want` says so.
    fn rms_norm_backward(
        &self,
        g: &Operand<'_>,
        x: &Operand<'_>,
        w: Option<&Operand<'_>>,
        rstd: &Operand<'_>,
        want: [bool; 2],
    ) -> Result<(Option<Dense>, Option<Dense>)> {
        const OP: &str = "rms_norm backward";
        float_only(OP, x.dtype())?;
        let (g, x, rstd) = (dense(g)?, dense(x)?, dense(rstd)?);
        let w = w.map(dense).transpose()?;
        let dev = device_of(&x)?;
        let dtype = x.dtype();
        let (rows, cols) = (x.shape()[0], x.shape()[1]);
        let (gb, xb, sb) = (buffer(&g)?, buffer(&x)?, buffer(&rstd)?);
        let dx = if want[0] {
            let wb = w.as_ref().map(buffer).transpose()?;
            let bufs = [&*gb, &*xb, &*sb];
            Some(dx_pass(
                &dev,
                OP,
                rms_backward_kernel(dtype),
                bufs,
                wb.as_deref(),
                dtype,
                (rows, cols),
            )?)
        } else {
            None
        };
        if !want[1] {
            return Ok((dx, None));
        }
        // Per chunk of rows, the column sums of g x̂.
        let (partial, chunks) = column_partials(
            &dev,
            OP,
            rms_params_kernel(dtype),
            [&*gb, &*xb, &*sb],
            (rows, cols),
            (1, stats_dtype(dtype)),
        )?;
        let mut dw = alloc(&dev, OP, &[cols], dtype)?;
        let f = function(&dev, rms_finish_kernel(dtype))?;
        launch(&dev, &f, cols)
            .arg_buffer(&partial)
            .arg_buffer_mut(&mut dw)
            .arg_u64(chunks as u64)
            .arg_u64(cols as u64)
            .run()?;
        Ok((dx, Some(wrap(&dev, dw, dtype, &[cols]))))
    }
}

#[cfg(test)]
mod tests {
    use ferry_cuda::{compile_ptx, nvrtc_present};

    use super::*;

    /// Every kernel name this file launches is an entry of the compiled module.
    #[test]
    fn norm_kernels_compile_and_are_exported() {
        if !nvrtc_present() {
            eprintln!("skipped: NVRTC not found");
            return;
        }
        let ptx = compile_ptx(&NORM, "compute_90").unwrap_or_else(|e| panic!("{e}"));
        for d in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            for name in [
                forward_kernel(d),
                backward_kernel(d),
                params_kernel(d),
                finish_kernel(d),
                rms_forward_kernel(d),
                rms_backward_kernel(d),
                rms_params_kernel(d),
                rms_finish_kernel(d),
            ] {
                assert!(ptx.contains(&format!(".entry {name}(")), "{name} missing");
            }
        }
    }

    #[test]
    fn row_blocks_are_powers_of_two_up_to_256() {
        for cols in [1, 31, 32, 33, 100, 256, 257, 4096] {
            let t = row_threads(cols);
            assert!(
                t.is_power_of_two() && (32..=256).contains(&t),
                "{cols}: {t}"
            );
        }
        assert_eq!(row_threads(100), 128);
        // Long rows get the most threads: rounded before narrowing, 2^32 columns gave 32, and
        // the next power of two of usize::MAX overflows.
        for cols in [1 << 32, (1 << 32) + 1, usize::MAX - 1, usize::MAX] {
            assert_eq!(row_threads(cols), 256, "{cols}");
        }
    }
}
