//! A fully mapped layout registered with NIXL, one registration per physical chunk, owning the
//! layout so that the registrations always go first.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use super::agent::{AgentShared, NixlAgent};
use crate::backing::PinRefused;
use crate::error::Result;
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

impl RegisteredLayout {
    pub(crate) fn new(agent: Arc<AgentShared>, layout: Layout) -> Result<Self> {
        let chunks = layout.chunks();
        let (kind, device) = (layout.memory_kind(), layout.device());
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
            chunks: Vec::with_capacity(chunks.len()),
            sleep_guard,
            layout,
        };
        for c in chunks {
            // On error `this` drops: the registrations made so far go, then the layout.
            this.agent.register(c, kind, device)?;
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
}

impl Drop for Registered {
    fn drop(&mut self) {
        // Registrations first, then (as the fields drop) the memory under them.
        for c in self.chunks.drain(..) {
            self.agent.deregister_range(c.addr, c.len);
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
