//! A listening socket's place in the file system, made safe before anything is created there.
//!
//! A socket's folder must be private to the listener's user: it is made so when missing (0700,
//! or 0710 with the group that may connect), and an existing one is refused when another user
//! owns it, others could write or reach it, or it is a symbolic link, with the path, owner and
//! mode in the error ([`Error::InsecurePath`]). The folder is reached one component at a time
//! from the root, each opened relative to its parent without following a symbolic link, and a
//! folder above it that others may write is refused unless it is sticky (see `walk`): no
//! other user can swap a parent to make the broker chmod or chown a folder it did not make.
//! Everything after that check works through the folder's descriptor (opened without
//! following a link), so the folder checked is the folder used, even if a component of its
//! path is swapped later: the socket's name is checked first, then the lock file beside the
//! socket (`<socket's name>.lock`) is opened with `O_NOFOLLOW` and must be a regular file of
//! ours (then it is rewritten, never anyone else's file), only a stale socket of ours is
//! removed from the socket's name (any other file there is refused and left as it was), the
//! socket is bound through the descriptor (`/proc/self/fd/<descriptor>/<name>`, see
//! [`SocketDir::bind`]) and checked there after bind, and its mode, group and removal at
//! the end are `*at` calls on the descriptor.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use crate::error::{Error, Result};

/// The longest address a Unix socket is bound to, in bytes: `sun_path` holds 108 with the
/// terminating NUL.
const MAX_SOCKET_ADDRESS: usize = 107;

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

/// Open (making what is missing, 0700) the folder `dir_path` one component at a time from
/// the root (or from the working folder for a relative path), each relative to its parent's
/// descriptor with `O_NOFOLLOW | O_DIRECTORY`: no symbolic link is followed anywhere on the
/// path, and a parent that others may write is refused unless it is sticky (there only the
/// owner may rename or remove what is ours), so no other user can swap a folder under us.
/// Returns the folder and whether this call made it (made with `mkdirat` in the parent held
/// open: the name there cannot have been replaced since, so what is opened is what was made).
fn walk(dir_path: &Path) -> Result<(OwnedFd, bool)> {
    use std::path::Component;
    // Folders on the way are opened `O_PATH` (search permission is enough, as for a path
    // lookup); the socket's folder itself is opened for reading (to fchmod/fchown it).
    let path_flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let open_flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let start = if dir_path.is_absolute() { "/" } else { "." };
    let mut here = PathBuf::from(start);
    let parts: Vec<_> = dir_path
        .components()
        .filter(|c| !matches!(c, Component::RootDir | Component::CurDir))
        .collect();
    let last = parts.len().saturating_sub(1);
    let first = if parts.is_empty() {
        open_flags
    } else {
        path_flags
    };
    let mut dir = rustix::fs::open(start, first, Mode::empty())
        .map_err(|e| io_error("open socket folder", &here, e))?;
    let mut made = false;
    for (i, part) in parts.into_iter().enumerate() {
        let flags = if i == last { open_flags } else { path_flags };
        let name = match part {
            Component::RootDir | Component::CurDir => continue,
            Component::Prefix(_) => return Err(insecure(dir_path, "a path prefix")),
            Component::ParentDir => {
                return Err(insecure(
                    dir_path,
                    "the socket's path must not contain `..`",
                ))
            }
            Component::Normal(n) => n,
        };
        let st = rustix::fs::fstat(&dir).map_err(|e| io_error("stat", &here, e))?;
        if st.st_mode & 0o002 != 0 && st.st_mode & 0o1000 == 0 {
            return Err(insecure(
                &here,
                format!(
                    "a folder above the socket's has mode {:04o} (owner uid {}): anyone may replace what is in it; use a path whose folders others cannot write (or that are sticky, like /tmp)",
                    mode_of(&st),
                    st.st_uid
                ),
            ));
        }
        here.push(name);
        made = false;
        let next = match rustix::fs::openat(&dir, name, flags, Mode::empty()) {
            Err(Errno::NOENT) => {
                match rustix::fs::mkdirat(&dir, name, Mode::from_raw_mode(0o700)) {
                    Ok(()) => made = true,
                    Err(Errno::EXIST) => {}
                    Err(e) => return Err(io_error("create socket folder", &here, e)),
                }
                rustix::fs::openat(&dir, name, flags, Mode::empty())
            }
            other => other,
        };
        dir = match next {
            Ok(d) => d,
            Err(Errno::LOOP | Errno::NOTDIR) => {
                let link = rustix::fs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW)
                    .is_ok_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Symlink);
                let what = if link {
                    "the folder is a symbolic link (no link is followed on the socket's path)"
                } else {
                    "not a folder"
                };
                return Err(insecure(&here, what));
            }
            Err(e) => return Err(io_error("open socket folder", &here, e)),
        };
    }
    Ok((dir, made))
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
    /// made so (no symbolic link is followed on the path; a folder above it others may write
    /// must be sticky); an existing one must be a real folder, owned by this
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
        let (dir, made) = walk(&dir_path)?;
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
            // Made by this call (see `walk`), or ours and private: set exactly what is needed.
            // The socket is later bound through this folder's descriptor (`bind`), so what is
            // set here is the socket's folder whatever happens to its path.
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

    /// Open and lock the lock file beside the socket (`<socket's file name>.lock`, so it can
    /// never be a neighbour such as `Cargo.lock` for a socket `Cargo.toml`) and write this
    /// process's id in it. The socket's path is checked first (nothing, or a socket of this
    /// user): a refused path creates and rewrites nothing. The lock file is opened without
    /// following a symbolic link and must be a regular file of this user with no other link;
    /// another process holding the lock is an error naming the pid it wrote.
    pub fn lock(&self) -> Result<File> {
        self.check_socket_path()?;
        let mut lock_name = self.name.clone();
        lock_name.push(".lock");
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
        if !self.check_socket_path()? {
            return Ok(());
        }
        let path = self.socket_path();
        rustix::fs::unlinkat(&self.dir, &self.name, AtFlags::empty())
            .map_err(|e| io_error("remove stale socket", &path, e))
    }

    /// Whether a socket of ours sits at the socket's path (false: nothing there); anything
    /// else there is refused, left as it was.
    fn check_socket_path(&self) -> Result<bool> {
        let path = self.socket_path();
        let st = match rustix::fs::statat(&self.dir, &self.name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Ok(false),
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
        Ok(true)
    }

    /// Bind the listening socket in the claimed folder, through the folder's descriptor: the
    /// address is `/proc/self/fd/<folder's descriptor>/<socket's name>`, and procfs resolves
    /// that link to the folder the descriptor holds, so a component of the socket's path
    /// swapped since the claim cannot move the socket elsewhere (Linux has no `bindat`).
    /// Then the socket's name in that folder is checked (`fstatat` on the descriptor) to be a
    /// socket of this user. Errors: an address or a socket path beyond the 107 bytes a Unix
    /// socket's address holds (clients connect by path), procfs missing, or the bind itself.
    pub fn bind(&self) -> Result<UnixListener> {
        let path = self.socket_path();
        let fd = self.dir.as_raw_fd();
        let mut via = OsString::from(format!("/proc/self/fd/{fd}/"));
        via.push(&self.name);
        if via.len() > MAX_SOCKET_ADDRESS {
            return Err(Error::InvalidArgument(format!(
                "the socket's name {:?} is {} bytes: bound through its folder's descriptor as {} ({} bytes), beyond the {MAX_SOCKET_ADDRESS} bytes a Unix socket's address holds; use a shorter name",
                self.name,
                self.name.len(),
                Path::new(&via).display(),
                via.len()
            )));
        }
        // Clients connect by path: a path no address can hold would bind here and be
        // unreachable for every client.
        if path.as_os_str().len() > MAX_SOCKET_ADDRESS {
            return Err(Error::InvalidArgument(format!(
                "the socket's path {} is {} bytes, beyond the {MAX_SOCKET_ADDRESS} bytes a Unix socket's address holds: clients connect by path; use a shorter folder or name",
                path.display(),
                path.as_os_str().len()
            )));
        }
        // The link must lead to the folder held (procfs mounted, and no other `/proc`).
        let held = rustix::fs::fstat(&self.dir).map_err(|e| io_error("stat", &self.dir_path, e))?;
        let link = format!("/proc/self/fd/{fd}");
        match rustix::fs::stat(link.as_str()) {
            Ok(st) if st.st_dev == held.st_dev && st.st_ino == held.st_ino => {}
            Ok(_) => {
                return Err(insecure(
                    &path,
                    format!("{link} does not lead to the socket's folder (is /proc procfs?); the socket is bound through it"),
                ))
            }
            Err(e) => {
                return Err(io_error(
                    "bind",
                    &path,
                    format!("{link}: {e}: the socket is bound through its folder's descriptor, which needs procfs at /proc"),
                ))
            }
        }
        let listener = UnixListener::bind(&via).map_err(|e| {
            io_error(
                "bind",
                &path,
                format!("through {}: {e}", Path::new(&via).display()),
            )
        })?;
        // What is now at the name in the folder held must be a socket of ours.
        let st = rustix::fs::statat(&self.dir, &self.name, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| io_error("stat the bound socket", &path, e))?;
        let me = rustix::process::geteuid().as_raw();
        if FileType::from_raw_mode(st.st_mode) != FileType::Socket || st.st_uid != me {
            return Err(insecure(
                &path,
                format!(
                    "after bind, {} of uid {} (mode {:04o}) sits at the socket's name in its folder, not the socket bound",
                    kind_of(&st),
                    st.st_uid,
                    mode_of(&st)
                ),
            ));
        }
        tracing::debug!(socket = %path.display(), via = %Path::new(&via).display(), "socket bound through its folder's descriptor");
        Ok(listener)
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
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};

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

    /// A folder above the socket's swapped for a symbolic link (to a folder of ours that claim
    /// did not make) while claim runs: claim must never chmod that folder. The old claim
    /// resolved the path three times (stat, mkdir -p, open) and took what it opened for what
    /// it made. Both a parent others may write (refused outright now) and a sticky one (no
    /// link followed now) are tried, with the swap in a loop on another thread.
    #[test]
    fn a_swapped_ancestor_never_gets_its_target_chmodded() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        use std::time::{Duration, Instant};
        for parent_mode in [0o777, 0o1777] {
            let base = scratch(&format!("swap{parent_mode:o}"));
            // The victim: an existing folder of ours, 0755, that claim did not make.
            let victim = base.join("victim/bin");
            std::fs::create_dir_all(&victim).unwrap();
            std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o755)).unwrap();
            // A folder others may write: a real folder `a` and a link `l` to the victim's
            // parent, exchanged in a loop.
            let x = base.join("x");
            std::fs::create_dir_all(x.join("a")).unwrap();
            std::os::unix::fs::symlink(base.join("victim"), x.join("l")).unwrap();
            std::fs::set_permissions(&x, std::fs::Permissions::from_mode(parent_mode)).unwrap();
            let xdir = File::open(&x).unwrap();
            let stop = Arc::new(AtomicBool::new(false));
            let swapper = {
                let stop = stop.clone();
                let xdir = xdir.try_clone().unwrap();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        let _ = rustix::fs::renameat_with(
                            &xdir,
                            "a",
                            &xdir,
                            "l",
                            rustix::fs::RenameFlags::EXCHANGE,
                        );
                    }
                })
            };
            let sock = x.join("a/bin/b.sock");
            let end = Instant::now() + Duration::from_secs(2);
            let (mut tries, mut clobbered) = (0u64, None);
            while Instant::now() < end {
                tries += 1;
                // What a previous round made goes again (whichever name is the real folder).
                for n in ["a", "l"] {
                    if let Ok(d) = rustix::fs::openat(
                        &xdir,
                        n,
                        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW,
                        Mode::empty(),
                    ) {
                        let _ = rustix::fs::unlinkat(&d, "bin", AtFlags::REMOVEDIR);
                    }
                }
                let _ = SocketDir::claim(&sock, None);
                let mode = std::fs::metadata(&victim).unwrap().permissions().mode() & 0o7777;
                if mode != 0o755 {
                    clobbered = Some(mode);
                    break;
                }
            }
            stop.store(true, Ordering::Relaxed);
            swapper.join().unwrap();
            let _ = std::fs::remove_dir_all(&base);
            assert!(
                clobbered.is_none(),
                "parent mode {parent_mode:04o}: after {tries} claims, {} (not made by claim) has mode {:04o}",
                victim.display(),
                clobbered.unwrap_or(0)
            );
        }
    }

    /// Issue 33, defect 7: the socket's folder renamed away after the claim and another folder
    /// put at its old path: the socket is bound in the claimed folder (the one checked), never
    /// in the folder now at the path, and its access is set and it is removed there too.
    #[test]
    fn the_socket_lands_in_the_claimed_folder_though_its_path_was_swapped() {
        let d = scratch("bind-swap");
        let s = SocketDir::claim(&d.join("a/x.sock"), None).unwrap();
        let _lock = s.lock().unwrap();
        s.clear_stale_socket().unwrap();
        // The claimed folder goes to `moved`; a new folder takes its path.
        std::fs::rename(d.join("a"), d.join("moved")).unwrap();
        std::fs::create_dir(d.join("a")).unwrap();
        let bound = s.bind();
        let in_claimed = std::fs::symlink_metadata(d.join("moved/x.sock"));
        let in_swapped = std::fs::symlink_metadata(d.join("a/x.sock"));
        let _ = std::fs::remove_file(d.join("a/x.sock"));
        let listener = bound.unwrap();
        assert!(
            in_swapped.is_err() && in_claimed.is_ok(),
            "bound at the swapped path {} (a socket in the folder now at the path: {}; in the claimed folder, moved to {}: {})",
            d.join("a/x.sock").display(),
            in_swapped.is_ok(),
            d.join("moved").display(),
            in_claimed.is_ok()
        );
        assert!(in_claimed.unwrap().file_type().is_socket());
        // The socket answers there, its access is set there, and it is removed from there.
        drop(std::os::unix::net::UnixStream::connect(d.join("moved/x.sock")).unwrap());
        assert!(listener.accept().is_ok());
        s.set_socket_access(0o600, None).unwrap();
        let mode = std::fs::symlink_metadata(d.join("moved/x.sock"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        s.remove_socket();
        assert!(std::fs::symlink_metadata(d.join("moved/x.sock")).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A socket's name too long for a Unix socket's address once bound through its folder's
    /// descriptor is refused with the numbers, before anything is bound.
    #[test]
    fn a_socket_name_beyond_the_address_limit_is_refused_with_the_numbers() {
        let d = scratch("long-name");
        let name = "n".repeat(100);
        let s = SocketDir::claim(&d.join(&name), None).unwrap();
        let e = s.bind().unwrap_err().to_string();
        assert!(
            e.contains("is 100 bytes") && e.contains("beyond the 107 bytes"),
            "{e}"
        );
        assert!(!d.join(&name).exists());
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A socket path naming a neighbour's file (`--socket dir/Cargo.toml`) is refused before
    /// anything is made: the old lock name (`with_extension("lock")`) truncated `Cargo.lock`.
    #[test]
    fn a_refused_socket_path_leaves_its_neighbours_alone() {
        let d = scratch("neighbours");
        std::fs::write(d.join("Cargo.toml"), "[package]\n").unwrap();
        std::fs::write(d.join("Cargo.lock"), "version = 4\n# precious\n").unwrap();
        let s = SocketDir::claim(&d.join("Cargo.toml"), None).unwrap();
        let e = s.lock().unwrap_err().to_string();
        assert!(
            e.contains("a regular file") && e.contains("left as it was"),
            "{e}"
        );
        assert_eq!(
            std::fs::read_to_string(d.join("Cargo.lock")).unwrap(),
            "version = 4\n# precious\n"
        );
        assert_eq!(
            std::fs::read_to_string(d.join("Cargo.toml")).unwrap(),
            "[package]\n"
        );
        assert!(!d.join("Cargo.toml.lock").exists());
        // A free path gets `<name>.lock`, never a neighbour's lock.
        let s = SocketDir::claim(&d.join("b.sock"), None).unwrap();
        drop(s.lock().unwrap());
        assert!(d.join("b.sock.lock").exists() && !d.join("b.lock").exists());
        let _ = std::fs::remove_dir_all(&d);
    }
}
