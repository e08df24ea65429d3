//! A fully mapped layout registered with NIXL, one registration per physical chunk, owning the
//! layout so that the registrations always go first.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use super::agent::{AgentShared, NixlAgent};
use crate::backing::PinRefused;
use crate::error::Result;
use crate::layout::{KvLayout, Layout, LayoutPin, LayoutViews, MemoryView};

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
    layout: Layout,
}

impl RegisteredLayout {
    pub(crate) fn new(agent: Arc<AgentShared>, layout: Layout) -> Result<Self> {
        let chunks = layout.chunks();
        let (kind, device) = (layout.memory_kind(), layout.device());
        let mut this = Registered {
            agent,
            chunks: Vec::with_capacity(chunks.len()),
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
