//! Which path moves blocks between two engines: exported chunks imported by the peer (same
//! node, exportable memory), or NIXL (everything else), and why.

use std::fmt;

use crate::backend::{format_uuid, BackendInfo, DeviceReach, MemoryKind};

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
    /// The device ordinal for device memory, as that process numbers its GPUs.
    pub device: Option<i32>,
    /// The GPU's UUID for device memory: one name in every process.
    pub device_uuid: Option<[u8; 16]>,
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
            device_uuid: backend.device_uuid,
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
/// run on one node, hold the same kind of memory, can export and import chunks as POSIX
/// descriptors, and (device memory) the receiver's device reaches the sender's GPU (`reach`,
/// as [`crate::backend::Backend::reach`] found it in the receiver's process: the same GPU, or
/// another one with peer access); [`TransferPath::Nixl`] otherwise. (NIXL's UCX moves VMM
/// device memory between processes by software emulation at about 0.5 GB/s where it has no
/// POSIX-fd VMM path, which is why the import path exists; see README.)
pub fn choose_path(sender: &Endpoint, receiver: &Endpoint, reach: DeviceReach) -> PathChoice {
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
    let gpu = sender
        .device_uuid
        .as_ref()
        .map_or_else(|| "of unknown UUID".to_owned(), format_uuid);
    let at = |d: Option<i32>| d.map_or_else(|| "?".to_owned(), |d| d.to_string());
    let devices = match (sender.memory, reach) {
        (MemoryKind::Host, _) => String::new(),
        (MemoryKind::Device, DeviceReach::Same) => {
            format!(", one GPU ({gpu}, device {})", at(receiver.device))
        }
        (MemoryKind::Device, DeviceReach::Peer { ordinal }) => format!(
            ", the sender's GPU {gpu} (device {ordinal} in the receiver's process) to the receiver's device {} with peer access",
            at(receiver.device)
        ),
        (MemoryKind::Device, DeviceReach::NoPeerAccess { ordinal }) => {
            return nixl(format!(
                "the receiver's device {} has no peer access to the sender's GPU {gpu} (device {ordinal} there)",
                at(receiver.device)
            ))
        }
        (MemoryKind::Device, DeviceReach::NotVisible) => {
            return nixl(format!(
                "the sender's GPU {gpu} is not visible in the receiver's process (CUDA_VISIBLE_DEVICES or a container hides it), so it cannot import its memory"
            ))
        }
        (MemoryKind::Device, DeviceReach::NoDevice) => {
            return nixl(format!(
                "the receiver's backend cannot tell whether its device reaches the sender's GPU {gpu}"
            ))
        }
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
            device_uuid: device.map(|d| [d as u8; 16]),
            exportable,
        }
    }

    #[test]
    fn path_and_reason() {
        let same = DeviceReach::Same;
        let a = ep("n1", MemoryKind::Device, true, Some(0));
        let b = ep("n1", MemoryKind::Device, true, Some(1));
        let c = choose_path(&a, &a, same);
        assert_eq!(c.path, TransferPath::PeerImport);
        assert!(
            c.reason
                .contains("one GPU (GPU-00000000-0000-0000-0000-000000000000, device 0)"),
            "{}",
            c.reason
        );
        let c = choose_path(&a, &b, DeviceReach::Peer { ordinal: 0 });
        assert_eq!(c.path, TransferPath::PeerImport);
        assert!(
            c.reason.contains(
                "(device 0 in the receiver's process) to the receiver's device 1 with peer access"
            ),
            "{}",
            c.reason
        );
        let c = choose_path(&a, &b, DeviceReach::NoPeerAccess { ordinal: 0 });
        assert_eq!(c.path, TransferPath::Nixl);
        assert!(
            c.reason
                .contains("device 1 has no peer access to the sender's GPU GPU-00000000"),
            "{}",
            c.reason
        );
        let c = choose_path(&a, &b, DeviceReach::NotVisible);
        assert_eq!(c.path, TransferPath::Nixl);
        assert!(c.reason.contains("not visible"), "{}", c.reason);
        let c = choose_path(&a, &b, DeviceReach::NoDevice);
        assert_eq!(c.path, TransferPath::Nixl);
        assert!(c.reason.contains("cannot tell"), "{}", c.reason);
        let c = choose_path(&a, &ep("n2", MemoryKind::Device, true, Some(0)), same);
        assert_eq!(c.path, TransferPath::Nixl);
        assert!(c.reason.contains("different nodes"), "{}", c.reason);
        let c = choose_path(&a, &ep("n1", MemoryKind::Host, true, None), same);
        assert_eq!(c.path, TransferPath::Nixl);
        assert!(c.reason.contains("Host"), "{}", c.reason);
        let h = ep("n1", MemoryKind::Host, true, None);
        let c = choose_path(&h, &h, DeviceReach::NoDevice);
        assert_eq!(c.path, TransferPath::PeerImport, "{}", c.reason);
        let c = choose_path(
            &ep("n1", MemoryKind::Host, false, None),
            &h,
            DeviceReach::NoDevice,
        );
        assert_eq!(c.path, TransferPath::Nixl);
        assert!(c.reason.contains("sender's backend"), "{}", c.reason);
        let e = ep("", MemoryKind::Host, true, None);
        let c = choose_path(&e, &e, DeviceReach::NoDevice);
        assert_eq!(c.path, TransferPath::Nixl);
        assert!(!boot_id().is_empty());
    }
}
