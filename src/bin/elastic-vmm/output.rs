//! Files the tool writes: the parent folder is created when missing, and the file appears whole
//! or not at all (written beside it, then renamed), so a reader never sees half a plot.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// Why an output file could not be written.
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// The folder that should hold the file could not be created.
    #[error("cannot create the folder {} for {}: {source}", .dir.display(), .file.display())]
    CreateDir {
        /// The folder.
        dir: PathBuf,
        /// The file that was to go in it.
        file: PathBuf,
        /// What the system said.
        source: io::Error,
    },
    /// The file itself could not be written or put in place.
    #[error("cannot write {}: {source}", .file.display())]
    Write {
        /// The file.
        file: PathBuf,
        /// What the system said.
        source: io::Error,
    },
    /// The path names no file (empty, or ends in `..` or `/`).
    #[error("{} is not a file name", .file.display())]
    NotAFile {
        /// The path given.
        file: PathBuf,
    },
}

/// Write `contents` to `file`, creating its parent folders first.
pub fn write_file(file: &Path, contents: &[u8]) -> Result<(), OutputError> {
    let name = file.file_name().ok_or_else(|| OutputError::NotAFile {
        file: file.to_path_buf(),
    })?;
    // `Path::parent` of a bare name is `""`: the current folder, which exists.
    if let Some(dir) = file.parent().filter(|d| !d.as_os_str().is_empty()) {
        fs::create_dir_all(dir).map_err(|source| OutputError::CreateDir {
            dir: dir.to_path_buf(),
            file: file.to_path_buf(),
            source,
        })?;
    }
    let mut tmp_name = name.to_os_string();
    tmp_name.push(".tmp");
    let tmp = file.with_file_name(tmp_name);
    let written = fs::write(&tmp, contents).and_then(|()| fs::rename(&tmp, file));
    written.map_err(|source| {
        // Best effort: a failed write must not leave a stray temporary file behind.
        let _ = fs::remove_file(&tmp);
        OutputError::Write {
            file: file.to_path_buf(),
            source,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh folder under the system's temporary folder, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> TempDir {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let dir = std::env::temp_dir().join(format!(
                "elastic-vmm-cli-{tag}-{}-{nanos}",
                std::process::id()
            ));
            fs::create_dir_all(&dir).expect("create a temporary folder");
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn creates_missing_parent_folders() {
        let tmp = TempDir::new("nested");
        let file = tmp.0.join("a/b/c/plot.svg");
        write_file(&file, b"<svg/>").expect("write into folders that do not exist yet");
        assert_eq!(fs::read(&file).expect("read back"), b"<svg/>");
        // Overwriting works, and no temporary file stays behind.
        write_file(&file, b"<svg></svg>").expect("overwrite");
        assert_eq!(fs::read(&file).expect("read back"), b"<svg></svg>");
        let names: Vec<_> = fs::read_dir(tmp.0.join("a/b/c"))
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("plot.svg")]);
    }

    #[test]
    fn a_file_in_the_way_of_the_folder_is_a_clear_error() {
        let tmp = TempDir::new("blocked");
        let blocker = tmp.0.join("not-a-folder");
        fs::write(&blocker, b"x").expect("create a plain file");
        let file = blocker.join("plot.svg");
        let err = write_file(&file, b"<svg/>").expect_err("a file cannot hold a file");
        assert!(matches!(err, OutputError::CreateDir { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("cannot create the folder") && msg.contains("not-a-folder"),
            "{msg}"
        );
        assert!(msg.contains("plot.svg"), "{msg}");
    }

    #[test]
    fn a_path_without_a_file_name_is_refused() {
        let err = write_file(Path::new(".."), b"x").expect_err("no file name");
        assert!(matches!(err, OutputError::NotAFile { .. }), "{err:?}");
        let err = write_file(Path::new(""), b"x").expect_err("empty path");
        assert!(matches!(err, OutputError::NotAFile { .. }), "{err:?}");
    }
}
