//! RAII allocations handed out by [`crate::Pool::allocate`].

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use super::Inner;
use crate::backend::BackendInfo;
use crate::error::{Error, Result};
use crate::tag::Tag;

/// Memory from a pool, backed by physical memory for as long as this value lives, except while
/// the pool sleeps ([`crate::Pool::sleep`]): the address stays reserved and the contents come
/// back with the wake, but `read`, `write` and `fill` are refused meanwhile.
///
/// Dropping it returns the memory to the pool's idle set (no driver call). The allocation owns a
/// reference to the pool's internals, so its address stays valid even if every [`crate::Pool`]
/// handle is dropped first, on any thread, in any order.
pub struct Allocation {
    /// The pool, kept alive by its [`super::state::KeepAlive`] while this allocation is live
    /// (not by a reference count of its own: allocating and freeing touch none).
    pool: NonNull<Inner>,
    offset: u64,
    size: usize,
    footprint: u64,
    slot: u32,
    /// Which thread front may keep it when freed (`thread_front::front_kind`).
    front_kind: u8,
}

// SAFETY: an allocation is a shared reference to the pool's internals (`Inner: Send + Sync`)
// plus plain numbers, as an `Arc<Inner>` would be.
unsafe impl Send for Allocation {}
// SAFETY: as for `Send`; every method takes the pool's lock or reads immutable fields.
unsafe impl Sync for Allocation {}

impl Allocation {
    /// An allocation the caller recorded as live under the pool's lock.
    ///
    /// # Safety
    /// `slot` is live in `pool`'s books and the pool's `KeepAlive` is held, until this
    /// allocation's drop frees the slot.
    pub(crate) unsafe fn new(
        pool: &Arc<Inner>,
        offset: u64,
        size: usize,
        footprint: u64,
        slot: u32,
        front_kind: u8,
    ) -> Self {
        Allocation {
            pool: NonNull::from(&**pool),
            offset,
            size,
            footprint,
            slot,
            front_kind,
        }
    }

    /// Never kept by a thread front when freed: for blocks a front cache holds (routing), whose
    /// flush must give them to the pool itself, not to the flushing thread's front.
    pub(crate) fn bypass_thread_fronts(&mut self) {
        self.front_kind = 0;
    }

    fn inner(&self) -> &Inner {
        // SAFETY: the pool's `KeepAlive` holds it while this allocation is live (see `new`).
        unsafe { self.pool.as_ref() }
    }

    /// Address of the first byte (a device pointer on CUDA, a host pointer on host memory).
    pub fn addr(&self) -> u64 {
        self.inner().base + self.offset
    }

    /// Bytes requested.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Bytes held, the request rounded up to the pool's allocation unit.
    pub fn footprint(&self) -> u64 {
        self.footprint
    }

    /// Offset of the allocation in the pool's reservation.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The name given at allocation, if any.
    pub fn name(&self) -> Option<String> {
        let st = self.inner().state.lock();
        st.live
            .get(self.slot)
            .and_then(|r| r.name.as_deref().map(str::to_owned))
    }

    /// What the memory holds ([`crate::MemOptions::tag`]; untagged: [`Tag::Scratch`]).
    pub fn tag(&self) -> Tag {
        let st = self.inner().state.lock();
        st.live
            .get(self.slot)
            .map_or_else(Tag::default, |r| r.tag.clone())
    }

    /// The backend the memory lives on.
    pub fn backend_info(&self) -> &BackendInfo {
        self.inner().backend.info()
    }

    fn check(&self, at: usize, len: usize) -> Result<()> {
        if at.checked_add(len).is_none_or(|end| end > self.size) {
            return Err(Error::RangeOutOfBounds {
                offset: at as u64,
                len: len as u64,
                capacity: self.size as u64,
            });
        }
        Ok(())
    }

    /// Copy `data` into the allocation at byte `at` (host-to-device on CUDA). Refused
    /// ([`Error::Asleep`]) while the pool sleeps.
    pub fn write(&mut self, at: usize, data: &[u8]) -> Result<()> {
        self.check(at, data.len())?;
        let _pin = CopyPin::new(self, "write")?;
        // SAFETY: the range lies inside this allocation, which is mapped with access while it
        // lives and the pool is awake (the pin keeps a sleep from starting meanwhile);
        // `&mut self` rules out concurrent use through this handle.
        unsafe {
            self.inner()
                .backend
                .copies()
                .write(self.addr() + at as u64, data)
        }
    }

    /// Copy bytes from the allocation at byte `at` into `out`. Refused while the pool sleeps.
    pub fn read(&self, at: usize, out: &mut [u8]) -> Result<()> {
        self.check(at, out.len())?;
        let _pin = CopyPin::new(self, "read")?;
        // SAFETY: the range lies inside this allocation, mapped while the pin holds.
        unsafe {
            self.inner()
                .backend
                .copies()
                .read(self.addr() + at as u64, out)
        }
    }

    /// Set every byte of the allocation to `byte`. Refused while the pool sleeps.
    pub fn fill(&mut self, byte: u8) -> Result<()> {
        let _pin = CopyPin::new(self, "fill")?;
        // SAFETY: the whole allocation is mapped with access while the pin holds; `&mut self`
        // as in `write`.
        unsafe {
            self.inner()
                .backend
                .copies()
                .fill(self.addr(), self.size, byte)
        }
    }
}

/// An allocation's range held against sleep while the CPU copies through it.
struct CopyPin<'a> {
    pool: &'a Inner,
    range: (u64, u64),
}

impl<'a> CopyPin<'a> {
    fn new(a: &'a Allocation, op: &'static str) -> Result<Self> {
        let pool = a.inner();
        let range = (a.offset, a.offset + a.footprint);
        let mut st = pool.state.lock();
        st.sleep.refuse_unless_awake(pool.name(), op)?;
        st.pins.push(range);
        Ok(CopyPin { pool, range })
    }
}

impl Drop for CopyPin<'_> {
    fn drop(&mut self) {
        let mut st = self.pool.state.lock();
        if let Some(i) = st.pins.iter().position(|&p| p == self.range) {
            st.pins.swap_remove(i);
        }
    }
}

impl fmt::Debug for Allocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocation")
            .field("pool", &self.inner().name())
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("size", &self.size)
            .field("footprint", &self.footprint)
            .finish()
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        // The last allocation of a closed pool ends the pool: its last reference is dropped
        // here, after `free` returned and with nothing of the pool used any more.
        let inner = self.inner();
        if inner.keep_in_thread_front(self.offset, self.footprint, self.slot, self.front_kind) {
            return;
        }
        drop(inner.free(self.offset, self.footprint, self.slot));
    }
}
