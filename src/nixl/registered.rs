//! A fully mapped layout registered with NIXL, one registration per physical chunk, owning the
//! layout so that the registrations always go first.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use super::agent::{AgentShared, NixlAgent};
use crate::error::Result;
use crate::layout::{KvLayout, Layout, LayoutViews, MemoryView};

/// A [`Layout`] whose chunks are registered with one agent. Dereferences to the layout.
/// Dropping it deregisters every chunk, then drops the layout (and gives its memory back).
pub struct RegisteredLayout {
    agent: Arc<AgentShared>,
    chunks: Vec<MemoryView>,
    layout: Layout,
}

impl RegisteredLayout {
    pub(crate) fn new(agent: Arc<AgentShared>, layout: Layout) -> Result<Self> {
        let chunks = layout.chunks();
        let (kind, device) = (layout.memory_kind(), layout.device());
        let mut this = RegisteredLayout {
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
        Ok(this)
    }

    /// The agent the layout is registered with.
    pub fn agent(&self) -> NixlAgent {
        NixlAgent {
            shared: self.agent.clone(),
        }
    }

    /// The registered chunks, one registration each.
    pub fn chunks(&self) -> &[MemoryView] {
        &self.chunks
    }

    fn deregister(&mut self) {
        for c in self.chunks.drain(..) {
            self.agent.deregister_range(c.addr, c.len);
        }
    }
}

impl Deref for RegisteredLayout {
    type Target = Layout;

    fn deref(&self) -> &Layout {
        &self.layout
    }
}

impl KvLayout for RegisteredLayout {
    fn views(&self) -> &LayoutViews {
        self.layout.views()
    }

    fn first_unbacked(&self, _blocks: &[usize]) -> Option<usize> {
        None
    }
}

impl Drop for RegisteredLayout {
    fn drop(&mut self) {
        // Registrations first, then (as the fields drop) the memory under them.
        self.deregister();
    }
}

impl fmt::Debug for RegisteredLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredLayout")
            .field("agent", &self.agent.name)
            .field("chunks", &self.chunks.len())
            .field("layout", &self.layout)
            .finish()
    }
}
