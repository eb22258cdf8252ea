//! The guide (docs/guide/) names files, figures, packages, `ferry` subcommands and items of the
//! `ferry` crate; this checks that each one exists, so a rename elsewhere fails here instead of
//! leaving the guide wrong. (The guide's Rust blocks run as doctests of the `ferry` crate, and
//! this checks that every chapter is among them; its `ferry graph` commands are parsed and run
//! by the ferry-cli unit tests.)

use std::collections::BTreeSet;
use std::path::PathBuf;

fn root() -> PathBuf {
    ferry_tests::repo_root()
}

/// `(path relative to the root, text)` of the README and every chapter.
fn pages() -> Vec<(PathBuf, String)> {
    let dir = root().join("docs/guide");
    let mut pages: Vec<_> = std::fs::read_dir(&dir)
        .expect("docs/guide exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            (p.strip_prefix(root()).unwrap().to_path_buf(), text)
        })
        .collect();
    pages.sort();
    assert!(pages.len() >= 8, "the index and seven chapters: {pages:?}");
    pages
}

/// Targets of markdown links `[..](target)`, without `#anchors`, external ones left out.
fn links(text: &str) -> Vec<String> {
    text.match_indices("](")
        .filter_map(|(i, _)| {
            let rest = &text[i + 2..];
            let target = &rest[..rest.find(')')?];
            let target = target.split('#').next().unwrap_or_default();
            (!target.is_empty() && !target.contains("://")).then(|| target.to_string())
        })
        .collect()
}

/// Inline code spans (`like this`) on one line.
fn code_spans(text: &str) -> Vec<&str> {
    text.lines()
        .flat_map(|line| line.split('`').skip(1).step_by(2))
        .collect()
}

/// Command lines: inline code spans, and the lines of fenced blocks that are not Rust.
fn commands(text: &str) -> Vec<&str> {
    let mut lines = Vec::new();
    let mut fence: Option<&str> = None;
    for line in text.lines() {
        if let Some(lang) = line.strip_prefix("```") {
            fence = if fence.is_some() { None } else { Some(lang) };
            continue;
        }
        match fence {
            Some("text" | "sh" | "console") => lines.push(line.trim()),
            Some(_) => {}
            None => lines.extend(line.split('`').skip(1).step_by(2)),
        }
    }
    lines
}

/// Words after `-p ` in the page (packages named by cargo commands).
fn packages_named(text: &str) -> BTreeSet<String> {
    text.match_indices("-p ")
        .filter_map(|(i, _)| text[i + 3..].split_whitespace().next())
        .map(|p| p.trim_matches(|c: char| c == '`' || c == ',').to_string())
        .collect()
}

fn workspace_packages() -> BTreeSet<String> {
    let mut manifests: Vec<PathBuf> = std::fs::read_dir(root().join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path().join("Cargo.toml"))
        .collect();
    manifests.push(root().join("tests/Cargo.toml"));
    manifests
        .iter()
        .filter_map(|m| std::fs::read_to_string(m).ok())
        .filter_map(|text| {
            let line = text.lines().find(|l| l.starts_with("name = "))?;
            Some(
                line.trim_start_matches("name = ")
                    .trim_matches('"')
                    .to_string(),
            )
        })
        .collect()
}

/// The `ferry` subcommands: variants of `enum Command` in the CLI, in kebab case.
fn subcommands() -> BTreeSet<String> {
    let main = std::fs::read_to_string(root().join("crates/ferry-cli/src/main.rs")).unwrap();
    let start = main
        .find("enum Command {")
        .expect("the CLI has `enum Command`");
    let body = &main[start..start + main[start..].find("\n}").unwrap()];
    body.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with("///") && !l.starts_with("enum") && !l.is_empty())
        .filter_map(|l| l.split(['(', ',', ' ', '{']).next())
        .map(|variant| {
            let mut name = String::new();
            for (i, c) in variant.chars().enumerate() {
                if c.is_uppercase() && i > 0 {
                    name.push('-');
                }
                name.push(c.to_ascii_lowercase());
            }
            name
        })
        .collect()
}

#[test]
fn the_readme_links_the_guide() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    assert!(
        links(&readme).iter().any(|l| l == "docs/guide/README.md"),
        "README.md should link docs/guide/README.md"
    );
}

#[test]
fn every_link_in_the_guide_resolves() {
    for (page, text) in pages() {
        let dir = root().join(page.parent().unwrap());
        for target in links(&text) {
            assert!(
                dir.join(&target).exists(),
                "{}: link `{target}` points nowhere",
                page.display()
            );
        }
    }
}

#[test]
fn every_chapter_is_in_the_index_and_every_figure_is_shown() {
    let pages = pages();
    let index = &pages
        .iter()
        .find(|(p, _)| p.ends_with("README.md"))
        .unwrap()
        .1;
    let linked: BTreeSet<String> = links(index).into_iter().collect();
    for (page, _) in &pages {
        let name = page.file_name().unwrap().to_str().unwrap();
        assert!(
            name == "README.md" || linked.contains(name),
            "docs/guide/README.md does not list {name}"
        );
    }
    let shown: BTreeSet<String> = pages.iter().flat_map(|(_, text)| links(text)).collect();
    for figure in std::fs::read_dir(root().join("docs/figures")).unwrap() {
        let name = figure.unwrap().file_name().into_string().unwrap();
        assert!(
            shown.contains(&format!("../figures/{name}")),
            "docs/figures/{name} is shown by no chapter"
        );
    }
}

#[test]
fn every_path_the_guide_names_exists() {
    const TOP: [&str; 5] = ["crates/", "docs/", "tests/", "kernels/", ".ci/"];
    let mut checked = 0;
    for (page, text) in pages() {
        let words = code_spans(&text)
            .into_iter()
            .flat_map(str::split_whitespace)
            .chain(text.lines().flat_map(str::split_whitespace));
        for word in words {
            let word = word.trim_matches(|c: char| "`(),.:;".contains(c));
            if !TOP.iter().any(|top| word.starts_with(top)) {
                continue;
            }
            checked += 1;
            assert!(
                root().join(word).exists(),
                "{}: `{word}` does not exist",
                page.display()
            );
        }
    }
    assert!(checked > 10, "the path scan found only {checked} paths");
}

#[test]
fn every_command_the_guide_names_exists() {
    let packages = workspace_packages();
    let subcommands = subcommands();
    assert!(subcommands.contains("graph"), "{subcommands:?}");
    let mut checked = 0;
    for (page, text) in pages() {
        for package in packages_named(&text) {
            assert!(
                packages.contains(&package),
                "{}: no workspace package `{package}` (have {packages:?})",
                page.display()
            );
        }
        for command in commands(&text) {
            let after = if let Some(rest) = command.strip_prefix("ferry ") {
                rest
            } else if let Some((_, rest)) = command.split_once("-p ferry-cli -- ") {
                rest
            } else {
                continue;
            };
            let word = after.split_whitespace().next().unwrap_or_default();
            checked += 1;
            assert!(
                subcommands.contains(word),
                "{}: `{command}` names no subcommand ({subcommands:?})",
                page.display()
            );
        }
    }
    assert!(
        checked >= 5,
        "the command scan found only {checked} commands"
    );
}

#[test]
fn every_chapter_runs_as_doctests() {
    let harness = std::fs::read_to_string(root().join("crates/ferry/src/guide.rs")).unwrap();
    for (page, _) in pages() {
        let name = page.file_name().unwrap().to_str().unwrap();
        assert!(
            harness.contains(&format!("include_str!(\"../../../docs/guide/{name}\")")),
            "crates/ferry/src/guide.rs does not include docs/guide/{name}, so its examples never run"
        );
    }
}

/// Every `.rs` file under `crates/*/src`.
fn sources() -> Vec<String> {
    let mut pending = vec![root().join("crates")];
    let mut texts = Vec::new();
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() && !path.ends_with("target") {
                pending.push(path);
            } else if path.extension().is_some_and(|x| x == "rs") {
                texts.push(std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    texts
}

fn is_ident(word: &str) -> bool {
    word.chars()
        .next()
        .is_some_and(|c| c.is_alphabetic() || c == '_')
        && word.chars().all(|c| c.is_alphanumeric() || c == '_')
}

/// Whether some crate declares a public item `name` (`pub fn name`, `pub struct name`, ..) or
/// re-exports one under that name (`pub use a::name;`, `pub use a::{b, name}`, `pub use a as name`).
fn declared(sources: &[String], name: &str) -> bool {
    const KINDS: [&str; 7] = ["fn", "struct", "enum", "trait", "type", "const", "mod"];
    let words = |line: &str| -> bool {
        line.split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .any(|w| w == name)
    };
    sources.iter().any(|text| {
        let mut in_use = false;
        text.lines().map(str::trim).any(|line| {
            let declares = KINDS.iter().any(|kind| {
                line.strip_prefix(&format!("pub {kind} {name}"))
                    .is_some_and(|rest| {
                        !rest.starts_with(|c: char| c.is_alphanumeric() || c == '_')
                    })
            });
            if line.starts_with("pub use") {
                in_use = true;
            }
            let exported = in_use && words(line);
            if in_use && line.contains(';') {
                in_use = false;
            }
            declares || exported
        })
    })
}

/// `ferry::` paths in the prose's code spans: the Rust blocks compile, the prose does not.
#[test]
fn every_ferry_item_the_guide_names_exists() {
    let sources = sources();
    let mut checked = 0;
    for (page, text) in pages() {
        let mut in_rust = false;
        for line in text.lines() {
            if let Some(lang) = line.strip_prefix("```") {
                in_rust = !in_rust && lang == "rust";
                continue;
            }
            if in_rust {
                continue;
            }
            for span in line.split('`').skip(1).step_by(2) {
                for (i, _) in span.match_indices("ferry::") {
                    let path: Vec<&str> = span[i + "ferry::".len()..]
                        .split("::")
                        .map(|seg| {
                            seg.split(|c: char| !(c.is_alphanumeric() || c == '_'))
                                .next()
                                .unwrap()
                        })
                        .take_while(|seg| is_ident(seg))
                        .collect();
                    for name in &path {
                        checked += 1;
                        assert!(
                            declared(&sources, name),
                            "{}: `{span}` names `{name}`, which no crate declares",
                            page.display()
                        );
                    }
                }
            }
        }
    }
    assert!(checked >= 10, "the item scan found only {checked} names");
}
