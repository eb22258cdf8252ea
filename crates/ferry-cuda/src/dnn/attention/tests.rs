//! The checks made before cuDNN is called, which need no GPU.

use super::super::cudnn_present;
use super::checks::{check_rng, end_byte, known_limit, layout};
use super::run::{masked_value, plan_key, usable_cudnn};
use super::*;

fn spec() -> SdpaSpec {
    SdpaSpec {
        batch: 2,
        heads: 4,
        kv_heads: 2,
        q_len: 128,
        kv_len: 128,
        head_dim: 64,
        dtype: DType::BF16,
        causal: Causal::TopLeft,
        scale: 0.125,
        dropout: 0.0,
    }
}

fn argument_of(err: CudaLibError) -> &'static str {
    match err {
        CudaLibError::AttentionArgument { argument, .. } => argument,
        other => panic!("expected an argument error, got {other}"),
    }
}

#[test]
fn impossible_specs_are_errors_naming_the_argument() {
    assert!(spec().check().is_ok());
    let s = spec();
    let cases = [
        (SdpaSpec { kv_heads: 3, ..s }, "kv_heads"),
        (SdpaSpec { kv_heads: 0, ..s }, "kv_heads"),
        (SdpaSpec { head_dim: 0, ..s }, "head_dim"),
        (SdpaSpec { kv_len: 0, ..s }, "kv_len"),
        (
            SdpaSpec {
                scale: f32::NAN,
                ..s
            },
            "scale",
        ),
        (SdpaSpec { dropout: 1.0, ..s }, "dropout"),
        (
            SdpaSpec {
                q_len: 1 << 31,
                ..s
            },
            "q_len",
        ),
    ];
    for (bad, argument) in cases {
        let err = bad.check().unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("sdpa: "), "{text}");
        assert_eq!(argument_of(err), argument, "{bad:?}");
    }
    let mut s = spec();
    s.kv_heads = 3;
    let text = s.check().unwrap_err().to_string();
    assert!(text.contains("divide the query heads (4)"), "{text}");
    // No queries need no keys.
    let empty = SdpaSpec {
        q_len: 0,
        kv_len: 0,
        ..spec()
    };
    assert!(empty.check().is_ok());
}

#[test]
fn what_cudnn_cannot_run_is_unsupported_so_the_caller_falls_back() {
    for (dtype, head_dim) in [(DType::BF16, 64), (DType::F16, 128), (DType::BF16, 8)] {
        assert!(
            SdpaSpec {
                dtype,
                head_dim,
                ..spec()
            }
            .supported()
            .is_ok()
        );
    }
    for (dtype, head_dim, needle) in [
        (DType::F32, 64, "not f32"),
        (DType::BF16, 100, "head dim 100"),
        (DType::BF16, 256, "head dim 256"),
    ] {
        let err = SdpaSpec {
            dtype,
            head_dim,
            ..spec()
        }
        .supported()
        .unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, CudaLibError::AttentionUnsupported { .. }),
            "{text}"
        );
        assert!(text.contains(needle), "`{needle}` missing from: {text}");
        assert!(text.contains("composed attention"), "{text}");
    }
}

#[test]
fn operands_are_checked_against_their_buffers() {
    let dims = [2, 4, 128, 64];
    let dense = [4 * 128 * 64, 128 * 64, 64, 1];
    let bytes = 2 * 4 * 128 * 64 * 2;
    assert_eq!(end_byte(0, dims, dense, 2), Some(bytes));
    assert_eq!(
        layout("q", bytes, 0, dense, dims, 2).unwrap(),
        dense.map(|s| s as i64)
    );
    // A [B, T, H, D] buffer read as [B, H, T, D] ends where the dense one does.
    let bthd = [128 * 4 * 64, 64, 4 * 64, 1];
    assert_eq!(end_byte(0, dims, bthd, 2), Some(bytes));
    // One element short.
    let err = layout("q", bytes - 2, 0, dense, dims, 2).unwrap_err();
    assert_eq!(argument_of(err), "q");
    let text = layout("k", bytes, 2, dense, dims, 2)
        .unwrap_err()
        .to_string();
    assert!(text.contains("reaches byte"), "{text}");
    let err = layout("v", bytes + 1, 1, dense, dims, 2).unwrap_err();
    assert!(
        err.to_string().contains("multiple of the element size"),
        "{err}"
    );
    // A non-contiguous head dim is cuDNN's limit, not a wrong argument.
    let err = layout(
        "o",
        2 * bytes,
        0,
        [dense[0] * 2, dense[1] * 2, 128, 2],
        dims,
        2,
    )
    .unwrap_err();
    assert!(
        matches!(err, CudaLibError::AttentionUnsupported { .. }),
        "{err}"
    );
    // The statistics' unit axis may have any stride; cuDNN gets 1.
    let stats = layout(
        "stats",
        2 * 4 * 128 * 4,
        0,
        [512, 128, 1, 0],
        [2, 4, 128, 1],
        4,
    );
    assert_eq!(stats.unwrap(), [512, 128, 1, 1]);
    assert_eq!(end_byte(0, [usize::MAX, 2, 1, 1], [2, 1, 1, 1], 2), None);
    assert_eq!(end_byte(64, [0, 4, 128, 64], dense, 2), Some(64));
}

#[test]
fn dropout_without_its_seed_is_an_error() {
    let s = SdpaSpec {
        dropout: 0.1,
        ..spec()
    };
    assert_eq!(argument_of(check_rng(&s, None).unwrap_err()), "rng");
    assert!(check_rng(&spec(), None).is_ok());
}

#[test]
fn plans_are_keyed_by_every_option_that_shapes_the_graph() {
    let strides = Strides::default();
    let key = |s: SdpaSpec| plan_key(&s, 1, Pass::Forward, strides);
    let base = key(spec());
    assert_eq!(base, key(spec()));
    assert_ne!(
        base,
        key(SdpaSpec {
            scale: 0.25,
            ..spec()
        })
    );
    assert_ne!(
        base,
        key(SdpaSpec {
            causal: Causal::BottomRight,
            ..spec()
        })
    );
    assert_ne!(
        base,
        key(SdpaSpec {
            dropout: 0.1,
            ..spec()
        })
    );
    assert_ne!(base, plan_key(&spec(), 2, Pass::Forward, strides));
    assert_ne!(base, plan_key(&spec(), 1, Pass::Backward, strides));
}

#[test]
fn without_libcudnn_the_call_is_the_no_cudnn_error_not_a_panic() {
    if cudnn_present() {
        return;
    }
    let err = usable_cudnn().unwrap_err();
    assert!(matches!(err, CudaLibError::NoCudnn { .. }), "{err}");
}

#[test]
fn older_cudnn_masks_with_the_lowest_float() {
    assert_eq!(masked_value(90500), f32::MIN);
    assert_eq!(masked_value(91000), f32::NEG_INFINITY);
}

#[test]
fn known_limits_of_cudnn_versions_are_refused_with_the_reason() {
    let s = spec();
    assert_eq!(known_limit(&s, true, 91900, 9), None);
    let refused = |s: &SdpaSpec, backward, version, major, needle: &str| {
        let reason = known_limit(s, backward, version, major).expect("refused");
        assert!(reason.contains(needle), "`{needle}` missing from: {reason}");
    };
    refused(&s, false, 91900, 7, "compute capability");
    refused(&s, true, 91001, 9, "9.10.2");
    let bottom_right = SdpaSpec {
        causal: Causal::BottomRight,
        ..s
    };
    refused(
        &SdpaSpec {
            q_len: 256,
            ..bottom_right
        },
        false,
        91900,
        9,
        "q_len (256)",
    );
    refused(
        &SdpaSpec {
            dropout: 0.1,
            ..bottom_right
        },
        false,
        91900,
        9,
        "dropout",
    );
    refused(
        &SdpaSpec {
            q_len: 100,
            ..bottom_right
        },
        false,
        90500,
        9,
        "multiples of 64",
    );
    assert_eq!(
        known_limit(
            &SdpaSpec {
                q_len: 100,
                ..bottom_right
            },
            false,
            90600,
            9
        ),
        None
    );
    refused(
        &SdpaSpec {
            q_len: 1,
            kv_len: 1,
            causal: Causal::None,
            ..s
        },
        true,
        91900,
        9,
        "q_len = kv_len = 1",
    );
}
