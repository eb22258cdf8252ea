//! The code's shape, checked from its sources: no library file passes 700 lines, no crate's
//! modules import each other in a cycle (a module imports only modules below it; helpers used
//! by several go down into a leaf module), and ferry-tensor's kernels work on storage and
//! layouts, never on the tensor type. All read the checkout the test runs from.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 700;

/// Cycles that predate this check, each a crate and its sorted module paths. The check fails
/// when a cycle not listed here appears, and when a listed one is gone or has changed (so the
/// list only shrinks): take its entry out then.
const KNOWN_CYCLES: &[(&str, &[&str])] = &[
    ("ferry-graph", &["graph", "group", "hooks", "node"]),
    (
        "ferry-memory",
        &["cuda::buffer", "cuda::device", "cuda::pinned"],
    ),
];

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// Each crate's name and its `src` folder.
fn crates() -> Vec<(String, PathBuf)> {
    let dir = ferry_tests::repo_root().join("crates");
    let mut found: Vec<(String, PathBuf)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("src").is_dir())
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                p.join("src"),
            )
        })
        .collect();
    found.sort();
    found
}

#[test]
fn no_library_file_passes_700_lines() {
    let mut checked = 0;
    let mut long = Vec::new();
    for (_, src) in crates() {
        for file in rust_files(&src) {
            let lines = std::fs::read_to_string(&file).unwrap().lines().count();
            if lines > MAX_LINES {
                long.push(format!("{}: {lines} lines", file.display()));
            }
            checked += 1;
        }
    }
    assert!(checked > 100, "read only {checked} files");
    assert!(
        long.is_empty(),
        "files over {MAX_LINES} lines (split each along its concepts, aiming under 500):\n{}",
        long.join("\n")
    );
}

type Module = Vec<String>;

/// The module path of `file` under `src` (`[]` for lib.rs or main.rs).
fn module_of(src: &Path, file: &Path) -> Module {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut path: Module = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(
        path.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        path.pop();
    }
    path
}

/// The source without comments and without its `#[cfg(test)]` tail (tests may use anything).
fn code(source: &str) -> String {
    let body = source.split("#[cfg(test)]").next().unwrap_or("");
    body.lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The identifiers of a path after `crate::` or `super::`, expanding `{a, b::c}` groups.
fn paths_after(rest: &str) -> Vec<Vec<String>> {
    let mut segments = Vec::new();
    let mut s = rest;
    loop {
        let t = s.trim_start();
        if let Some(group) = t.strip_prefix('{') {
            let mut out = Vec::new();
            let (mut depth, mut start) = (0usize, 0usize);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.push(&group[start..i]);
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(&group[start..i]);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            return out
                .into_iter()
                .flat_map(paths_after)
                .map(|tail| segments.iter().cloned().chain(tail).collect())
                .collect();
        }
        let ident: String = t
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if ident.is_empty() {
            break;
        }
        s = &t[ident.len()..];
        segments.push(ident);
        match s.strip_prefix("::") {
            Some(next) => s = next,
            None => break,
        }
    }
    if segments.is_empty() {
        Vec::new()
    } else {
        vec![segments]
    }
}

/// The modules `source` (of module `own`) names through `crate::` and `super::` paths.
fn imports(own: &[String], source: &str, modules: &BTreeSet<Module>) -> Vec<Module> {
    let code = code(source);
    let mut found = Vec::new();
    for (at, _) in code
        .match_indices("crate::")
        .chain(code.match_indices("super::"))
    {
        // Part of a longer word (`my_crate::`) or of a `super::super::` chain already read.
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        let mut rest = &code[at..];
        let mut base: Module = Vec::new();
        if let Some(r) = rest.strip_prefix("crate::") {
            rest = r;
        } else {
            // `super` is the parent of the file's module (a mod.rs is its folder's module).
            let mut up = 0;
            while let Some(r) = rest.strip_prefix("super::") {
                up += 1;
                rest = r;
            }
            base = own[..own.len().saturating_sub(up)].to_vec();
        }
        for tail in paths_after(rest) {
            let full: Module = base.iter().cloned().chain(tail).collect();
            if let Some(k) = (1..=full.len())
                .rev()
                .find(|&k| modules.contains(&full[..k]))
            {
                found.push(full[..k].to_vec());
            }
        }
    }
    found
}

/// Edges between sibling modules: an import from `a` of `b` is an edge between their
/// ancestors just below the module they share.
fn sibling_edges(src: &Path) -> BTreeSet<(Module, Module)> {
    let files = rust_files(src);
    let modules: BTreeSet<Module> = files.iter().map(|f| module_of(src, f)).collect();
    let mut edges = BTreeSet::new();
    for file in &files {
        let own = module_of(src, file);
        // A module's tests in their own file (`#[cfg(test)] mod tests;`), like a `#[cfg(test)]`
        // tail, may use anything.
        if own.last().is_some_and(|m| m == "tests") {
            continue;
        }
        let source = std::fs::read_to_string(file).unwrap();
        for target in imports(&own, &source, &modules) {
            let shared = own.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if shared >= own.len() || shared >= target.len() {
                continue; // an ancestor or a descendant
            }
            edges.insert((own[..=shared].to_vec(), target[..=shared].to_vec()));
        }
    }
    edges
}

/// The strongly connected components of more than one module (Tarjan), each sorted.
fn cycles(edges: &BTreeSet<(Module, Module)>) -> BTreeSet<Vec<String>> {
    let mut graph: BTreeMap<&Module, Vec<&Module>> = BTreeMap::new();
    for (a, b) in edges {
        graph.entry(a).or_default().push(b);
        graph.entry(b).or_default();
    }
    struct State<'a> {
        index: BTreeMap<&'a Module, usize>,
        low: BTreeMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        on: BTreeSet<&'a Module>,
        found: BTreeSet<Vec<String>>,
    }
    fn visit<'a>(v: &'a Module, g: &BTreeMap<&'a Module, Vec<&'a Module>>, s: &mut State<'a>) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on.insert(v);
        for &w in &g[v] {
            if !s.index.contains_key(w) {
                visit(w, g, s);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                component.push(w.join("::"));
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.found.insert(component);
            }
        }
    }
    let mut state = State {
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        found: BTreeSet::new(),
    };
    for v in graph.keys() {
        if !state.index.contains_key(v) {
            visit(v, &graph, &mut state);
        }
    }
    state.found
}

#[test]
fn no_crate_has_a_new_module_cycle() {
    let known: BTreeSet<(String, Vec<String>)> = KNOWN_CYCLES
        .iter()
        .map(|(c, m)| (c.to_string(), m.iter().map(|s| s.to_string()).collect()))
        .collect();
    let mut found = BTreeSet::new();
    let mut crates_read = 0;
    for (name, src) in crates() {
        for cycle in cycles(&sibling_edges(&src)) {
            found.insert((name.clone(), cycle));
        }
        crates_read += 1;
    }
    assert!(crates_read >= 8, "read only {crates_read} crates");
    let new: Vec<String> = found
        .difference(&known)
        .map(|(c, m)| format!("{c}: {}", m.join(" <-> ")))
        .collect();
    assert!(
        new.is_empty(),
        "modules that import each other in a cycle (move what they share down into a module below both):\n{}",
        new.join("\n")
    );
    let gone: Vec<String> = known
        .difference(&found)
        .map(|(c, m)| format!("{c}: {}", m.join(", ")))
        .collect();
    assert!(
        gone.is_empty(),
        "these cycles are gone or changed: take them out of KNOWN_CYCLES:\n{}",
        gone.join("\n")
    );
}

#[test]
fn the_cycle_check_sees_grouped_relative_and_nested_imports() {
    let m = |s: &str| -> Module {
        s.split("::")
            .filter(|x| !x.is_empty())
            .map(String::from)
            .collect()
    };
    let modules: BTreeSet<Module> = ["", "a", "b", "c", "c::x", "c::y"]
        .iter()
        .map(|s| m(s))
        .collect();
    let got = imports(
        &m("c::x"),
        "use super::y::Thing;\nuse crate::{a::f, b};\n// crate::c\nfn g() { my_crate::a::h(); }",
        &modules,
    );
    assert!(
        got.contains(&m("c::y")) && got.contains(&m("a")) && got.contains(&m("b")),
        "{got:?}"
    );
    assert_eq!(got.len(), 3, "{got:?}");
    let edges: BTreeSet<(Module, Module)> = [
        (m("a"), m("b")),
        (m("b"), m("c")),
        (m("c"), m("a")),
        (m("c"), m("d")),
    ]
    .into_iter()
    .collect();
    let found = cycles(&edges);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found.contains(&vec!["a".to_string(), "b".into(), "c".into()]));
}

/// The lines of `source` (1-based) whose code, comments aside, names the identifier `name`:
/// on its own or at the end of a path, not inside a longer identifier (`TensorError`).
fn lines_naming(source: &str, name: &str) -> Vec<(usize, String)> {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    source
        .lines()
        .enumerate()
        .filter(|(_, line)| {
            let code = line.split("//").next().unwrap_or("");
            code.match_indices(name).any(|(at, _)| {
                !code[..at].chars().next_back().is_some_and(ident)
                    && !code[at + name.len()..].chars().next().is_some_and(ident)
            })
        })
        .map(|(n, line)| (n + 1, line.trim().to_string()))
        .collect()
}

#[test]
fn kernels_know_nothing_of_the_tensor_type() {
    let src = ferry_tests::repo_root().join("crates/ferry-tensor/src");
    let mut checked = 0;
    let mut found = Vec::new();
    for dir in ["cpu", "cuda"] {
        for file in rust_files(&src.join(dir)) {
            let source = std::fs::read_to_string(&file).unwrap();
            for (n, line) in lines_naming(&source, "Tensor") {
                found.push(format!("{}:{n}: {line}", file.display()));
            }
            checked += 1;
        }
    }
    assert!(checked >= 15, "read only {checked} kernel files");
    assert!(
        found.is_empty(),
        "kernels name `Tensor` (they take `Operand`s and return `Dense` outputs; `backend` \
         makes tensors of them):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_tensor_check_sees_paths_and_skips_comments_and_longer_names() {
    let source = "fn a(x: &Tensor) {}\n\
                  use crate::{Result, Tensor};\n\
                  let t = crate::Tensor::scalar(1.0);\n\
                  // a Tensor in a comment\n\
                  Err(TensorError::Shape) // Tensor\n\
                  struct MyTensor;\n\
                  let tensors = 1;";
    let lines: Vec<usize> = lines_naming(source, "Tensor")
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(lines, [1, 2, 3]);
}

/// The Python entry points that only read a field or call an accessor that cannot fail (a
/// counter, a handle, a shape): everything else ferry-py exposes runs under `guarded`.
const UNGUARDED_ACCESSORS: &[&str] = &[
    "path",
    "staging",
    "gradient_stream",
    "upload_stream",
    "device",
    "steps",
    "pinned_bytes",
    "state_bytes",
    "__iter__",
    "__len__",
    "shape",
    "dtype",
    "is_pinned",
    "__dlpack_device__",
    "__repr__",
];

/// The index just past the brace that closes the one opened before `start`.
fn block_end(source: &str, start: usize) -> usize {
    let mut depth = 1;
    for (i, c) in source[start..].char_indices() {
        depth += match c {
            '{' => 1,
            '}' => -1,
            _ => 0,
        };
        if depth == 0 {
            return start + i + 1;
        }
    }
    source.len()
}

/// Each function of `block` (`fn NAME ... {`) and whether its body calls `guarded(`.
fn functions_guarded(block: &str) -> Vec<(String, bool)> {
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(i) = block[at..].find("fn ") {
        let start = at + i + 3;
        let name: String = block[start..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let Some(open) = block[start..].find('{') else {
            break;
        };
        // `fn` inside a type (`impl Fn(..)`, a pointer) ends at a `;` before any body.
        if let Some(semi) = block[start..].find(';')
            && semi < open
        {
            at = start + semi;
            continue;
        }
        let body_start = start + open + 1;
        let end = block_end(block, body_start);
        found.push((name, block[body_start..end].contains("guarded(")));
        at = end;
    }
    found
}

/// Every `#[pyfunction]` and every method of a `#[pymethods]` block, with whether it is guarded.
fn python_entry_points(source: &str) -> Vec<(String, bool)> {
    let code = code(source);
    let mut found = Vec::new();
    for (marker, whole_block) in [("#[pyfunction]", false), ("#[pymethods]", true)] {
        let mut at = 0;
        while let Some(i) = code[at..].find(marker) {
            let start = at + i + marker.len();
            let Some(open) = code[start..].find('{') else {
                break;
            };
            let body_start = start + open + 1;
            let end = block_end(&code, body_start);
            if whole_block {
                found.extend(functions_guarded(&code[body_start..end - 1]));
            } else {
                found.extend(functions_guarded(&code[start..end]).into_iter().take(1));
            }
            at = end;
        }
    }
    found
}

/// Issue 42: a panic inside ferry-py would reach Python as pyo3's `PanicException` (a
/// `BaseException` that `except Exception` does not catch); every entry point but the plain
/// accessors runs under `errors::guarded`, which makes one a `FerryError` naming the bug.
#[test]
fn every_python_entry_point_is_under_the_panic_guard() {
    let src = ferry_tests::repo_root().join("crates/ferry-py/src");
    let mut unguarded = Vec::new();
    let mut seen = 0;
    for file in rust_files(&src) {
        let source = std::fs::read_to_string(&file).unwrap();
        for (name, guarded) in python_entry_points(&source) {
            seen += 1;
            if !guarded && !UNGUARDED_ACCESSORS.contains(&name.as_str()) {
                unguarded.push(format!("{}: {name}", file.display()));
            }
        }
    }
    assert!(
        seen > 50,
        "found only {seen} entry points: the scan is broken"
    );
    assert!(
        unguarded.is_empty(),
        "wrap these in `guarded(|| ...)`:\n{}",
        unguarded.join("\n")
    );
}

#[test]
fn the_guard_check_sees_functions_and_methods() {
    let source = "#[pyfunction]\npub fn a(x: u8) -> PyResult<u8> { guarded(|| Ok(x)) }\n\
                  #[pymethods]\nimpl T {\n fn b(&self) -> u8 { if true { 1 } else { 2 } }\n \
                  fn c(&self) -> PyResult<()> { guarded(|| Ok(())) }\n}\n\
                  fn helper() { }\n";
    assert_eq!(
        python_entry_points(source),
        [("a".into(), true), ("b".into(), false), ("c".into(), true)]
    );
}
