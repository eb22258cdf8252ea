//! The kernel modules (sources from kernels/, embedded) and a typed id for every kernel.
//!
//! Each module is compiled as kernels/common.cuh, then the CUDA C that the op table generates
//! (`ferry_unary`, `ferry_binary`, `ferry_compare`, `reduce_op`: see `crate::ops`), then the
//! module's own source.

use ferry_cuda::{CudaFunction, KernelModule, Kernels};
use ferry_memory::DType;
use ferry_memory::cuda::CudaDevice;

use crate::Result;

macro_rules! module {
    ($name:literal) => {
        KernelModule {
            name: $name,
            source: concat!(
                include_str!("../../../../kernels/common.cuh"),
                "\n",
                crate::op::cuda_op_table!(),
                "\n",
                include_str!(concat!("../../../../kernels/", $name, ".cu"))
            ),
        }
    };
}

/// Elementwise maps, binary ops, comparisons, casts, fills, random numbers.
pub static ELEMENTWISE: KernelModule = module!("elementwise");
/// Strided copies and the gather that packs many tensors into one buffer: small, so a first
/// copy compiles in milliseconds.
pub static COPY: KernelModule = module!("copy");
/// Sums, maxima and argmax along an axis; two-pass whole-tensor sums.
pub static REDUCE: KernelModule = module!("reduce");
/// Fused row softmax and log-softmax, the negative log-likelihood after them, and fused
/// cross-entropy.
pub static SOFTMAX: KernelModule = module!("softmax");
/// Fused in-place optimizer updates.
pub static OPTIM: KernelModule = module!("optim");
/// index_select, gather, index_add and scatter_add along one axis.
pub static INDEX: KernelModule = module!("index");
/// Fused layer normalization and RMSNorm, forward and backward.
pub static NORM: KernelModule = module!("norm");
/// where_cond, fused dropout and its masked backward.
pub static SELECT: KernelModule = module!("select");
/// im2col, col2im and the max-pooling argmax for conv2d and pooling.
pub static CONV: KernelModule = module!("conv");

/// Every module, for compile checks and `ferry doctor`.
pub static ALL: [&KernelModule; 9] = [
    &ELEMENTWISE,
    &COPY,
    &REDUCE,
    &SOFTMAX,
    &OPTIM,
    &INDEX,
    &NORM,
    &SELECT,
    &CONV,
];

/// One kernel of one module, named by what it does and the dtypes it reads and writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kernel {
    Unary(DType),
    Binary(DType),
    Random(DType),
    Compare(DType),
    Fill(DType),
    Arange(DType),
    Cast(DType, DType),
    /// A strided copy of elements of this many bytes.
    Copy(usize),
    ReduceRow(DType),
    ReduceCol(DType),
    /// Sums down long columns, 32 columns a block.
    SumColTiled(DType),
    SumPartial(DType),
    SumFinish(DType),
    Softmax(DType),
    /// Its gradient from the saved output.
    SoftmaxBackward(DType),
    /// Mean negative log-likelihood at one class per row, targets checked.
    Nll(DType),
    /// Its gradient with respect to the log-probabilities.
    NllBackward(DType),
    /// Cross-entropy: each row's log-sum-exp of the logits, one block a row.
    CrossEntropyRows(DType),
    /// Cross-entropy: the mean loss from the log-sum-exp, targets checked.
    CrossEntropyMean(DType),
    /// Cross-entropy's logits gradient from the log-sum-exp.
    CrossEntropyBackward(DType),
    /// Many byte regions into one buffer.
    Gather,
    /// One fused Adam step, in place.
    Adam(DType),
    /// `where_cond` of values of this dtype.
    Where(DType),
    /// Fused dropout: mask drawn, output scaled.
    Dropout(DType),
    /// Dropout's backward from the saved mask.
    MaskedScale(DType),
    /// The rotary position embedding (half rotation), or its transpose.
    Rotary(DType),
}

/// `$prefix` followed by the C name of `$dtype`'s element type, as a `&'static str`.
macro_rules! typed_name {
    ($prefix:literal, $dtype:expr) => {
        match $dtype {
            DType::F32 => concat!($prefix, "float"),
            DType::F64 => concat!($prefix, "double"),
            DType::F16 => concat!($prefix, "f16"),
            DType::BF16 => concat!($prefix, "bf16"),
            DType::I64 => concat!($prefix, "i64"),
            DType::U8 => concat!($prefix, "u8"),
        }
    };
}

macro_rules! cast_name {
    ($from:literal, $to:expr) => {
        match $to {
            DType::F32 => concat!("cast_", $from, "_float"),
            DType::F64 => concat!("cast_", $from, "_double"),
            DType::F16 => concat!("cast_", $from, "_f16"),
            DType::BF16 => concat!("cast_", $from, "_bf16"),
            DType::I64 => concat!("cast_", $from, "_i64"),
            DType::U8 => concat!("cast_", $from, "_u8"),
        }
    };
}

impl Kernel {
    fn module(self) -> &'static KernelModule {
        match self {
            Kernel::ReduceRow(_)
            | Kernel::ReduceCol(_)
            | Kernel::SumColTiled(_)
            | Kernel::SumPartial(_)
            | Kernel::SumFinish(_) => &REDUCE,
            Kernel::Softmax(_)
            | Kernel::SoftmaxBackward(_)
            | Kernel::Nll(_)
            | Kernel::NllBackward(_)
            | Kernel::CrossEntropyRows(_)
            | Kernel::CrossEntropyMean(_)
            | Kernel::CrossEntropyBackward(_) => &SOFTMAX,
            Kernel::Adam(_) => &OPTIM,
            Kernel::Where(_) | Kernel::Dropout(_) | Kernel::MaskedScale(_) => &SELECT,
            Kernel::Copy(_) | Kernel::Gather => &COPY,
            _ => &ELEMENTWISE,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kernel::Unary(d) => typed_name!("unary_", d),
            Kernel::Binary(d) => typed_name!("binary_", d),
            Kernel::Random(d) => typed_name!("random_", d),
            Kernel::Compare(d) => typed_name!("compare_", d),
            Kernel::Fill(d) => typed_name!("fill_", d),
            Kernel::Arange(d) => typed_name!("arange_", d),
            Kernel::Cast(from, to) => match from {
                DType::F32 => cast_name!("float", to),
                DType::F64 => cast_name!("double", to),
                DType::F16 => cast_name!("f16", to),
                DType::BF16 => cast_name!("bf16", to),
                DType::I64 => cast_name!("i64", to),
                DType::U8 => cast_name!("u8", to),
            },
            Kernel::Copy(1) => "copy_b8",
            Kernel::Copy(2) => "copy_b16",
            Kernel::Copy(4) => "copy_b32",
            Kernel::Copy(_) => "copy_b64",
            Kernel::ReduceRow(d) => typed_name!("reduce_row_", d),
            Kernel::ReduceCol(d) => typed_name!("reduce_col_", d),
            Kernel::SumColTiled(d) => typed_name!("sum_col_tiled_", d),
            Kernel::SumPartial(d) => typed_name!("sum_partial_", d),
            Kernel::SumFinish(d) => typed_name!("sum_finish_", d),
            Kernel::Softmax(d) => typed_name!("softmax_", d),
            Kernel::SoftmaxBackward(d) => typed_name!("softmax_backward_", d),
            Kernel::Nll(d) => typed_name!("nll_", d),
            Kernel::NllBackward(d) => typed_name!("nll_backward_", d),
            Kernel::CrossEntropyRows(d) => typed_name!("cross_entropy_rows_", d),
            Kernel::CrossEntropyMean(d) => typed_name!("cross_entropy_mean_", d),
            Kernel::CrossEntropyBackward(d) => typed_name!("cross_entropy_backward_", d),
            Kernel::Gather => "gather_regions",
            Kernel::Adam(d) => typed_name!("adam_", d),
            Kernel::Where(d) => typed_name!("where_", d),
            Kernel::Dropout(d) => typed_name!("dropout_", d),
            Kernel::MaskedScale(d) => typed_name!("masked_scale_", d),
            Kernel::Rotary(d) => typed_name!("rotary_", d),
        }
    }

    /// The kernel loaded on `device` (its module compiled on first use).
    pub(crate) fn load(self, device: &CudaDevice) -> Result<CudaFunction> {
        Ok(device.function(self.module(), self.name())?)
    }
}

/// Compiles and loads every kernel module on CUDA device `ordinal` (a no-op for modules already
/// loaded) and returns the device's total NVRTC compile-and-load time so far.
pub fn compile_kernels(ordinal: usize) -> Result<std::time::Duration> {
    let device = CudaDevice::get(ordinal)?;
    for kernel in [
        Kernel::Fill(DType::F32),
        Kernel::Gather,
        Kernel::ReduceRow(DType::F32),
        Kernel::Softmax(DType::F32),
    ] {
        kernel.load(&device)?;
    }
    Ok(device.compile_time())
}

/// Compiles and loads the kernel module that copies between device buffers (strided copies and
/// the gather that packs many tensors into one buffer) on CUDA device `ordinal`, a no-op once
/// loaded, and returns the device's total NVRTC compile-and-load time so far: what a first copy
/// of a process would otherwise pay in its call, taken where no one waits. The module is
/// small (a first save of a process took 11.7 s on a fresh H100 when these kernels were part
/// of the elementwise module).
pub fn compile_copy_kernels(ordinal: usize) -> Result<std::time::Duration> {
    let device = CudaDevice::get(ordinal)?;
    Kernel::Gather.load(&device)?;
    Ok(device.compile_time())
}

#[cfg(test)]
pub(crate) fn every_kernel() -> Vec<Kernel> {
    let mut kernels: Vec<Kernel> = [1, 2, 4, 8].map(Kernel::Copy).into();
    kernels.push(Kernel::Gather);
    for d in DType::ALL {
        kernels.extend([Kernel::Compare(d), Kernel::Fill(d), Kernel::Arange(d)]);
        kernels.push(Kernel::Where(d));
        if d.is_float() {
            kernels.extend([Kernel::Dropout(d), Kernel::MaskedScale(d)]);
        }
        kernels.extend(DType::ALL.map(|to| Kernel::Cast(d, to)));
        if d.is_float() {
            kernels.extend([
                Kernel::Unary(d),
                Kernel::Binary(d),
                Kernel::Random(d),
                Kernel::Rotary(d),
                Kernel::ReduceRow(d),
                Kernel::ReduceCol(d),
                Kernel::SumColTiled(d),
                Kernel::SumPartial(d),
                Kernel::SumFinish(d),
                Kernel::Softmax(d),
                Kernel::SoftmaxBackward(d),
                Kernel::Nll(d),
                Kernel::NllBackward(d),
                Kernel::CrossEntropyRows(d),
                Kernel::CrossEntropyMean(d),
                Kernel::CrossEntropyBackward(d),
            ]);
        }
    }
    kernels
}

#[cfg(test)]
mod tests {
    use ferry_cuda::{compile_ptx, nvrtc_present, nvrtc_version};

    use super::*;

    /// Op codes reach kernels only through the table's functions, which trap on an unknown code;
    /// a hand-written `case 3:` or `op == 2` in kernels/ could compute another op instead.
    #[test]
    fn kernels_take_op_codes_from_the_table_only() {
        let table = crate::op::cuda_op_table!();
        for module in ALL {
            let (_, own) = module
                .source
                .split_once(table)
                .unwrap_or_else(|| panic!("{} lacks the op table", module.name));
            assert!(
                !own.contains(table),
                "{} has the op table twice",
                module.name
            );
            for line in own.lines() {
                let code = line.split_once("//").map_or(line, |(code, _)| code);
                let words: Vec<&str> = code.split_whitespace().collect();
                for w in words.windows(3) {
                    let literal = w[2].starts_with(|c: char| c.is_ascii_digit());
                    assert!(
                        !(w[0].ends_with("op") && ["==", "!="].contains(&w[1]) && literal),
                        "{}: op compared with a number: {line}",
                        module.name
                    );
                }
                assert!(
                    !words.contains(&"case"),
                    "{}: a switch on codes by hand: {line}",
                    module.name
                );
            }
        }
    }

    /// CI runs this with NVRTC 13.0 on the library path (see .ci/run); without NVRTC it says it
    /// was skipped, so a plain `cargo test` on a fresh machine still passes.
    #[test]
    fn every_kernel_compiles_for_hopper_and_is_exported() {
        if !nvrtc_present() {
            eprintln!(
                "skipped: NVRTC not found; .ci/run puts NVRTC 13.0 on LD_LIBRARY_PATH for this test"
            );
            return;
        }
        eprintln!("NVRTC {:?}", nvrtc_version().unwrap());
        let ptx: Vec<(&str, String)> = ALL
            .iter()
            .map(|m| {
                (
                    m.name,
                    compile_ptx(m, "compute_90").unwrap_or_else(|e| panic!("{e}")),
                )
            })
            .collect();
        for kernel in every_kernel() {
            let (_, text) = ptx
                .iter()
                .find(|(name, _)| *name == kernel.module().name)
                .unwrap();
            assert!(
                text.contains(&format!(".entry {}(", kernel.name())),
                "{kernel:?} ({}) missing from the PTX",
                kernel.name()
            );
        }
    }
}
