//! ferry's behaviour, tested through its public API. One binary: each test binary costs a link.

// Numerical gradients of arithmetic, scalar ops and activations, broadcast and non-contiguous.
mod grad_elementwise;
// Numerical gradients of sums, means, maxima and matrix products.
mod grad_reduce;
// Numerical gradients of views, rearrangements, casts and the softmax family.
mod grad_shape;
// Numerical gradients and references of index_select, gather, scatter_add, embedding, layer_norm.
mod grad_index;
// rotary_embedding: references, numerical gradients, strided inputs, half precision, errors.
mod rotary;
// rms_norm: references, numerical gradients, f32 and half against f64, bf16's rounding order.
mod rms_norm;
// GELU, SiLU, sin, cos, clamp, maximum/minimum, where_cond, masked_fill, permute, stack, dropout.
mod grad_ops;
// conv2d (stride, padding, dilation, groups), max and average pooling, Conv2d and pools.
mod grad_conv;
// Fused step ops (cuBLASLt linear, nll, softmax backward, column sums, Adam) against f64.
mod fused;
// Cross-entropy as one op: ignore_index, long rows, bf16, what its node keeps, against f64.
mod cross_entropy;
// Whole models trained on the CPU and on the GPU from the same weights follow each other.
mod models;
// Broadcasting against a naive reference, by hand and by proptest.
mod broadcasting;
// Hand-worked derivatives and naive references for matmul, reductions and argmax.
mod values;
// Views share storage and copy nothing; chunk, narrow and cat agree with each other.
mod views;
// Autograd behaviour: retain_graph, traces, DOT, errors of the engine.
mod autograd;
// Live-node, saved-byte and recorded counts of each test's own graph, in parallel.
mod graph_accounting;
// Training steps give back their graph; GraphWatch catches a running total that keeps it.
mod leak_check;
// Every recording op keeps alive exactly the tensors its rule declares, and saved_bytes says so.
mod saved_state;
// The op registry walked: recorded ops, gradcheck, saved state; every recorded op registered.
mod registry;
// Threads training their own models read exact counts of their own graphs, with no lock.
mod concurrency;
// f16 and bf16: casts, round trips and ops against f32.
mod dtypes;
// No library file over 700 lines, no module cycle in any crate.
mod code_layout;
// Every TensorError reachable on a CPU, and what its message tells the user to do.
mod errors;
// 0-dimensional and empty tensors, stride-0 inputs, shapes too large to count.
mod edge_cases;
// Shapes too large to address: refused before allocating, named, and the process goes on.
mod sizes;
// One storage read twice, or several written, while other threads write: no deadlock.
mod deadlocks;
// Device moves: gradients go home, dtypes fuse, copies are exact and carry no .grad.
mod transfer;
// Modules: Linear, Sequential names, Dropout, Kaiming/Xavier init, losses, leaves kept by `to`.
mod nn;
// SGD, Adam, AdamW against hand-worked updates; zero_grad; optimizer state dicts.
mod optim;
// The CPU AdamW over host slices against the tensor step on each device (f64 CPU, CUDA kernel).
mod host_optim;
// safetensors checkpoints: round trips, and bad files refused with the key named.
mod checkpoint;
mod checkpoint_async;
// Checkpoints read by Python's safetensors (numpy here, PyTorch on the GPU machine) and back.
mod checkpoint_interop;
// 100,000 damaged or made-up checkpoint and .npy files (FERRY_FUZZ_CASES): errors, no panics.
mod fuzz_loading;
// Chunk plans, reports, chunked/async/batched moves: bit-identity and the gradient path.
mod transfer_methods;
// ndarray and .npy interop: round trips, and errors that name the fix.
mod interop;
// The DOT figures in docs/transfer-methods.md, regenerated from the real moves.
mod transfer_docs;
// Every path, figure, package and subcommand the guide (docs/guide/) names exists.
mod guide;
// Constants, methods, rule files, boundary copies and the quick start the docs state, as coded.
mod doc_facts;
// Every table of measured figures in docs/ names its date, commit and machine right above it.
mod doc_tables;
// gradgradcheck of every op on both devices, Hessian-vector products, autograd::grad's options.
mod higher_order;
// Gradient hooks observe and replace, retain_grad, post-accumulate hooks filling buckets.
mod hooks;
// Which grad-mode scope covers a thread pool's workers; inference data; carried modes.
mod inference;
// In-place writes into saved tensors (assign, optimizer steps) make backward fail, named.
mod inplace;
// Learning-rate schedules driving optimizers; a resumed run continues its schedule.
mod lr_schedule;
// Gradient clipping by global norm and by value.
mod grad_clip;
// Mixed precision: autocast scopes and the GradScaler.
mod amp;
// Recomputed regions: the same gradients as without, dropout and autocast included, and less kept.
mod recompute;
