//! The documentation is checked against the tree where a test can do it: every file the docs
//! name exists, and every crate of the workspace has its rows in `docs/ARCHITECTURE.md`.
//! (The settings' table in docs/DAEMON.md is checked against the flags by the daemon's own
//! config test; `include/kvd.h` against ffi/ by the test command.)

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every file under the repository's root, as a path relative to it (build outputs and git's
/// own folder left out).
fn files() -> BTreeSet<String> {
    fn walk(dir: &Path, rel: &str, out: &mut BTreeSet<String>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = if rel.is_empty() {
                name.clone()
            } else {
                format!("{rel}/{name}")
            };
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                if !matches!(
                    name.as_str(),
                    ".git" | "target" | "node_modules" | "__pycache__"
                ) {
                    walk(&e.path(), &path, out);
                }
            } else {
                out.insert(path);
            }
        }
    }
    let mut out = BTreeSet::new();
    walk(&root(), "", &mut out);
    out
}

/// The docs a reader is pointed to: the README and every page under docs/.
fn docs() -> Vec<String> {
    let mut d: Vec<String> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    d.sort();
    d.insert(0, "README.md".into());
    d
}

/// The tokens of `text` that name a file of the tree: a path with a folder in it and a source
/// or document ending (`kvd/crates/store/src/lifecycle.rs`, `local/copy.rs`), or any `.rs`
/// file name. Absolute paths are a deployment's, not the tree's.
fn file_names(text: &str) -> BTreeSet<String> {
    const ENDINGS: [&str; 9] = [
        ".rs", ".md", ".sh", ".py", ".toml", ".h", ".yaml", ".json", ".c",
    ];
    let is_name = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-');
    text.split(|c: char| !is_name(c))
        .map(|t| t.trim_end_matches(['.', ',']))
        .filter(|t| !t.is_empty() && !t.starts_with('/') && !t.contains("//"))
        .filter(|t| ENDINGS.iter().any(|e| t.len() > e.len() && t.ends_with(e)))
        .filter(|t| t.contains('/') || t.ends_with(".rs"))
        .map(|t| t.trim_start_matches("./").to_string())
        .collect()
}

#[test]
fn every_file_the_docs_name_exists() {
    let tree = files();
    let mut missing = Vec::new();
    for doc in docs() {
        for name in file_names(&read(&doc)) {
            // a path from the root must be there as written; a shorter one (`local/copy.rs`,
            // relative to its crate) must end some file's path
            let found =
                tree.contains(&name) || tree.iter().any(|f| f.ends_with(&format!("/{name}")));
            if !found {
                missing.push(format!("{doc}: {name}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "the docs name files that are not in the tree:\n  {}",
        missing.join("\n  ")
    );
}

/// The workspace's members (folder, package name), from the root Cargo.toml.
fn members() -> Vec<(String, String)> {
    let manifest = read("Cargo.toml");
    let line = manifest
        .lines()
        .find(|l| l.starts_with("members"))
        .expect("the workspace lists its members");
    line.split('"')
        .skip(1)
        .step_by(2)
        .map(|folder| {
            let name = read(&format!("{folder}/Cargo.toml"))
                .lines()
                .find_map(|l| l.strip_prefix("name = \""))
                .and_then(|l| l.strip_suffix('"'))
                .unwrap_or_else(|| panic!("{folder}/Cargo.toml names its package"))
                .to_string();
            (folder.to_string(), name)
        })
        .collect()
}

#[test]
fn every_crate_has_its_row_in_the_architecture_page() {
    let arch = read("docs/ARCHITECTURE.md");
    let folders_table: String = arch
        .split("## Folders")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("ARCHITECTURE.md has a Folders section")
        .to_string();
    let mut missing = Vec::new();
    for (folder, name) in members() {
        let row = |f: &str| format!("| `{f}` |");
        if !folders_table.contains(&row(&folder))
            && !folders_table.contains(&row(&format!("{folder}/")))
        {
            missing.push(format!("no row for `{folder}` in the Folders table"));
        }
        if !arch.contains(&format!("| {name} |")) {
            missing.push(format!(
                "no row for {name} in the crates' \"where to start\" table"
            ));
        }
    }
    assert!(
        missing.is_empty(),
        "docs/ARCHITECTURE.md:\n  {}",
        missing.join("\n  ")
    );
}

#[test]
fn the_file_name_scan_finds_paths_and_leaves_prose_alone() {
    let t = "see `kvd/crates/store/src/lifecycle.rs`, local/copy.rs and state.rs; \
             /etc/kvd/kvd.toml, e.g. config.json, https://example.invalid/a.rs, any `.rs` file";
    let got: Vec<String> = file_names(t).into_iter().collect();
    assert_eq!(
        got,
        [
            "kvd/crates/store/src/lifecycle.rs",
            "local/copy.rs",
            "state.rs"
        ]
    );
}

/// `kvd/src` wires the crates into the binary and holds no subsystem: its files are the command
/// line (`main.rs`) and the re-exports (`lib.rs`), each short. A service or a protocol grows in
/// a crate of its own under `kvd/crates/`, where it can be tested in one process.
#[test]
fn the_binary_crate_holds_only_its_wiring() {
    let mut files: Vec<(String, usize)> = std::fs::read_dir(root().join("kvd/src"))
        .unwrap()
        .flatten()
        .map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let lines = std::fs::read_to_string(e.path()).map_or(0, |t| t.lines().count());
            (name, lines)
        })
        .collect();
    files.sort();
    let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["lib.rs", "main.rs"], "kvd/src holds wiring only");
    for (name, lines) in &files {
        assert!(
            *lines <= 150,
            "kvd/src/{name} has {lines} lines: wiring only"
        );
    }
}
