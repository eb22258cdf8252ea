use ferry_tensor::{Device, Result, Tensor, broadcast_shapes};
use ferry_tests::{assert_close, broadcast_at, device_test, indices, randn, values};
use proptest::prelude::*;

type Binary = fn(&Tensor, &Tensor) -> Result<Tensor>;
type Reference = fn(f64, f64) -> f64;

const OPS: [(Binary, Reference); 4] = [
    (Tensor::add, |a, b| a + b),
    (Tensor::sub, |a, b| a - b),
    (Tensor::mul, |a, b| a * b),
    (Tensor::div, |a, b| a / b),
];

/// Checks every op on `a` and `b` against the naive per-index reference.
fn agrees_with_reference(a: &Tensor, b: &Tensor) -> Result<()> {
    let shape = broadcast_shapes("test", a.shape(), b.shape())?;
    let (da, db) = (values(a), values(b));
    for (op, reference) in OPS {
        let out = op(a, b)?;
        assert_eq!(out.shape(), shape.as_slice());
        let expected: Vec<f64> = indices(&shape)
            .iter()
            .map(|i| {
                reference(
                    broadcast_at(&da, a.shape(), i),
                    broadcast_at(&db, b.shape(), i),
                )
            })
            .collect();
        assert_close(&values(&out), &expected, 1e-12);
    }
    Ok(())
}

fn hand_picked(device: Device) -> Result<()> {
    let pairs: [(&[usize], &[usize]); 6] = [
        (&[3, 1], &[1, 4]),
        (&[4], &[2, 3, 4]),
        (&[], &[2, 3]),
        (&[2, 1, 3], &[4, 1]),
        (&[1], &[5]),
        (&[2, 3], &[2, 3]),
    ];
    for (sa, sb) in pairs {
        agrees_with_reference(&randn(device, sa)?, &randn(device, sb)?)?;
        agrees_with_reference(&randn(device, sb)?, &randn(device, sa)?)?;
    }
    // Non-contiguous operands: a transposed view against a broadcast view.
    let a = randn(device, &[4, 3])?.t()?;
    let b = randn(device, &[3, 1])?.broadcast_to(&[3, 4])?;
    agrees_with_reference(&a, &b)?;
    agrees_with_reference(&b, &a)?;
    Ok(())
}
device_test!(broadcast_pairs_match_reference, hand_picked);

fn worked_example(device: Device) -> Result<()> {
    // [[1],[2],[3]] + [[10, 20]] = [[11, 21], [12, 22], [13, 23]]
    let col = ferry_tests::tensor(device, &[1.0, 2.0, 3.0], &[3, 1])?;
    let row = ferry_tests::tensor(device, &[10.0, 20.0], &[1, 2])?;
    let sum = col.add(&row)?;
    assert_eq!(sum.shape(), [3, 2]);
    assert_eq!(values(&sum), [11.0, 21.0, 12.0, 22.0, 13.0, 23.0]);
    // Comparisons broadcast the same way and give u8.
    let gt = col.gt(&ferry_tests::tensor(device, &[1.5], &[])?)?;
    assert_eq!(gt.dtype(), ferry_tensor::DType::U8);
    assert_eq!(gt.to_vec::<u8>()?, [0, 1, 1]);
    Ok(())
}
device_test!(broadcast_worked_example, worked_example);

/// An output shape of rank 0..=4 and two operand shapes that broadcast to it: each keeps a
/// suffix of the output's dimensions, some set to 1.
fn broadcast_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    prop::collection::vec(1usize..4, 0..=4).prop_flat_map(|out| {
        let n = out.len();
        let operand = move |out: Vec<usize>| {
            (0..=n, prop::collection::vec(any::<bool>(), n)).prop_map(move |(rank, ones)| {
                (n - rank..n)
                    .map(|i| if ones[i] { 1 } else { out[i] })
                    .collect::<Vec<usize>>()
            })
        };
        (operand(out.clone()), operand(out))
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn elementwise_broadcasting_matches_naive_reference((sa, sb) in broadcast_pair(), transpose in any::<bool>()) {
        let a = randn(Device::Cpu, &sa).unwrap();
        // Sometimes read `b` through a reversed-axes view of a tensor laid out the other way.
        let b = if transpose && sb.len() >= 2 {
            let mut rev = sb.clone();
            rev.reverse();
            let mut t = randn(Device::Cpu, &rev).unwrap();
            for i in 0..sb.len() / 2 {
                t = t.transpose(i as isize, (sb.len() - 1 - i) as isize).unwrap();
            }
            t
        } else {
            randn(Device::Cpu, &sb).unwrap()
        };
        prop_assert_eq!(b.shape(), sb.as_slice());
        agrees_with_reference(&a, &b).unwrap();
    }
}
