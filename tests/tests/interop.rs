use std::fs;

use ferry::memory::{bf16, f16};
use ferry::ndarray::{Array2, ArrayD, IxDyn, ShapeBuilder, s};
use ferry::{DeviceMove, NpyError, TensorError, from_ndarray, load_npy, save_npy, to_ndarray};
use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::randn;

fn run(body: impl FnOnce() -> Result<()>) {
    ferry_tests::fresh_seed();
    if let Err(e) = body() {
        panic!("(replay with FERRY_SEED={}): {e}", ferry_tests::seed());
    }
}

#[test]
fn ndarray_round_trips_keep_values_shape_and_dtype() {
    run(|| {
        let x = randn(Device::Cpu, &[4, 3, 2])?;
        for t in [x.clone(), x.transpose(0, 2)?, x.narrow(1, 1, 2)?] {
            let a = to_ndarray::<f64>(&t)?;
            assert_eq!(a.shape(), t.shape());
            assert_eq!(a.iter().copied().collect::<Vec<_>>(), t.to_vec::<f64>()?);
            let back = from_ndarray(&a)?;
            assert_eq!((back.shape(), back.dtype()), (t.shape(), DType::F64));
            assert_eq!(back.to_vec::<f64>()?, t.to_vec::<f64>()?);
        }
        let halves = x.to_dtype(DType::F16)?;
        assert_eq!(
            from_ndarray(&to_ndarray::<f16>(&halves)?)?.to_vec::<f16>()?,
            halves.to_vec::<f16>()?
        );
        let brains = x.to_dtype(DType::BF16)?;
        assert_eq!(to_ndarray::<bf16>(&brains)?.len(), 24);
        let scalar = to_ndarray::<f64>(&Tensor::scalar(2.5f64))?;
        assert_eq!((scalar.ndim(), scalar[IxDyn(&[])]), (0, 2.5));
        Ok(())
    })
}

#[test]
fn arrays_in_any_layout_become_row_major_tensors() {
    run(|| {
        let fortran = Array2::from_shape_vec((2, 3).f(), vec![1i64, 4, 2, 5, 3, 6]).unwrap();
        assert_eq!(from_ndarray(&fortran)?.to_vec::<i64>()?, [1, 2, 3, 4, 5, 6]);
        let base = ArrayD::from_shape_vec(IxDyn(&[3, 4]), (0u8..12).collect()).unwrap();
        let sliced = base.slice(s![1.., ..;2]);
        let t = from_ndarray(&sliced)?;
        assert_eq!(
            (t.shape(), t.to_vec::<u8>()?),
            (&[2usize, 2][..], vec![4, 6, 8, 10])
        );
        Ok(())
    })
}

#[test]
fn leaving_the_graph_or_the_dtype_is_an_error_that_names_the_fix() {
    run(|| {
        let w = randn(Device::Cpu, &[3])?.with_grad()?;
        let err = to_ndarray::<f64>(&w).unwrap_err();
        assert!(matches!(
            err,
            TensorError::RequiresGrad { op: "to_ndarray" }
        ));
        assert!(err.to_string().contains(".detach()"), "{err}");
        assert_eq!(to_ndarray::<f64>(&w.detach())?.len(), 3);
        let err = to_ndarray::<f32>(&w.detach()).unwrap_err();
        assert!(err.to_string().contains("DType::F32"), "{err}");
        let dir = tempfile::tempdir().unwrap();
        let err = save_npy(&w, dir.path().join("w.npy")).unwrap_err();
        assert!(err.to_string().contains(".detach()"), "{err}");
        Ok(())
    })
}

#[test]
#[ignore = "needs a CUDA device"]
fn a_cuda_tensor_must_be_moved_to_the_host_first() {
    run(|| {
        let x = randn(Device::Cuda(0), &[3])?;
        let err = to_ndarray::<f64>(&x).unwrap_err();
        assert!(matches!(err, TensorError::NotOnHost { .. }));
        assert!(err.to_string().contains(".to(Device::Cpu)"), "{err}");
        assert_eq!(to_ndarray::<f64>(&x.to(Device::Cpu)?)?.len(), 3);
        Ok(())
    })
}

#[test]
fn npy_files_round_trip_every_dtype_they_can_hold() {
    run(|| {
        let dir = tempfile::tempdir().unwrap();
        let x = randn(Device::Cpu, &[5, 4])?.mul_scalar(50.0)?;
        let cases = [
            x.clone(),
            x.t()?,
            x.to_dtype(DType::F32)?,
            x.to_dtype(DType::I64)?,
            x.abs()?.to_dtype(DType::U8)?,
            Tensor::scalar(7.0f32),
            Tensor::zeros(&[0, 3], DType::F64, Device::Cpu)?,
        ];
        for (i, t) in cases.iter().enumerate() {
            let path = dir.path().join(format!("{i}.npy"));
            save_npy(t, &path).unwrap();
            let back = load_npy(&path).unwrap();
            assert_eq!(
                (back.shape(), back.dtype()),
                (t.shape(), t.dtype()),
                "case {i}"
            );
            assert_eq!(back.to_vec_f64()?, t.to_vec_f64()?, "case {i}");
        }
        let err = save_npy(&x.to_dtype(DType::F16)?, dir.path().join("h.npy")).unwrap_err();
        assert!(err.to_string().contains("to_dtype(DType::F32)"), "{err}");
        Ok(())
    })
}

#[test]
fn bad_npy_files_are_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.npy");
    save_npy(
        &Tensor::from_slice(&[1.0f64, 2.0, 3.0, 4.0], &[2, 2]).unwrap(),
        &good,
    )
    .unwrap();
    let bytes = fs::read(&good).unwrap();
    let data = &bytes[bytes.len() - 32..];
    // A version 1.0 header describing `descr` and `shape`, padded as NumPy pads it.
    let file = |descr: &str, shape: &str| -> Vec<u8> {
        let mut dict =
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        while (10 + dict.len() + 1) % 64 != 0 {
            dict.push(' ');
        }
        dict.push('\n');
        let len = u16::try_from(dict.len()).unwrap().to_le_bytes();
        [b"\x93NUMPY\x01\x00".as_slice(), &len, dict.as_bytes(), data].concat()
    };
    assert!(
        load_npy_bytes(dir.path(), file("<f8", "(2, 2)")).is_ok(),
        "the hand-made header is valid"
    );
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("garbage", b"this is not a numpy file at all".to_vec()),
        ("truncated data", bytes[..bytes.len() - 5].to_vec()),
        ("truncated header", bytes[..20].to_vec()),
        ("extra bytes", [bytes.clone(), vec![0; 8]].concat()),
        (
            "a shape far larger than the file",
            file("<f8", "(99999999999, 9)"),
        ),
        (
            "a shape whose size overflows",
            file("<f8", "(18446744073709551615, 3)"),
        ),
        ("a negative dimension", file("<f8", "(-2, 2)")),
        ("complex numbers", file("<c8", "(2, 2)")),
    ];
    for (what, contents) in cases {
        let path = dir.path().join("bad.npy");
        fs::write(&path, contents).unwrap();
        let err = load_npy(&path).expect_err(what);
        assert!(err.to_string().contains("bad.npy"), "{what}: {err}");
    }
    let missing = load_npy(dir.path().join("missing.npy")).unwrap_err();
    assert!(matches!(missing, NpyError::Io { .. }), "{missing}");
}

fn load_npy_bytes(dir: &std::path::Path, contents: Vec<u8>) -> Result<Tensor, NpyError> {
    let path = dir.join("made.npy");
    fs::write(&path, contents).unwrap();
    load_npy(path)
}

/// `save_npy` writes a new file and renames it over the old one: a hard link to the old file
/// keeps the old bytes (a write in place would change both names), and no temporary is left.
#[test]
fn save_npy_replaces_the_file_instead_of_writing_into_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.npy");
    let old = Tensor::from_slice(&[1.0f64, 2.0], &[2]).unwrap();
    save_npy(&old, &path).unwrap();
    let link = dir.path().join("w-before.npy");
    fs::hard_link(&path, &link).unwrap();
    let new = Tensor::from_slice(&[5.0f64, 6.0, 7.0], &[3]).unwrap();
    save_npy(&new, &path).unwrap();
    assert_eq!(
        load_npy(&path).unwrap().to_vec_f64().unwrap(),
        [5.0, 6.0, 7.0]
    );
    assert_eq!(load_npy(&link).unwrap().to_vec_f64().unwrap(), [1.0, 2.0]);
    let names: Vec<String> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "a temporary was left: {names:?}");
}
