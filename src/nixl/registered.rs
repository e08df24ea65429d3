//! A fully mapped layout registered with NIXL, one registration per physical chunk, owning the
//! layout so that the registrations always go first.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use nixl_sys::MemType;

use super::agent::{mem_type_of, AgentShared, NixlAgent};
use crate::backing::PinRefused;
use crate::error::Result;
use crate::layout::StorageKind;
use crate::layout::{KvLayout, Layout, LayoutPin, LayoutViews, MemoryView};
use crate::pool::SleepWatcher;

/// A [`Layout`] whose chunks are registered with one agent. Dereferences to the layout.
/// Dropping it deregisters every chunk, then drops the layout (and gives its memory back); while
/// a transfer over it may still run (one that timed out, see
/// [`crate::nixl::transfer_blocks`]), both wait for it.
pub struct RegisteredLayout {
    inner: Arc<Registered>,
}

/// The registrations and the layout; shared with the pins of transfers over it.
struct Registered {
    agent: Arc<AgentShared>,
    /// The registry's address space: 0 for memory, the file's own for a disk layout.
    space: u64,
    chunks: Vec<MemoryView>,
    /// Keeps the layout's pool from sleeping under the registrations (`None`: caller memory).
    sleep_guard: Option<(crate::Pool, Arc<dyn SleepWatcher>, u64)>,
    layout: Layout,
}

/// Refuses every sleep of a pool while a [`RegisteredLayout`] holds registrations of its
/// memory: NIXL would keep pointing at released memory. Elastic layouts, whose hook lets go of
/// and renews registrations, sleep fine.
struct RefuseSleep {
    pool: String,
    agent: String,
}

impl SleepWatcher for RefuseSleep {
    fn freeze(&self) -> Result<()> {
        Err(crate::Error::SleepRefused {
            pool: self.pool.clone(),
            op: "sleep",
            reason: format!(
                "a RegisteredLayout holds NIXL registrations of its memory for agent {:?}; drop it first (elastic layouts re-register through their hook)",
                self.agent
            ),
        })
    }
    fn thaw(&self) {}
    fn unmapping_all(&self) {}
    fn mapped_all(&self) -> Result<()> {
        Ok(())
    }
}

/// The registry space, NIXL memory type and device id of a layout's memory: a disk layout's
/// file is `FILE` with the descriptor as device id, in a space of its own (its views are
/// offsets); memory is `DRAM` or `VRAM` by kind, in space 0.
pub(crate) fn registration_of(views: &LayoutViews) -> Result<(u64, MemType, u64)> {
    if views.storage() == StorageKind::Disk {
        let fd = views.file_fd().ok_or_else(|| {
            crate::Error::InvalidArgument("a disk layout without its file".into())
        })?;
        let fd = u64::try_from(fd).map_err(|_| {
            crate::Error::InvalidArgument(format!("a disk layout's descriptor {fd}"))
        })?;
        return Ok((fd + 1, MemType::File, fd));
    }
    let (mem, dev) = mem_type_of(views.memory_kind(), views.device())?;
    Ok((0, mem, dev))
}

impl RegisteredLayout {
    pub(crate) fn new(agent: Arc<AgentShared>, layout: Layout) -> Result<Self> {
        let chunks = layout.chunks();
        let (space, mem_type, device_id) = registration_of(layout.views())?;
        // Before any registration: a backend must move this memory type (POSIX is created
        // for a file when the agent has none).
        agent.ensure_backend_for(mem_type)?;
        let sleep_guard = layout.pool().map(|pool| {
            let w: Arc<dyn SleepWatcher> = Arc::new(RefuseSleep {
                pool: pool.name().to_string(),
                agent: agent.name.to_string(),
            });
            let id = pool.inner().add_watcher(Arc::downgrade(&w));
            (pool.clone(), w, id)
        });
        let mut this = Registered {
            agent,
            space,
            chunks: Vec::with_capacity(chunks.len()),
            sleep_guard,
            layout,
        };
        for c in chunks {
            // On error `this` drops: the registrations made so far go, then the layout.
            this.agent.register_in(space, c, mem_type, device_id)?;
            this.chunks.push(c);
        }
        tracing::debug!(agent = %this.agent.name, chunks = this.chunks.len(), "layout registered with NIXL");
        Ok(RegisteredLayout {
            inner: Arc::new(this),
        })
    }

    /// The agent the layout is registered with.
    pub fn agent(&self) -> NixlAgent {
        NixlAgent {
            shared: self.inner.agent.clone(),
        }
    }

    /// The registered chunks, one registration each.
    pub fn chunks(&self) -> &[MemoryView] {
        &self.inner.chunks
    }
}

impl Deref for RegisteredLayout {
    type Target = Layout;

    fn deref(&self) -> &Layout {
        &self.inner.layout
    }
}

impl KvLayout for RegisteredLayout {
    fn views(&self) -> &LayoutViews {
        self.inner.layout.views()
    }
}

impl crate::layout::sealed::Sealed for RegisteredLayout {
    fn pin_blocks(&self, _blocks: &[usize], _holder: &str) -> Result<LayoutPin, PinRefused> {
        // Every block has memory for the layout's whole life; the pin keeps that life going.
        Ok(LayoutPin::owner(self.inner.clone()))
    }

    fn pool_of(&self) -> Option<&crate::Pool> {
        self.inner.layout.pool()
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        // Registrations first, then (as the fields drop) the memory under them.
        for c in self.chunks.drain(..) {
            self.agent.deregister_range_in(self.space, c.addr, c.len);
        }
        if let Some((pool, _, id)) = &self.sleep_guard {
            pool.inner().remove_watcher(*id);
        }
    }
}

impl fmt::Debug for RegisteredLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredLayout")
            .field("agent", &self.inner.agent.name)
            .field("chunks", &self.inner.chunks.len())
            .field("layout", &self.inner.layout)
            .finish()
    }
}
