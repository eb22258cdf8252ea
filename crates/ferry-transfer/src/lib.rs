//! Every byte that crosses a device boundary in ferry: autograd-aware moves, detach-before-copy,
//! moves by value, chunked moves through bounded pinned staging, asynchronous moves on a chosen
//! stream, batched moves of whole state dicts, streams of host chunks, and the report each move
//! returns.
//!
//! Tensor ops never move data between devices; this crate is the one place that does, so that
//! "what did this move cost, and what did it record in the graph" has one answer: the
//! [`TransferReport`]. It does not own memory (ferry-memory does: buffers, pools, streams) or
//! the graph (ferry-graph); it composes them.
//!
//! Key decision: a move is an ordinary graph op (a transfer node) whose backward moves the
//! gradient back to the source device and dtype. `detach()` before a move records nothing, and
//! copies never carry `.grad`: a moved leaf's copy starts with no gradient. Whether a result is
//! ready to read is carried by types, not by convention: pinned buffers wait for their copy on
//! every read, and an asynchronous move hands out its tensor only from [`PendingTensor::wait`].
//!
//! The seven methods (see docs/transfer-methods.md):
//! [`DeviceMove::cpu`] / [`DeviceMove::to`], [`DeviceMove::to_with`] (fused dtype,
//! non_blocking), `detach()` then a move, [`DeviceMove::into_device`] /
//! [`DeviceMove::detach_into`], [`DeviceMove::to_chunked`], [`DeviceMove::to_async`], and
//! creating tensors on their device in the first place; plus [`move_state_dict`] and
//! [`DeviceMove::stream_to`], an iterator of host chunks that overlaps the caller's work with the
//! copies still in flight.
//!
//! # Layers
//!
//! The modules form layers, each importing only from layers below it (no cycles; a test in this
//! file parses every module's `crate::` paths and fails on an import that points sideways or
//! up):
//!
//! 0. leaves: `report` (what a move did), `plan` (chunk arithmetic), `staging` (the copy stream,
//!    pinned staging within the budget and its meter, dense sources);
//! 1. `pipeline`: byte pipelines through a pinned staging ring;
//! 2. `copy`: raw moves between devices, no autograd;
//! 3. `record`: the transfer node and the plain move its backward runs (the backward of a move is
//!    a move, so both sit above the raw copies);
//! 4. `chunked`, `pending`, `batched`, `streaming`, `prefetch`: the move methods and the device
//!    loader;
//! 5. `moves`: the user-facing trait.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod batched;
mod chunked;
mod copy;
mod moves;
mod pending;
mod pipeline;
mod plan;
mod prefetch;
mod record;
mod report;
mod staging;
mod streaming;

pub use batched::{QueuedStateDict, StateDict, move_state_dict, queue_state_dict};
pub use moves::DeviceMove;
pub use pending::PendingTensor;
pub use plan::{ChunkPlan, ChunkSpec, pinned_block_size};
pub use prefetch::{Batch, DEFAULT_IN_FLIGHT, DeviceLoader, LoaderStats};
pub use record::MoveOptions;
pub use report::{TransferPath, TransferReport};
pub use streaming::{ChunkStream, HostChunk};

#[cfg(test)]
mod layering {
    //! The layer table above, checked against the sources.

    use std::collections::HashMap;

    /// Each module's layer; a module may import only from lower layers.
    const LAYERS: &[(&str, usize)] = &[
        ("report", 0),
        ("plan", 0),
        ("staging", 0),
        ("pipeline", 1),
        ("copy", 2),
        ("record", 3),
        ("chunked", 4),
        ("pending", 4),
        ("batched", 4),
        ("streaming", 4),
        ("prefetch", 4),
        ("moves", 5),
    ];

    /// The source without comments and without its `#[cfg(test)]` tail (tests may use
    /// anything).
    fn code(source: &str) -> String {
        let body = source.split("#[cfg(test)]").next().unwrap_or("");
        body.lines()
            .map(|line| line.split("//").next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Every first segment after `crate::` in `code`, expanding `crate::{a, b::c}` groups.
    fn crate_paths(code: &str) -> Vec<String> {
        let ident = |s: &str| -> String {
            s.trim_start()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect()
        };
        let mut found = Vec::new();
        for (at, _) in code.match_indices("crate::") {
            let rest = &code[at + "crate::".len()..];
            if let Some(group) = rest.strip_prefix('{') {
                let (mut depth, mut start) = (0usize, 0usize);
                for (i, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 0 => {
                            found.push(ident(&group[start..i]));
                            break;
                        }
                        '}' => depth -= 1,
                        ',' if depth == 0 => {
                            found.push(ident(&group[start..i]));
                            start = i + 1;
                        }
                        _ => {}
                    }
                }
            } else {
                found.push(ident(rest));
            }
        }
        found.retain(|s| !s.is_empty());
        found
    }

    /// Item name -> defining module, from the `pub use module::{..}` lines of lib.rs.
    fn reexports(lib: &str) -> HashMap<String, String> {
        let mut map = HashMap::new();
        for line in code(lib).lines() {
            let Some(rest) = line.trim().strip_prefix("pub use ") else {
                continue;
            };
            let Some((module, items)) = rest.split_once("::") else {
                continue;
            };
            let items = items
                .trim_end_matches(';')
                .trim_matches(|c| c == '{' || c == '}');
            for item in items.split(',') {
                map.insert(item.trim().to_string(), module.trim().to_string());
            }
        }
        map
    }

    /// The imports of `module` (source `source`) that do not point to a lower layer.
    fn violations(module: &str, source: &str, items: &HashMap<String, String>) -> Vec<String> {
        let layer = |m: &str| LAYERS.iter().find(|(name, _)| *name == m).map(|&(_, l)| l);
        let Some(own) = layer(module) else {
            return vec![format!(
                "module `{module}` has no layer: add it to LAYERS in lib.rs (and to the list in the crate docs)"
            )];
        };
        crate_paths(&code(source))
            .into_iter()
            .filter_map(|path| {
                let target = items.get(&path).cloned().unwrap_or(path.clone());
                match layer(&target) {
                    Some(l) if l < own => None,
                    Some(l) => Some(format!(
                        "`{module}` (layer {own}) uses `crate::{path}` from `{target}` (layer {l}): \
                         move the shared part down into a lower module"
                    )),
                    None => Some(format!(
                        "`{module}` uses `crate::{path}`, which is neither a module nor a re-export"
                    )),
                }
            })
            .collect()
    }

    #[test]
    fn every_module_imports_only_from_lower_layers() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src");
        let lib = std::fs::read_to_string(format!("{dir}/lib.rs")).unwrap();
        let items = reexports(&lib);
        assert_eq!(items.get("DeviceMove").map(String::as_str), Some("moves"));
        let mut checked = 0;
        let mut problems = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let Some(module) = path.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            if path.extension().is_none_or(|e| e != "rs") || module == "lib" {
                continue;
            }
            let source = std::fs::read_to_string(&path).unwrap();
            problems.extend(violations(module, &source, &items));
            checked += 1;
        }
        assert!(checked >= 11, "read only {checked} modules from {dir}");
        assert!(problems.is_empty(), "{}", problems.join("\n"));
        // The table (and the crate docs) name no module the crate does not have.
        for (name, _) in LAYERS {
            let file = format!("{dir}/{name}.rs");
            assert!(
                std::path::Path::new(&file).exists(),
                "LAYERS names `{name}`, which is no module of this crate"
            );
        }
    }

    #[test]
    fn the_check_catches_an_upward_or_sideways_import() {
        let items = reexports("pub use moves::{DeviceMove, Other};\npub use record::MoveOptions;");
        let upward = "use crate::moves::record_transfer;\nfn f() {}";
        assert_eq!(violations("copy", upward, &items).len(), 1);
        let grouped =
            "use crate::{\n    plan::ChunkPlan,\n    pending::{PendingTensor, to_async},\n};";
        let found = violations("chunked", grouped, &items);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].contains("pending"), "{found:?}");
        // Through a re-export, inline in code: still an upward import.
        assert_eq!(
            violations("pipeline", "let x = crate::DeviceMove::to;", &items).len(),
            1
        );
        // Comments and tests do not count; lower layers are fine.
        let fine =
            "use crate::copy::move_bytes; // crate::moves\n#[cfg(test)]\nuse crate::moves::X;";
        assert!(violations("record", fine, &items).is_empty());
        assert_eq!(violations("nowhere", "", &items).len(), 1);
    }
}
