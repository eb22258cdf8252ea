//! What a user sees of a block run plain, recomputed whole and recomputed selectively, on the
//! CPU: which of its intermediates are still alive after the forward (weak references to their
//! storages), and what the host allocator holds against what the graph reports saved. The host
//! statistics are process-wide, so this takes the binary's lock.

use std::sync::{Arc, Mutex, Weak};

use ferry::memory::host_stats;
use ferry_tensor::{DType, Device, Result, Tensor, recompute, recompute_selective};

#[derive(Debug, Clone, Copy)]
enum Way {
    Plain,
    Whole,
    Selective,
}

#[test]
fn what_a_user_sees_of_a_selective_region() {
    let _serial = super::serial_lock();
    // On a thread of its own, joined under the lock: what the thread's exit lets go of (its
    // batched host counts, its thread-local state) lands before the next test counts.
    std::thread::scope(|s| s.spawn(run).join())
        .expect("the block's thread")
        .expect("the block runs");
}

fn run() -> Result<()> {
    let w1 = Tensor::randn(&[256, 64], DType::F32, Device::Cpu)?.with_grad()?;
    let w2 = Tensor::randn(&[64, 256], DType::F32, Device::Cpu)?.with_grad()?;
    let x = Tensor::randn(&[128, 64], DType::F32, Device::Cpu)?.with_grad()?;
    let graph = w1.graph().expect("a leaf has a graph");
    // The block, noting its intermediates' storages on its first run: the first product, the
    // GELU's output, the second product.
    let noted = || Arc::new(Mutex::new(Vec::<Weak<ferry_tensor::Storage>>::new()));
    let traced = |seen: Arc<Mutex<Vec<Weak<ferry_tensor::Storage>>>>| {
        let (w1, w2) = (w1.clone(), w2.clone());
        move |x: &[Tensor]| -> Result<Tensor> {
            let a = x[0].matmul(&w1.t()?)?;
            let g = a.gelu()?;
            let b = g.matmul(&w2.t()?)?;
            let mut seen = seen.lock().unwrap();
            if seen.is_empty() {
                seen.extend([&a, &g, &b].map(|t| Arc::downgrade(t.storage())));
            }
            x[0].add(&b)
        }
    };
    let mut alive = Vec::new();
    let mut bytes_seen = Vec::new();
    for way in [Way::Plain, Way::Whole, Way::Selective] {
        let seen = noted();
        let (bytes, saved) = (host_stats().allocated_bytes, graph.saved_bytes());
        let y = match way {
            Way::Plain => traced(seen.clone())(std::slice::from_ref(&x))?,
            Way::Whole => recompute(&[&x], traced(seen.clone()))?,
            Way::Selective => recompute_selective(&[&x], traced(seen.clone()))?,
        };
        let held = host_stats().allocated_bytes - bytes;
        let graph_saved = graph.saved_bytes() - saved;
        let live: Vec<bool> = seen
            .lock()
            .unwrap()
            .iter()
            .map(|w| w.upgrade().is_some())
            .collect();
        println!(
            "{way:?}: alive after the forward (product, gelu, product) {live:?}; host allocator \
             +{held} bytes (the output's 32768 among them), graph saved +{graph_saved} bytes"
        );
        alive.push(live);
        bytes_seen.push((held, graph_saved));
        y.sum()?.backward()?;
    }
    // Plain: the first product (the GELU reads it) and the GELU's output (the second product
    // reads it); the second product's result is gone (the add saves nothing). Whole: none.
    // Selective: both products, the second one too although plain lets it go: the second run
    // takes it back instead of multiplying again (ferry's rerun runs the whole closure).
    assert_eq!(alive[0], [true, true, false]);
    assert_eq!(alive[1], [false, false, false]);
    assert_eq!(alive[2], [true, false, true]);
    // The allocator holds the output (the caller's) and what the graph saved beyond the input;
    // plain's graph also counts the two weights it saves (alive anyway, 2 x 65536 bytes).
    let (out, weights) = (128 * 64 * 4, 2 * 256 * 64 * 4);
    assert_eq!(
        bytes_seen[0].1,
        bytes_seen[0].0 + weights - out + 128 * 64 * 4
    );
    assert_eq!(bytes_seen[1], (out, 128 * 64 * 4));
    assert_eq!(bytes_seen[2].0, bytes_seen[2].1);
    Ok(())
}
