//! Every table of measured figures in docs/ says which run it came from: a line right above it
//! (blank lines between allowed) of the form
//!
//! `Measured 2026-12-04 [more about when], commit 1d25c20 [more], NVIDIA H200.`
//!
//! that is: `Measured `, the date, then `, commit ` and a hash of at least 7 hex digits (or
//! `, commits ` and several, joined by `, `, `and` or `to`), or the explicit `commit unknown`
//! where git history does not tell; then `, ` and the machine, and a closing `.`. A hash marked
//! `(inferred)` is the code commit that the commit publishing the figures followed directly.
//!
//! Which tables are measurements is decided by a rule, not a list: a table holds measured
//! figures when at least two of its body cells outside the first column begin with a digit
//! (bold or not). API, option and promise tables hold words there and are exempt.

use std::path::PathBuf;

fn root() -> PathBuf {
    ferry_tests::repo_root()
}

/// A table of a page: the 1-based line of its header, its header, its body rows, and the
/// nearest non-blank line above it.
struct Table {
    line: usize,
    header: String,
    rows: Vec<String>,
    above: String,
}

/// Every markdown table of `text` outside fenced blocks.
fn tables(text: &str) -> Vec<Table> {
    let lines: Vec<&str> = text.lines().collect();
    let is_rule = |l: &str| {
        l.starts_with('|') && l.len() > 2 && l.chars().all(|c| matches!(c, '|' | '-' | ':' | ' '))
    };
    let mut found = Vec::new();
    let (mut i, mut fenced) = (0, false);
    while i < lines.len() {
        let line = lines[i];
        if line.starts_with("```") {
            fenced = !fenced;
        }
        if !fenced && line.starts_with('|') && lines.get(i + 1).is_some_and(|l| is_rule(l)) {
            let above = lines[..i]
                .iter()
                .rev()
                .find(|l| !l.trim().is_empty())
                .map_or(String::new(), |l| l.to_string());
            let mut end = i + 2;
            while end < lines.len() && lines[end].starts_with('|') {
                end += 1;
            }
            found.push(Table {
                line: i + 1,
                header: line.to_string(),
                rows: lines[i + 2..end].iter().map(|l| l.to_string()).collect(),
                above,
            });
            i = end;
            continue;
        }
        i += 1;
    }
    found
}

/// The rule: two or more body cells beyond the first column that begin with a digit.
fn is_measurement(table: &Table) -> bool {
    let numeric = table
        .rows
        .iter()
        .flat_map(|row| row.trim().trim_matches('|').split('|').skip(1))
        .filter(|cell| {
            let cell = cell.trim().trim_start_matches('*');
            cell.starts_with(|c: char| c.is_ascii_digit())
        })
        .count();
    numeric >= 2
}

fn is_hash(word: &str) -> bool {
    word.len() >= 7
        && word.len() <= 40
        && word
            .chars()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        && word.chars().any(|c| c.is_ascii_digit())
}

/// The date, commits and machine a stamp line gives; `Err` says what is missing.
fn parse_stamp(line: &str) -> Result<(String, Vec<String>, String), String> {
    let rest = line
        .trim()
        .strip_prefix("Measured ")
        .ok_or("it does not start with `Measured `")?;
    let date: String = rest.chars().take(10).collect();
    let shape_ok = date.len() == 10
        && date.char_indices().all(|(i, c)| match i {
            4 | 7 => c == '-',
            _ => c.is_ascii_digit(),
        });
    if !shape_ok {
        return Err(format!("`{date}` is not a date (YYYY-MM-DD)"));
    }
    let at = rest
        .find(", commit ")
        .or_else(|| rest.find(", commits "))
        .ok_or("it names no commit (`, commit HASH` or `, commit unknown`)")?;
    let after = &rest[at + 2..];
    let after = after
        .strip_prefix("commits ")
        .or_else(|| after.strip_prefix("commit "))
        .unwrap_or(after);
    let mut commits = Vec::new();
    let mut words = after.split(' ').peekable();
    let mut machine = None;
    let mut listing = true;
    while let Some(word) = words.next() {
        let bare = word.trim_end_matches(',').trim_end_matches("'s");
        let comma = word.ends_with(',');
        if listing && (is_hash(bare) || (bare == "unknown" && commits.is_empty())) {
            commits.push(bare.to_string());
        } else if listing && !commits.is_empty() && (word == "and" || word == "to") {
            continue;
        } else {
            listing = false;
        }
        if comma {
            // After a comma: another commit of the list, or the machine.
            let next_is_commit = words.peek().is_some_and(|w| {
                let w = w.trim_end_matches(',').trim_end_matches("'s");
                listing && is_hash(w)
            });
            if !next_is_commit {
                machine = Some(words.collect::<Vec<_>>().join(" "));
                break;
            }
        }
    }
    if commits.is_empty() {
        return Err("the commit is neither a hash nor `unknown`".into());
    }
    let machine = machine.ok_or("no `, MACHINE.` after the commit")?;
    let machine = machine
        .strip_suffix('.')
        .ok_or("the stamp does not end with `.`")?;
    if machine.trim().is_empty() {
        return Err("it names no machine".into());
    }
    Ok((date, commits, machine.to_string()))
}

#[test]
fn every_table_of_measured_figures_names_its_run() {
    let mut stamped = 0;
    let mut missing = Vec::new();
    let mut pages = Vec::new();
    for dir in ["docs", "docs/guide"] {
        for entry in std::fs::read_dir(root().join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|x| x == "md") {
                pages.push(path);
            }
        }
    }
    pages.sort();
    for path in pages {
        let name = path.strip_prefix(root()).unwrap().display().to_string();
        let text = std::fs::read_to_string(&path).unwrap();
        for table in tables(&text).iter().filter(|t| is_measurement(t)) {
            match parse_stamp(&table.above) {
                Ok(_) => stamped += 1,
                Err(why) => missing.push(format!(
                    "{name}:{} `{}`: the line above it is no stamp ({why}); write \
                     `Measured YYYY-MM-DD, commit HASH, MACHINE.` right above the table, \
                     `commit unknown` only where git history does not tell",
                    table.line,
                    table.header.chars().take(60).collect::<String>(),
                )),
            }
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
    assert!(stamped >= 30, "only {stamped} tables of figures found");
}

#[test]
fn the_stamp_and_the_table_rule_read_what_they_should() {
    let (date, commits, machine) =
        parse_stamp("Measured 2026-12-04 ~14:55 UTC, commit a47f20f, NVIDIA H200.").unwrap();
    assert_eq!(
        (date.as_str(), commits, machine.as_str()),
        ("2026-12-04", vec!["a47f20f".to_string()], "NVIDIA H200")
    );
    let (_, commits, machine) = parse_stamp(
        "Measured 2026-12-03 and 2026-12-04, commits 77749cf, 8d03d1c and 99b40c2, one H200 (16 cores, AVX-512).",
    )
    .unwrap();
    assert_eq!(commits, ["77749cf", "8d03d1c", "99b40c2"]);
    assert_eq!(machine, "one H200 (16 cores, AVX-512)");
    let (_, commits, _) =
        parse_stamp("Measured 2026-12-01, commit eac389f (inferred), NVIDIA H200.").unwrap();
    assert_eq!(commits, ["eac389f"]);
    let (_, commits, _) = parse_stamp("Measured 2026-11-29, commit unknown, NVIDIA H200.").unwrap();
    assert_eq!(commits, ["unknown"]);
    for bad in [
        "Measured on the H200, commit a47f20f, NVIDIA H200.",
        "Measured 2026-12-04, NVIDIA H200.",
        "Measured 2026-12-04, commit later, NVIDIA H200.",
        "Measured 2026-12-04, commit a47f20f.",
        "Measured 2026-12-04, commit a47f20f, NVIDIA H200",
        "2026-12-04, commit a47f20f, NVIDIA H200.",
    ] {
        assert!(parse_stamp(bad).is_err(), "{bad}");
    }
    let page = "Measured 2026-12-04, commit a47f20f, H200.\n\n| case | ms | GB/s |\n|---|---|---|\n\
                | a | 1.0 | **2.0** |\n\n| promise | test |\n|---|---|\n| 64 results | `t` |\n";
    let found = tables(page);
    assert_eq!(found.len(), 2);
    assert!(is_measurement(&found[0]) && !is_measurement(&found[1]));
    assert!(parse_stamp(&found[0].above).is_ok());
}
