//! `kvd sim` as a user runs it.

use std::process::Command;

fn kvd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvd"))
}

#[test]
fn sim_help_teaches_the_experiments_and_an_example() {
    let out = kvd().args(["sim", "--help"]).output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "run",
        "list",
        "Examples",
        "kvd sim run --experiment a",
        "docs/SIMULATION.md",
    ] {
        assert!(text.contains(needle), "help lacks {needle:?}:\n{text}");
    }
}

#[test]
fn an_unknown_experiment_is_refused_with_the_choices() {
    let out = kvd()
        .args(["sim", "run", "--experiment", "z", "--out", "/nonexistent"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("choose a, b, c, d, v, l or all"), "{err}");
}

#[test]
fn one_short_experiment_writes_its_csv_summary_and_plots() {
    let dir = std::env::temp_dir().join(format!("kvd-sim-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = kvd()
        .args([
            "sim",
            "run",
            "-e",
            "a",
            "--duration-s",
            "20",
            "--failure-at-s",
            "8",
            "--out",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("[sim]"), "progress lines on stderr: {err}");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("stop_restart") && table.contains("lumen"),
        "{table}"
    );
    for f in ["a.csv", "a_series.csv", "summary.md"] {
        assert!(dir.join(f).is_file(), "{f} missing");
    }
    // Plots need a font; without one they are skipped with a note, never an error.
    let plotted = dir.join("a_bars.png").is_file() && dir.join("a_timeline.png").is_file();
    assert!(plotted || err.contains("PNG plots skipped"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
