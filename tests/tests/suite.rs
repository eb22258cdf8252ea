//! ferry's behaviour, tested through its public API. One binary: each test binary costs a link.

// Numerical gradients of arithmetic, scalar ops and activations, broadcast and non-contiguous.
mod grad_elementwise;
// Numerical gradients of sums, means, maxima and matrix products.
mod grad_reduce;
// Numerical gradients of views, rearrangements, casts and the softmax family.
mod grad_shape;
// Broadcasting against a naive reference, by hand and by proptest.
mod broadcasting;
// Hand-worked derivatives and naive references for matmul, reductions and argmax.
mod values;
// Views share storage and copy nothing; chunk, narrow and cat agree with each other.
mod views;
// Autograd behaviour that does not depend on process-wide graph counts.
mod autograd;
// f16 and bf16: casts, round trips and ops against f32.
mod dtypes;
// Every TensorError reachable on a CPU, and what its message tells the user to do.
mod errors;
// 0-dimensional and empty tensors, stride-0 inputs, shapes too large to count.
mod edge_cases;
// Device moves: gradients go home, dtypes fuse, copies are exact and carry no .grad.
mod transfer;
// Modules: Linear, Sequential names, Dropout, Kaiming/Xavier init, losses, leaves kept by `to`.
mod nn;
// SGD, Adam, AdamW against hand-worked updates; zero_grad; optimizer state dicts.
mod optim;
// safetensors checkpoints: round trips, and bad files refused with the key named.
mod checkpoint;
// Checkpoints read by Python's safetensors (numpy here, PyTorch on the GPU machine) and back.
mod checkpoint_interop;
// Chunk plans, reports, chunked/async/batched moves: bit-identity and the gradient path.
mod transfer_methods;
// ndarray and .npy interop: round trips, and errors that name the fix.
mod interop;
// The DOT figures in docs/transfer-methods.md, regenerated from the real moves.
mod transfer_docs;
// Every path, figure, package and subcommand the guide (docs/guide/) names exists.
mod guide;
