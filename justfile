# ferry's everyday recipes. CI runs .ci/run; these are the same steps, one at a time.

# Run every test on this machine (CUDA variants are reported as ignored without a GPU).
test:
    cargo test --workspace

# Format check and clippy with warnings denied.
lint:
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets -- -D warnings

# Build the API docs with warnings denied.
doc:
    RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps

# The main job: the transfer-methods table, measured here.
demo:
    cargo run --release -p ferry-cli -- methods

# Benchmarks, side by side with their rivals.
bench:
    cargo bench --workspace

# Pack test executables and binaries for the GPU machine (see README, "GPU machine").
gpu:
    ../shared/tools/gpu-bundle

# Everything CI runs.
ci:
    bash .ci/run
