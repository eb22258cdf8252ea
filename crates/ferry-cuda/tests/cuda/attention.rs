//! cuDNN's fused attention against a host reference computed in f64 from the same bf16 (or f16)
//! inputs: `softmax(Q Kᵀ · scale, masked) V`, its log-sum-exp and its gradients.

use std::time::Instant;

use ferry_cuda::{
    Attention, Causal, CudaLibError, DropoutRng, SdpaBackward, SdpaForward, SdpaInput, SdpaOutput,
    SdpaSpec,
};
use ferry_memory::DType;
use ferry_memory::cuda::{CudaDevice, DeviceBuffer, Stream};
use half::{bf16, f16};

use super::{gpu, random_bytes};

fn spec(head_dim: usize, causal: Causal) -> SdpaSpec {
    SdpaSpec {
        batch: 2,
        heads: 4,
        kv_heads: 2,
        q_len: 128,
        kv_len: 128,
        head_dim,
        dtype: DType::BF16,
        causal,
        scale: 1.0 / (head_dim as f32).sqrt(),
        dropout: 0.0,
    }
}

/// `n` values in [-1, 1), rounded to `dtype`.
fn uniform(n: usize, seed: u64, dtype: DType) -> Vec<f32> {
    random_bytes(2 * n, seed)
        .chunks(2)
        .map(|b| {
            round(
                dtype,
                f32::from(u16::from_le_bytes([b[0], b[1]])) / 32768.0 - 1.0,
            )
        })
        .collect()
}

fn round(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(x).to_f32(),
        _ => bf16::from_f32(x).to_f32(),
    }
}

/// Where element `[b, h, l, d]` of a `[B, H, L, D]` operand lives: in that order, or (`bthd`)
/// stored as `[B, L, H, D]`, as a projection's output is before any transpose.
fn strides(dims: [usize; 4], bthd: bool) -> [usize; 4] {
    let [_, h, l, d] = dims;
    if bthd {
        [l * h * d, d, h * d, 1]
    } else {
        [h * l * d, l * d, d, 1]
    }
}

fn position(index: usize, dims: [usize; 4], strides: [usize; 4]) -> usize {
    let [_, h, l, d] = dims;
    let (b, rest) = (index / (h * l * d), index % (h * l * d));
    let (hh, rest) = (rest / (l * d), rest % (l * d));
    let (ll, dd) = (rest / d, rest % d);
    b * strides[0] + hh * strides[1] + ll * strides[2] + dd * strides[3]
}

/// An operand on the device, laid out by `strides`, with its values in `[B, H, L, D]` order.
struct Operand {
    buffer: DeviceBuffer,
    dims: [usize; 4],
    strides: [usize; 4],
    dtype: DType,
}

impl Operand {
    fn upload(
        dev: &CudaDevice,
        stream: &Stream,
        dtype: DType,
        dims: [usize; 4],
        values: &[f32],
        bthd: bool,
    ) -> Self {
        let strides = strides(dims, bthd);
        let mut bytes = vec![0u8; values.len() * dtype.size()];
        for (i, &x) in values.iter().enumerate() {
            let at = position(i, dims, strides) * dtype.size();
            let bits = match dtype {
                DType::F32 => {
                    bytes[at..at + 4].copy_from_slice(&x.to_le_bytes());
                    continue;
                }
                DType::F16 => f16::from_f32(x).to_bits(),
                _ => bf16::from_f32(x).to_bits(),
            };
            bytes[at..at + 2].copy_from_slice(&bits.to_le_bytes());
        }
        let mut buffer = dev.alloc(bytes.len(), stream).unwrap();
        buffer.copy_from_host(&bytes, stream).unwrap();
        Operand {
            buffer,
            dims,
            strides,
            dtype,
        }
    }

    fn zeros(
        dev: &CudaDevice,
        stream: &Stream,
        dtype: DType,
        dims: [usize; 4],
        bthd: bool,
    ) -> Self {
        let n = dims.iter().product::<usize>();
        Self::upload(dev, stream, dtype, dims, &vec![0.0; n], bthd)
    }

    fn download(&self, stream: &Stream) -> Vec<f32> {
        let mut bytes = vec![0u8; self.buffer.len()];
        self.buffer.copy_to_host(&mut bytes, stream).unwrap();
        let n = self.dims.iter().product::<usize>();
        let size = self.dtype.size();
        (0..n)
            .map(|i| {
                let at = position(i, self.dims, self.strides) * size;
                let b = &bytes[at..at + size];
                match self.dtype {
                    DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                    DType::F16 => f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
                    _ => bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
                }
            })
            .collect()
    }

    fn input(&self) -> SdpaInput<'_> {
        SdpaInput {
            buffer: &self.buffer,
            offset_bytes: 0,
            strides: self.strides,
        }
    }

    fn output(&mut self) -> SdpaOutput<'_> {
        SdpaOutput {
            buffer: &mut self.buffer,
            offset_bytes: 0,
            strides: self.strides,
        }
    }
}

/// The host's attention in f64: its output, log-sum-exp and gradients for the output
/// gradient `d_o`, and the probabilities `[B, H, T, S]`.
struct Reference {
    o: Vec<f64>,
    stats: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
    p: Vec<f64>,
}

fn reference(s: &SdpaSpec, q: &[f32], k: &[f32], v: &[f32], d_o: &[f32]) -> Reference {
    let (t, n, d, group) = (s.q_len, s.kv_len, s.head_dim, s.heads / s.kv_heads);
    let mut r = Reference {
        o: vec![0.0; q.len()],
        stats: vec![0.0; s.batch * s.heads * t],
        dq: vec![0.0; q.len()],
        dk: vec![0.0; k.len()],
        dv: vec![0.0; v.len()],
        p: vec![0.0; s.batch * s.heads * t * n],
    };
    let dot = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| f64::from(x) * f64::from(y))
            .sum::<f64>()
    };
    let scale = f64::from(s.scale);
    for b in 0..s.batch {
        for h in 0..s.heads {
            let qh = (b * s.heads + h) * t * d;
            let kh = (b * s.kv_heads + h / group) * n * d;
            for i in 0..t {
                let row = |x: &[f32], base, j| x[base + j * d..base + (j + 1) * d].to_vec();
                let qi = row(q, qh, i);
                let doi = row(d_o, qh, i);
                let seen = |j: usize| match s.causal {
                    Causal::None => true,
                    Causal::TopLeft => j <= i,
                    Causal::BottomRight => j + t <= i + n,
                };
                let scores: Vec<f64> = (0..n)
                    .map(|j| {
                        if seen(j) {
                            scale * dot(&qi, &row(k, kh, j))
                        } else {
                            f64::NEG_INFINITY
                        }
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = max + scores.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
                r.stats[(b * s.heads + h) * t + i] = lse;
                let p: Vec<f64> = scores.iter().map(|x| (x - lse).exp()).collect();
                let mut oi = vec![0.0; d];
                for (j, pj) in p.iter().enumerate() {
                    for (e, o) in oi.iter_mut().enumerate() {
                        *o += pj * f64::from(v[kh + j * d + e]);
                    }
                }
                // D_i = dO_i · O_i; dS_ij = P_ij (dO_i · V_j - D_i).
                let di: f64 = oi.iter().zip(&doi).map(|(o, &g)| o * f64::from(g)).sum();
                for (j, pj) in p.iter().enumerate() {
                    r.p[((b * s.heads + h) * t + i) * n + j] = *pj;
                    let ds = pj * (dot(&doi, &row(v, kh, j)) - di);
                    for e in 0..d {
                        r.dq[qh + i * d + e] += scale * ds * f64::from(k[kh + j * d + e]);
                        r.dk[kh + j * d + e] += scale * ds * f64::from(qi[e]);
                        r.dv[kh + j * d + e] += pj * f64::from(doi[e]);
                    }
                }
                r.o[qh + i * d..qh + (i + 1) * d].copy_from_slice(&oi);
            }
        }
    }
    r
}

/// The largest difference from `want`, relative to `want`'s largest magnitude, is within `tol`.
fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0f64, |m, w| m.max(w.abs())).max(1e-12);
    let (at, err) = got
        .iter()
        .zip(want)
        .map(|(&g, w)| (f64::from(g) - w).abs())
        .enumerate()
        .fold(
            (0, 0f64),
            |best, (i, e)| if e > best.1 { (i, e) } else { best },
        );
    assert!(
        err <= tol * scale,
        "{what}: element {at} is {} but the host has {} (error {err:.3e}, {:.3e} of the largest {scale:.3e}, allowed {tol:.1e})",
        got[at],
        want[at],
        err / scale
    );
}

/// Q, K, V and dO of `s` on the host, rounded to its dtype.
fn inputs(s: &SdpaSpec) -> [Vec<f32>; 4] {
    let q_n = s.batch * s.heads * s.q_len * s.head_dim;
    let kv_n = s.batch * s.kv_heads * s.kv_len * s.head_dim;
    [(q_n, 1), (kv_n, 2), (kv_n, 3), (q_n, 4)].map(|(n, seed)| uniform(n, seed, s.dtype))
}

fn dims(s: &SdpaSpec) -> ([usize; 4], [usize; 4], [usize; 4]) {
    (
        [s.batch, s.heads, s.q_len, s.head_dim],
        [s.batch, s.kv_heads, s.kv_len, s.head_dim],
        [s.batch, s.heads, s.q_len, 1],
    )
}

/// The operands of a forward call on the device.
struct Forward {
    q: Operand,
    k: Operand,
    v: Operand,
    o: Operand,
    stats: Operand,
}

impl Forward {
    /// Q, K and V holding `values` (`bthd`: Q and O stored `[B, T, H, D]`), O and the
    /// statistics zero.
    fn new(dev: &CudaDevice, s: &SdpaSpec, values: &[Vec<f32>; 4], bthd: bool) -> Self {
        let stream = dev.default_stream();
        let (qd, kvd, sd) = dims(s);
        Forward {
            q: Operand::upload(dev, stream, s.dtype, qd, &values[0], bthd),
            k: Operand::upload(dev, stream, s.dtype, kvd, &values[1], false),
            v: Operand::upload(dev, stream, s.dtype, kvd, &values[2], false),
            o: Operand::zeros(dev, stream, s.dtype, qd, bthd),
            stats: Operand::zeros(dev, stream, DType::F32, sd, false),
        }
    }

    fn io<'a>(&'a mut self, rng: Option<DropoutRng<'a>>) -> SdpaForward<'a> {
        SdpaForward {
            q: self.q.input(),
            k: self.k.input(),
            v: self.v.input(),
            o: self.o.output(),
            stats: self.stats.output(),
            rng,
        }
    }

    fn run(&mut self, dev: &CudaDevice, s: &SdpaSpec, rng: Option<DropoutRng<'_>>) {
        dev.sdpa_forward(s, self.io(rng), dev.default_stream())
            .unwrap_or_else(|e| panic!("forward of {s:?}: {e}"));
    }
}

/// The output's gradient (holding `values[3]`) and the inputs' gradients, zero, on the device.
struct Gradients {
    d_o: Operand,
    dq: Operand,
    dk: Operand,
    dv: Operand,
}

impl Gradients {
    fn new(dev: &CudaDevice, s: &SdpaSpec, values: &[Vec<f32>; 4], bthd: bool) -> Self {
        let stream = dev.default_stream();
        let (qd, kvd, _) = dims(s);
        Gradients {
            d_o: Operand::upload(dev, stream, s.dtype, qd, &values[3], bthd),
            dq: Operand::zeros(dev, stream, s.dtype, qd, bthd),
            dk: Operand::zeros(dev, stream, s.dtype, kvd, false),
            dv: Operand::zeros(dev, stream, s.dtype, kvd, false),
        }
    }

    fn run(&mut self, dev: &CudaDevice, s: &SdpaSpec, f: &Forward, rng: Option<DropoutRng<'_>>) {
        let io = SdpaBackward {
            q: f.q.input(),
            k: f.k.input(),
            v: f.v.input(),
            o: f.o.input(),
            d_o: self.d_o.input(),
            stats: f.stats.input(),
            dq: self.dq.output(),
            dk: self.dk.output(),
            dv: self.dv.output(),
            rng,
        };
        dev.sdpa_backward(s, io, dev.default_stream())
            .unwrap_or_else(|e| panic!("backward of {s:?}: {e}"));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn fused_attention_forward_matches_the_host_reference() {
    let (_lock, dev) = gpu();
    let stream = dev.default_stream();
    let (causal, bottom_right) = (spec(64, Causal::TopLeft), spec(64, Causal::BottomRight));
    let cases = [
        (spec(64, Causal::None), false),
        // Q and O stored [B, T, H, D], read through their strides.
        (spec(128, Causal::TopLeft), true),
        // Fewer queries than keys: the last query sees every key.
        (
            SdpaSpec {
                q_len: 64,
                ..bottom_right
            },
            false,
        ),
        (
            SdpaSpec {
                dtype: DType::F16,
                ..causal
            },
            false,
        ),
    ];
    for (s, bthd) in cases {
        let values = inputs(&s);
        let want = reference(&s, &values[0], &values[1], &values[2], &values[3]);
        let mut f = Forward::new(&dev, &s, &values, bthd);
        f.run(&dev, &s, None);
        assert_close(&format!("O of {s:?}"), &f.o.download(stream), &want.o, 1e-2);
        let stats = f.stats.download(stream);
        assert_close(&format!("stats of {s:?}"), &stats, &want.stats, 2e-3);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn fused_attention_backward_matches_the_host_gradients() {
    let (_lock, dev) = gpu();
    let stream = dev.default_stream();
    let mha = SdpaSpec {
        kv_heads: 4,
        ..spec(64, Causal::TopLeft)
    };
    // Grouped heads sum their per-head dK and dV; one head per key/value head writes them.
    for (s, bthd) in [
        (spec(64, Causal::None), false),
        (spec(128, Causal::TopLeft), true),
        (mha, false),
    ] {
        let values = inputs(&s);
        let want = reference(&s, &values[0], &values[1], &values[2], &values[3]);
        let mut f = Forward::new(&dev, &s, &values, bthd);
        f.run(&dev, &s, None);
        let mut g = Gradients::new(&dev, &s, &values, bthd);
        g.run(&dev, &s, &f, None);
        for (name, got, want) in [
            ("dQ", &g.dq, &want.dq),
            ("dK", &g.dk, &want.dk),
            ("dV", &g.dv, &want.dv),
        ] {
            assert_close(
                &format!("{name} of {s:?}"),
                &got.download(stream),
                want,
                2e-2,
            );
        }
    }
}

fn scalar(dev: &CudaDevice, value: i64) -> DeviceBuffer {
    let stream = dev.default_stream();
    let mut buffer = dev.alloc(8, stream).unwrap();
    buffer.copy_from_host(&value.to_le_bytes(), stream).unwrap();
    buffer
}

#[test]
#[ignore = "needs a CUDA device"]
fn dropout_keeps_weights_with_one_minus_p_scaled_up_and_backward_redraws_the_mask() {
    let (_lock, dev) = gpu();
    let stream = dev.default_stream();
    // S = D and V the identity, so O's row i is the dropped-out probabilities P'_i.
    let s = SdpaSpec {
        q_len: 64,
        kv_len: 64,
        dropout: 0.25,
        ..spec(64, Causal::TopLeft)
    };
    let (qd, kvd, _) = dims(&s);
    let mut values = inputs(&s);
    values[2] = (0..kvd.iter().product::<usize>())
        .map(|i| f32::from(u8::from(i / 64 % 64 == i % 64)))
        .collect();
    values[3] = vec![1.0; qd.iter().product()];
    let want = reference(&s, &values[0], &values[1], &values[2], &values[3]);
    let (seed, offset, other) = (scalar(&dev, 1234), scalar(&dev, 0), scalar(&dev, 99));
    let rng = DropoutRng {
        seed: &seed,
        offset: &offset,
    };
    let mut f = Forward::new(&dev, &s, &values, false);
    f.run(&dev, &s, Some(rng));
    let dropped = f.o.download(stream);
    // Every weight is dropped or kept and scaled by 1 / (1 - p); about p of them are dropped.
    let (mut zeros, mut weights) = (0usize, 0usize);
    for (i, (&got, &p)) in dropped.iter().zip(&want.p).enumerate() {
        if p < 1e-3 {
            continue;
        }
        weights += 1;
        if got == 0.0 {
            zeros += 1;
        } else {
            let kept = p / (1.0 - f64::from(s.dropout));
            let off = (f64::from(got) - kept).abs();
            assert!(
                off <= 2e-2 * kept,
                "weight {i}: {got} is neither 0 nor {kept}"
            );
        }
    }
    let share = zeros as f64 / weights as f64;
    assert!(
        (share - 0.25).abs() < 0.05,
        "{zeros} of {weights} weights dropped"
    );
    // The statistics are the softmax's, before dropout.
    assert_close(
        "stats under dropout",
        &f.stats.download(stream),
        &want.stats,
        2e-3,
    );
    // The same seed and offset draw the same mask; another offset another.
    let mut again = Forward::new(&dev, &s, &values, false);
    again.run(&dev, &s, Some(rng));
    assert_eq!(again.o.download(stream), dropped);
    again.run(
        &dev,
        &s,
        Some(DropoutRng {
            seed: &seed,
            offset: &other,
        }),
    );
    assert_ne!(again.o.download(stream), dropped);

    // With dO all ones, dV_j = Σ_i P'_ij over the group's query heads: the forward's mask.
    let mut g = Gradients::new(&dev, &s, &values, false);
    g.run(&dev, &s, &f, Some(rng));
    let (t, n, group) = (s.q_len, s.kv_len, s.heads / s.kv_heads);
    let mut column_sums = vec![0f64; kvd.iter().product()];
    for b in 0..s.batch {
        for h in 0..s.heads {
            for i in 0..t {
                for j in 0..n {
                    let weight = f64::from(dropped[((b * s.heads + h) * t + i) * n + j]);
                    let at = ((b * s.kv_heads + h / group) * n + j) * s.head_dim;
                    for e in 0..s.head_dim {
                        column_sums[at + e] += weight;
                    }
                }
            }
        }
    }
    assert_close(
        "dV under dropout",
        &g.dv.download(stream),
        &column_sums,
        2e-2,
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn what_cudnn_cannot_run_is_refused_before_it_is_called() {
    let (_lock, dev) = gpu();
    let s = spec(64, Causal::None);
    let mut f = Forward::new(&dev, &s, &inputs(&s), false);
    let mut call = |s: SdpaSpec| {
        dev.sdpa_forward(&s, f.io(None), dev.default_stream())
            .unwrap_err()
    };
    let err = call(SdpaSpec {
        dtype: DType::F32,
        ..s
    });
    assert!(
        matches!(err, CudaLibError::AttentionUnsupported { .. }),
        "{err}"
    );
    // The buffers hold 64-wide heads: a 128-wide head would read past them.
    let err = call(SdpaSpec { head_dim: 128, ..s });
    assert!(
        matches!(err, CudaLibError::AttentionArgument { argument: "q", .. }),
        "{err}"
    );
    let err = call(SdpaSpec {
        head_dim: 32,
        kv_heads: 3,
        ..s
    });
    let kv_heads = matches!(
        err,
        CudaLibError::AttentionArgument {
            argument: "kv_heads",
            ..
        }
    );
    assert!(kv_heads, "{err}");
}

/// Prints forward and backward TFLOP/s at sequence 2048, head dim 128, bf16, causal (the
/// figures the fused path exists for) and checks the forward reaches a floor far below them.
#[test]
#[ignore = "needs a CUDA device"]
fn fused_attention_throughput_at_sequence_2048() {
    let (_lock, dev) = gpu();
    let stream = dev.default_stream();
    let s = SdpaSpec {
        batch: 4,
        heads: 16,
        kv_heads: 16,
        q_len: 2048,
        kv_len: 2048,
        ..spec(128, Causal::TopLeft)
    };
    let values = inputs(&s);
    let mut f = Forward::new(&dev, &s, &values, false);
    let mut g = Gradients::new(&dev, &s, &values, false);
    let seconds = |round: &mut dyn FnMut()| {
        round();
        stream.synchronize().unwrap();
        let rounds = 20;
        let start = Instant::now();
        for _ in 0..rounds {
            round();
        }
        stream.synchronize().unwrap();
        start.elapsed().as_secs_f64() / f64::from(rounds)
    };
    let forward_s = seconds(&mut || f.run(&dev, &s, None));
    let backward_s = seconds(&mut || g.run(&dev, &s, &f, None));
    // Causal: half of the 4·B·H·T·S·D flops of the two products forward, 2.5 times that back.
    let flops = 4.0 * (s.batch * s.heads * s.q_len * s.kv_len * s.head_dim) as f64 / 2.0;
    let (forward, backward) = (flops / forward_s / 1e12, 2.5 * flops / backward_s / 1e12);
    println!(
        "cuDNN fused attention {s:?}: forward {forward:.0} TFLOP/s, backward {backward:.0} TFLOP/s"
    );
    assert!(forward > 100.0, "forward runs at {forward:.0} TFLOP/s");
}
