//! What the README and docs/ state about the code, checked against the code: the values of the
//! constants they name, the items they call by `Type::member`, where gradient rules live, where
//! bytes cross a device boundary outside ferry-transfer, and the README's quick start. A change
//! to any of these fails here, naming the page to update.

use std::path::{Path, PathBuf};

/// The repository root, from the run-time `CARGO_MANIFEST_DIR` (or the compile-time one).
fn root() -> PathBuf {
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    manifest.join("..")
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `(path, text)` of the README and every page under docs/ (the guide included).
fn pages() -> Vec<(String, String)> {
    let mut pages = vec![("README.md".to_string(), read("README.md"))];
    for dir in ["docs", "docs/guide"] {
        for entry in std::fs::read_dir(root().join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|x| x == "md") {
                let name = format!("{dir}/{}", path.file_name().unwrap().to_str().unwrap());
                pages.push((name.clone(), read(&name)));
            }
        }
    }
    pages
}

/// `(path relative to the root, text)` of every `.rs` file under `crates/*/src`.
fn sources() -> Vec<(String, String)> {
    let mut pending = vec![root().join("crates")];
    let mut files = Vec::new();
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|x| x == "rs")
                && path.components().any(|c| c.as_os_str() == "src")
            {
                let relative = path.strip_prefix(root()).unwrap_or(Path::new(""));
                let relative = relative.to_str().unwrap().replace('\\', "/");
                files.push((relative, std::fs::read_to_string(&path).unwrap()));
            }
        }
    }
    files.sort();
    files
}

/// Inline code spans of `text` outside fenced blocks.
fn prose_spans(text: &str) -> Vec<String> {
    let mut spans = Vec::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            spans.extend(line.split('`').skip(1).step_by(2).map(str::to_string));
        }
    }
    spans
}

fn is_constant_name(word: &str) -> bool {
    word.len() > 1
        && word.starts_with(|c: char| c.is_ascii_uppercase())
        && word
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        && word.contains('_')
}

/// The integer a constant is defined as (`const NAME: T = 1 << 20;` style literals and shifts).
fn defined_value(sources: &[(String, String)], name: &str) -> Option<(String, u128)> {
    sources.iter().find_map(|(path, text)| {
        text.lines().find_map(|line| {
            let rest = line.trim().split_once(&format!("const {name}:"))?.1;
            let expr = rest.split_once('=')?.1.trim().trim_end_matches(';').trim();
            let number = |s: &str| s.trim().replace('_', "").parse::<u128>().ok();
            let value = match expr.split_once("<<") {
                Some((base, shift)) => number(base)? << number(shift)?,
                None => number(expr)?,
            };
            Some((path.clone(), value))
        })
    })
}

/// "`NAME` = 1" or "`NAME` is 1" in the prose: the constant's value as the page gives it.
fn stated_values(text: &str) -> Vec<(String, u128)> {
    let mut stated = Vec::new();
    for (i, _) in text.match_indices('`') {
        let rest = &text[i + 1..];
        let Some(end) = rest.find('`') else { continue };
        let name = &rest[..end];
        if !is_constant_name(name) {
            continue;
        }
        let after = rest[end + 1..].trim_start();
        let Some(after) = after
            .strip_prefix("= ")
            .or_else(|| after.strip_prefix("is "))
        else {
            continue;
        };
        let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
        if let Ok(value) = digits.parse() {
            stated.push((name.to_string(), value));
        }
    }
    stated
}

#[test]
fn constants_have_the_values_the_docs_give() {
    let sources = sources();
    let mut checked = Vec::new();
    for (page, text) in pages() {
        for (name, value) in stated_values(&text) {
            let (path, defined) = defined_value(&sources, &name)
                .unwrap_or_else(|| panic!("{page} gives `{name}` a value; no crate defines it"));
            assert_eq!(
                defined, value,
                "{page} says `{name}` is {value}; {path} defines it as {defined}"
            );
            checked.push(name);
        }
    }
    for name in ["PINNED_FROM_BYTES", "HOLD_RECORDS"] {
        assert!(
            checked.iter().any(|c| c == name),
            "no page states `{name}`: {checked:?}"
        );
    }
}

#[test]
fn the_constant_scan_reads_values_and_definitions() {
    assert_eq!(
        stated_values("`A_B` = 1 byte, `C_D` is 4, `lower` = 2, `E_F` means 3"),
        [("A_B".to_string(), 1), ("C_D".to_string(), 4)]
    );
    let sources = vec![(
        "x.rs".to_string(),
        "pub(crate) const A_B: usize = 2 << 20;\nconst C_D: u32 = 1_000;".to_string(),
    )];
    assert_eq!(
        defined_value(&sources, "A_B"),
        Some(("x.rs".into(), 2 << 20))
    );
    assert_eq!(defined_value(&sources, "C_D"), Some(("x.rs".into(), 1000)));
    assert_eq!(defined_value(&sources, "E_F"), None);
}

/// Whether some source declares `fn name` (or `fn name<`), for methods the docs call.
fn declares_fn(sources: &[(String, String)], name: &str) -> bool {
    sources.iter().any(|(_, text)| {
        text.match_indices(&format!("fn {name}")).any(|(i, m)| {
            let next = text[i + m.len()..].chars().next();
            next.is_some_and(|c| c == '(' || c == '<')
        })
    })
}

/// Whether some source declares a public field `name`.
fn declares_field(sources: &[(String, String)], name: &str) -> bool {
    let decl = format!("pub {name}:");
    sources
        .iter()
        .any(|(_, text)| text.lines().any(|l| l.trim().starts_with(&decl)))
}

/// Whether some source declares a type `name` (struct, enum, trait or type alias).
fn declares_type(sources: &[(String, String)], name: &str) -> bool {
    ["struct", "enum", "trait", "type"].iter().any(|kind| {
        let decl = format!("{kind} {name}");
        sources.iter().any(|(_, text)| {
            text.match_indices(&decl).any(|(i, m)| {
                let next = text[i + m.len()..].chars().next();
                next.is_none_or(|c| !(c.is_alphanumeric() || c == '_'))
            })
        })
    })
}

/// `Type::method` in the transfer-methods page's prose: the type and the method exist.
#[test]
fn methods_the_transfer_methods_page_calls_exist() {
    let sources = sources();
    let page = read("docs/transfer-methods.md");
    let mut checked = 0;
    for span in prose_spans(&page) {
        for (i, _) in span.match_indices("::") {
            let ty = span[..i]
                .rsplit(|c: char| !(c.is_alphanumeric() || c == '_'))
                .next()
                .unwrap_or_default();
            let member: String = span[i + 2..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            let is_type = ty.starts_with(|c: char| c.is_ascii_uppercase());
            let is_method = member.starts_with(|c: char| c.is_ascii_lowercase());
            if !(is_type && is_method) {
                continue;
            }
            checked += 1;
            assert!(
                declares_type(&sources, ty),
                "docs/transfer-methods.md: `{span}` names a type `{ty}` that no crate declares"
            );
            assert!(
                declares_fn(&sources, &member) || declares_field(&sources, &member),
                "docs/transfer-methods.md: `{span}` names `{member}`, which no crate declares as a method or field"
            );
        }
    }
    assert!(
        checked >= 5,
        "the scan found only {checked} `Type::method` spans"
    );
    // What the check exists for: the page once named a method that does not exist.
    assert!(!declares_fn(&sources, "dot_from"));
}

/// Rules live in one place: every file that builds a gradient rule is in ferry-tensor's `rules`
/// module or is the move's own (ferry-transfer's record.rs), and guide/02 names each.
#[test]
fn every_file_with_a_gradient_rule_is_named_in_the_guide() {
    let guide = read("docs/guide/02-tensors-and-broadcasting.md");
    let with_rules: Vec<String> = sources()
        .into_iter()
        .filter(|(_, text)| text.contains("Rule::new("))
        .map(|(path, _)| path)
        .collect();
    assert!(
        with_rules
            .iter()
            .any(|p| p.ends_with("ferry-tensor/src/rules/mod.rs")),
        "{with_rules:?}"
    );
    for path in &with_rules {
        assert!(
            path.starts_with("crates/ferry-tensor/src/rules/")
                || path == "crates/ferry-transfer/src/record.rs",
            "{path} builds a gradient rule outside crates/ferry-tensor/src/rules/: give it a \
             function there that the op calls"
        );
        assert!(
            guide.contains(path.as_str()),
            "{path} builds gradient rules, but docs/guide/02-tensors-and-broadcasting.md does not name it among the places rules live"
        );
    }
}

/// Bytes cross a device boundary outside ferry-transfer only where guide/03 says.
#[test]
fn copies_across_the_boundary_outside_ferry_transfer_are_the_ones_the_guide_lists() {
    const COPIES: [&str; 4] = [
        "copy_to_host",
        "copy_from_host",
        "copy_to_pinned_async",
        "copy_from_pinned_async",
    ];
    // (where the copies are, what guide/03 calls them)
    const LISTED: [(&str, &str); 4] = [
        ("crates/ferry-tensor/src/cuda/", "`to_vec`"),
        (
            "crates/ferry-tensor/src/autograd/offload",
            "`crates/ferry-tensor/src/autograd/offload.rs`",
        ),
        ("crates/ferry/src/checkpoint/", "`ferry::checkpoint`"),
        (
            "crates/ferry/src/optim/offload",
            "`crates/ferry/src/optim/offload.rs`",
        ),
    ];
    for page in ["docs/guide/03-device-moves.md", "docs/transfer-methods.md"] {
        let text = read(page);
        for (_, named) in LISTED {
            assert!(text.contains(named), "{page} no longer names {named}");
        }
    }
    // Library crates above ferry-memory (which defines the copies), ferry-transfer excepted.
    let libraries = [
        "crates/ferry-graph/",
        "crates/ferry-tensor/",
        "crates/ferry/",
    ];
    let mut found = 0;
    for (path, text) in sources() {
        if !libraries.iter().any(|l| path.starts_with(l)) {
            continue;
        }
        if !COPIES.iter().any(|c| text.contains(&format!(".{c}"))) {
            continue;
        }
        found += 1;
        assert!(
            LISTED.iter().any(|(place, _)| path.starts_with(place)),
            "{path} copies across a device boundary outside ferry-transfer; say so in docs/guide/03-device-moves.md (and here)"
        );
    }
    assert!(found >= 3, "the scan found only {found} files");
}

/// The report's `grad_bytes_copied` is 0 by construction, as the docs now say: no source
/// sets it to anything else. If a move starts measuring it, the docs must say so.
#[test]
fn grad_bytes_copied_is_structural_as_the_docs_say() {
    let mut fields = 0;
    for (path, text) in sources() {
        for line in text.lines().filter(|l| l.contains("grad_bytes_copied")) {
            let line = line.trim();
            if line.starts_with("//") || line.starts_with("pub grad_bytes_copied") {
                continue;
            }
            fields += 1;
            let value = line
                .split_once("grad_bytes_copied")
                .map(|(_, rest)| rest.trim_start_matches([':', ' ', '=']))
                .unwrap_or_default();
            assert!(
                value.starts_with("0,") || value.starts_with("r.grad_bytes_copied"),
                "{path}: `{line}` sets grad_bytes_copied; docs/guide/03-device-moves.md and docs/transfer-methods.md call it 0 by construction"
            );
        }
    }
    assert!(fields >= 1, "no source sets grad_bytes_copied at all");
    for page in ["docs/guide/03-device-moves.md", "docs/transfer-methods.md"] {
        let words: Vec<String> = read(page).split_whitespace().map(str::to_string).collect();
        assert!(
            words
                .windows(2)
                .any(|w| w[0] == "by" && w[1].starts_with("construction")),
            "{page} no longer says grad_bytes_copied is 0 by construction"
        );
    }
}

/// The README's quick start: a whole program, a dependency a checkout can use, where the
/// methods table is explained, and what the Python one-liner needs.
#[test]
fn the_readme_quick_start_is_complete() {
    let readme = read("README.md");
    let first = readme
        .split("```rust\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the README has a Rust example");
    assert!(
        first.contains("fn main()"),
        "the quick example is not a whole program"
    );
    let dependency = readme
        .lines()
        .find(|l| l.starts_with("ferry = { path = "))
        .expect("the README shows how to depend on ferry by path");
    let path = dependency.split('"').nth(1).unwrap();
    let in_checkout = path.split_once("ferry/").map(|(_, p)| p).unwrap_or(path);
    let manifest = read(&format!("{in_checkout}/Cargo.toml"));
    assert!(
        manifest.contains("name = \"ferry\""),
        "{in_checkout} is not the ferry crate"
    );
    assert!(readme.contains("](docs/transfer-methods.md)"));
    let lines: Vec<&str> = readme.lines().collect();
    let python = lines
        .iter()
        .position(|l| l.starts_with("python -c"))
        .expect("the Python one-liner");
    let before = lines[python - 1];
    assert!(
        before.contains("torch") && before.contains("GPU"),
        "the line before the Python one-liner should say it needs torch and a GPU: {before}"
    );
}

/// The layers transfer-methods.md lists are ferry-transfer's modules, every one and no other.
#[test]
fn the_transfer_layers_the_docs_list_are_the_crates_modules() {
    let page = read("docs/transfer-methods.md");
    let section = page
        .split("## Layers of ferry-transfer")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("docs/transfer-methods.md has a section on ferry-transfer's layers");
    let mut listed: Vec<String> = section
        .lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .flat_map(|l| l.split('`').skip(1).step_by(2).map(str::to_string))
        .filter(|name| name.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .collect();
    listed.sort();
    let mut modules: Vec<String> = std::fs::read_dir(root().join("crates/ferry-transfer/src"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "rs"))
        .map(|p| p.file_stem().unwrap().to_str().unwrap().to_string())
        .filter(|m| m != "lib")
        .collect();
    modules.sort();
    assert_eq!(
        listed, modules,
        "docs/transfer-methods.md's layers and crates/ferry-transfer/src differ"
    );
}

/// ferry's crate docs name every public module the crate has (as an intra-doc link, which
/// `cargo doc` with warnings denied resolves).
#[test]
fn ferrys_crate_docs_name_every_public_module() {
    let lib = read("crates/ferry/src/lib.rs");
    let docs: String = lib
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .collect::<Vec<_>>()
        .join("\n");
    let modules: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("pub mod "))
        .map(|rest| rest.trim_end_matches([';', ' ', '{']))
        .collect();
    assert!(modules.len() >= 10, "{modules:?}");
    for module in modules {
        assert!(
            docs.contains(&format!("[`{module}`]")),
            "crates/ferry/src/lib.rs's docs do not name its module `{module}`"
        );
    }
}

/// The README's thread count for OffloadAdamW's CPU step is the code's: all cores but one.
#[test]
fn the_readme_gives_the_offload_step_its_real_thread_count() {
    let pipeline = read("crates/ferry/src/optim/offload/pipeline.rs");
    let threads = pipeline
        .split("fn step_threads")
        .nth(1)
        .expect("OffloadAdamW's step_threads");
    let body = threads.split("\n}\n").next().unwrap();
    assert!(
        body.contains("available_parallelism") && body.contains("saturating_sub(1)"),
        "step_threads no longer takes one core fewer than the machine has: update README.md"
    );
    assert!(body.contains("FERRY_OFFLOAD_THREADS"));
    let readme = read("README.md")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        readme.contains("all cores but one") && readme.contains("`FERRY_OFFLOAD_THREADS`"),
        "README.md no longer says OffloadAdamW steps on all cores but one"
    );
}

/// ferry-py's `unsafe` is at its boundary with PyTorch only: DLPack (dlpack.rs) and torch's
/// streams borrowed by handle (`borrow_stream`), as README.md and ferry-memory's docs say.
#[test]
fn ferry_pys_unsafe_code_is_where_the_docs_say() {
    let mut borrowed = 0;
    for (path, text) in sources() {
        if !path.starts_with("crates/ferry-py/src/") || path.ends_with("/dlpack.rs") {
            continue;
        }
        for line in text.lines().filter(|l| l.contains("unsafe")) {
            let line = line.trim();
            if line.starts_with("//") {
                continue;
            }
            assert!(
                line.contains("unsafe { ") && line.contains("borrow_stream("),
                "{path}: `{line}` is unsafe code outside ferry-py's DLPack module and its \
                 borrowed streams; say so in README.md and crates/ferry-memory/src/lib.rs"
            );
            borrowed += 1;
        }
    }
    assert!(borrowed >= 1, "no borrowed stream found: update the docs");
    for page in ["README.md", "crates/ferry-memory/src/lib.rs"] {
        let text = read(page).split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            text.contains("DLPack") && text.contains("borrowed by handle"),
            "{page} no longer says where ferry-py's unsafe code is"
        );
    }
}
