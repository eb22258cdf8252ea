//! The op names the library code can record, read from its sources: every call of ferry-tensor's
//! `record`, `try_record` and `record_kind`, and of any function that forwards its own `op`
//! parameter to one of them (ferry-transfer's `record_transfer`), in every crate that depends on
//! ferry-tensor. An argument is resolved as a string literal, a `const` of the same file, a
//! `let` that chooses between literals, or `op.name()` of an op-table enum (every row's name);
//! any other form is reported, so a new way of naming an op fails the test instead of hiding.
//!
//! Why the sources and not a list of enum variants: the table enums cover only elementwise ops,
//! and conv2d, layer_norm, the index ops and the moves name themselves at their `record` call;
//! reading the calls catches every op, whichever file or crate adds it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The functions that record a node, with the index of their op-name argument.
const RECORDING: &[(&str, usize)] = &[("record", 1), ("try_record", 1), ("record_kind", 1)];

/// Where they are defined (calls there forward their own parameters).
const RECORDING_FILE: &str = "crates/ferry-tensor/src/autograd.rs";

/// The code of a source file: no `//` comments, no `#[cfg(test)] mod` tail.
pub fn code(source: &str) -> String {
    let mut body = source;
    let mut from = 0;
    while let Some(at) = source[from..].find("#[cfg(test)]") {
        let at = from + at;
        if source[at + 12..].trim_start().starts_with("mod ") {
            body = &source[..at];
            break;
        }
        from = at + 12;
    }
    body.lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every `.rs` file under `src` of each crate that is ferry-tensor or depends on it (directly or
/// through ferry, which re-exports it).
pub fn sources() -> Vec<(PathBuf, String)> {
    let crates = ferry_tests::repo_root().join("crates");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&crates).unwrap_or_else(|e| panic!("{}: {e}", crates.display()))
    {
        let dir = entry.unwrap().path();
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap_or_default();
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        // ferry-graph and ferry-memory sit below ferry-tensor (ferry-graph's own `record` takes
        // node metadata, not an op name).
        let uses_tensor = manifest.contains("ferry-tensor")
            || manifest
                .lines()
                .any(|l| l.starts_with("ferry.") || l.starts_with("ferry ="));
        if name != "ferry-tensor" && !uses_tensor {
            continue;
        }
        let mut stack = vec![dir.join("src")];
        while let Some(d) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&d) else {
                continue;
            };
            for entry in entries {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).unwrap();
                    files.push((path, code(&text)));
                }
            }
        }
    }
    files.sort();
    files
}

/// What the scan found: each op name with one place that records it, and the calls it could
/// not resolve.
#[derive(Debug, Default)]
pub struct Scan {
    pub names: BTreeMap<String, String>,
    pub unresolved: Vec<String>,
}

/// Scans `files` (path, code) for recording calls.
pub fn scan(files: &[(PathBuf, String)]) -> Scan {
    let mut recording: Vec<(String, usize, String)> = RECORDING
        .iter()
        .map(|&(f, i)| (f.to_string(), i, RECORDING_FILE.to_string()))
        .collect();
    let mut scan = Scan::default();
    let mut done = 0;
    // A wrapper found in one pass is scanned for its callers in the next.
    while done < recording.len() {
        let (callee, position, home) = recording[done].clone();
        done += 1;
        for (path, text) in files {
            // A file calls the recording function only where it defines or imports it (another
            // crate's own `fn record` is something else).
            if short(path) != home && !imports(text, &callee) && !qualified(text, &callee) {
                continue;
            }
            for call in calls(text, &callee) {
                let line = text[..call].lines().count();
                let place = format!("{}:{line}", short(path));
                let Some(arg) = argument(text, call + callee.len(), position) else {
                    scan.unresolved
                        .push(format!("{place}: {callee}(..) without argument {position}"));
                    continue;
                };
                match resolve(files, text, call, &arg) {
                    Resolved::Names(names) => {
                        for n in names {
                            scan.names.entry(n).or_insert_with(|| place.clone());
                        }
                    }
                    Resolved::Forwarded(wrapper, index) => {
                        if !recording.iter().any(|(f, ..)| *f == wrapper) {
                            recording.push((wrapper, index, short(path)));
                        }
                    }
                    Resolved::Unknown => scan
                        .unresolved
                        .push(format!("{place}: {callee}(..) names its op as `{arg}`")),
                }
            }
        }
    }
    scan
}

/// Whether a `use` item of `text` names `callee`.
fn imports(text: &str, callee: &str) -> bool {
    text.match_indices("use ").any(|(i, _)| {
        let item = &text[i..i + text[i..].find(';').unwrap_or(0)];
        item.split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .any(|word| word == callee)
    })
}

/// Whether `text` calls `callee` by a path (`ferry::tensor::record(..)`), ferry-graph's aside.
fn qualified(text: &str, callee: &str) -> bool {
    text.match_indices(&format!("::{callee}("))
        .any(|(i, _)| !text[..i].ends_with("ferry_graph"))
}

fn short(path: &Path) -> String {
    let s = path.to_string_lossy();
    s.find("crates/")
        .map_or(s.to_string(), |i| s[i..].to_string())
}

/// Byte offsets of calls `callee(` that are free-function calls (not methods, not ferry-graph's
/// own `record`, not definitions).
fn calls(text: &str, callee: &str) -> Vec<usize> {
    let pattern = format!("{callee}(");
    text.match_indices(&pattern)
        .map(|(i, _)| i)
        .filter(|&i| {
            let before = &text[..i];
            let prev = before.chars().next_back();
            !prev.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.')
                && !before.ends_with("fn ")
                && !before.ends_with("ferry_graph::")
        })
        .collect()
}

/// The `index`th top-level argument of the call whose `(` is at `open`.
fn argument(text: &str, open: usize, index: usize) -> Option<String> {
    split_top(&text[open..], false).and_then(|args| args.into_iter().nth(index))
}

/// The comma-separated top-level items of the bracketed list `text` starts with; `<>` nest
/// only in `angles` (a signature's types, not a call's comparisons).
fn split_top(text: &str, angles: bool) -> Option<Vec<String>> {
    let mut depth = 0i32;
    let mut items = Vec::new();
    let mut current = String::new();
    let mut in_string = false;
    let mut prev = ' ';
    for c in text.chars() {
        if in_string {
            current.push(c);
            if c == '"' && prev != '\\' {
                in_string = false;
            }
        } else {
            match c {
                '"' => {
                    in_string = true;
                    current.push(c);
                }
                '<' if !angles => current.push(c),
                '>' if !angles || prev == '-' => current.push(c),
                '(' | '[' | '{' | '<' => {
                    depth += 1;
                    if depth > 1 {
                        current.push(c);
                    }
                }
                ')' | ']' | '}' | '>' => {
                    depth -= 1;
                    if depth == 0 {
                        items.push(current.trim().to_string());
                        return Some(items.into_iter().filter(|s| !s.is_empty()).collect());
                    }
                    current.push(c);
                }
                ',' if depth == 1 => items.push(std::mem::take(&mut current).trim().to_string()),
                _ => current.push(c),
            }
        }
        prev = c;
    }
    None
}

enum Resolved {
    Names(Vec<String>),
    /// The argument is parameter `index` of the enclosing free function, which records.
    Forwarded(String, usize),
    Unknown,
}

fn literals(text: &str) -> Vec<String> {
    text.split('"')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect()
}

fn is_ident(s: &str) -> bool {
    !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_')
}

fn resolve(files: &[(PathBuf, String)], text: &str, at: usize, arg: &str) -> Resolved {
    let before = &text[..at];
    if arg.starts_with('"') && arg.ends_with('"') && arg.len() >= 2 {
        return Resolved::Names(vec![arg[1..arg.len() - 1].to_string()]);
    }
    let (fn_name, params) = enclosing_fn(before);
    if let Some(var) = arg.strip_suffix(".name()").filter(|v| is_ident(v)) {
        // `op.name()` of an op-table enum: every row of that enum.
        let ty = params
            .iter()
            .find(|(n, _)| n == var)
            .map(|(_, t)| t.clone());
        return match ty.and_then(|t| table_names(files, &t)) {
            Some(names) => Resolved::Names(names),
            None => Resolved::Unknown,
        };
    }
    if !is_ident(arg) {
        return Resolved::Unknown;
    }
    let body = &before[before.rfind("fn ").unwrap_or(0)..];
    if let Some(i) = body.rfind(&format!("let {arg} = ")) {
        let statement = &body[i..i + body[i..].find(';').unwrap_or(0)];
        let names = literals(statement);
        return if names.is_empty() {
            Resolved::Unknown
        } else {
            Resolved::Names(names)
        };
    }
    if let Some(index) = params.iter().position(|(n, _)| n == arg) {
        return match fn_name {
            Some(f) if !params.iter().any(|(n, _)| n == "self") => Resolved::Forwarded(f, index),
            _ => Resolved::Unknown,
        };
    }
    if let Some(i) = before.rfind(&format!("const {arg}: &str = ")) {
        return Resolved::Names(literals(&before[i..]).into_iter().take(1).collect());
    }
    Resolved::Unknown
}

/// The name and parameters (name, type) of the last function declared before a position.
fn enclosing_fn(before: &str) -> (Option<String>, Vec<(String, String)>) {
    let Some(i) = before.rfind("fn ") else {
        return (None, Vec::new());
    };
    let rest = &before[i + 3..];
    let name: String = rest
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    let Some(open) = rest.find('(') else {
        return (Some(name), Vec::new());
    };
    let params = split_top(&rest[open..], true)
        .unwrap_or_default()
        .into_iter()
        .map(|p| {
            let p = p.trim_start_matches("mut ").to_string();
            match p.split_once(':') {
                Some((n, t)) => (n.trim().to_string(), t.trim().to_string()),
                None => (p.trim_start_matches('&').trim().to_string(), String::new()),
            }
        })
        .collect();
    (Some(name), params)
}

/// The row names of op-table enum `ty` (`Name => "name", code, ...`), wherever it is declared.
fn table_names(files: &[(PathBuf, String)], ty: &str) -> Option<Vec<String>> {
    let head = format!("enum {ty} {{");
    let (_, text) = files.iter().find(|(_, t)| t.contains(&head))?;
    let start = text.find(&head)? + head.len();
    let body = &text[start..start + text[start..].find("\n    }")?];
    let names: Vec<String> = body
        .split("=> \"")
        .skip(1)
        .filter_map(|s| s.split('"').next())
        .map(str::to_string)
        .collect();
    (!names.is_empty()).then_some(names)
}

/// Every op name the scan finds in `files`, and nothing unresolved.
pub fn names_in(files: &[(PathBuf, String)]) -> BTreeSet<String> {
    let found = scan(files);
    assert!(
        found.unresolved.is_empty(),
        "record calls whose op name the scan cannot read (name the op with a literal, a const \
         or op.name() of a table enum, or teach tests/tests/registry/scan.rs the new form):\n{}",
        found.unresolved.join("\n")
    );
    found.names.into_keys().collect()
}
