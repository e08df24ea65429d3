//! The README's quick starts cannot drift from code that compiles and runs: every ```rust block
//! of the README names, in the comment line above it, the example it is taken from
//! (`<!-- example: examples/NAME.rs -->`), and each of its lines is a line of that example, in
//! order (leading and trailing blanks aside). The examples are built by `cargo test` (those that
//! need a GPU by the `candle` lint in scripts/test.sh), and scripts/test.sh runs the ones that
//! run on the host backend.

use std::path::Path;

/// Each rust block of `readme`: the line number of its fence, the example named above it (if
/// any), and its lines.
fn rust_blocks(readme: &str) -> Vec<(usize, Option<String>, Vec<String>)> {
    let lines: Vec<&str> = readme.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() == "```rust" {
            let named = i
                .checked_sub(1)
                .and_then(|p| lines[p].trim().strip_prefix("<!-- example: "))
                .and_then(|r| r.strip_suffix(" -->"))
                .map(str::to_string);
            let start = i + 1;
            let mut end = start;
            while end < lines.len() && lines[end].trim() != "```" {
                end += 1;
            }
            let body = lines[start..end].iter().map(|l| l.to_string()).collect();
            out.push((i + 1, named, body));
            i = end;
        }
        i += 1;
    }
    out
}

/// Which lines of `block` are not found, in order, among the lines of `source` (a line not
/// found is reported and the search goes on from where it was).
fn missing_lines(block: &[String], source: &str) -> Vec<String> {
    let src: Vec<&str> = source.lines().map(str::trim).collect();
    let mut at = 0;
    let mut missing = Vec::new();
    for l in block.iter().map(|l| l.trim()).filter(|l| !l.is_empty()) {
        match src[at..].iter().position(|s| *s == l) {
            Some(p) => at += p + 1,
            None => missing.push(l.to_string()),
        }
    }
    missing
}

#[test]
fn every_readme_rust_block_is_an_examples_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    assert!(
        !readme.contains("<!-- kv quick start -->"),
        "the README still has the KV quick start's placeholder"
    );
    let blocks = rust_blocks(&readme);
    assert!(
        blocks.len() >= 3,
        "a quick start per role: {} rust blocks",
        blocks.len()
    );
    let mut problems = Vec::new();
    for (line, named, body) in &blocks {
        let Some(example) = named else {
            problems.push(format!(
                "README.md:{line}: a rust block without `<!-- example: examples/NAME.rs -->` above it"
            ));
            continue;
        };
        let source = match std::fs::read_to_string(root.join(example)) {
            Ok(s) => s,
            Err(e) => {
                problems.push(format!("README.md:{line}: {example}: {e}"));
                continue;
            }
        };
        for l in missing_lines(body, &source) {
            problems.push(format!(
                "README.md:{line}: not a line of {example} (or out of order): {l}"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The check itself catches a changed line, a line out of order and a block without its example.
#[test]
fn the_check_catches_drift() {
    let source = "fn main() {\n    let a = 1; // one\n    let b = a + 1;\n}\n";
    let ok = [
        "let a = 1; // one".to_string(),
        "  let b = a + 1;".to_string(),
    ];
    assert!(missing_lines(&ok, source).is_empty());
    let changed = ["let a = 2; // one".to_string()];
    assert_eq!(missing_lines(&changed, source), ["let a = 2; // one"]);
    let swapped = [
        "let b = a + 1;".to_string(),
        "let a = 1; // one".to_string(),
    ];
    assert_eq!(missing_lines(&swapped, source), ["let a = 1; // one"]);
    let readme =
        "text\n<!-- example: examples/x.rs -->\n```rust\nlet a = 1;\n```\n\n```rust\nx\n```\n";
    let blocks = rust_blocks(readme);
    assert_eq!(blocks.len(), 2);
    assert_eq!(blocks[0].1.as_deref(), Some("examples/x.rs"));
    assert_eq!(blocks[0].2, ["let a = 1;"]);
    assert_eq!(blocks[1].1, None);
}
