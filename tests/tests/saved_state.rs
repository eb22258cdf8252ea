//! After a forward pass the graph keeps alive exactly what each rule declares: for every
//! recording op, on each device, weak references to the inputs', outputs' and intermediates'
//! storages show which outlive the caller's handles, and the graph's saved bytes are theirs.
//! Each case counts its own graph, so these run in parallel with everything else; the same
//! cases, with allocated bytes read from the allocator, run serialised in memory_accounting.

use std::sync::Arc;

use ferry_tensor::{DType, Device, Result, Tensor};
use ferry_tests::device_test;

pub(crate) mod cases;

fn group(device: Device, cases: Vec<cases::Case>) -> Result<()> {
    for case in &cases {
        cases::check(device, case, None)?;
    }
    Ok(())
}

fn binary_ops(device: Device) -> Result<()> {
    group(device, cases::binary())
}
device_test!(binary_ops_keep_what_the_other_gradient_needs, binary_ops);

fn unary_ops(device: Device) -> Result<()> {
    group(device, cases::unary())
}
device_test!(unary_ops_keep_their_input_output_or_nothing, unary_ops);

fn reductions(device: Device) -> Result<()> {
    group(device, cases::reductions())
}
device_test!(reductions_keep_shapes_and_max_its_indices, reductions);

fn matmul(device: Device) -> Result<()> {
    group(device, cases::matmul())
}
device_test!(matmul_keeps_each_operand_for_the_other, matmul);

fn shapes(device: Device) -> Result<()> {
    group(device, cases::shapes())
}
device_test!(views_copies_and_casts_keep_nothing, shapes);

fn softmax_family(device: Device) -> Result<()> {
    group(device, cases::softmax_family())
}
device_test!(softmax_family_keeps_outputs_and_targets, softmax_family);

fn moves_and_chains(device: Device) -> Result<()> {
    group(device, cases::moves_and_chains())
}
device_test!(
    moves_keep_nothing_and_chains_keep_what_rules_say,
    moves_and_chains
);

fn chain(device: Device) -> Result<()> {
    cases::chain_keeps_only_the_leaf_and_exp(device, None)
}
device_test!(a_four_op_chain_keeps_the_leaf_and_exp_output, chain);

/// Two graphs that save one storage (a data tensor both multiply by) count it once each; once
/// an op joins them, the merged graph counts it once, until the last node saving it goes.
fn shared_storage(device: Device) -> Result<()> {
    let x = Tensor::randn(&[16], DType::F32, device)?;
    let (a, b) = (
        Tensor::randn(&[16], DType::F32, device)?.with_grad()?,
        Tensor::randn(&[16], DType::F32, device)?.with_grad()?,
    );
    let (ya, yb) = (a.mul(&x)?, b.mul(&x)?); // each saves x for its leaf's gradient
    let (ga, gb) = (ya.graph().unwrap(), yb.graph().unwrap());
    assert!(!ga.same_graph(&gb));
    assert_eq!((ga.saved_bytes(), gb.saved_bytes()), (64, 64));
    let x_storage = Arc::downgrade(x.storage());
    drop(x);
    let z = ya.add(&yb)?; // add saves nothing; the two graphs become one
    assert!(ga.same_graph(&gb));
    assert_eq!(ga.saved_bytes(), 64, "x counted once in the merged graph");
    drop((z, ya));
    assert_eq!(ga.saved_bytes(), 64, "b's product still saves x");
    assert!(x_storage.upgrade().is_some());
    drop(yb);
    assert_eq!(ga.saved_bytes(), 0);
    assert!(
        x_storage.upgrade().is_none(),
        "x went with the last node saving it"
    );
    assert_eq!(ga.live_nodes(), 2, "the leaves");
    Ok(())
}
device_test!(
    a_storage_two_graphs_save_counts_once_after_they_merge,
    shared_storage
);
