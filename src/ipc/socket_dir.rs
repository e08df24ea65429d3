//! A listening socket's place in the file system, made safe before anything is created there.
//!
//! A socket's folder must be private to the listener's user: it is made so when missing (0700,
//! or 0710 with the group that may connect), and an existing one is refused when another user
//! owns it, others could write or reach it, or it is a symbolic link, with the path, owner and
//! mode in the error ([`Error::InsecurePath`]). Everything after that check works through the
//! folder's descriptor (opened without following a link), so the folder checked is the folder
//! used: the lock file beside the socket is opened with `O_NOFOLLOW` and must be a regular file
//! of ours (then it is rewritten, never anyone else's file), and only a stale socket of ours is
//! removed from the socket's path; any other file there is refused and left as it was.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use crate::error::{Error, Result};

/// The permission bits a folder or file has, as `ls` would show them in octal.
fn mode_of(st: &rustix::fs::Stat) -> u32 {
    st.st_mode & 0o7777
}

fn insecure(path: &Path, problem: impl Into<String>) -> Error {
    Error::InsecurePath {
        path: path.to_path_buf(),
        problem: problem.into(),
    }
}

fn io_error(op: &'static str, path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Ipc {
        op,
        detail: format!("{}: {e}", path.display()),
    }
}

/// What a file is, for errors.
fn kind_of(st: &rustix::fs::Stat) -> &'static str {
    match FileType::from_raw_mode(st.st_mode) {
        FileType::RegularFile => "a regular file",
        FileType::Directory => "a folder",
        FileType::Symlink => "a symbolic link",
        FileType::Fifo => "a named pipe",
        FileType::Socket => "a socket",
        FileType::CharacterDevice => "a character device",
        FileType::BlockDevice => "a block device",
        FileType::Unknown => "a file of unknown type",
    }
}

/// A socket's folder, checked private, held open; and the socket's name in it.
#[derive(Debug)]
pub struct SocketDir {
    dir: OwnedFd,
    dir_path: PathBuf,
    name: OsString,
}

impl SocketDir {
    /// Check (or make) the folder of `socket`. `group`: the group that may connect too (the
    /// folder is then 0710 with that group, so its members can reach the socket and nothing
    /// else); `None`: the folder is 0700. A missing folder (and missing folders above it) is
    /// made so; an existing one must be a real folder (no symbolic link), owned by this
    /// process's user, with no access for others and no write access for its group. A private
    /// folder of ours (no access for group or others) is given to `group` when one is asked.
    pub fn claim(socket: &Path, group: Option<u32>) -> Result<SocketDir> {
        let name = socket
            .file_name()
            .ok_or_else(|| insecure(socket, "the socket's path names no file"))?
            .to_os_string();
        let dir_path = match socket.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let made = match std::fs::symlink_metadata(&dir_path) {
            Ok(_) => false,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(&dir_path)
                    .map_err(|e| io_error("create socket folder", &dir_path, e))?;
                true
            }
            Err(e) => return Err(io_error("inspect socket folder", &dir_path, e)),
        };
        let dir = match rustix::fs::open(
            &dir_path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(d) => d,
            Err(Errno::LOOP) => return Err(insecure(&dir_path, "the folder is a symbolic link")),
            Err(Errno::NOTDIR) => {
                let what = std::fs::symlink_metadata(&dir_path)
                    .map(|m| {
                        if m.file_type().is_symlink() {
                            "the folder is a symbolic link"
                        } else {
                            "not a folder"
                        }
                    })
                    .unwrap_or("not a folder");
                return Err(insecure(&dir_path, what));
            }
            Err(e) => return Err(io_error("open socket folder", &dir_path, e)),
        };
        let me = rustix::process::geteuid().as_raw();
        let st = rustix::fs::fstat(&dir).map_err(|e| io_error("stat", &dir_path, e))?;
        if st.st_uid != me {
            return Err(insecure(
                &dir_path,
                format!(
                    "the socket's folder belongs to uid {} (group {}, mode {:04o}), not to this user (uid {me}): another user could replace the socket; use a folder of your own (mode 0700)",
                    st.st_uid,
                    st.st_gid,
                    mode_of(&st)
                ),
            ));
        }
        let mode = mode_of(&st);
        let private = mode & 0o077 == 0;
        if made || (private && group.is_some()) {
            // Ours and private (or just made): set exactly what is needed.
            if let Some(gid) = group {
                rustix::fs::fchown(&dir, None, Some(rustix::process::Gid::from_raw(gid)))
                    .map_err(|e| io_error("chown socket folder", &dir_path, e))?;
            }
            let want = if group.is_some() { 0o710 } else { 0o700 };
            rustix::fs::fchmod(&dir, Mode::from_raw_mode(want))
                .map_err(|e| io_error("chmod socket folder", &dir_path, e))?;
        }
        let st = rustix::fs::fstat(&dir).map_err(|e| io_error("stat", &dir_path, e))?;
        let mode = mode_of(&st);
        let ok = match group {
            None => mode & 0o077 == 0,
            Some(gid) => mode & 0o027 == 0 && mode & 0o010 != 0 && st.st_gid == gid,
        };
        if !ok {
            let want = match group {
                None => "0700 (no access for group or others)".to_string(),
                Some(gid) => {
                    format!("0710 with group {gid} (its members may reach the socket, nobody else)")
                }
            };
            return Err(insecure(
                &dir_path,
                format!(
                    "the socket's folder has mode {mode:04o} (owner uid {}, group {}): others could reach or replace what is in it; it must be {want} (chmod it, or remove it and let the broker make it)",
                    st.st_uid, st.st_gid
                ),
            ));
        }
        Ok(SocketDir {
            dir,
            dir_path,
            name,
        })
    }

    /// The socket's path.
    pub fn socket_path(&self) -> PathBuf {
        self.dir_path.join(&self.name)
    }

    /// Open and lock the lock file beside the socket (`<socket>` with extension `lock`) and
    /// write this process's id in it. It is opened without following a symbolic link and must
    /// be a regular file of this user with no other link; another process holding the lock is
    /// an error naming the pid it wrote.
    pub fn lock(&self) -> Result<File> {
        let lock_name = Path::new(&self.name).with_extension("lock");
        let path = self.dir_path.join(&lock_name);
        let fd = match rustix::fs::openat(
            &self.dir,
            &lock_name,
            OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NOCTTY,
            Mode::from_raw_mode(0o600),
        ) {
            Ok(fd) => fd,
            Err(Errno::LOOP) => {
                return Err(insecure(
                    &path,
                    "the lock file is a symbolic link (not followed)",
                ))
            }
            Err(e) => return Err(io_error("open lock file", &path, e)),
        };
        let st = rustix::fs::fstat(&fd).map_err(|e| io_error("stat", &path, e))?;
        let me = rustix::process::geteuid().as_raw();
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile
            || st.st_uid != me
            || st.st_nlink != 1
        {
            return Err(insecure(
                &path,
                format!(
                    "the lock file is {} of uid {} with {} links (mode {:04o}); it must be a regular file of this user (uid {me}) with one link",
                    kind_of(&st),
                    st.st_uid,
                    st.st_nlink,
                    mode_of(&st)
                ),
            ));
        }
        let mut lock = File::from(fd);
        if let Err(e) =
            rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive)
        {
            let mut holder = String::new();
            let _ = lock.read_to_string(&mut holder);
            return Err(Error::Ipc {
                op: "start broker",
                detail: format!(
                    "another broker (pid {}) serves {} ({e})",
                    holder.trim(),
                    self.socket_path().display()
                ),
            });
        }
        // Ours, locked: rewrite it with our pid.
        let written = lock
            .set_len(0)
            .and_then(|()| lock.rewind())
            .and_then(|()| lock.write_all(std::process::id().to_string().as_bytes()));
        if let Err(e) = written {
            tracing::warn!(path = %path.display(), error = %e, "cannot write the pid into the lock file");
        }
        Ok(lock)
    }

    /// Make room for the socket: nothing there is fine; a socket of ours left by a dead
    /// listener (the caller holds the lock) is removed; anything else (a file, a link, another
    /// user's socket) is refused and left as it was.
    pub fn clear_stale_socket(&self) -> Result<()> {
        let path = self.socket_path();
        let st = match rustix::fs::statat(&self.dir, &self.name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Ok(()),
            Err(e) => return Err(io_error("stat", &path, e)),
        };
        let me = rustix::process::geteuid().as_raw();
        if FileType::from_raw_mode(st.st_mode) != FileType::Socket || st.st_uid != me {
            return Err(insecure(
                &path,
                format!(
                    "not a socket of this user: {} of uid {} ({} bytes, mode {:04o}) sits at the socket's path",
                    kind_of(&st),
                    st.st_uid,
                    st.st_size,
                    mode_of(&st)
                ),
            ));
        }
        rustix::fs::unlinkat(&self.dir, &self.name, AtFlags::empty())
            .map_err(|e| io_error("remove stale socket", &path, e))
    }

    /// Set the socket's mode and group (after bind, in the folder already checked).
    pub fn set_socket_access(&self, mode: u32, group: Option<u32>) -> Result<()> {
        let path = self.socket_path();
        if let Some(gid) = group {
            rustix::fs::chownat(
                &self.dir,
                &self.name,
                None,
                Some(rustix::process::Gid::from_raw(gid)),
                AtFlags::SYMLINK_NOFOLLOW,
            )
            .map_err(|e| io_error("chown socket", &path, e))?;
        }
        rustix::fs::chmodat(
            &self.dir,
            &self.name,
            Mode::from_raw_mode(mode),
            AtFlags::empty(),
        )
        .map_err(|e| io_error("chmod socket", &path, e))
    }

    /// Remove the socket if a socket of ours is still there (a broker stopping).
    pub fn remove_socket(&self) {
        if let Ok(st) = rustix::fs::statat(&self.dir, &self.name, AtFlags::SYMLINK_NOFOLLOW) {
            if FileType::from_raw_mode(st.st_mode) == FileType::Socket
                && st.st_uid == rustix::process::geteuid().as_raw()
            {
                let _ = rustix::fs::unlinkat(&self.dir, &self.name, AtFlags::empty());
            }
        }
    }

    /// The socket's file name.
    pub fn name(&self) -> &OsStr {
        &self.name
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("evmm-sockdir-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        d
    }

    #[test]
    fn folders_locks_and_socket_paths_are_checked() {
        let d = scratch("unit");
        // A fresh folder (two levels) is made private.
        let s = SocketDir::claim(&d.join("a/b/x.sock"), None).unwrap();
        for p in [d.join("a"), d.join("a/b")] {
            let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", p.display());
        }
        // The lock is exclusive: a second claim of it names the holder's pid.
        let lock = s.lock().unwrap();
        let e = SocketDir::claim(&d.join("a/b/x.sock"), None)
            .unwrap()
            .lock()
            .unwrap_err()
            .to_string();
        assert!(e.contains(&std::process::id().to_string()), "{e}");
        drop(lock);
        // A regular file at the socket's path is refused and kept.
        std::fs::write(d.join("a/b/x.sock"), "data").unwrap();
        let e = s.clear_stale_socket().unwrap_err().to_string();
        assert!(e.contains("a regular file") && e.contains("4 bytes"), "{e}");
        assert_eq!(std::fs::read(d.join("a/b/x.sock")).unwrap(), b"data");
        std::fs::remove_file(d.join("a/b/x.sock")).unwrap();
        // A stale socket is removed.
        drop(std::os::unix::net::UnixListener::bind(d.join("a/b/x.sock")).unwrap());
        s.clear_stale_socket().unwrap();
        assert!(!d.join("a/b/x.sock").exists());
        // Modes: open to others refused (with the mode); a file as the folder refused.
        std::fs::set_permissions(d.join("a/b"), std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = SocketDir::claim(&d.join("a/b/x.sock"), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("mode 0755"), "{e}");
        std::fs::write(d.join("file"), "").unwrap();
        let e = SocketDir::claim(&d.join("file/x.sock"), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a folder"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
