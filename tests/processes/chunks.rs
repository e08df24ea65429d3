//! Chunks exported in one process, imported and mapped in another (host backend: real memfd
//! memory shared between the two).

use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;

use elastic_vmm::backend::host::{ChunkFiles, HostBackend, DEFAULT_GRANULARITY};
use elastic_vmm::ipc;
use elastic_vmm::Backend;

use super::common;

pub const TESTS: &[(&str, fn())] = &[(
    "chunks::exported_chunk_is_shared_memory",
    exported_chunk_is_shared_memory,
)];

pub fn role(name: &str) -> Option<fn()> {
    match name {
        "chunks-importer" => Some(importer),
        _ => None,
    }
}

const CHUNK: usize = 4 * DEFAULT_GRANULARITY;

fn pattern(seed: u8) -> Vec<u8> {
    (0..CHUNK)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// Parent: creates two exportable chunks, writes into one, sends it to a child process, which
/// checks the bytes and writes its own; the parent sees them through its own mapping.
fn exported_chunk_is_shared_memory() {
    let backend =
        Arc::new(HostBackend::with_chunk_files(DEFAULT_GRANULARITY, ChunkFiles::PerChunk).unwrap());
    assert!(backend.info().posix_fd_exportable);
    let other = backend.create(CHUNK).unwrap();
    let chunk = backend.create(CHUNK).unwrap();
    let base = backend.reserve(CHUNK, DEFAULT_GRANULARITY).unwrap();
    // SAFETY: base is our fresh reservation of exactly one chunk, which is mapped nowhere.
    unsafe {
        backend.map(base, chunk).unwrap();
        backend.set_access(base, CHUNK).unwrap();
        backend.copies().write(base, &pattern(1)).unwrap();
    }
    let dir = common::temp_dir("chunks");
    let path = dir.join("s");
    let listener = UnixListener::bind(&path).unwrap();
    let child = common::spawn(
        "chunks-importer",
        &[("EVMM_SOCKET", path.display().to_string())],
    );
    let (conn, _) = listener.accept().unwrap();
    let creds = ipc::peer_credentials(&conn).unwrap();
    assert_eq!(creds.pid as u32, child.id(), "SO_PEERCRED names the child");
    let fd = backend.export_chunk(chunk).unwrap();
    let msg = ipc::encode(&(CHUNK as u64, "chunk".to_string())).unwrap();
    ipc::send_frame(&conn, &msg, &[fd.as_fd()]).unwrap();
    drop(fd);
    // The child answers once it has checked our bytes and written its own.
    let reply = ipc::recv_frame(&conn, ipc::MAX_FRAME)
        .unwrap()
        .expect("child's answer");
    let answer: String = ipc::decode(&reply.payload).unwrap();
    assert_eq!(answer, "written");
    let mut seen = vec![0u8; CHUNK];
    // SAFETY: mapped with access above, and the child has finished writing.
    unsafe { backend.copies().read(base, &mut seen).unwrap() };
    assert!(
        seen == pattern(2),
        "the child's bytes are visible in the parent"
    );
    assert!(common::wait_for(child, 30).success(), "child failed");
    // Exporting a chunk of a shared-memfd backend is refused with a reason.
    let shared = HostBackend::new(DEFAULT_GRANULARITY).unwrap();
    let c = shared.create(DEFAULT_GRANULARITY).unwrap();
    let e = shared.export_chunk(c).unwrap_err().to_string();
    assert!(e.contains("UNSUPPORTED") && e.contains("PerChunk"), "{e}");
    // SAFETY: chunks and reservation are ours and unused now.
    unsafe {
        shared.release(c).unwrap();
        backend.unmap(base, CHUNK).unwrap();
        backend.release(chunk).unwrap();
        backend.release(other).unwrap();
        backend.free_reservation(base, CHUNK).unwrap();
    }
    assert_eq!(backend.physical_bytes().unwrap(), 0);
    let _ = std::fs::remove_dir_all(dir);
}

/// Child: import the chunk, check the parent's bytes, write ours.
fn importer() {
    let conn = UnixStream::connect(common::var("EVMM_SOCKET")).unwrap();
    let frame = ipc::recv_frame(&conn, ipc::MAX_FRAME)
        .unwrap()
        .expect("a chunk");
    let (size, what): (u64, String) = ipc::decode(&frame.payload).unwrap();
    assert_eq!(what, "chunk");
    assert_eq!(frame.fds.len(), 1);
    let fd = frame.fds.into_iter().next().unwrap();
    // The descriptor is the chunk's own file: nothing of the parent's other memory.
    let len = std::fs::File::from(fd.try_clone().unwrap())
        .metadata()
        .unwrap()
        .len();
    assert_eq!(len, size, "the exported file holds this chunk only");
    let backend = HostBackend::new(DEFAULT_GRANULARITY).unwrap();
    // Asking for more than the file holds is an error, not a mapping past its end.
    let e = backend
        .import_chunk(fd.try_clone().unwrap(), size as usize * 2)
        .unwrap_err()
        .to_string();
    assert!(e.contains("holds"), "{e}");
    let chunk = backend.import_chunk(fd, size as usize).unwrap();
    let base = backend.reserve(size as usize, DEFAULT_GRANULARITY).unwrap();
    let mut seen = vec![0u8; size as usize];
    // SAFETY: fresh reservation of exactly the chunk's size; the parent writes no more.
    unsafe {
        backend.map(base, chunk).unwrap();
        backend.set_access(base, size as usize).unwrap();
        backend.copies().read(base, &mut seen).unwrap();
    }
    assert!(
        seen == pattern(1),
        "the parent's bytes are visible in the child"
    );
    // SAFETY: as above; the parent reads only after our answer.
    unsafe { backend.copies().write(base, &pattern(2)).unwrap() };
    // Imported memory is not counted as created here.
    assert_eq!(backend.physical_bytes().unwrap(), 0);
    ipc::send_frame(&conn, &ipc::encode(&"written".to_string()).unwrap(), &[]).unwrap();
    // SAFETY: ours, unused now.
    unsafe {
        backend.unmap(base, size as usize).unwrap();
        backend.release(chunk).unwrap();
        backend.free_reservation(base, size as usize).unwrap();
    }
}
