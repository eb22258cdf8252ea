//! Fuzzing of checkpoint (safetensors) and `.npy` loading: mutated real files (bit flips, byte
//! changes, truncations, extensions, cut and repeated ranges, huge length fields, huge numbers
//! and bad dtypes in headers) and headers made up whole (huge shapes, bad offsets, deep nesting).
//! Every case goes through both loaders; none may panic, and the cases with a known answer must
//! give it: a truncated or extended file is an error, and a bit flipped in the data of a ferry
//! checkpoint is a checksum error naming the tensor it hit.
//!
//! `FERRY_FUZZ_CASES` sets the number of cases (default 100,000); `FERRY_SEED` replays a run.

use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::time::Instant;

use ferry::checkpoint::{self, Checkpoint};
use ferry::{CheckpointError, load_npy, save_npy};
use ferry_tensor::{DType, Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const DEFAULT_CASES: usize = 100_000;

/// A valid file to mutate, and what is known about it.
struct SeedFile {
    bytes: Vec<u8>,
    /// safetensors (true) or .npy (false).
    safetensors: bool,
    /// Where the header ends (the data section starts).
    data_start: usize,
    /// For a ferry checkpoint: each tensor's byte range in the file, to check what a flip hits.
    tensors: Vec<(String, std::ops::Range<usize>)>,
}

fn safetensors_seed(bytes: Vec<u8>, checksummed: bool) -> SeedFile {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let tensors = if checksummed {
        header
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| *k != "__metadata__")
            .map(|(k, v)| {
                let at = |i: usize| 8 + n + v["data_offsets"][i].as_u64().unwrap() as usize;
                (k.clone(), at(0)..at(1))
            })
            .collect()
    } else {
        Vec::new()
    };
    SeedFile {
        bytes,
        safetensors: true,
        data_start: 8 + n,
        tensors,
    }
}

fn npy_seed(bytes: Vec<u8>) -> SeedFile {
    let data_start = match bytes[6] {
        1 => 10 + u16::from_le_bytes([bytes[8], bytes[9]]) as usize,
        _ => 12 + u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize,
    };
    SeedFile {
        bytes,
        safetensors: false,
        data_start,
        tensors: Vec::new(),
    }
}

/// A version-`major` .npy file with this header dictionary text and data.
fn npy_bytes(major: u8, dict: &str, data: &[u8]) -> Vec<u8> {
    let prefix = if major == 1 { 10 } else { 12 };
    let mut dict = dict.to_string();
    while !(prefix + dict.len() + 1).is_multiple_of(64) {
        dict.push(' ');
    }
    dict.push('\n');
    let mut out = b"\x93NUMPY".to_vec();
    out.extend_from_slice(&[major, 0]);
    if major == 1 {
        out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&(dict.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(dict.as_bytes());
    out.extend_from_slice(data);
    out
}

fn seeds(dir: &Path) -> Vec<SeedFile> {
    let base = Tensor::from_slice(&[0.5f64, -1.0, 2.25, 3.0, -0.0, 1e-3], &[2, 3]).unwrap();
    let mut ck = Checkpoint::new();
    let tensors: Vec<(String, Tensor)> = DType::ALL
        .iter()
        .map(|&d| (format!("w.{}", d.name()), base.to_dtype(d).unwrap()))
        .chain([
            ("scalar".into(), Tensor::scalar(7i64)),
            (
                "empty".into(),
                Tensor::zeros(&[0, 3], DType::F32, Device::Cpu).unwrap(),
            ),
        ])
        .collect();
    ck.insert_section("model", tensors.clone());
    ck.set_metadata("epoch", "3");
    ck.set_metadata("note", "caf\u{e9} \"quoted\"");
    let path = dir.join("seed.safetensors");
    ck.save(&path).unwrap();
    let ferry_file = std::fs::read(&path).unwrap();
    // The same tensors as Python writes them: no checksum record.
    let python_file = {
        let n = u64::from_le_bytes(ferry_file[..8].try_into().unwrap()) as usize;
        let mut header: serde_json::Value = serde_json::from_slice(&ferry_file[8..8 + n]).unwrap();
        header.as_object_mut().unwrap().remove("__metadata__");
        let mut text = serde_json::to_vec(&header).unwrap();
        text.resize(text.len().next_multiple_of(8), b' ');
        [
            &(text.len() as u64).to_le_bytes()[..],
            &text,
            &ferry_file[8 + n..],
        ]
        .concat()
    };
    let mut out = vec![
        safetensors_seed(ferry_file, true),
        safetensors_seed(python_file, false),
    ];
    let npy_path = dir.join("seed.npy");
    for t in [
        base.to_dtype(DType::F32).unwrap(),
        base.reshape(&[3, 1, 2]).unwrap(),
        base.to_dtype(DType::I64).unwrap().reshape(&[6]).unwrap(),
        base.to_dtype(DType::U8).unwrap(),
        Tensor::scalar(2.5f64),
    ] {
        save_npy(&t, &npy_path).unwrap();
        out.push(npy_seed(std::fs::read(&npy_path).unwrap()));
    }
    let data: Vec<u8> = (1..=6).flat_map(|v| (v as f32).to_le_bytes()).collect();
    let dict =
        |order: &str| format!("{{'descr': '<f4', 'fortran_order': {order}, 'shape': (2, 3), }}");
    out.push(npy_seed(npy_bytes(1, &dict("True"), &data)));
    out.push(npy_seed(npy_bytes(2, &dict("False"), &data)));
    out.push(npy_seed(npy_bytes(3, &dict("True"), &data)));
    out
}

const HUGE_NUMBERS: &[&str] = &[
    "0",
    "1",
    "-1",
    "4294967296",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999999",
    "1e309",
    "1.5",
    "null",
    "\"7\"",
];
const ST_DTYPES: &[&str] = &[
    "F32", "F64", "F16", "BF16", "I64", "U8", "I32", "BOOL", "F8_E4M3", "F4", "C64", "U64", "I8",
    "XX", "", "f32",
];
const NPY_DESCRS: &[&str] = &[
    "'<f4'",
    "'<f8'",
    "'<i8'",
    "'|u1'",
    "'=f8'",
    "'<f2'",
    "'<c8'",
    "'>f4'",
    "'|b1'",
    "'<i4'",
    "'<U3'",
    "'|O'",
    "'<f16'",
    "''",
    "[('a', '<f4')]",
    "3",
    "None",
];

/// Replaces one run of ASCII digits inside `bytes[..end]` with `with`.
fn replace_number(rng: &mut StdRng, bytes: &mut Vec<u8>, end: usize, with: &str) {
    let runs: Vec<(usize, usize)> = {
        let mut runs = Vec::new();
        let mut i = 0;
        while i < end.min(bytes.len()) {
            if bytes[i].is_ascii_digit() {
                let j = (i..end.min(bytes.len()))
                    .find(|&j| !bytes[j].is_ascii_digit())
                    .unwrap_or(end.min(bytes.len()));
                runs.push((i, j));
                i = j;
            } else {
                i += 1;
            }
        }
        runs
    };
    if runs.is_empty() {
        return;
    }
    let (a, b) = runs[rng.random_range(0..runs.len())];
    bytes.splice(a..b, with.bytes());
}

/// Replaces the first occurrence of any of `tokens` (quoted as they appear) with another.
fn replace_token(rng: &mut StdRng, bytes: &mut Vec<u8>, tokens: &[&str], quote: &str) {
    let quoted = |t: &str| format!("{quote}{t}{quote}");
    let choices: Vec<(usize, usize)> = tokens
        .iter()
        .filter_map(|t| {
            let needle = quoted(t).into_bytes();
            bytes
                .windows(needle.len())
                .position(|w| w == needle.as_slice())
                .map(|at| (at, at + needle.len()))
        })
        .collect();
    if let Some(&(a, b)) = choices.get(rng.random_range(0..choices.len().max(1))) {
        let with = quoted(tokens[rng.random_range(0..tokens.len())]);
        bytes.splice(a..b, with.into_bytes());
    }
}

/// One to three random mutations of a seed file.
fn mutate(rng: &mut StdRng, seed: &SeedFile) -> Vec<u8> {
    let mut b = seed.bytes.clone();
    for _ in 0..rng.random_range(1..=3) {
        let len = b.len().max(1);
        match rng.random_range(0..10) {
            0 => {
                let at = rng.random_range(0..len).min(b.len().saturating_sub(1));
                if !b.is_empty() {
                    b[at] ^= 1 << rng.random_range(0..8);
                }
            }
            1 => {
                if !b.is_empty() {
                    let at = rng.random_range(0..b.len());
                    b[at] = *[
                        0u8, 0xff, 0x7f, 0x80, b'"', b'{', b'[', b'(', b'-', b'9', b'\\',
                    ]
                    .get(rng.random_range(0..11))
                    .unwrap();
                }
            }
            2 => b.truncate(rng.random_range(0..len)),
            3 => b.extend((0..rng.random_range(1..64)).map(|_| rng.random::<u8>())),
            4 => {
                let a = rng.random_range(0..len).min(b.len());
                let e = (a + rng.random_range(1..32)).min(b.len());
                b.drain(a..e);
            }
            5 => {
                let a = rng.random_range(0..len).min(b.len());
                let e = (a + rng.random_range(1..32)).min(b.len());
                let copy = b[a..e].to_vec();
                b.splice(a..a, copy);
            }
            6 if seed.safetensors && b.len() >= 8 => {
                let total = b.len() as u64;
                let n = *[
                    0,
                    1,
                    7,
                    total.saturating_sub(8),
                    total.saturating_sub(7),
                    total,
                    u64::MAX,
                    1 << 63,
                    100_000_000,
                    100_000_001,
                    rng.random(),
                ]
                .get(rng.random_range(0..11))
                .unwrap();
                b[..8].copy_from_slice(&n.to_le_bytes());
            }
            6 if b.len() >= 12 => {
                b[6] = *[1u8, 2, 3, 0, 4, 255].get(rng.random_range(0..6)).unwrap();
                let n = *[
                    0u32,
                    1,
                    0xffff,
                    0xffff_ffff,
                    1 << 20,
                    (1 << 20) + 1,
                    rng.random(),
                ]
                .get(rng.random_range(0..7))
                .unwrap();
                b[8..12].copy_from_slice(&n.to_le_bytes());
            }
            7 => {
                let with = HUGE_NUMBERS[rng.random_range(0..HUGE_NUMBERS.len())];
                replace_number(rng, &mut b, seed.data_start, with);
            }
            8 if seed.safetensors => replace_token(rng, &mut b, ST_DTYPES, "\""),
            8 => replace_token(rng, &mut b, NPY_DESCRS, ""),
            _ => {
                // A block of the data section zeroed, as a lost write leaves it.
                if b.len() > seed.data_start {
                    let a = rng.random_range(seed.data_start..b.len());
                    let e = (a + rng.random_range(1..4096)).min(b.len());
                    b[a..e].fill(0);
                }
            }
        }
    }
    b
}

fn pick<'a>(rng: &mut StdRng, items: &[&'a str]) -> &'a str {
    items[rng.random_range(0..items.len())]
}

/// A safetensors file whose header is made up: random dtypes, shapes, offsets and metadata.
fn made_up_safetensors(rng: &mut StdRng) -> Vec<u8> {
    let dim = |rng: &mut StdRng| -> String {
        match rng.random_range(0..4) {
            0 => pick(rng, HUGE_NUMBERS).to_string(),
            _ => rng.random_range(0..5usize).to_string(),
        }
    };
    let mut entries = Vec::new();
    let mut offset = 0u64;
    for i in 0..rng.random_range(0..4) {
        let shape: Vec<String> = (0..rng.random_range(0..4)).map(|_| dim(rng)).collect();
        let len = rng.random_range(0..48u64);
        let offsets = match rng.random_range(0..4) {
            0 => format!("[{},{}]", dim(rng), dim(rng)),
            1 => format!("[{offset},{}]", pick(rng, HUGE_NUMBERS)),
            _ => format!("[{offset},{}]", offset + len),
        };
        offset += len;
        let name = match rng.random_range(0..8) {
            0 => "__metadata__".to_string(),
            1 => "t0".to_string(),
            _ => format!("t{i}"),
        };
        entries.push(format!(
            "\"{name}\":{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":{offsets}}}",
            pick(rng, ST_DTYPES),
            shape.join(",")
        ));
    }
    match rng.random_range(0..5) {
        0 => entries.push("\"__metadata__\":{\"a\":\"b\"}".into()),
        1 => entries.push("\"__metadata__\":{\"a\":3}".into()),
        2 => entries.push(format!(
            "\"__metadata__\":{{\"ferry.crc32\":\"{}\"}}",
            pick(
                rng,
                &[
                    "{}",
                    "{\\\"header\\\":\\\"00000000\\\",\\\"tensors\\\":{}}",
                    "x"
                ]
            )
        )),
        _ => {}
    }
    let header = format!("{{{}}}", entries.join(","));
    let data_len = match rng.random_range(0..3) {
        0 => rng.random_range(0..64),
        _ => offset as usize,
    };
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend((0..data_len).map(|_| rng.random::<u8>()));
    out
}

/// An .npy file whose header is made up: random descriptors, orders, shapes, keys, nesting.
fn made_up_npy(rng: &mut StdRng) -> Vec<u8> {
    let shape = match rng.random_range(0..8) {
        0 => "()".to_string(),
        1 => format!("({},)", pick(rng, HUGE_NUMBERS)),
        2 => format!("({}, {})", pick(rng, HUGE_NUMBERS), pick(rng, HUGE_NUMBERS)),
        3 => "(2, (3,))".into(),
        4 => "[2, 3]".into(),
        5 => {
            let depth = rng.random_range(1..3000);
            format!("{}2{}", "(".repeat(depth), ",)".repeat(depth))
        }
        _ => format!("({}, {})", rng.random_range(0..4), rng.random_range(0..4)),
    };
    let order = pick(rng, &["False", "True", "1", "None", "'x'"]);
    let mut dict = format!(
        "{{'descr': {}, 'fortran_order': {order}, 'shape': {shape}, }}",
        pick(rng, NPY_DESCRS)
    );
    match rng.random_range(0..6) {
        0 => dict = dict.replace("'fortran_order'", "'extra'"),
        1 => dict = dict.replace("'descr': ", "'descr': ('"),
        2 => dict = format!("[{dict}]"),
        _ => {}
    }
    let data_len = match rng.random_range(0..3) {
        0 => rng.random_range(0..64),
        _ => 24,
    };
    let data: Vec<u8> = (0..data_len).map(|_| rng.random()).collect();
    npy_bytes(rng.random_range(1..=3), &dict, &data)
}

/// What a case must give, when that is known.
enum Expect {
    Anything,
    /// Both loaders refuse it (a truncated or extended valid file).
    Refused,
    /// A ferry checkpoint with one bit flipped in this tensor's bytes.
    Checksum(String),
}

struct Tally {
    cases: usize,
    loaded: usize,
    refused: usize,
}

fn run_case(path: &Path, bytes: &[u8], expect: &Expect, tally: &mut Tally) -> Result<(), String> {
    std::fs::write(path, bytes).unwrap();
    let st = catch_unwind(AssertUnwindSafe(|| checkpoint::load(path)))
        .map_err(|_| "checkpoint::load panicked".to_string())?;
    let npy = catch_unwind(AssertUnwindSafe(|| load_npy(path)))
        .map_err(|_| "load_npy panicked".to_string())?;
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    for err in [
        st.as_ref().err().map(|e| e.to_string()),
        npy.as_ref().err().map(|e| e.to_string()),
    ]
    .into_iter()
    .flatten()
    {
        if !err.contains(&name) {
            return Err(format!("an error that does not name the file: {err}"));
        }
    }
    match expect {
        Expect::Anything => {}
        Expect::Refused if st.is_ok() || npy.is_ok() => {
            return Err("a truncated or extended file loaded".into());
        }
        Expect::Refused => {}
        Expect::Checksum(key) => match &st {
            Err(CheckpointError::ChecksumMismatch { key: k, .. }) if k == key => {}
            Ok(_) => return Err(format!("a bit flipped in {key:?} went unnoticed")),
            Err(e) => return Err(format!("a bit flipped in {key:?} gave: {e}")),
        },
    }
    tally.cases += 1;
    for ok in [st.is_ok(), npy.is_ok()] {
        if ok {
            tally.loaded += 1;
        } else {
            tally.refused += 1;
        }
    }
    Ok(())
}

#[test]
fn damaged_and_made_up_files_are_errors_never_panics() {
    let cases: usize = std::env::var("FERRY_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_CASES);
    let seed = ferry_tests::fresh_seed();
    let mut rng = StdRng::seed_from_u64(seed);
    // Memory-backed where there is one: a disk makes each rewrite of the case file wait on it.
    let shm = Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        tempfile::tempdir_in(shm).or_else(|_| tempfile::tempdir())
    } else {
        tempfile::tempdir()
    }
    .unwrap();
    let seeds = seeds(dir.path());
    let path = dir.path().join("case.bin");
    let mut tally = Tally {
        cases: 0,
        loaded: 0,
        refused: 0,
    };
    let start = Instant::now();
    for i in 0..cases {
        let (bytes, expect) = match i % 8 {
            0 => (made_up_safetensors(&mut rng), Expect::Anything),
            1 => (made_up_npy(&mut rng), Expect::Anything),
            2 => {
                // A strict prefix, or extra bytes: never a valid file of either kind.
                let s = &seeds[rng.random_range(0..seeds.len())];
                let mut b = s.bytes.clone();
                if rng.random_bool(0.5) {
                    b.truncate(rng.random_range(0..b.len()));
                } else {
                    b.extend((0..rng.random_range(1..16)).map(|_| rng.random::<u8>()));
                }
                (b, Expect::Refused)
            }
            3 => {
                let s = &seeds[0];
                let (key, range) = &s.tensors[rng.random_range(0..s.tensors.len())];
                let mut b = s.bytes.clone();
                if range.is_empty() {
                    (b, Expect::Anything)
                } else {
                    b[rng.random_range(range.clone())] ^= 1 << rng.random_range(0..8);
                    (b, Expect::Checksum(key.clone()))
                }
            }
            _ => {
                let s = &seeds[rng.random_range(0..seeds.len())];
                (mutate(&mut rng, s), Expect::Anything)
            }
        };
        if let Err(why) = run_case(&path, &bytes, &expect, &mut tally) {
            let kept = std::env::temp_dir().join(format!("ferry-fuzz-failure-{seed}-{i}.bin"));
            std::fs::write(&kept, &bytes).unwrap();
            panic!(
                "fuzz case {i}: {why} (input kept in {}; replay with FERRY_SEED={seed})",
                kept.display()
            );
        }
    }
    let took = start.elapsed().as_secs_f64();
    // Straight to stderr, past libtest's capture (which takes print! and eprint! only): CI's log
    // shows how many cases ran.
    let _ = writeln!(
        std::io::stderr(),
        "fuzz_loading: {} cases ({} loads: {} loaded, {} refused, 0 panics) in {took:.1} s, seed {seed}",
        tally.cases,
        2 * tally.cases,
        tally.loaded,
        tally.refused
    );
    assert_eq!(tally.cases, cases);
}

/// The fuzzer starts from valid files: each seed loads, with its values (Fortran order read as
/// the same row-major tensor NumPy shows).
#[test]
fn the_seed_files_load_with_their_values() {
    let dir = tempfile::tempdir().unwrap();
    let seeds = seeds(dir.path());
    let path = dir.path().join("case.bin");
    for (i, s) in seeds.iter().enumerate() {
        std::fs::write(&path, &s.bytes).unwrap();
        if s.safetensors {
            let state = checkpoint::load(&path).unwrap();
            let (_, w) = state.iter().find(|(k, _)| k == "model.w.f32").unwrap();
            assert_eq!(
                w.to_vec::<f32>().unwrap(),
                [0.5, -1.0, 2.25, 3.0, -0.0, 1e-3]
            );
        } else {
            assert!(load_npy(&path).is_ok(), "npy seed {i}");
        }
    }
    // Column-major 2x3 holding 1..=6 is [[1, 3, 5], [2, 4, 6]].
    std::fs::write(&path, &seeds[seeds.len() - 3].bytes).unwrap();
    let t = load_npy(&path).unwrap();
    assert_eq!(t.shape(), [2, 3]);
    assert_eq!(t.to_vec::<f32>().unwrap(), [1.0, 3.0, 5.0, 2.0, 4.0, 6.0]);
    std::fs::write(&path, &seeds[seeds.len() - 2].bytes).unwrap();
    assert_eq!(
        load_npy(&path).unwrap().to_vec::<f32>().unwrap(),
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    );
    // Three axes in Fortran order: element [i, j, k] is data[i + 2j + 6k].
    let data: Vec<u8> = (0..12).flat_map(|v| (v as f32).to_le_bytes()).collect();
    let dict = "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3, 2), }";
    std::fs::write(&path, npy_bytes(1, dict, &data)).unwrap();
    let mut expected = Vec::new();
    for i in 0..2 {
        for j in 0..3 {
            for k in 0..2 {
                expected.push((i + 2 * j + 6 * k) as f32);
            }
        }
    }
    assert_eq!(load_npy(&path).unwrap().to_vec::<f32>().unwrap(), expected);
}
