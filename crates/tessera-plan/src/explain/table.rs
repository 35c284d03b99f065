//! The strategies' table: columns that fit [`super::WIDTH`], cells filled word by word, and
//! wrapped lists.

use super::WIDTH;

/// `items` joined by `sep`, wrapped at [`WIDTH`]: the first line starts with `first`, the
/// others with `indent` spaces; a comma ends the line it follows, another separator (`+`)
/// starts the next.
pub(super) fn wrap(first: &str, items: &[String], sep: &str, indent: usize) -> String {
    let comma = sep.starts_with(',');
    let mut out = String::new();
    let mut line = first.to_string();
    for (i, item) in items.iter().enumerate() {
        let joint = if i == 0 { "" } else { sep };
        if line.chars().count() + joint.chars().count() + item.chars().count() <= WIDTH {
            line += joint;
        } else {
            if comma {
                line += joint.trim_end();
            }
            out += line.trim_end();
            out.push('\n');
            line = " ".repeat(indent);
            if !comma {
                line += joint.trim_start();
            }
        }
        line += item;
    }
    out += line.trim_end();
    out.push('\n');
    out
}

/// `blocks 0–3, 5–31`, `block 4`.
pub(super) fn ranges(blocks: &[u32]) -> String {
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &b in blocks {
        match runs.last_mut() {
            Some((_, end)) if *end + 1 == b => *end = b,
            _ => runs.push((b, b)),
        }
    }
    let text: Vec<String> = runs
        .iter()
        .map(|&(a, b)| if a == b { a.to_string() } else { format!("{a}–{b}") })
        .collect();
    let word = if blocks.len() == 1 { "block" } else { "blocks" };
    format!("{word} {}", text.join(", "))
}

/// One op's line: its cells as words (a spec is one word).
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Row {
    pub(super) label: Vec<String>,
    pub(super) inputs: Vec<String>,
    pub(super) outputs: Vec<String>,
    pub(super) split: Vec<String>,
}

impl Row {
    fn cells(&self) -> [&[String]; 4] {
        [&self.label, &self.inputs, &self.outputs, &self.split]
    }
}

/// The widths of the columns, which a cell fills word by word.
pub(super) struct Columns {
    widths: [usize; 4],
}

/// Where the first column starts (after the `*` mark of a differing op).
const INDENT: usize = 4;

impl Columns {
    /// Widths from the rows: the split column as wide as its widest cell, the others sharing
    /// what is left of [`WIDTH`] so that the rows take the fewest lines (ties: the widest
    /// label).
    pub(super) fn fit(rows: &[&Row]) -> Columns {
        let len = |w: &str| w.chars().count();
        let natural = |c: usize, header: &str| {
            rows.iter().map(|r| len(&r.cells()[c].join(" "))).chain([header.len()]).max()
        };
        let split = natural(3, "split").unwrap_or(5);
        let room = WIDTH.saturating_sub(INDENT + 3 * 2 + split);
        // Widths worth trying for a column: the lengths of its cells' runs of words, none
        // narrower than its widest word (a spec is never cut).
        let candidates = |c: usize, header: &str| {
            let words = rows.iter().flat_map(|r| r.cells()[c].iter().map(|w| len(w)));
            let floor = words.chain([header.len()]).max().unwrap_or(0);
            let runs = rows.iter().flat_map(|r| {
                let cell = r.cells()[c];
                (0..cell.len()).flat_map(move |a| {
                    (a + 1..=cell.len()).map(move |b| len(&cell[a..b].join(" ")))
                })
            });
            let mut v: Vec<usize> = runs.filter(|&w| w >= floor).chain([floor]).collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        let label_natural = natural(0, "op").unwrap_or(2);
        let mut best = (usize::MAX, 0, Columns { widths: [label_natural, 6, 7, split] });
        for &i in &candidates(1, "inputs") {
            for &o in &candidates(2, "outputs") {
                let Some(l) = room.checked_sub(i + o) else { continue };
                let l = l.min(label_natural);
                let widths = [l, i, o, split];
                let lines: usize = rows
                    .iter()
                    .map(|r| {
                        let cells = r.cells();
                        (0..4).map(|c| fill(cells[c], widths[c]).len()).max().unwrap_or(1)
                    })
                    .sum();
                if lines < best.0 || (lines == best.0 && l > best.1) {
                    best = (lines, l, Columns { widths });
                }
            }
        }
        best.2
    }

    pub(super) fn header(&self) -> String {
        let words = ["op", "inputs", "outputs", "split"].map(|w| vec![w.to_string()]);
        self.row(&[&words[0], &words[1], &words[2], &words[3]], ' ')
    }

    /// The rows; with `against`, those that differ from its row at the same place are marked
    /// `*`.
    pub(super) fn table(&self, rows: &[Row], against: Option<&[Row]>) -> String {
        let mut s = String::new();
        for (i, r) in rows.iter().enumerate() {
            let mark = match against {
                Some(a) if a.len() == rows.len() && a[i] != *r => '*',
                _ => ' ',
            };
            s += &self.row(&r.cells(), mark);
        }
        s
    }

    /// One row, as many lines as its fullest cell needs; a word wider than its column pushes
    /// the cells after it right.
    fn row(&self, cells: &[&[String]; 4], mark: char) -> String {
        let lines: Vec<Vec<String>> =
            cells.iter().zip(self.widths).map(|(words, w)| fill(words, w)).collect();
        let height = lines.iter().map(Vec::len).max().unwrap_or(1).max(1);
        let mut out = String::new();
        for k in 0..height {
            let mut line = if k == 0 { format!("  {mark} ") } else { " ".repeat(INDENT) };
            let mut start = INDENT;
            for (c, cell) in lines.iter().enumerate() {
                let len = line.chars().count();
                if c > 0 && len > start.saturating_sub(1) {
                    line.push(' ');
                } else {
                    line += &" ".repeat(start - len);
                }
                line += cell.get(k).map_or("", String::as_str);
                start += self.widths[c] + 2;
            }
            out += line.trim_end();
            out.push('\n');
        }
        out
    }
}

/// Words into lines of at most `width` columns (a longer word alone on its line).
fn fill(words: &[String], width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    for w in words {
        match lines.last_mut() {
            Some(l) if l.chars().count() + 1 + w.chars().count() <= width => {
                l.push(' ');
                l.push_str(w);
            }
            _ => lines.push(w.clone()),
        }
    }
    lines
}
