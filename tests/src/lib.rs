//! Shared helpers for ferry's cross-crate tests: a device-parametrized test macro, seeded random
//! inputs that say how to replay a failure, gradcheck with a readable report, and comparisons.
//!
//! Key decision: every random input comes from a fresh seed per test (printed on failure, and
//! replayable with `FERRY_SEED=<seed>`), so runs keep exploring new inputs without losing the
//! ability to reproduce a failure.
#![forbid(unsafe_code)]

pub mod registry;

use std::cell::Cell;
use std::path::{Path, PathBuf};

use ferry_tensor::gradcheck::{GradcheckOptions, gradcheck};
use ferry_tensor::{DType, Device, Result, Tensor};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// Stamps out a test for each device from one body `fn(Device) -> ferry_tensor::Result<()>`:
/// `name::cpu` runs here, `name::cuda` is ignored with "needs a CUDA device" so a machine without
/// a GPU reports it as ignored, never as passed (`cargo test cuda -- --ignored` runs them).
///
/// The tests are `name::cpu` / `name::cuda` rather than `name_cpu`: `macro_rules!` cannot glue
/// identifiers without the `paste` crate, and the path filters just as well.
#[macro_export]
macro_rules! device_test {
    ($name:ident, $body:ident) => {
        mod $name {
            #[test]
            fn cpu() {
                $crate::run_on(::ferry_tensor::Device::Cpu, super::$body);
            }

            #[test]
            #[ignore = "needs a CUDA device"]
            fn cuda() {
                $crate::run_on(::ferry_tensor::Device::Cuda(0), super::$body);
            }
        }
    };
}

/// Runs a device test body with a fresh seed, failing with the error and the seed.
pub fn run_on(device: Device, body: impl FnOnce(Device) -> Result<()>) {
    let seed = fresh_seed();
    if let Err(e) = body(device) {
        panic!("on {device} (replay with FERRY_SEED={seed}): {e}");
    }
}

thread_local! {
    static SEED: Cell<Option<u64>> = const { Cell::new(None) };
    static DRAWS: Cell<u64> = const { Cell::new(0) };
}

/// Seeds this thread's tensor generator from `FERRY_SEED` or fresh entropy, and remembers the
/// seed for failure messages.
pub fn fresh_seed() -> u64 {
    let seed = std::env::var("FERRY_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    ferry_tensor::manual_seed(seed);
    SEED.with(|s| s.set(Some(seed)));
    DRAWS.with(|d| d.set(0));
    seed
}

/// The seed of this thread's current test (seeding now if nothing did yet).
pub fn seed() -> u64 {
    SEED.with(Cell::get).unwrap_or_else(fresh_seed)
}

/// Standard normal f64 samples.
pub fn randn(device: Device, shape: &[usize]) -> Result<Tensor> {
    Tensor::randn(shape, DType::F64, device)
}

/// Uniform f64 samples in `[lo, hi)`.
pub fn uniform(device: Device, shape: &[usize], lo: f64, hi: f64) -> Result<Tensor> {
    Tensor::rand(shape, DType::F64, device)?
        .mul_scalar(hi - lo)?
        .add_scalar(lo)
}

/// f64 samples with `|x| >= min` and random sign (for relu, abs, denominators).
pub fn away_from_zero(device: Device, shape: &[usize], min: f64) -> Result<Tensor> {
    let magnitude = uniform(device, shape, min, min + 1.5)?;
    let sign = Tensor::rand(shape, DType::F64, device)?
        .sub_scalar(0.5)?
        .step()?
        .mul_scalar(2.0)?
        .sub_scalar(1.0)?;
    magnitude.mul(&sign)
}

/// A random permutation of `0, 0.1, 0.2, ..` in `shape`: distinct values at least 0.1 apart, so
/// maxima do not switch under a finite-difference step.
pub fn distinct(device: Device, shape: &[usize]) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut values: Vec<f64> = (0..n).map(|i| i as f64 * 0.1 - n as f64 * 0.05).collect();
    let draw = DRAWS.with(|d| d.replace(d.get() + 1));
    values.shuffle(&mut rand::rngs::StdRng::seed_from_u64(
        seed().wrapping_add(draw),
    ));
    on(device, Tensor::from_vec(values, shape)?)
}

/// Host-built `t` placed on `device`.
pub fn on(device: Device, t: Tensor) -> Result<Tensor> {
    if device == t.device() {
        return Ok(t);
    }
    ferry::DeviceMove::to(&t, device)
}

/// Tensor from f64 values on `device`.
pub fn tensor(device: Device, values: &[f64], shape: &[usize]) -> Result<Tensor> {
    on(device, Tensor::from_slice(values, shape)?)
}

/// Gradcheck `f` at `inputs` (an array or slice of f64 tensors) with default tolerances; panics with the seed, the inputs and every
/// mismatch when an analytical gradient disagrees with central differences.
pub fn check_grad(
    what: &str,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: impl AsRef<[Tensor]>,
) -> Result<()> {
    check_grad_with(what, f, inputs, GradcheckOptions::default())
}

/// [`check_grad`] with explicit tolerances.
pub fn check_grad_with(
    what: &str,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: impl AsRef<[Tensor]>,
    options: GradcheckOptions,
) -> Result<()> {
    let inputs = inputs.as_ref();
    let mismatches = gradcheck(f, inputs, options)?;
    if !mismatches.is_empty() {
        let shown: Vec<String> = inputs.iter().map(|t| format!("  {t:?}")).collect();
        panic!(
            "gradcheck of {what} failed (replay with FERRY_SEED={}):\ninputs:\n{}\nmismatches: {mismatches:#?}",
            seed(),
            shown.join("\n")
        );
    }
    Ok(())
}

/// Asserts `actual` matches `expected` element by element within `tol` (absolute or relative).
#[track_caller]
pub fn assert_close(actual: &[f64], expected: &[f64], tol: f64) {
    assert_eq!(
        actual.len(),
        expected.len(),
        "lengths differ: {actual:?} vs {expected:?}"
    );
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        assert!(
            approx::relative_eq!(a, e, epsilon = tol, max_relative = tol),
            "element {i}: {a} vs expected {e} (tol {tol}, seed {})\nactual:   {actual:?}\nexpected: {expected:?}",
            seed()
        );
    }
}

/// Values of `t` as f64, row-major.
pub fn values(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().expect("reading values back")
}

/// Row-major strides of `shape`, for naive reference loops.
pub fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

/// Naive broadcast reference: the value of `data` (of `shape`) at index `index` of the broadcast
/// output shape (aligned on trailing dimensions).
pub fn broadcast_at(data: &[f64], shape: &[usize], index: &[usize]) -> f64 {
    let lead = index.len() - shape.len();
    let st = strides(shape);
    let flat: usize = shape
        .iter()
        .enumerate()
        .map(|(i, &d)| if d == 1 { 0 } else { index[lead + i] * st[i] })
        .sum();
    data[flat]
}

/// Every index of `shape`, row-major.
pub fn indices(shape: &[usize]) -> Vec<Vec<usize>> {
    let n: usize = shape.iter().product();
    let st = strides(shape);
    (0..n)
        .map(|k| {
            shape
                .iter()
                .zip(&st)
                .map(|(&d, &s)| (k / s) % d.max(1))
                .collect()
        })
        .collect()
}

/// docs/transfer-methods.md's runnable example (its activation-offload block) as a doctest; its
/// other blocks are fragments marked `ignore`.
#[cfg(doctest)]
#[doc = include_str!("../../docs/transfer-methods.md")]
struct TransferMethodsPage;

/// The root of the repository, for tests that read its files: from the run-time
/// `CARGO_MANIFEST_DIR` (cargo sets it when it runs a test), else the current directory or one
/// above it, else where the tests crate was compiled. A test executable packed and run from
/// another checkout reads that checkout's files.
pub fn repo_root() -> PathBuf {
    let is_root = |dir: &Path| dir.join("Cargo.toml").is_file() && dir.join("crates").is_dir();
    let from_env = std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from);
    let here = std::env::current_dir().ok();
    let candidates = from_env
        .iter()
        .chain(&here)
        .flat_map(|dir| dir.ancestors().map(Path::to_path_buf).collect::<Vec<_>>());
    for dir in candidates {
        if is_root(&dir) {
            return dir;
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}
