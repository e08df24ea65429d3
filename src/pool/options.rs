//! [`MemOptions`]: how a call that maps memory should do it (tag, name, zeroing, chunk size).

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::tag::Tag;

/// Options for every call that maps memory: [`crate::Pool::allocate_with`],
/// [`crate::Pool::map_with`], [`crate::Pool::reserve_region_with`], and the builders over them
/// ([`crate::BlockBacking::reserve`], the `LayoutBuilder` memories, `ElasticKv::new`).
///
/// ```
/// use elastic_vmm::{MemOptions, Pool, Tag};
/// # fn main() -> elastic_vmm::Result<()> {
/// let pool = Pool::host(1 << 30)?;
/// let w = pool.allocate_with(4096, &MemOptions::new().tag(Tag::Weights).name("w").zeroed())?;
/// assert_eq!(w.tag(), Tag::Weights);
/// # Ok(()) }
/// ```
///
/// | option   | allocate       | map                        | reserve region / builders           |
/// |----------|----------------|----------------------------|-------------------------------------|
/// | `tag`    | the allocation | the range                  | every mapping of the region         |
/// | `name`   | reports, leaks | refused                    | refused (layout allocation: yes)    |
/// | `zeroed` | zero-filled    | the range zero-filled      | region: unmapped parts read as zeros (the zero page); builders: refused (`map_region` layout: yes) |
/// | `chunk`  | refused        | largest physical chunk     | the region's chunk (backing: page)  |
///
/// An option set where it does not apply is refused with [`Error::OptionNotApplicable`] naming
/// it, before anything is mapped. An unset tag is the call's default: [`Tag::Scratch`] for the
/// pool's calls, [`Tag::Kv`] for KV structures (backings, layouts, elastic tensors). `chunk` is
/// checked to be a non-zero multiple of the granularity ([`Error::Misaligned`]); a range mapped
/// with chunks larger than a granule can only be unmapped in whole chunks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MemOptions {
    tag: Option<Tag>,
    pub(crate) name: Option<Arc<str>>,
    pub(crate) zeroed: bool,
    chunk: Option<u64>,
}

impl MemOptions {
    /// No option set: the call's defaults.
    pub fn new() -> Self {
        MemOptions::default()
    }

    /// What the memory holds: sleep policies and per-tag stats go by it.
    pub fn tag(mut self, tag: Tag) -> Self {
        self.tag = Some(tag);
        self
    }

    /// A name that shows in reports and leak warnings (allocations only).
    pub fn name(mut self, name: &str) -> Self {
        self.name = Some(name.into());
        self
    }

    /// Every byte reads as zero: set to zero before the call returns (allocate, map), or, for a
    /// region, every unmapped part aliased to the pool's zero page (see
    /// [`crate::Pool::reserve_region_with`]).
    pub fn zeroed(mut self) -> Self {
        self.zeroed = true;
        self
    }

    /// Physical chunks of up to `bytes` (a multiple of the granularity): fewer driver calls,
    /// but unmapping must cover whole chunks.
    pub fn chunk(mut self, bytes: u64) -> Self {
        self.chunk = Some(bytes);
        self
    }

    /// The tag, or `default` when none was set.
    pub(crate) fn tag_or(&self, default: Tag) -> Tag {
        self.tag.clone().unwrap_or(default)
    }

    /// The chunk size, checked to be a non-zero multiple of `gran`.
    pub(crate) fn chunk_checked(&self, gran: u64) -> Result<Option<u64>> {
        match self.chunk {
            Some(c) if c == 0 || c % gran != 0 => Err(Error::Misaligned {
                what: "chunk",
                value: c,
                alignment: gran,
            }),
            c => Ok(c),
        }
    }

    /// Refuse the options among `name`, `zeroed` and `chunk` that `call` does not take.
    pub(crate) fn refuse(&self, call: &'static str, options: &[&'static str]) -> Result<()> {
        for &option in options {
            let set = match option {
                "name" => self.name.is_some(),
                "zeroed" => self.zeroed,
                "chunk" => self.chunk.is_some(),
                _ => false,
            };
            if set {
                return Err(Error::OptionNotApplicable { option, call });
            }
        }
        Ok(())
    }
}
