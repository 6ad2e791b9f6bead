//! The picture of a run (`timeline.svg`, beside the history): operations answered per second,
//! and the attempts' latency percentiles per second on a log scale, with each fault's window
//! shaded and named and each anomaly marked where its operation was answered (or sent).
//! Written by hand: the SVG needed is a few rectangles, lines and labels.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::check::{Anomaly, Report};
use crate::history::Event;

const WIDTH: f64 = 1200.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
/// The fault labels' band, then the throughput panel, then the latency panel.
const BAND_TOP: f64 = 40.0;
const BAND_ROW: f64 = 14.0;
const PANEL: f64 = 180.0;
const GAP: f64 = 40.0;
/// The most faults named one by one above the panels.
const LABELLED: usize = 60;

/// One second of the run.
#[derive(Default)]
struct Second {
    answered: u64,
    latencies: Vec<u64>,
}

/// The SVG document of a run's history and its report.
pub(crate) fn timeline(events: &[Event], report: &Report, title: &str) -> String {
    let mut seconds: BTreeMap<u64, Second> = BTreeMap::new();
    let mut faults: BTreeMap<u64, (u64, Option<u64>, String)> = BTreeMap::new();
    let mut answered_at = BTreeMap::new();
    let mut sent_at = BTreeMap::new();
    let mut end = 0u64;
    let mut healed = None;
    for event in events {
        match event {
            Event::Invoke { t, op, .. } => {
                sent_at.insert(*op, *t);
                end = end.max(*t);
            }
            Event::Ok { t, op, .. } => {
                seconds.entry(t / 1000).or_default().answered += 1;
                answered_at.insert(*op, *t);
                end = end.max(*t);
            }
            Event::Attempt { t, ms, .. } => {
                seconds.entry(t / 1000).or_default().latencies.push(*ms);
                end = end.max(*t);
            }
            Event::FaultStart {
                t,
                fault,
                kind,
                target,
            } => {
                let name = if target.is_empty() || kind.ends_with(target.as_str()) {
                    kind.clone()
                } else {
                    format!("{kind} {target}")
                };
                faults.insert(*fault, (*t, None, name));
            }
            Event::FaultEnd { t, fault } => {
                if let Some(f) = faults.get_mut(fault) {
                    f.1 = Some(*t);
                }
            }
            Event::Healed { t } => healed = Some(*t),
            Event::End { t } => end = end.max(*t),
            _ => {}
        }
    }
    let end = end.max(1000);
    let x = |t: u64| LEFT + (t as f64 / end as f64) * (WIDTH - LEFT - RIGHT);

    // Fault labels in rows, so that overlapping windows do not write over each other; past
    // `LABELLED` faults (a long run) the windows are not named one by one, and the legend
    // of colors names their kinds.
    let labelled = faults.len() <= LABELLED;
    let mut rows: Vec<u64> = Vec::new();
    let mut placed = Vec::new();
    for (from, to, name) in faults.values() {
        let to = to.unwrap_or(end);
        // A label needs about 7 px a character.
        let label_end =
            from + ((name.len() as f64 * 7.0 + 10.0) / (WIDTH - LEFT - RIGHT) * end as f64) as u64;
        let row = if !labelled {
            0
        } else if let Some(row) = rows.iter().position(|&free| free <= *from) {
            row
        } else {
            rows.push(0);
            rows.len() - 1
        };
        if labelled {
            rows[row] = label_end.max(to);
        }
        placed.push((*from, to, name.clone(), row));
    }
    let band = rows.len().max(1) as f64 * BAND_ROW;
    let top1 = BAND_TOP + band + 10.0;
    let top2 = top1 + PANEL + GAP;
    let height = top2 + PANEL + 60.0;

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(svg, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let verdict = if report.ok() {
        "no anomaly".to_owned()
    } else {
        format!("{} anomalies", report.anomalies.len())
    };
    let _ = writeln!(
        svg,
        r#"<text x="{LEFT}" y="20" font-size="14">{} — {}</text>"#,
        escape(title),
        verdict
    );

    // Fault windows: shaded over both panels, named in the band.
    for (from, to, name, row) in &placed {
        let (x0, x1) = (x(*from), x(*to).max(x(*from) + 2.0));
        let color = color_of(name);
        let _ = writeln!(
            svg,
            r#"<rect x="{x0:.1}" y="{top1:.1}" width="{:.1}" height="{:.1}" fill="{color}" fill-opacity="0.18"/>"#,
            x1 - x0,
            top2 + PANEL - top1
        );
        if labelled {
            let y = BAND_TOP + (*row as f64 + 1.0) * BAND_ROW - 3.0;
            let _ = writeln!(
                svg,
                r#"<text x="{x0:.1}" y="{y:.1}" fill="{color}">{}</text>"#,
                escape(name)
            );
        }
    }
    if !labelled {
        // The legend: each kind of fault in the run, in its color.
        let mut kinds: Vec<&str> = placed
            .iter()
            .map(|(_, _, name, _)| name.split(' ').next().unwrap_or_default())
            .collect();
        kinds.sort_unstable();
        kinds.dedup();
        let mut lx = LEFT;
        for kind in kinds {
            let color = color_of(kind);
            let _ = writeln!(
                svg,
                r#"<rect x="{lx:.1}" y="{:.1}" width="10" height="10" fill="{color}" fill-opacity="0.5"/><text x="{:.1}" y="{:.1}" fill="{color}">{kind}</text>"#,
                BAND_TOP + 2.0,
                lx + 14.0,
                BAND_TOP + 11.0
            );
            lx += 14.0 + kind.len() as f64 * 7.0 + 16.0;
        }
    }
    if let Some(healed) = healed {
        let hx = x(healed);
        let _ = writeln!(
            svg,
            r##"<line x1="{hx:.1}" y1="{top1:.1}" x2="{hx:.1}" y2="{:.1}" stroke="#2a7" stroke-dasharray="4 3"/><text x="{:.1}" y="{:.1}" fill="#2a7">healed</text>"##,
            top2 + PANEL,
            hx + 3.0,
            top1 + 12.0
        );
    }

    // Throughput.
    let peak = seconds
        .values()
        .map(|s| s.answered)
        .max()
        .unwrap_or(1)
        .max(1);
    axis(
        &mut svg,
        top1,
        "answered / s",
        &[(0.0, "0".into()), (1.0, peak.to_string())],
    );
    let points: Vec<String> = seconds
        .iter()
        .map(|(s, second)| {
            let y = top1 + PANEL - second.answered as f64 / peak as f64 * PANEL;
            format!("{:.1},{y:.1}", x(s * 1000 + 500))
        })
        .collect();
    let _ = writeln!(
        svg,
        r##"<polyline points="{}" fill="none" stroke="#225" stroke-width="1.5"/>"##,
        points.join(" ")
    );

    // Latency, log scale from 1 ms to the worst attempt.
    let worst = seconds
        .values()
        .flat_map(|s| s.latencies.iter().copied())
        .max()
        .unwrap_or(1)
        .max(10);
    let log_top = (worst as f64).log10().ceil().max(1.0);
    let ly = |ms: u64| top2 + PANEL - ((ms.max(1) as f64).log10() / log_top) * PANEL;
    let ticks: Vec<(f64, String)> = (0..=log_top as u32)
        .map(|p| (f64::from(p) / log_top, format!("{} ms", 10u64.pow(p))))
        .collect();
    axis(&mut svg, top2, "attempt latency", &ticks);
    for (quantile, color, label) in [
        (0.5, "#59a", "p50"),
        (0.99, "#d80", "p99"),
        (1.0, "#c22", "max"),
    ] {
        let points: Vec<String> = seconds
            .iter()
            .filter(|(_, s)| !s.latencies.is_empty())
            .map(|(s, second)| {
                let mut sorted = second.latencies.clone();
                sorted.sort_unstable();
                let i = ((sorted.len() - 1) as f64 * quantile).round() as usize;
                format!("{:.1},{:.1}", x(s * 1000 + 500), ly(sorted[i]))
            })
            .collect();
        let _ = writeln!(
            svg,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="1.2"/>"#,
            points.join(" ")
        );
        let lx = WIDTH - RIGHT - 120.0
            + 40.0
                * if label == "p50" {
                    0.0
                } else if label == "p99" {
                    1.0
                } else {
                    2.0
                };
        let _ = writeln!(
            svg,
            r#"<text x="{lx:.1}" y="{:.1}" fill="{color}">{label}</text>"#,
            top2 - 4.0
        );
    }

    // Anomalies: a red mark where the operation was answered, or sent.
    for anomaly in &report.anomalies {
        let op = match anomaly {
            Anomaly::Unfinished { op, .. }
            | Anomaly::Late { op, .. }
            | Anomaly::SlowAttempt { op, .. }
            | Anomaly::WrongAnswer { op, .. }
            | Anomaly::MissingEffect { op, .. }
            | Anomaly::DuplicateEffect { op, .. }
            | Anomaly::ReplayMismatch { op, .. } => Some(*op),
            _ => None,
        };
        let t = op
            .and_then(|op| answered_at.get(&op).or_else(|| sent_at.get(&op)))
            .copied()
            .unwrap_or(end);
        let ax = x(t);
        let _ = writeln!(
            svg,
            r#"<line x1="{ax:.1}" y1="{top1:.1}" x2="{ax:.1}" y2="{:.1}" stroke="red" stroke-width="1"/><circle cx="{ax:.1}" cy="{:.1}" r="3" fill="red"><title>{}</title></circle>"#,
            top2 + PANEL,
            top1 + 4.0,
            escape(&anomaly.to_string())
        );
    }

    // Time axis.
    let bottom = top2 + PANEL;
    let step = (end / 1000 / 12).max(1) * 1000;
    let mut t = 0;
    while t <= end {
        let _ = writeln!(
            svg,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="#444">{} s</text>"##,
            x(t),
            bottom + 16.0,
            t / 1000
        );
        t += step;
    }
    let _ = writeln!(svg, "</svg>");
    svg
}

/// A panel's frame, its name and its labelled ticks (`(fraction of the height, label)`).
fn axis(svg: &mut String, top: f64, name: &str, ticks: &[(f64, String)]) {
    let _ = writeln!(
        svg,
        r##"<rect x="{LEFT}" y="{top:.1}" width="{:.1}" height="{PANEL}" fill="none" stroke="#999"/>"##,
        WIDTH - LEFT - RIGHT
    );
    let _ = writeln!(
        svg,
        r##"<text x="{LEFT}" y="{:.1}" fill="#222">{name}</text>"##,
        top - 4.0
    );
    for (fraction, label) in ticks {
        let y = top + PANEL - fraction * PANEL;
        let _ = writeln!(
            svg,
            r##"<line x1="{:.1}" y1="{y:.1}" x2="{LEFT}" y2="{y:.1}" stroke="#999"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#444">{label}</text>"##,
            LEFT - 4.0,
            LEFT - 6.0,
            y + 4.0
        );
    }
}

/// A color per kind of fault.
fn color_of(name: &str) -> &'static str {
    match name.split(' ').next().unwrap_or_default() {
        "partition-store" | "partition-broker" => "#7b3fbf",
        "freeze-store" => "#1f6fd1",
        "pause-instance" => "#0a8f8f",
        "restart-broker" => "#c26a00",
        "failover-store" => "#6b8e23",
        _ => "#b22",
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::check;
    use crate::history::Kind;

    #[test]
    fn a_long_run_names_its_kinds_of_fault_in_a_legend() {
        let mut events = vec![Event::End { t: 1_000_000 }];
        for fault in 0..100 {
            events.push(Event::FaultStart {
                t: fault * 9_000,
                fault,
                kind: if fault % 2 == 0 {
                    "freeze-store"
                } else {
                    "kill-relay"
                }
                .into(),
                target: String::new(),
            });
            events.push(Event::FaultEnd {
                t: fault * 9_000 + 1_000,
                fault,
            });
        }
        let svg = timeline(&events, &check(&events), "long");
        assert_eq!(svg.matches(">freeze-store<").count(), 1, "{svg}");
        assert_eq!(svg.matches(">kill-relay<").count(), 1);
        assert_eq!(svg.matches("fill-opacity=\"0.18\"").count(), 100);
    }

    #[test]
    fn a_timeline_names_its_faults_and_marks_its_anomalies() {
        let events = vec![
            Event::Invoke {
                t: 100,
                op: 1,
                kind: Kind::Order,
                key: "k<1>".into(),
                amount: None,
            },
            Event::Attempt {
                t: 1500,
                op: 1,
                target: "payments-0".into(),
                ms: 1400,
                outcome: "201".into(),
            },
            Event::FaultStart {
                t: 1000,
                fault: 0,
                kind: "partition-store".into(),
                target: "store".into(),
            },
            Event::FaultEnd { t: 3000, fault: 0 },
            Event::Healed { t: 3000 },
            Event::End { t: 4000 },
        ];
        let report = check(&events);
        let svg = timeline(&events, &report, "redis, seed 1");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains(">partition-store<"), "{svg}");
        assert!(svg.contains("1 anomalies"));
        // The unfinished op is marked, its key escaped.
        assert!(svg.contains("k&lt;1&gt;"), "{svg}");
        assert!(svg.contains(">healed<"));
    }
}
