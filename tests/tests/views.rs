use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::{device_test, randn, tensor, values};

fn views_share(device: Device) -> Result<()> {
    let x = Tensor::arange(0.0, 24.0, DType::F64, device)?.reshape(&[2, 3, 4])?;
    let views = [
        ("transpose", x.transpose(0, 2)?),
        ("t", x.t()?),
        ("narrow", x.narrow(1, 1, 2)?),
        ("chunk", x.chunk(2, -1)?.remove(1)),
        ("broadcast_to", x.narrow(0, 0, 1)?.broadcast_to(&[5, 3, 4])?),
        ("reshape of contiguous", x.reshape(&[6, 4])?),
        ("unsqueeze", x.unsqueeze(1)?),
        ("squeeze", x.unsqueeze(0)?.squeeze(0)?),
        ("unsqueeze of a transposed view", x.t()?.unsqueeze(0)?),
        ("contiguous of contiguous", x.contiguous()?),
    ];
    for (what, view) in &views {
        assert!(view.shares_storage(&x), "{what} copied");
    }
    assert_eq!(
        x.storage().bytes(),
        24 * 8,
        "views allocate nothing in the base"
    );

    // Values are read through the strides: x[i, j, k] = 12 i + 4 j + k.
    // transpose(0, 2)[3, j, i] = x[i, j, 3], so j runs slower than i.
    assert_eq!(
        values(&x.transpose(0, 2)?.narrow(0, 3, 1)?),
        [3.0, 15.0, 7.0, 19.0, 11.0, 23.0]
    );
    assert_eq!(
        values(&x.narrow(1, 1, 2)?.narrow(2, 2, 1)?),
        [6.0, 10.0, 18.0, 22.0]
    );
    let t = x.t()?.unsqueeze(0)?;
    assert_eq!(t.shape(), [1, 2, 4, 3]);
    assert_eq!(
        values(&t.narrow(2, 1, 1)?),
        [1.0, 5.0, 9.0, 13.0, 17.0, 21.0]
    );

    // Contiguity is what the layout says it is.
    assert!(!x.t()?.is_contiguous());
    assert!(x.narrow(0, 1, 1)?.is_contiguous());
    assert!(!x.narrow(2, 1, 2)?.is_contiguous());
    Ok(())
}
device_test!(views_share_storage_and_copy_nothing, views_share);

fn non_contiguous_reshape(device: Device) -> Result<()> {
    let x = tensor(device, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    let xt = x.t()?; // [[1, 4], [2, 5], [3, 6]]
    let flat = xt.reshape(&[6])?;
    assert_eq!(values(&flat), [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    assert!(
        !flat.shares_storage(&x),
        "a reshape of a non-contiguous view must copy"
    );
    assert!(flat.is_contiguous());
    assert_eq!(
        values(&xt.reshape(&[2, 3])?),
        [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
    );
    // A narrowed view with gaps, and a broadcast view: reshape reads them in logical order.
    assert_eq!(
        values(&x.narrow(1, 1, 2)?.reshape(&[4])?),
        [2.0, 3.0, 5.0, 6.0]
    );
    let row = tensor(device, &[7.0, 8.0], &[1, 2])?.broadcast_to(&[3, 2])?;
    assert_eq!(values(&row.reshape(&[6])?), [7.0, 8.0, 7.0, 8.0, 7.0, 8.0]);
    Ok(())
}
device_test!(reshape_of_non_contiguous_views, non_contiguous_reshape);

fn chunk_sizes(device: Device) -> Result<()> {
    let sizes = |n: usize, chunks: usize| -> Result<Vec<usize>> {
        let x = Tensor::zeros(&[2, n], DType::F32, device)?;
        Ok(x.chunk(chunks, 1)?.iter().map(|c| c.shape()[1]).collect())
    };
    // As in PyTorch: chunks of ceil(n / chunks), the last one smaller, possibly fewer chunks.
    assert_eq!(sizes(10, 3)?, [4, 4, 2]);
    assert_eq!(sizes(9, 3)?, [3, 3, 3]);
    assert_eq!(sizes(6, 4)?, [2, 2, 2]);
    assert_eq!(sizes(2, 5)?, [1, 1]);
    assert_eq!(sizes(7, 1)?, [7]);
    Ok(())
}
device_test!(chunk_sizes_match_pytorch, chunk_sizes);

fn cat_narrow(device: Device) -> Result<()> {
    let x = randn(device, &[3, 10, 2])?;
    let chunks = x.chunk(3, 1)?;
    let refs: Vec<&Tensor> = chunks.iter().collect();
    let joined = Tensor::cat(&refs, 1)?;
    assert_eq!(values(&joined), values(&x));
    assert!(!joined.shares_storage(&x), "cat makes new storage");

    let (a, b, c) = (
        randn(device, &[2, 1, 3])?,
        randn(device, &[3, 2, 2])?.transpose(0, 2)?,
        randn(device, &[2, 4, 3])?,
    );
    let abc = Tensor::cat(&[&a, &b, &c], 1)?;
    assert_eq!(abc.shape(), [2, 7, 3]);
    assert_eq!(values(&abc.narrow(1, 0, 1)?), values(&a));
    assert_eq!(values(&abc.narrow(1, 1, 2)?), values(&b));
    assert_eq!(values(&abc.narrow(1, 3, 4)?), values(&c));
    // Along the first and last axes too.
    let rows = Tensor::cat(&[&a, &a.mul_scalar(2.0)?], 0)?;
    assert_eq!(values(&rows.narrow(0, 2, 2)?), values(&a.mul_scalar(2.0)?));
    let cols = Tensor::cat(&[&c, &c], -1)?;
    assert_eq!(cols.shape(), [2, 4, 6]);
    assert_eq!(values(&cols.narrow(-1, 3, 3)?), values(&c));
    Ok(())
}
device_test!(cat_and_narrow_round_trip, cat_narrow);

fn assign_in_place(device: Device) -> Result<()> {
    let w = tensor(device, &[1.0, 2.0, 3.0, 4.0], &[2, 2])?.with_grad()?;
    let update = tensor(device, &[10.0, 20.0, 30.0, 40.0], &[2, 2])?;
    let err = w.assign(&update).unwrap_err();
    assert!(err.to_string().contains("no_grad"), "{err}");
    {
        let _guard = ferry_tensor::no_grad();
        // w ← w − 0.5·update, the shape of an SGD step; w stays the same leaf.
        w.assign(&w.sub(&update.mul_scalar(0.5)?)?)?;
        // A view writes through to its storage: the second column becomes [7, 8].
        w.narrow(1, 1, 1)?
            .assign(&tensor(device, &[7.0, 8.0], &[2, 1])?)?;
    }
    assert_eq!(values(&w), [-4.0, 7.0, -12.0, 8.0]);
    assert!(w.requires_grad() && w.is_leaf());
    let err = w.detach().assign(&update.narrow(0, 0, 1)?).unwrap_err();
    assert!(err.to_string().contains("same shape"), "{err}");
    Ok(())
}
device_test!(assign_writes_in_place, assign_in_place);

fn pack_parts(device: Device) -> Result<()> {
    let a = tensor(device, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
    let b = tensor(device, &[7.0, 8.0, 9.0], &[3])?;
    let c = a.t()?; // not contiguous: packed from a copy
    let (packed, offsets) = Tensor::pack(&[&a, &b, &c], 64)?;
    // f64 parts start at multiples of 64 bytes = 8 elements.
    assert_eq!(offsets, [0, 8, 16]);
    assert_eq!(packed.shape(), &[22]);
    let all = values(&packed);
    assert_eq!(&all[..6], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    assert_eq!(&all[8..11], &[7.0, 8.0, 9.0]);
    assert_eq!(&all[16..22], &[1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    // Many parts at once (more than one gather launch on a GPU).
    let parts: Vec<Tensor> = (0..150)
        .map(|i| Tensor::full(&[i % 7 + 1], i as f64, DType::F64, device))
        .collect::<Result<_>>()?;
    let refs: Vec<&Tensor> = parts.iter().collect();
    let (packed, offsets) = Tensor::pack(&refs, 8)?;
    let all = values(&packed);
    for (i, (part, &at)) in parts.iter().zip(&offsets).enumerate() {
        assert!(
            all[at..at + part.numel()].iter().all(|&v| v == i as f64),
            "part {i}"
        );
    }
    assert!(
        Tensor::pack(&[&a], 3).is_err(),
        "alignment must be a multiple of the element size"
    );
    Ok(())
}
device_test!(pack_places_parts_at_aligned_offsets, pack_parts);
