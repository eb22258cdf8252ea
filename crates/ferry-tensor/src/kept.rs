//! The outputs a selective recompute keeps: the results of the expensive ops (matrix products,
//! fused linear layers, attention) of a region's first run, handed back to the same ops, in the
//! same order, by its second run instead of computing them again. Only the cheap ops (norms,
//! activations, element-wise) run twice.
//!
//! A thread-local mode tells the ops what to do: [`keep_products`] runs a closure with every
//! such op keeping its outputs, [`reuse_products`] with every such op taking the next kept
//! outputs where they fit (the same op, the same shape) and computing them where they do not
//! (which the count of fall-backs says). Outside both, the ops compute as usual.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::Arc;

use crate::{Result, Tensor};

/// One kept op: its name, its first output's shape, its outputs.
struct Entry {
    op: &'static str,
    shape: Vec<usize>,
    outputs: Vec<Tensor>,
}

/// The outputs a region's first run kept ([`keep_products`]), for its second run
/// ([`reuse_products`]).
#[derive(Default)]
pub struct KeptProducts {
    entries: VecDeque<Entry>,
}

impl KeptProducts {
    /// How many ops kept their outputs.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no op kept anything.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The kept tensors (each op's outputs, in order).
    pub fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        self.entries.iter().flat_map(|e| e.outputs.iter())
    }

    /// Keeps `outputs` of `op` (history-free handles to them).
    fn push(&mut self, op: &'static str, shape: &[usize], outputs: &[Tensor]) {
        self.entries.push_back(Entry {
            op,
            shape: shape.to_vec(),
            outputs: outputs.iter().map(Tensor::detach).collect(),
        });
    }

    /// The bytes the kept tensors hold, each storage once.
    pub fn bytes(&self) -> u64 {
        self.bytes_apart_from(&[])
    }

    /// The same, leaving out the storages of `others` (a region's output, which the next
    /// region holds anyway).
    pub fn bytes_apart_from(&self, others: &[&Tensor]) -> u64 {
        let mut seen: Vec<usize> = others
            .iter()
            .map(|t| Arc::as_ptr(t.storage()) as usize)
            .collect();
        let mut total = 0;
        for t in self.tensors() {
            let key = Arc::as_ptr(t.storage()) as usize;
            if !seen.contains(&key) {
                seen.push(key);
                total += t.storage().bytes() as u64;
            }
        }
        total
    }
}

enum Mode {
    Keep(KeptProducts),
    Reuse {
        kept: KeptProducts,
        fell_back: usize,
    },
}

thread_local! {
    static MODE: RefCell<Option<Mode>> = const { RefCell::new(None) };
}

/// Puts the mode that was there back when dropped (a region inside another's run).
struct Restore(Option<Mode>);

impl Drop for Restore {
    fn drop(&mut self) {
        let outer = self.0.take();
        MODE.with(|m| *m.borrow_mut() = outer);
    }
}

fn enter(mode: Mode) -> Restore {
    Restore(MODE.with(|m| m.borrow_mut().replace(mode)))
}

fn leave(restore: Restore) -> Option<Mode> {
    let mine = MODE.with(|m| m.borrow_mut().take());
    drop(restore);
    mine
}

/// Runs `f` with every matrix product, fused linear layer and attention keeping its outputs;
/// returns what `f` gave and what was kept.
pub fn keep_products<R>(f: impl FnOnce() -> R) -> (R, KeptProducts) {
    let restore = enter(Mode::Keep(KeptProducts::default()));
    let out = f();
    match leave(restore) {
        Some(Mode::Keep(kept)) => (out, kept),
        _ => (out, KeptProducts::default()),
    }
}

/// Runs `f` with each matrix product, fused linear layer and attention taking the next outputs
/// of `kept` instead of computing them, where they are of the same op and shape; returns what
/// `f` gave and how many ops computed after all (a mismatch stops the reuse: every later op
/// computes too).
pub fn reuse_products<R>(kept: KeptProducts, f: impl FnOnce() -> R) -> (R, usize) {
    let restore = enter(Mode::Reuse { kept, fell_back: 0 });
    let out = f();
    match leave(restore) {
        Some(Mode::Reuse { fell_back, .. }) => (out, fell_back),
        _ => (out, 0),
    }
}

/// `f` outside any mode: the ops an expensive op is made of (attention composed of products)
/// are not kept or reused apart from it.
fn outside<T>(f: impl FnOnce() -> T) -> T {
    let _restore = Restore(MODE.with(|m| m.borrow_mut().take()));
    f()
}

/// `compute`, an expensive op's `N` outputs whose first is of `shape`, as the mode says: kept,
/// handed back, or simply computed.
pub(crate) fn kept<const N: usize>(
    op: &'static str,
    shape: &[usize],
    compute: impl FnOnce() -> Result<[Tensor; N]>,
) -> Result<[Tensor; N]> {
    enum Step<const N: usize> {
        Compute,
        Keep,
        Reused([Tensor; N]),
    }
    let step = MODE.with(|m| match &mut *m.borrow_mut() {
        None => Step::Compute,
        Some(Mode::Keep(_)) => Step::Keep,
        Some(Mode::Reuse { kept, fell_back }) => {
            let fits = kept
                .entries
                .front()
                .is_some_and(|e| e.op == op && e.shape == shape && e.outputs.len() == N);
            match fits {
                true => {
                    let entry = kept.entries.pop_front().expect("checked");
                    match <[Tensor; N]>::try_from(entry.outputs) {
                        Ok(outputs) => Step::Reused(outputs),
                        Err(_) => Step::Compute,
                    }
                }
                false => {
                    kept.entries.clear(); // out of step: nothing after this fits either
                    *fell_back += 1;
                    Step::Compute
                }
            }
        }
    });
    match step {
        Step::Reused(outputs) => Ok(outputs),
        Step::Compute => outside(compute),
        Step::Keep => {
            let outputs = outside(compute)?;
            MODE.with(|m| {
                if let Some(Mode::Keep(kept)) = &mut *m.borrow_mut() {
                    kept.push(op, shape, &outputs);
                }
            });
            Ok(outputs)
        }
    }
}

/// As [`kept`] for an op that may not run on this device (`compute` gives None, and the caller
/// takes another path, made of ops that are kept on their own): only an output it gave is kept,
/// and one is handed back only where the first run kept one here.
pub(crate) fn kept_optional(
    op: &'static str,
    shape: &[usize],
    compute: impl FnOnce() -> Result<Option<Tensor>>,
) -> Result<Option<Tensor>> {
    let fits = MODE.with(|m| match &*m.borrow() {
        Some(Mode::Reuse { kept, .. }) => kept
            .entries
            .front()
            .is_some_and(|e| e.op == op && e.shape == shape && e.outputs.len() == 1),
        _ => false,
    });
    if fits {
        let [out] = kept(op, shape, || -> Result<[Tensor; 1]> {
            Err(crate::TensorError::InvalidArgument {
                op,
                message: "a selective recompute's kept output was not handed back".into(),
            })
        })?;
        return Ok(Some(out));
    }
    let out = outside(compute)?;
    if let Some(t) = &out {
        MODE.with(|m| match &mut *m.borrow_mut() {
            Some(Mode::Keep(kept)) => kept.push(op, shape, std::slice::from_ref(t)),
            Some(Mode::Reuse { kept, fell_back }) => {
                kept.entries.clear(); // the first run did not run it here: out of step
                *fell_back += 1;
            }
            None => {}
        });
    }
    Ok(out)
}
