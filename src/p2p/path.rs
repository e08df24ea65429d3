//! Which path moves blocks between two engines: exported chunks imported by the peer (same
//! node, exportable memory), or NIXL (everything else), and why.

use std::fmt;

use crate::backend::{BackendInfo, MemoryKind};

/// How blocks move between two engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TransferPath {
    /// The sender exports the chunks under the blocks as POSIX descriptors, the receiver
    /// imports and maps them and copies the blocks itself (device to device on a GPU).
    PeerImport,
    /// NIXL (UCX, host or device memory), as for engines on different nodes.
    Nixl,
}

impl fmt::Display for TransferPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransferPath::PeerImport => "peer-import",
            TransferPath::Nixl => "nixl",
        })
    }
}

/// One side of a transfer as the path choice sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// The kernel's boot id (`/proc/sys/kernel/random/boot_id`): equal on one node.
    pub boot_id: String,
    /// Host or device memory.
    pub memory: MemoryKind,
    /// The device ordinal for device memory.
    pub device: Option<i32>,
    /// Whether its chunks can be exported and imported as POSIX descriptors.
    pub exportable: bool,
}

impl Endpoint {
    /// This process over `backend`.
    pub fn local(backend: &BackendInfo) -> Endpoint {
        Endpoint {
            boot_id: boot_id(),
            memory: backend.memory_kind,
            device: backend.device_ordinal,
            exportable: backend.posix_fd_exportable,
        }
    }
}

/// The path chosen and the reason, for logs and reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathChoice {
    /// The path.
    pub path: TransferPath,
    /// Why, in words with the facts that decided it.
    pub reason: String,
}

/// This node's boot id; empty when it cannot be read (then no two nodes are taken as one).
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

/// Choose how blocks move from `sender` to `receiver`: [`TransferPath::PeerImport`] when both
/// run on one node, hold the same kind of memory and can export and import chunks as POSIX
/// descriptors; [`TransferPath::Nixl`] otherwise. (NIXL's UCX moves VMM device memory between
/// processes by software emulation at about 0.5 GB/s where it has no POSIX-fd VMM path, which is
/// why the import path exists; see README.)
pub fn choose_path(sender: &Endpoint, receiver: &Endpoint) -> PathChoice {
    let nixl = |reason: String| PathChoice {
        path: TransferPath::Nixl,
        reason,
    };
    if sender.boot_id.is_empty() || sender.boot_id != receiver.boot_id {
        return nixl(format!(
            "different nodes (boot ids {:?} and {:?})",
            sender.boot_id, receiver.boot_id
        ));
    }
    if sender.memory != receiver.memory {
        return nixl(format!(
            "sender holds {:?} memory, receiver {:?} memory",
            sender.memory, receiver.memory
        ));
    }
    if !sender.exportable || !receiver.exportable {
        let side = if sender.exportable {
            "receiver"
        } else {
            "sender"
        };
        return nixl(format!(
            "the {side}'s backend cannot export or import chunks as POSIX descriptors (host: create it with ChunkFiles::PerChunk; CUDA: the device lacks POSIX-fd handles)"
        ));
    }
    let devices = match (sender.device, receiver.device) {
        (Some(a), Some(b)) if a == b => format!(", one device ({a})"),
        (Some(a), Some(b)) => format!(", device {a} to device {b} with peer access"),
        _ => String::new(),
    };
    PathChoice {
        path: TransferPath::PeerImport,
        reason: format!(
            "same node (boot id {}), {:?} memory exportable as POSIX descriptors on both sides{devices}",
            sender.boot_id, sender.memory
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(boot: &str, memory: MemoryKind, exportable: bool, device: Option<i32>) -> Endpoint {
        Endpoint {
            boot_id: boot.into(),
            memory,
            device,
            exportable,
        }
    }

    #[test]
    fn path_and_reason() {
        let a = ep("n1", MemoryKind::Device, true, Some(0));
        let c = choose_path(&a, &ep("n1", MemoryKind::Device, true, Some(1)));
        assert_eq!(c.path, TransferPath::PeerImport);
        assert!(c.reason.contains("device 0 to device 1"), "{}", c.reason);
        let c = choose_path(&a, &ep("n2", MemoryKind::Device, true, Some(0)));
        assert_eq!(c.path, TransferPath::Nixl);
        assert!(c.reason.contains("different nodes"), "{}", c.reason);
        let c = choose_path(&a, &ep("n1", MemoryKind::Host, true, None));
        assert_eq!(c.path, TransferPath::Nixl);
        assert!(c.reason.contains("Host"), "{}", c.reason);
        let c = choose_path(
            &ep("n1", MemoryKind::Host, false, None),
            &ep("n1", MemoryKind::Host, true, None),
        );
        assert_eq!(c.path, TransferPath::Nixl);
        assert!(c.reason.contains("sender's backend"), "{}", c.reason);
        let c = choose_path(
            &ep("", MemoryKind::Host, true, None),
            &ep("", MemoryKind::Host, true, None),
        );
        assert_eq!(c.path, TransferPath::Nixl);
        assert!(!boot_id().is_empty());
    }
}
