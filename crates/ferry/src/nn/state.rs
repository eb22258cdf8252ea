//! Checking a state dict against the tensors it should fill, then filling them.
//!
//! Two passes so that a bad checkpoint changes nothing: [`check_state`] finds every problem
//! first; only then does [`assign_state`] move what needs moving and write in place.

use std::collections::HashMap;

use ferry_tensor::{Device, Tensor, with_no_grad};
use ferry_transfer::{DeviceMove, move_state_dict};

use crate::checkpoint::{CheckpointError, Mismatch};

/// Checks that `state` has exactly the keys of `expected`, each with its shape and dtype.
/// `what` names the owner in the error ("model", "optimizer"). Every problem is reported, in
/// `expected`'s order, then unexpected keys.
pub fn check_state(
    what: &'static str,
    expected: &[(String, Tensor)],
    state: &[(String, Tensor)],
) -> Result<(), CheckpointError> {
    let given: HashMap<&str, &Tensor> = state.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let mut problems = Vec::new();
    for (key, want) in expected {
        match given.get(key.as_str()) {
            None => problems.push(Mismatch::Missing {
                key: key.clone(),
                shape: want.shape().to_vec(),
                dtype: want.dtype(),
            }),
            Some(got) if got.shape() != want.shape() => problems.push(Mismatch::Shape {
                key: key.clone(),
                expected: want.shape().to_vec(),
                found: got.shape().to_vec(),
            }),
            Some(got) if got.dtype() != want.dtype() => problems.push(Mismatch::DType {
                key: key.clone(),
                expected: want.dtype(),
                found: got.dtype(),
            }),
            Some(_) => {}
        }
    }
    let known: HashMap<&str, ()> = expected.iter().map(|(k, _)| (k.as_str(), ())).collect();
    for (key, got) in state {
        if !known.contains_key(key.as_str()) {
            problems.push(Mismatch::Unexpected {
                key: key.clone(),
                shape: got.shape().to_vec(),
            });
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(CheckpointError::Mismatch { what, problems })
    }
}

/// Writes each tensor of `state` into the tensor of `targets` with the same name, in place,
/// under `no_grad` (so leaves stay leaves). Call [`check_state`] first: this assumes the keys,
/// shapes and dtypes match. Sources on another device are moved first, all of them before any
/// write (in one batch when the targets share a device), so a failed move changes nothing.
pub fn assign_state(
    targets: &[(String, Tensor)],
    state: &[(String, Tensor)],
) -> Result<(), CheckpointError> {
    let given: HashMap<&str, &Tensor> = state.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let pairs: Vec<(&Tensor, Tensor)> = targets
        .iter()
        .filter_map(|(k, t)| given.get(k.as_str()).map(|s| (t, (*s).clone())))
        .collect();
    let sources = moved_to_targets(&pairs)?;
    with_no_grad(|| -> Result<(), CheckpointError> {
        for ((target, _), source) in pairs.iter().zip(&sources) {
            target.assign(source)?;
        }
        Ok(())
    })
}

/// The sources of `pairs`, each on its target's device.
fn moved_to_targets(pairs: &[(&Tensor, Tensor)]) -> Result<Vec<Tensor>, CheckpointError> {
    let devices: Vec<Device> = pairs.iter().map(|(t, _)| t.device()).collect();
    let one_device = devices.windows(2).all(|w| w[0] == w[1]);
    let needs_move = pairs.iter().any(|(t, s)| t.device() != s.device());
    if one_device && needs_move {
        // One batch, one synchronization, whatever the number of tensors.
        let batch: Vec<(String, Tensor)> = pairs
            .iter()
            .enumerate()
            .map(|(i, (_, s))| (i.to_string(), s.clone()))
            .collect();
        let (moved, _report) = move_state_dict(&batch, devices[0])?;
        return Ok(moved.into_iter().map(|(_, t)| t).collect());
    }
    Ok(with_no_grad(|| {
        pairs
            .iter()
            .map(|(t, s)| s.detach().to(t.device()))
            .collect::<ferry_tensor::Result<Vec<_>>>()
    })?)
}
