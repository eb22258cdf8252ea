//! One row, two outputs: a bench writes each row once as named cells, each with its text for
//! the terminal and its value for the JSON file, and a [`Report`] prints the tables, notes and
//! goals and writes the same rows, goals and facts to JSON.

use std::error::Error;
use std::path::Path;

use serde_json::{Map, Value, json};

use super::goal::{Judged, goals_json, print_goals};
use super::measure::Measured;
use super::report::{Verdict, format_ratio, print_table, significant};
use super::run_info::RunInfo;

/// One cell: what the table shows and what the JSON file records.
#[derive(Debug, Clone, PartialEq)]
pub struct Cell {
    text: String,
    value: Value,
}

impl Cell {
    /// Text shown and recorded as it is.
    pub fn text(text: impl Into<String>) -> Self {
        let text = text.into();
        Self {
            value: Value::String(text.clone()),
            text,
        }
    }

    /// A count (threads, replicas, bytes): shown in full, recorded as an integer.
    pub fn count(n: impl Into<u64>) -> Self {
        let n = n.into();
        Self {
            text: n.to_string(),
            value: json!(n),
        }
    }

    /// A figure with three significant digits, "-" when absent (recorded as null).
    pub fn number(x: Option<f64>) -> Self {
        Self::shown(x, significant)
    }

    /// A figure shown by `format`, "-" when absent; recorded unformatted.
    pub fn shown(x: Option<f64>, format: impl Fn(f64) -> String) -> Self {
        Self {
            text: x.map_or_else(|| "-".into(), format),
            value: json!(x),
        }
    }

    /// Milliseconds: "7.24 ms".
    pub fn ms(x: Option<f64>) -> Self {
        Self::shown(x, |ms| format!("{} ms", significant(ms)))
    }

    /// ferry's figure over PyTorch's (below 1, ferry's time is smaller), "-" without both.
    pub fn ratio(ferry: Option<f64>, pytorch: Option<f64>) -> Self {
        match ferry.zip(pytorch) {
            Some((f, p)) if p > 0.0 => Self {
                text: format_ratio(f, p),
                value: json!(f / p),
            },
            _ => Self::number(None),
        }
    }

    /// One side's samples: the median shown ("error" after a failure, "-" when not run), and
    /// recorded with every sample and the error.
    pub fn median(side: &Measured) -> Self {
        Self {
            text: side.median_text(),
            value: json!({
                "samples_ms": side.samples_ms,
                "median_ms": side.complete_median(),
                "error": side.error,
            }),
        }
    }

    /// [`Cell::median`] with the median shown by `format` (a unit, fixed decimals).
    pub fn median_shown(side: &Measured, format: impl Fn(f64) -> String) -> Self {
        Self {
            text: side.median_cell(format),
            ..Self::median(side)
        }
    }

    /// A verdict: "met", "MISSED", "?" or blank; recorded as true, false or null.
    pub fn verdict(verdict: Verdict) -> Self {
        Self {
            text: verdict.label().into(),
            value: json!(verdict.as_bool()),
        }
    }

    /// The same text, recorded as `value` instead (a richer object, the unrounded figure).
    pub fn recorded(self, value: Value) -> Self {
        Self { value, ..self }
    }

    /// What the table shows.
    pub fn as_text(&self) -> &str {
        &self.text
    }
}

/// Rows of named cells under one header. A column's JSON key is its header in snake case
/// ([`key`]); fields only the JSON needs ride along with a row ([`Table::push_with`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Table {
    header: Vec<&'static str>,
    rows: Vec<(Vec<Cell>, Map<String, Value>)>,
}

impl Table {
    /// An empty table with these columns.
    pub fn new(header: &[&'static str]) -> Self {
        Self {
            header: header.to_vec(),
            rows: Vec::new(),
        }
    }

    /// Adds a row: one cell per column.
    pub fn push(&mut self, cells: Vec<Cell>) {
        self.push_with(cells, Value::Null);
    }

    /// Adds a row with `extra` (a JSON object, or null) merged into its JSON object.
    pub fn push_with(&mut self, cells: Vec<Cell>, extra: Value) {
        assert_eq!(
            cells.len(),
            self.header.len(),
            "a row has a cell per column: {:?}",
            self.header
        );
        let extra = match extra {
            Value::Object(fields) => fields,
            _ => Map::new(),
        };
        self.rows.push((cells, extra));
    }

    /// The shown text of every row.
    pub fn texts(&self) -> Vec<Vec<String>> {
        self.rows
            .iter()
            .map(|(cells, _)| cells.iter().map(|c| c.text.clone()).collect())
            .collect()
    }

    /// Prints the header and rows, aligned.
    pub fn print(&self) {
        print_table(&self.header, &self.texts());
    }

    /// Each row as one object: `{key(column): value, ...extra}`.
    pub fn json(&self) -> Value {
        let rows = self.rows.iter().map(|(cells, extra)| {
            let mut row: Map<String, Value> = self
                .header
                .iter()
                .zip(cells)
                .map(|(h, c)| (key(h), c.value.clone()))
                .collect();
            row.extend(extra.clone());
            Value::Object(row)
        });
        Value::Array(rows.collect())
    }
}

/// A header as a JSON key: lower case, `/` read as "per", anything else not a letter or digit
/// an underscore, none doubled: "ferry ms/step" -> "ferry_ms_per_step".
pub fn key(header: &str) -> String {
    let spelled = header.to_lowercase().replace('/', " per ");
    let mut key = String::new();
    for c in spelled.chars() {
        if c.is_alphanumeric() {
            key.push(c);
        } else if !key.is_empty() && !key.ends_with('_') {
            key.push('_');
        }
    }
    key.trim_end_matches('_').to_string()
}

/// What one bench run says: a title, its tables (each under an optional heading, recorded under
/// a name), notes under them, its goals judged, and facts for the JSON file alone.
#[derive(Debug, Default)]
pub struct Report {
    title: String,
    tables: Vec<(&'static str, Option<String>, Table)>,
    notes: Vec<String>,
    goals: Vec<Judged>,
    facts: Map<String, Value>,
}

impl Report {
    /// A report whose JSON file names the bench as `bench` and whose first line is `title`.
    pub fn new(bench: &str, title: impl Into<String>) -> Self {
        let mut facts = Map::new();
        facts.insert("bench".into(), json!(bench));
        Self {
            title: title.into(),
            ..Self::default()
        }
        .with_facts(Value::Object(facts))
    }

    /// Adds `fields` (a JSON object) to what the file records beside the tables.
    pub fn with_facts(mut self, fields: Value) -> Self {
        if let Value::Object(fields) = fields {
            self.facts.extend(fields);
        }
        self
    }

    /// Adds a table, recorded as `name` and printed under `heading` when there is one.
    pub fn table(&mut self, name: &'static str, heading: Option<String>, table: Table) {
        self.tables.push((name, heading, table));
    }

    /// Adds a line printed under the tables and recorded in `notes`.
    pub fn note(&mut self, note: impl Into<String>) {
        self.notes.push(note.into());
    }

    /// Adds judged goals, printed last and recorded in `goals`.
    pub fn goals(&mut self, judged: impl IntoIterator<Item = Judged>) {
        self.goals.extend(judged);
    }

    /// The judged goals so far.
    #[cfg(test)]
    pub fn judged(&self) -> &[Judged] {
        &self.goals
    }

    /// Prints the title, each table under its heading, the notes and the goal lines.
    pub fn print(&self) {
        println!("{}", self.title);
        for (_, heading, table) in &self.tables {
            println!();
            if let Some(heading) = heading {
                println!("{heading}");
            }
            table.print();
        }
        if !self.notes.is_empty() {
            println!();
        }
        for note in &self.notes {
            println!("{note}");
        }
        print_goals(&self.goals);
    }

    /// The facts, each table's rows under its name, the notes and the goals, stamped with the
    /// run's time, version and commit.
    pub fn json(&self) -> Value {
        let mut doc = self.facts.clone();
        doc.insert("title".into(), json!(self.title));
        for (name, _, table) in &self.tables {
            doc.insert((*name).into(), table.json());
        }
        doc.insert("notes".into(), json!(self.notes));
        doc.insert("goals".into(), goals_json(&self.goals));
        RunInfo::stamp(Value::Object(doc))
    }

    /// Prints the report and, with `--json`, writes it there and says so.
    pub fn finish(&self, json: Option<&Path>) -> Result<(), Box<dyn Error>> {
        self.print();
        match json {
            Some(path) => super::write_json(path, &self.json(), "figure"),
            None => Ok(()),
        }
    }
}

/// Bytes in GiB (2^30), for cells and notes.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

#[cfg(test)]
mod tests {
    use super::super::goal::{Bound, Goal};
    use super::*;

    #[test]
    fn headers_become_snake_case_keys() {
        assert_eq!(key("ferry ms/step"), "ferry_ms_per_step");
        assert_eq!(key("PyTorch GB/s"), "pytorch_gb_per_s");
        assert_eq!(key("ferry/PyTorch"), "ferry_per_pytorch");
        assert_eq!(key("case"), "case");
        assert_eq!(key("peak (GiB)"), "peak_gib");
    }

    #[test]
    fn a_row_is_written_once_and_read_twice() {
        let mut table = Table::new(&["case", "ferry ms", "PyTorch ms", "ratio", "met"]);
        let ferry = Measured::from_samples(vec![3.0, 2.9, 3.1]);
        let mut pytorch = Measured::from_samples(vec![2.82]);
        table.push_with(
            vec![
                Cell::text("mlp"),
                Cell::median(&ferry),
                Cell::median(&pytorch),
                Cell::ratio(ferry.complete_median(), pytorch.complete_median()),
                Cell::verdict(Verdict::Missed),
            ],
            json!({ "batch": 256 }),
        );
        pytorch.fail("exited");
        table.push(vec![
            Cell::text("cnn"),
            Cell::ms(Some(1.234)),
            Cell::median(&pytorch),
            Cell::ratio(Some(1.0), None),
            Cell::verdict(Verdict::Unknown),
        ]);
        assert_eq!(
            table.texts(),
            [
                ["mlp", "3.00", "2.82", "1.06", "MISSED"],
                ["cnn", "1.23 ms", "error", "-", "?"],
            ]
        );
        let rows = table.json();
        assert_eq!(rows[0]["ferry_ms"]["samples_ms"], json!([3.0, 2.9, 3.1]));
        assert_eq!(rows[0]["ferry_ms"]["median_ms"], json!(3.0));
        assert!((rows[0]["ratio"].as_f64().unwrap() - 3.0 / 2.82).abs() < 1e-12);
        assert_eq!(
            (&rows[0]["met"], &rows[0]["batch"]),
            (&json!(false), &json!(256))
        );
        assert_eq!(rows[1]["pytorch_ms"]["error"], "exited");
        assert_eq!(rows[1]["pytorch_ms"]["median_ms"], Value::Null);
        assert_eq!(
            (&rows[1]["ratio"], &rows[1]["met"]),
            (&Value::Null, &Value::Null)
        );
        assert_eq!(rows[1]["ferry_ms"], json!(1.234));
    }

    #[test]
    #[should_panic(expected = "a cell per column")]
    fn a_short_row_is_a_bug() {
        Table::new(&["a", "b"]).push(vec![Cell::text("x")]);
    }

    #[test]
    fn a_report_records_what_it_prints() {
        let mut table = Table::new(&["threads", "steps/s"]);
        table.push(vec![Cell::count(8u32), Cell::number(Some(1481.2))]);
        let goal = Goal {
            name: "efficiency >= 0.75",
            metric: "efficiency",
            bound: Bound::AtLeast(0.75),
        };
        let mut report = Report::new("threads", "threads on one GPU").with_facts(json!({
            "device": "cuda:0",
        }));
        report.table("scaling", Some("scaling".into()), table);
        report.note("steps/s: all threads together");
        report.goals([goal.judge(Some(0.08), "0.08".into())]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.json");
        report.finish(Some(&path)).unwrap();
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(
            (&doc["bench"], &doc["device"]),
            (&json!("threads"), &json!("cuda:0"))
        );
        assert_eq!(doc["scaling"][0]["threads"], 8);
        assert_eq!(doc["scaling"][0]["steps_per_s"], 1481.2);
        assert_eq!(doc["notes"][0], "steps/s: all threads together");
        assert_eq!(doc["goals"][0]["met"], false);
        assert!(doc["commit"].is_string() || doc["commit"].is_null());
    }
}
