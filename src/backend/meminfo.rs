//! Host memory as the kernel reports it: the machine's (`/proc/meminfo`) or one NUMA node's
//! (`/sys/devices/system/node/node<N>/meminfo`), for backends whose chunks are host memory.

use super::MemoryInfo;
use crate::error::{Error, Result};

/// The machine's meminfo.
const PROC: &str = "/proc/meminfo";

/// Most characters of a meminfo text quoted in an error.
const QUOTE: usize = 400;

/// The machine's host memory: `MemAvailable` free (page cache the kernel can drop counts as
/// free) of `MemTotal`. `backend` names the backend in errors.
pub(crate) fn machine(backend: &'static str) -> Result<MemoryInfo> {
    read(backend, PROC)?
        .ok_or_else(|| Error::backend(backend, "read /proc/meminfo", "ENOENT", "no such file"))
}

/// NUMA node `node`'s host memory: `MemFree` of `MemTotal` of its meminfo (the kernel keeps no
/// `MemAvailable` per node); the machine's ([`machine`]) where the node's file is missing (a
/// kernel without NUMA).
pub(crate) fn node(backend: &'static str, node: u32) -> Result<MemoryInfo> {
    let path = format!("/sys/devices/system/node/node{node}/meminfo");
    match read(backend, &path)? {
        Some(m) => Ok(m),
        None => {
            tracing::debug!(%path, "no meminfo for the NUMA node; the machine's instead");
            machine(backend)
        }
    }
}

/// Read and parse `path`; `None` when it does not exist.
fn read(backend: &'static str, path: &str) -> Result<Option<MemoryInfo>> {
    match std::fs::read_to_string(path) {
        Ok(text) => parse(&text, path).map(Some).map_err(|why| {
            Error::backend(
                backend,
                "parse meminfo",
                "unparsable",
                format!("{path}: {why}"),
            )
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::backend(
            backend,
            "read meminfo",
            format!("{:?}", e.kind()),
            format!("{path}: {e}"),
        )),
    }
}

/// Free and total bytes from a meminfo text, either format: the machine's (`MemTotal:
/// 16303924 kB` lines) or a NUMA node's (`Node 0 MemTotal: 16303924 kB`). Free is
/// `MemAvailable` where the text has it, else `MemFree`. A missing field, a value that is not
/// a number of kB, a field given twice, or bytes past `u64` is an error that quotes the line
/// (or the text) and names `path`.
pub(crate) fn parse(text: &str, path: &str) -> std::result::Result<MemoryInfo, String> {
    let (mut total, mut free, mut available) = (None, None, None);
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let Some(mut key) = words.next() else {
            continue;
        };
        if key == "Node" {
            let numbered = words.next().is_some_and(|n| n.parse::<u32>().is_ok());
            match words.next() {
                Some(k) if numbered => key = k,
                _ => {
                    return Err(format!(
                        "line {line:?}: expected \"Node <N> <field>: <kB> kB\""
                    ))
                }
            }
        }
        let slot = match key {
            "MemTotal:" => &mut total,
            "MemFree:" => &mut free,
            "MemAvailable:" => &mut available,
            _ => continue,
        };
        let kib = match (
            words.next().map(str::parse::<u64>),
            words.next(),
            words.next(),
        ) {
            (Some(Ok(kib)), Some("kB"), None) => kib,
            _ => return Err(format!("line {line:?}: expected \"{key} <number> kB\"")),
        };
        let bytes = kib
            .checked_mul(1024)
            .ok_or_else(|| format!("line {line:?}: {kib} kB overflow 64 bits of bytes"))?;
        if slot.replace(bytes).is_some() {
            return Err(format!("line {line:?}: {key} given twice"));
        }
    }
    let quoted = || {
        let mut q: String = text.chars().take(QUOTE).collect();
        if q.len() < text.len() {
            q.push_str("...");
        }
        format!("{q:?}")
    };
    let Some(total) = total else {
        return Err(format!("no MemTotal in {path}: {}", quoted()));
    };
    let Some(free) = available.or(free) else {
        return Err(format!(
            "no MemAvailable or MemFree in {path}: {}",
            quoted()
        ));
    };
    Ok(MemoryInfo { free, total })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MACHINE: &str = "MemTotal:       16303924 kB\nMemFree:         1183820 kB\nMemAvailable:    9361368 kB\nBuffers:          553420 kB\nHugePages_Total:       0\nHugepagesize:       2048 kB\n";
    const NODE: &str = "Node 1 MemTotal:       263855228 kB\nNode 1 MemFree:        251297532 kB\nNode 1 MemUsed:         12557696 kB\nNode 1 Active(file):     1022936 kB\nNode 1 HugePages_Total:     0\n";

    #[test]
    fn both_formats_parse() {
        assert_eq!(
            parse(MACHINE, PROC),
            Ok(MemoryInfo {
                free: 9361368 * 1024,
                total: 16303924 * 1024
            })
        );
        assert_eq!(
            parse(NODE, "node1"),
            Ok(MemoryInfo {
                free: 251297532 * 1024,
                total: 263855228 * 1024
            })
        );
        // An old kernel's /proc/meminfo without MemAvailable: MemFree.
        let old = MACHINE.replace("MemAvailable:    9361368 kB\n", "");
        assert_eq!(parse(&old, PROC).map(|m| m.free), Ok(1183820 * 1024));
    }

    #[test]
    fn malformed_text_is_refused_with_the_text_quoted() {
        let cases = [
            ("", "no MemTotal in /proc/meminfo: \"\""),
            (
                "MemFree: 5 kB\n",
                "no MemTotal in /proc/meminfo: \"MemFree: 5 kB\\n\"",
            ),
            (
                "MemTotal: 5 kB\n",
                "no MemAvailable or MemFree in /proc/meminfo",
            ),
            (
                "MemTotal: lots kB\n",
                "line \"MemTotal: lots kB\": expected \"MemTotal: <number> kB\"",
            ),
            ("MemTotal: 5 MB\n", "line \"MemTotal: 5 MB\": expected"),
            ("MemTotal: 5\n", "line \"MemTotal: 5\": expected"),
            ("MemTotal: 5 kB extra\n", "expected"),
            ("MemTotal: 18446744073709551615 kB\n", "overflow 64 bits"),
            ("MemTotal: 5 kB\nMemTotal: 6 kB\n", "MemTotal: given twice"),
            (
                "Node x MemTotal: 5 kB\n",
                "line \"Node x MemTotal: 5 kB\": expected \"Node <N>",
            ),
            ("Node 0\n", "line \"Node 0\": expected"),
        ];
        for (text, want) in cases {
            let e = parse(text, PROC).expect_err(text);
            assert!(e.contains(want), "{text:?}: {e}");
        }
        // A long text is quoted in part.
        let long = "Cached: 1 kB\n".repeat(100);
        let e = parse(&long, PROC).expect_err("no fields");
        assert!(e.contains("Cached: 1 kB\\n") && e.ends_with("...\""), "{e}");
        assert!(e.len() < QUOTE + 200, "{}", e.len());
    }

    /// This machine's files parse, the node's where there is one.
    #[test]
    fn this_machines_meminfo_reads() {
        let m = machine("host").expect("/proc/meminfo");
        assert!(m.total > 0 && m.free <= m.total, "{m:?}");
        let n = node("host", 0).expect("node 0 or the machine");
        assert!(n.total > 0 && n.free <= n.total, "{n:?}");
        // A node that does not exist: the machine's numbers.
        let none = node("host", u32::MAX).expect("fallback");
        assert_eq!(none.total, m.total);
    }
}
