//! A timeline as text: one row per stage over a common time axis, computes labelled with their
//! micro-batch, idle time as dots, then a legend and the bubble fraction.

use std::fmt::Write;

use super::schedule::ScheduleKind;
use super::timeline::{Activity, Timeline};

/// Renders `timeline` with `width` columns for the time axis (at least 1). Example row: stage 1
/// of 1F1B with 2 stages, 2 micro-batches, forward 1, backward 2, 18 columns:
/// `stage 1 |..F0B0bbF1B1bb....|`.
pub fn render_timeline(timeline: &Timeline, width: usize) -> String {
    let width = width.max(1);
    let stages = timeline.stages();
    let interleaved = matches!(
        timeline.kind,
        ScheduleKind::Interleaved {
            virtual_stages: 2..
        }
    );
    let column = |t: f64| {
        if timeline.makespan <= 0.0 {
            0
        } else {
            ((t / timeline.makespan * width as f64).round() as usize).min(width)
        }
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: {stages} stages, {} micro-batches, step time {} ({:.3} per column)",
        timeline.kind,
        timeline.micro_batches,
        timeline.makespan,
        timeline.makespan / width as f64
    );
    let label_width = stages.saturating_sub(1).to_string().len();
    for (stage, spans) in timeline.spans.iter().enumerate() {
        let mut row = vec!['.'; width];
        for span in spans {
            let (letter, fill, micro_batch, chunk) = match span.what {
                Activity::Forward { micro_batch, chunk } => ('F', 'f', micro_batch, chunk),
                Activity::Backward { micro_batch, chunk } => ('B', 'b', micro_batch, chunk),
                Activity::Comm => continue,
            };
            let first = column(span.start).min(width - 1);
            let last = column(span.end).clamp(first + 1, width);
            // The longest label that fits: micro-batch and chunk, micro-batch, or the letter.
            let cells = last - first;
            let full = format!("{letter}{micro_batch}:{chunk}");
            let short = format!("{letter}{micro_batch}");
            let label = match (interleaved, cells) {
                (true, n) if n >= full.len() => full,
                (_, n) if n >= short.len() => short,
                _ => letter.to_string(),
            };
            let mut text = label.chars().chain(std::iter::repeat(fill));
            for cell in &mut row[first..last] {
                *cell = text.next().unwrap_or(fill);
            }
        }
        let _ = writeln!(
            out,
            "stage {stage:>label_width$} |{}|",
            row.into_iter().collect::<String>()
        );
    }
    let chunk_note = if interleaved {
        ":c = model chunk c of the stage, "
    } else {
        ""
    };
    let _ = writeln!(
        out,
        "legend: Fm = forward of micro-batch m (f while it runs), Bm = backward (b), {chunk_note}\
         . = idle (waiting or communicating); narrow spans drop the chunk, then the number"
    );
    let _ = writeln!(
        out,
        "bubble fraction: {:.4} (idle / compute time over all stages); formula {} = {:.4}",
        timeline.bubble_fraction(),
        if interleaved {
            "(p-1)/(m*v)"
        } else {
            "(p-1)/m"
        },
        timeline.formula_bubble_fraction
    );
    out
}
