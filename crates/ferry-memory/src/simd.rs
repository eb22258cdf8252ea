//! Vector instructions chosen at run time: [`vectorized`] runs a loop compiled for AVX2 where
//! the CPU has it, and for the baseline (SSE2) elsewhere, from one source.
//!
//! ferry builds for generic x86-64, so its loops use 128-bit vectors; AVX2 doubles the width.
//! Code inlined into a function compiled with `#[target_feature(enable = "avx2")]` is compiled
//! for AVX2 too, so a kernel's loop passed here as a closure (with the loop's helpers marked
//! `#[inline(always)]`) vectorises at 256 bits. The results are the same bit for bit: the same
//! IEEE operations, only more at a time (Rust never fuses a multiply and an add on its own).

/// Runs `f`, compiled for AVX2 when this CPU supports it.
#[inline(always)]
pub fn vectorized<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above; `avx2` needs nothing else.
        return unsafe { avx2(f) };
    }
    f()
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_result_is_the_closures() {
        let data: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
        let plain: f32 = data.iter().map(|v| v * 2.0 + 1.0).sum();
        let fast: f32 = super::vectorized(|| data.iter().map(|v| v * 2.0 + 1.0).sum());
        assert_eq!(plain.to_bits(), fast.to_bits());
    }
}
