//! `top`: a live terminal view of the broker (ratatui): every engine and model with use,
//! limit, guarantee, in use, idle, cached, and a history sparkline of the global use.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crossterm::event::{self, Event, KeyCode, KeyEventKind};
use elastic_vmm::broker::{BrokerClient, Snapshot};
use elastic_vmm::stats::human_bytes;
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Gauge, Paragraph, Row, Sparkline, Table};
use ratatui::Frame;

use super::BoxError;

/// Samples kept for the sparklines.
const HISTORY: usize = 240;

#[derive(clap::Args, Clone)]
pub struct TopArgs {
    /// The broker's socket (default: see `ctl --help`).
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Refresh period in ms.
    #[arg(long, default_value_t = 500)]
    pub interval_ms: u64,
    /// Quit after this many refreshes (default: until q or Esc).
    #[arg(long)]
    pub frames: Option<u64>,
}

/// What the view remembers between refreshes.
#[derive(Default)]
pub struct TopState {
    global: VecDeque<u64>,
    per_model: HashMap<String, VecDeque<u64>>,
}

impl TopState {
    /// Add a snapshot to the history.
    pub fn push(&mut self, s: &Snapshot) {
        push_bounded(&mut self.global, s.global_used);
        for m in &s.models {
            push_bounded(self.per_model.entry(m.name.clone()).or_default(), m.used);
        }
        let live: Vec<&str> = s.models.iter().map(|m| m.name.as_str()).collect();
        self.per_model.retain(|k, _| live.contains(&k.as_str()));
    }
}

fn push_bounded(q: &mut VecDeque<u64>, v: u64) {
    if q.len() == HISTORY {
        q.pop_front();
    }
    q.push_back(v);
}

pub fn run(socket: PathBuf, args: &TopArgs) -> Result<(), BoxError> {
    let client = BrokerClient::connect_control(&socket, "top")?;
    let mut terminal = ratatui::init();
    let result = (|| -> Result<(), BoxError> {
        let mut state = TopState::default();
        let mut frames = 0u64;
        loop {
            let snap = client.snapshot()?;
            state.push(&snap);
            terminal.draw(|f| draw(f, &snap, &state, &socket))?;
            frames += 1;
            if args.frames.is_some_and(|n| frames >= n) {
                return Ok(());
            }
            let until = Instant::now() + Duration::from_millis(args.interval_ms.max(50));
            while let Some(left) = until.checked_duration_since(Instant::now()) {
                if event::poll(left)? {
                    if let Event::Key(k) = event::read()? {
                        if k.kind == KeyEventKind::Press
                            && matches!(k.code, KeyCode::Char('q') | KeyCode::Esc)
                        {
                            return Ok(());
                        }
                    }
                }
            }
        }
    })();
    ratatui::restore();
    result
}

/// Draw one frame.
pub fn draw(f: &mut Frame, s: &Snapshot, state: &TopState, socket: &std::path::Path) {
    let [head, gauge, models, spark, engines] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Length(3),
        Constraint::Min(6),
        Constraint::Length(6),
        Constraint::Length(6),
    ])
    .areas(f.area());
    let c = &s.counters;
    f.render_widget(
        Paragraph::new(vec![
            Line::from(format!(
                "elastic-vmm broker pid {} on {}  {} ({})  q: quit",
                s.broker_pid,
                socket.display(),
                s.backend.name,
                s.backend.device_name
            )),
            Line::from(format!(
                "grants {}  hand-overs {}  creates {}  releases {}  refusals {}  reclaims {}  dead engines {}  malformed {}{}",
                c.grants,
                c.handovers,
                c.creates,
                c.releases,
                c.refusals,
                c.reclaim_requests,
                c.dead_engines,
                c.malformed,
                s.audit.as_ref().map_or(String::new(), |a| format!("  AUDIT: {a}"))
            )),
        ]),
        head,
    );
    let ratio = if s.global_limit == 0 {
        0.0
    } else {
        (s.global_used as f64 / s.global_limit as f64).clamp(0.0, 1.0)
    };
    f.render_widget(
        Gauge::default()
            .block(Block::default().borders(Borders::ALL).title("global"))
            .gauge_style(Style::default().fg(Color::Green))
            .ratio(ratio)
            .label(format!(
                "{} of {}  (idle at broker {}, physical {}){}",
                human_bytes(s.global_used),
                human_bytes(s.global_limit),
                human_bytes(s.idle),
                human_bytes(s.physical),
                s.host_tier.as_ref().map_or(String::new(), |h| format!(
                    "  host tier {} of {} (idle {}, {} models, {} hand-overs, {} creates)",
                    human_bytes(h.global_used),
                    human_bytes(h.global_limit),
                    human_bytes(h.idle),
                    h.models.len(),
                    h.counters.handovers,
                    h.counters.creates
                ))
            )),
        gauge,
    );
    let header = Row::new([
        "MODEL",
        "PID",
        "USED",
        "LIMIT",
        "GUARANTEE",
        "PRIO",
        "IN USE",
        "IDLE",
        "CACHED",
        "ASLEEP",
        "PEAK",
        "REFUSED",
        "HISTORY",
    ])
    .style(Style::default().add_modifier(Modifier::BOLD));
    let rows = s.models.iter().map(|m| {
        let pid = s
            .engines
            .iter()
            .find(|e| e.id == m.engine)
            .map_or(0, |e| e.peer.pid);
        let history = state
            .per_model
            .get(&m.name)
            .map(|h| spark_text(h, m.limit))
            .unwrap_or_default();
        // A held lease has no engine: its memory waits for one to attach.
        let pid = match m.lease.as_ref().map(|l| l.state) {
            Some(elastic_vmm::broker::protocol::LeaseState::Held) => "leased".to_string(),
            _ => pid.to_string(),
        };
        Row::new([
            m.name.clone(),
            pid,
            human_bytes(m.used),
            human_bytes(m.limit),
            human_bytes(m.guarantee),
            m.priority.to_string(),
            human_bytes(m.in_use),
            human_bytes(m.idle),
            human_bytes(m.cached),
            "-".into(),
            human_bytes(m.peak),
            m.refusals.to_string(),
            history,
        ])
    });
    f.render_widget(
        Table::new(
            rows,
            [
                Constraint::Length(16),
                Constraint::Length(8),
                Constraint::Length(11),
                Constraint::Length(11),
                Constraint::Length(11),
                Constraint::Length(5),
                Constraint::Length(11),
                Constraint::Length(11),
                Constraint::Length(11),
                Constraint::Length(7),
                Constraint::Length(11),
                Constraint::Length(8),
                Constraint::Min(10),
            ],
        )
        .header(header)
        .block(
            Block::default()
                .borders(Borders::ALL)
                .title(format!("models ({})", s.models.len())),
        ),
        models,
    );
    let data: Vec<u64> = state.global.iter().copied().collect();
    f.render_widget(
        Sparkline::default()
            .block(
                Block::default()
                    .borders(Borders::ALL)
                    .title("global use, history"),
            )
            .max(s.global_limit.max(1))
            .data(&data)
            .style(Style::default().fg(Color::Cyan)),
        spark,
    );
    let lines: Vec<Line> = s
        .engines
        .iter()
        .map(|e| {
            Line::from(format!(
                "{:>4}  {:<24} {:?}  pid {}  uid {}  gid {}",
                e.id, e.name, e.role, e.peer.pid, e.peer.uid, e.peer.gid
            ))
        })
        .collect();
    f.render_widget(
        Paragraph::new(lines).block(
            Block::default()
                .borders(Borders::ALL)
                .title(format!("engines ({})", s.engines.len())),
        ),
        engines,
    );
}

/// A one-line sparkline of the last samples, against `max`.
fn spark_text(h: &VecDeque<u64>, max: u64) -> String {
    const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let max = max.max(1) as f64;
    h.iter()
        .rev()
        .take(24)
        .rev()
        .map(|&v| BARS[((v as f64 / max) * 7.0).round().clamp(0.0, 7.0) as usize])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use elastic_vmm::broker::protocol::{BackendDesc, BrokerCounters, EngineInfo, ModelInfo, Role};
    use elastic_vmm::ipc::PeerCredentials;
    use ratatui::backend::TestBackend;
    use ratatui::Terminal;

    #[test]
    fn a_frame_shows_every_engine_and_model() {
        let snap = Snapshot {
            broker_pid: 7,
            backend: BackendDesc {
                name: "host".into(),
                device_ordinal: None,
                granularity: 2 << 20,
                device_name: "host memory".into(),
                creates_zeroed: true,
            },
            global_limit: 1 << 30,
            global_used: 1 << 29,
            idle: 0,
            physical: 1 << 29,
            engines: vec![EngineInfo {
                id: 3,
                name: "engine-a".into(),
                role: Role::Engine,
                peer: PeerCredentials {
                    pid: 4242,
                    uid: 0,
                    gid: 0,
                },
            }],
            models: vec![ModelInfo {
                id: 4,
                name: "llama".into(),
                engine: 3,
                limit: 1 << 30,
                guarantee: 0,
                priority: 1,
                used: 1 << 29,
                peak: 1 << 29,
                chunks: 2,
                refusals: 0,
                reclaimed: 0,
                in_use: 1 << 28,
                idle: 1 << 28,
                cached: 0,
                orphaned: false,
                lease: None,
            }],
            counters: BrokerCounters::default(),
            audit: None,
            host_tier: None,
        };
        let mut snap = snap;
        let mut host = snap.clone();
        host.global_limit = 96 << 20;
        host.global_used = 24 << 20;
        snap.host_tier = Some(Box::new(host));
        let mut state = TopState::default();
        state.push(&snap);
        let mut term = Terminal::new(TestBackend::new(160, 30)).unwrap();
        term.draw(|f| draw(f, &snap, &state, std::path::Path::new("/tmp/s")))
            .unwrap();
        let text: String = term
            .backend()
            .buffer()
            .content()
            .iter()
            .map(|c| c.symbol())
            .collect();
        for want in [
            "llama",
            "4242",
            "engine-a",
            "512.00 MiB",
            "1.00 GiB",
            "host tier 24.00 MiB of 96.00 MiB",
        ] {
            assert!(text.contains(want), "{want} missing from the frame");
        }
    }
}
