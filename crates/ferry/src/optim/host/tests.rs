use ferry_memory::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

fn normal(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| (rng.random::<f32>() - 0.5) * 2.0 * scale)
        .collect()
}

/// A length that crosses a block and a sub-block boundary and ends in a ragged tail.
const N: usize = BLOCK + SUB + 7;

struct State {
    p: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

fn state(seed: u64, n: usize) -> State {
    let mut rng = StdRng::seed_from_u64(seed);
    State {
        p: normal(&mut rng, n, 1.0),
        m: normal(&mut rng, n, 0.1),
        v: normal(&mut rng, n, 0.01).iter().map(|v| v.abs()).collect(),
    }
}

fn step_one(step: &AdamStep, s: &mut State, grad: GradSlice<'_>, out: Option<ParamSlice<'_>>) {
    adamw(
        step,
        [AdamTensor {
            master: &mut s.p,
            exp_avg: &mut s.m,
            exp_avg_sq: &mut s.v,
            grad,
            out,
        }],
    )
    .unwrap();
}

/// One step in f32 against the same step in f64 from the same f32 state, element by element:
/// each result within 4 f32 epsilons of the magnitudes it is summed from (the bound the docs
/// state: a handful of roundings, none amplified, as no sum here cancels beyond its terms).
#[test]
#[allow(clippy::needless_range_loop)] // four slices read at one index
fn cpu_matches_the_f64_update() {
    for (decoupled, weight_decay) in [(1, 0.01), (0, 0.05), (1, 0.0)] {
        let step = AdamStep {
            decoupled,
            weight_decay,
            ..adamw_step(3, 1e-3, (0.9, 0.999), 1e-8, 0.0)
        };
        let before = state(7, N);
        let grad = normal(&mut StdRng::seed_from_u64(8), N, 1.0);
        let mut after = state(7, N);
        step_one(&step, &mut after, GradSlice::F32(&grad), None);
        let tol = 4.0 * f64::from(f32::EPSILON);
        for i in 0..N {
            let (p0, m0, v0) = (
                f64::from(before.p[i]),
                f64::from(before.m[i]),
                f64::from(before.v[i]),
            );
            let mut p = p0;
            let mut g = f64::from(grad[i]);
            if decoupled == 1 {
                p *= 1.0 - step.lr * step.weight_decay;
            } else {
                g += step.weight_decay * p;
            }
            let m = step.beta1 * m0 + (1.0 - step.beta1) * g;
            let v = step.beta2 * v0 + (1.0 - step.beta2) * g * g;
            let update = step.lr / step.bias_correction1 * m
                / ((v / step.bias_correction2).sqrt() + step.eps);
            let m_scale = (step.beta1 * m0).abs() + ((1.0 - step.beta1) * g).abs();
            let v_scale = v;
            let p_scale = p.abs() + update.abs();
            let got = (after.p[i], after.m[i], after.v[i]);
            assert!(
                (f64::from(got.0) - (p - update)).abs() <= tol * p_scale,
                "p[{i}]: {} against {}",
                got.0,
                p - update
            );
            assert!((f64::from(got.1) - m).abs() <= tol * m_scale, "m[{i}]");
            assert!((f64::from(got.2) - v).abs() <= tol * v_scale, "v[{i}]");
        }
    }
}

/// 16-bit gradients are widened exactly, so a step from them equals the step from their f32
/// values bit for bit; the 16-bit copies of the result are the master weights rounded as `half`
/// rounds them.
#[test]
fn half_gradients_and_copies_are_exact() {
    let step = adamw_step(1, 1e-2, (0.9, 0.95), 1e-8, 0.1);
    let g32 = normal(&mut StdRng::seed_from_u64(3), N, 2.0);
    let g_bf: Vec<bf16> = g32.iter().map(|&g| bf16::from_f32(g)).collect();
    let g_h: Vec<f16> = g32.iter().map(|&g| f16::from_f32(g)).collect();

    let mut want = state(1, N);
    let widened: Vec<f32> = g_bf.iter().map(|g| g.to_f32()).collect();
    step_one(&step, &mut want, GradSlice::F32(&widened), None);
    let mut got = state(1, N);
    let mut out = vec![bf16::ZERO; N];
    step_one(
        &step,
        &mut got,
        GradSlice::Bf16(&g_bf),
        Some(ParamSlice::Bf16(&mut out)),
    );
    assert_eq!(bits(&got.p), bits(&want.p));
    assert_eq!(bits(&got.v), bits(&want.v));
    assert!(
        out.iter()
            .zip(&got.p)
            .all(|(o, p)| o.to_bits() == bf16::from_f32(*p).to_bits())
    );

    let mut want = state(1, N);
    let widened: Vec<f32> = g_h.iter().map(|g| g.to_f32()).collect();
    step_one(&step, &mut want, GradSlice::F32(&widened), None);
    let mut got = state(1, N);
    let mut out = vec![f16::ZERO; N];
    step_one(
        &step,
        &mut got,
        GradSlice::F16(&g_h),
        Some(ParamSlice::F16(&mut out)),
    );
    assert_eq!(bits(&got.m), bits(&want.m));
    assert!(
        out.iter()
            .zip(&got.p)
            .all(|(o, p)| o.to_bits() == f16::from_f32(*p).to_bits())
    );

    let mut copy = vec![0.0f32; N];
    let mut again = state(1, N);
    step_one(
        &step,
        &mut again,
        GradSlice::F32(&widened),
        Some(ParamSlice::F32(&mut copy)),
    );
    assert_eq!(bits(&copy), bits(&again.p));
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The branch-free rounding agrees with `half` on ties, overflow, subnormals, infinities, NaNs
/// and a million random bit patterns.
#[test]
fn bf16_rounding_is_halfs() {
    let special = [
        0.0f32,
        -0.0,
        1.0,
        f32::MAX,
        f32::MIN_POSITIVE,
        1e-40,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x3f80_8000), // a tie, rounds to even (down)
        f32::from_bits(0x3f81_8000), // a tie, rounds to even (up)
        f32::from_bits(0x7f7f_ffff),
        f32::from_bits(0x7f80_0001), // a signalling NaN comes back quiet
    ];
    let mut rng = StdRng::seed_from_u64(11);
    let random = (0..1_000_000).map(|_| f32::from_bits(rng.random()));
    for x in special.into_iter().chain(random) {
        let want = bf16::from_f32(x);
        let got = bf16::from_bits(bf16_bits(x));
        if x.is_nan() {
            assert!(got.is_nan(), "{x:?}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{x:?} ({:#x})", x.to_bits());
        }
    }
}

/// Several tensors of different sizes (one empty, one smaller than a sub-block) in one step give
/// what each gives alone.
#[test]
fn a_list_steps_as_its_tensors_do() {
    let step = adamw_step(5, 3e-4, (0.9, 0.999), 1e-8, 0.01);
    let sizes = [N, 0, 5, 2 * BLOCK];
    let grads: Vec<Vec<f32>> = sizes
        .iter()
        .map(|&n| normal(&mut StdRng::seed_from_u64(n as u64), n, 1.0))
        .collect();
    let mut alone: Vec<State> = sizes.iter().map(|&n| state(n as u64, n)).collect();
    for (s, g) in alone.iter_mut().zip(&grads) {
        step_one(&step, s, GradSlice::F32(g), None);
    }
    let mut together: Vec<State> = sizes.iter().map(|&n| state(n as u64, n)).collect();
    let tensors = together.iter_mut().zip(&grads).map(|(s, g)| AdamTensor {
        master: &mut s.p,
        exp_avg: &mut s.m,
        exp_avg_sq: &mut s.v,
        grad: GradSlice::F32(g),
        out: None,
    });
    adamw(&step, tensors).unwrap();
    for (a, t) in alone.iter().zip(&together) {
        assert_eq!(bits(&a.p), bits(&t.p));
        assert_eq!(bits(&a.v), bits(&t.v));
    }
}

/// A slice of the wrong length is an error naming it, and nothing is written, even to the
/// tensors before it in the list.
#[test]
fn mismatched_lengths_are_refused_before_any_write() {
    let step = adamw_step(1, 1e-3, (0.9, 0.999), 1e-8, 0.0);
    let mut good = state(1, 100);
    let mut bad = state(2, 100);
    let grad = vec![1.0f32; 100];
    let short = vec![1.0f32; 99];
    let mut out = vec![bf16::ZERO; 101];
    let before = bits(&good.p);
    let err = adamw(
        &step,
        [
            AdamTensor {
                master: &mut good.p,
                exp_avg: &mut good.m,
                exp_avg_sq: &mut good.v,
                grad: GradSlice::F32(&grad),
                out: None,
            },
            AdamTensor {
                master: &mut bad.p,
                exp_avg: &mut bad.m,
                exp_avg_sq: &mut bad.v,
                grad: GradSlice::F32(&short),
                out: Some(ParamSlice::Bf16(&mut out)),
            },
        ],
    )
    .unwrap_err();
    assert!(err.to_string().contains("`grad` has 99 elements"), "{err}");
    assert_eq!(bits(&good.p), before);
}

/// SGD with and without momentum, Nesterov and weight decay, over two steps against f64 (the
/// first from a zero buffer, which makes `b = g` as torch's first step does).
#[test]
#[allow(clippy::needless_range_loop)] // four slices read at one index
fn sgd_matches_the_f64_update() {
    for (momentum, nesterov, weight_decay) in
        [(0.0, false, 0.0), (0.9, false, 1e-4), (0.9, true, 0.0)]
    {
        let step = SgdStep {
            lr: 0.05,
            momentum,
            weight_decay,
            nesterov,
        };
        let mut rng = StdRng::seed_from_u64(5);
        let mut p = normal(&mut rng, N, 1.0);
        let mut b = vec![0.0f32; N];
        let mut want_p: Vec<f64> = p.iter().map(|&x| f64::from(x)).collect();
        let mut want_b = vec![0.0f64; N];
        for _ in 0..2 {
            let g = normal(&mut rng, N, 1.0);
            let buffer = (momentum != 0.0).then_some(&mut b[..]);
            let tensor = SgdTensor {
                master: &mut p,
                momentum_buffer: buffer,
                grad: GradSlice::F32(&g),
                out: None,
            };
            sgd(&step, [tensor]).unwrap();
            for i in 0..N {
                let gi = f64::from(g[i]) + weight_decay * want_p[i];
                let dir = if momentum == 0.0 {
                    gi
                } else {
                    want_b[i] = momentum * want_b[i] + gi;
                    if nesterov {
                        gi + momentum * want_b[i]
                    } else {
                        want_b[i]
                    }
                };
                want_p[i] -= 0.05 * dir;
            }
        }
        for i in 0..N {
            assert!(
                (f64::from(p[i]) - want_p[i]).abs() <= 1e-5 * (1.0 + want_p[i].abs()),
                "momentum {momentum} nesterov {nesterov}: p[{i}] {} against {}",
                p[i],
                want_p[i]
            );
        }
    }
}

/// Held gradients: the first pass copies (converting bf16), the next adds, and each returns
/// the sum of squares of what is held, across block and sub-block edges.
#[test]
fn accumulate_copies_then_adds_and_returns_the_sum_of_squares() {
    let n = 2 * BLOCK + 1000;
    let a: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) / 16.0).collect();
    let b: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32((i % 13) as f32 / 8.0))
        .collect();
    let mut held = vec![f32::NAN; n];
    let first = accumulate(&mut held, GradSlice::F32(&a), true);
    assert_eq!(held, a);
    let expect: f64 = a.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    assert!(
        (first - expect).abs() <= 1e-6 * expect,
        "{first} against {expect}"
    );
    let second = accumulate(&mut held, GradSlice::Bf16(&b), false);
    let sum: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y.to_f32()).collect();
    assert_eq!(held, sum);
    let expect: f64 = sum.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
    assert!(
        (second - expect).abs() <= 1e-6 * expect,
        "{second} against {expect}"
    );
    // A finite gradient whose square passes f32's range is not an overflow.
    let large = vec![1e20f32; 4];
    let sumsq = accumulate(&mut held[..4], GradSlice::F32(&large), true);
    assert!(
        sumsq.is_finite() && (sumsq - 4e40).abs() <= 1e-6 * 4e40,
        "{sumsq}"
    );
}

/// A scaled step is the step from the scaled gradients, to the bit (fused, no pass of its own).
#[test]
fn a_scaled_step_equals_the_step_from_scaled_gradients() {
    let mut rng = StdRng::seed_from_u64(9);
    let grad = normal(&mut rng, N, 3.0);
    let start = normal(&mut rng, N, 1.0);
    let step = adamw_step(3, 1e-3, (0.9, 0.999), 1e-8, 0.01);
    let run = |scale: f32, grad: &[f32]| {
        let (mut p, mut m, mut v) = (start.clone(), vec![0.1f32; N], vec![0.2f32; N]);
        let tensor = AdamTensor {
            master: &mut p,
            exp_avg: &mut m,
            exp_avg_sq: &mut v,
            grad: GradSlice::F32(grad),
            out: None,
        };
        adamw_scaled(&step, scale, [tensor]).unwrap();
        (p, m, v)
    };
    let scaled: Vec<f32> = grad.iter().map(|g| g * 0.37).collect();
    assert_eq!(run(0.37, &grad), run(1.0, &scaled));
    assert_ne!(run(0.37, &grad), run(1.0, &grad));
}

/// A gradient's sum of squares read in place is the one `accumulate` takes while copying it
/// (f32, bf16 and f16 gradients; the blocks may sum in another order).
#[test]
fn the_sum_of_squares_in_place_is_the_copys() {
    let mut rng = StdRng::seed_from_u64(11);
    let g = normal(&mut rng, 3 * BLOCK + 17, 3.0);
    let halves: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
    let f16s: Vec<f16> = g.iter().map(|&x| f16::from_f32(x)).collect();
    for grad in [
        GradSlice::F32(&g),
        GradSlice::Bf16(&halves),
        GradSlice::F16(&f16s),
    ] {
        let mut held = vec![0.0f32; g.len()];
        let copied = accumulate(&mut held, grad, true);
        let in_place = sum_squares(grad);
        assert!(
            (copied - in_place).abs() <= 1e-12 * copied,
            "{copied} {in_place}"
        );
    }
}
