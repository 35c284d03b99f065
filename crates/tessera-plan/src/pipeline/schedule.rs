//! Pipeline schedules as data, and their simulation in time.
//!
//! [`build`] turns a [`ScheduleKind`] into a [`Schedule`]: for every device, the ordered list of
//! [`Slot`]s it runs (forward `F`, backward `B`, and for split schedules the weight-gradient
//! pass `W`). Device `d` holds chunks `0..v`; chunk `c` is virtual stage `c·p + d`, and a
//! micro-batch's forward visits the virtual stages `0, 1, …, p·v − 1` in turn, its backward the
//! same stages in reverse.
//!
//! - GPipe: all forwards, then all backwards (both in micro-batch order).
//! - 1F1B (PipeDream-flush, Megatron's non-interleaved schedule): device `d` runs
//!   `min(p − d − 1, m)` warm-up forwards, then forward/backward pairs, then the remaining
//!   backwards.
//! - Interleaved 1F1B (Megatron's schedule with virtual stages): the `k`-th forward of a device
//!   runs chunk `(k mod p·v) / p` on micro-batch `⌊k / p·v⌋·p + k mod p` (groups of `p`
//!   micro-batches per chunk), backwards visit the chunks in reverse; warm-up is
//!   `(p − d − 1)·2 + (v − 1)·p` forwards, capped at `m·v`. Needs `m` to be a multiple of `p`.
//! - ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B's forward/backward order with
//!   the backward split into `B` (input gradients, sent upstream at once) and `W` (weight
//!   gradients). Device `d` delays each `W` by `d` steady-state steps, which fills the bubbles
//!   of 1F1B while no device ever holds more micro-batches between `F` and `W` than 1F1B's
//!   peak (`p`, on device 0). In the cool-down each `B` is followed by one pending `W`; the
//!   rest run at the end.
//!
//! [`Schedule::validate`] checks the structure (one `F`, one `B` and, when split, one `W` per
//! micro-batch and chunk, in order) and that the schedule finishes when every device runs its
//! list strictly in order with blocking receives. [`Schedule::simulate`] replays it with
//! per-slot durations and per-hop transfer times into a [`Timeline`], which reports the
//! bubble fraction and draws itself as text or SVG.

use super::{Pass, ScheduleKind, Slot};

/// An ordered list of slots per device.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    pub kind: ScheduleKind,
    pub devices: usize,
    pub micro_batches: usize,
    /// Per device, in execution order.
    pub slots: Vec<Vec<Slot>>,
}

/// One executed slot of a [`Timeline`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    pub slot: Slot,
    pub start_s: f64,
    pub end_s: f64,
}

/// A schedule replayed in time.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    pub devices: usize,
    /// Per device, in execution order.
    pub spans: Vec<Vec<Span>>,
    pub makespan_s: f64,
}

/// Builds the schedule of `kind` for `devices` pipeline devices and `micro_batches`
/// micro-batches.
pub fn build(kind: ScheduleKind, devices: usize, micro_batches: usize) -> Result<Schedule, String> {
    if devices == 0 {
        return Err("a pipeline schedule needs at least one device".to_string());
    }
    if micro_batches == 0 {
        return Err("a pipeline schedule needs at least one micro-batch".to_string());
    }
    let (p, m) = (devices, micro_batches);
    let slots = match kind {
        ScheduleKind::Gpipe => (0..p).map(|_| gpipe(m)).collect(),
        ScheduleKind::OneFOneB => (0..p).map(|d| one_f_one_b(p, d, m)).collect(),
        ScheduleKind::ZbH1 => (0..p).map(|d| zb_h1(p, d, m)).collect(),
        ScheduleKind::Interleaved { v } => {
            if v == 0 {
                return Err(
                    "interleaved:0 has no model chunks; use interleaved:V with V >= 1".to_string()
                );
            }
            if m % p != 0 {
                let up = m.div_ceil(p) * p;
                return Err(format!(
                    "{kind} needs the micro-batch count ({m}) to be a multiple of the pipeline \
                     devices ({p}); use {up} micro-batches, or the 1f1b schedule"
                ));
            }
            (0..p).map(|d| interleaved(p, d, m, v)).collect()
        }
    };
    Ok(Schedule { kind, devices, micro_batches, slots })
}

fn slot(micro_batch: usize, chunk: usize, pass: Pass) -> Slot {
    Slot { micro_batch, chunk, pass }
}

fn gpipe(m: usize) -> Vec<Slot> {
    let forwards = (0..m).map(|k| slot(k, 0, Pass::F));
    forwards.chain((0..m).map(|k| slot(k, 0, Pass::B))).collect()
}

fn one_f_one_b(p: usize, d: usize, m: usize) -> Vec<Slot> {
    let warmup = (p - d - 1).min(m);
    let mut out = Vec::with_capacity(2 * m);
    out.extend((0..warmup).map(|k| slot(k, 0, Pass::F)));
    for i in 0..m - warmup {
        out.push(slot(warmup + i, 0, Pass::F));
        out.push(slot(i, 0, Pass::B));
    }
    out.extend((m - warmup..m).map(|k| slot(k, 0, Pass::B)));
    out
}

fn zb_h1(p: usize, d: usize, m: usize) -> Vec<Slot> {
    let warmup = (p - d - 1).min(m);
    let mut out = Vec::with_capacity(3 * m);
    let mut pending = std::collections::VecDeque::with_capacity(d + 1);
    out.extend((0..warmup).map(|k| slot(k, 0, Pass::F)));
    for i in 0..m - warmup {
        out.push(slot(warmup + i, 0, Pass::F));
        out.push(slot(i, 0, Pass::B));
        pending.push_back(i);
        // Device d runs the W of micro-batch i - d here: d steps late.
        while pending.len() > d {
            if let Some(k) = pending.pop_front() {
                out.push(slot(k, 0, Pass::W));
            }
        }
    }
    for k in m - warmup..m {
        out.push(slot(k, 0, Pass::B));
        pending.push_back(k);
        if let Some(j) = pending.pop_front() {
            out.push(slot(j, 0, Pass::W));
        }
    }
    out.extend(pending.into_iter().map(|k| slot(k, 0, Pass::W)));
    out
}

fn interleaved(p: usize, d: usize, m: usize, v: usize) -> Vec<Slot> {
    let total = m * v;
    let group = p * v;
    let micro_batch = |k: usize| (k / group) * p + k % p;
    let forward = |k: usize| slot(micro_batch(k), (k % group) / p, Pass::F);
    let backward = |k: usize| slot(micro_batch(k), v - 1 - (k % group) / p, Pass::B);
    let warmup = ((p - d - 1) * 2 + (v - 1) * p).min(total);
    let mut out = Vec::with_capacity(2 * total);
    out.extend((0..warmup).map(forward));
    for i in 0..total - warmup {
        out.push(forward(warmup + i));
        out.push(backward(i));
    }
    out.extend((total - warmup..total).map(backward));
    out
}

fn pass_index(pass: Pass) -> usize {
    match pass {
        Pass::F => 0,
        Pass::B => 1,
        Pass::W => 2,
    }
}

fn describe(s: Slot) -> String {
    format!("{:?} of micro-batch {} chunk {}", s.pass, s.micro_batch, s.chunk)
}

/// Completion times of every (pass, virtual stage, micro-batch), filled while replaying.
struct Done {
    stages: usize,
    micro_batches: usize,
    at: Vec<Option<f64>>,
}

impl Done {
    fn new(stages: usize, micro_batches: usize) -> Self {
        Done { stages, micro_batches, at: vec![None; 3 * stages * micro_batches] }
    }

    fn index(&self, pass: Pass, stage: usize, micro_batch: usize) -> usize {
        (pass_index(pass) * self.stages + stage) * self.micro_batches + micro_batch
    }

    fn get(&self, pass: Pass, stage: usize, micro_batch: usize) -> Option<f64> {
        self.at[self.index(pass, stage, micro_batch)]
    }

    fn set(&mut self, pass: Pass, stage: usize, micro_batch: usize, t: f64) {
        let i = self.index(pass, stage, micro_batch);
        self.at[i] = Some(t);
    }
}

impl Schedule {
    /// Chunks (model pieces) per device.
    pub fn chunks(&self) -> usize {
        self.kind.chunks()
    }

    /// Virtual stages in all: devices × chunks.
    pub fn stages(&self) -> usize {
        self.devices * self.chunks()
    }

    /// The virtual stage that chunk `chunk` of device `device` runs.
    pub fn virtual_stage(&self, device: usize, chunk: usize) -> usize {
        chunk * self.devices + device
    }

    /// Checks every device's list and that the schedule runs to the end with blocking
    /// receives; the error names the device and slot at fault.
    pub fn validate(&self) -> Result<(), String> {
        self.simulate(&|_, _| 1.0, &|_, _| 0.0).map(|_| ())
    }

    /// The most micro-batch-chunks whose forward has run on `device` but whose last backward
    /// part (`B`, or `W` when the backward is split) has not, over the device's order.
    pub fn max_in_flight(&self, device: usize) -> usize {
        let last = if self.kind.splits_backward() { Pass::W } else { Pass::B };
        let Some(slots) = self.slots.get(device) else {
            return 0;
        };
        let (mut now, mut most) = (0usize, 0usize);
        for s in slots {
            if s.pass == Pass::F {
                now += 1;
                most = most.max(now);
            } else if s.pass == last {
                now = now.saturating_sub(1);
            }
        }
        most
    }

    /// The most activation bytes `device` holds at once over its order, when a forward pass
    /// keeps `kept` bytes until its backward, and a split backward (ZB) frees them but keeps
    /// `weight_inputs` bytes (what its weight-gradient pass reads: the inputs of the weight
    /// matmuls, recomputed ones included) until its `W`. Unsplit schedules never hold the
    /// latter; with `weight_inputs == kept` a split one holds what [`Self::max_in_flight`]
    /// counts.
    pub fn peak_held(&self, device: usize, kept: f64, weight_inputs: f64) -> f64 {
        let split = self.kind.splits_backward();
        let (mut now, mut most) = (0.0f64, 0.0f64);
        for s in self.slots.get(device).into_iter().flatten() {
            now += match s.pass {
                Pass::F => kept,
                Pass::B if split => weight_inputs - kept,
                Pass::B => -kept,
                Pass::W => -weight_inputs,
            };
            most = most.max(now);
        }
        most
    }

    /// The structural checks of [`Schedule::validate`], without running anything.
    fn check_lists(&self) -> Result<(), String> {
        if self.devices == 0 || self.micro_batches == 0 {
            return Err("a schedule needs at least one device and one micro-batch".to_string());
        }
        if self.slots.len() != self.devices {
            return Err(format!(
                "the schedule has {} device lists for {} devices",
                self.slots.len(),
                self.devices
            ));
        }
        for (d, slots) in self.slots.iter().enumerate() {
            self.check_device(slots).map_err(|e| format!("device {d}: {e}"))?;
        }
        Ok(())
    }

    fn check_device(&self, slots: &[Slot]) -> Result<(), String> {
        let (v, m) = (self.chunks(), self.micro_batches);
        let split = self.kind.splits_backward();
        // Position of each (pass, chunk, micro-batch) in the list.
        let mut pos: Vec<Option<usize>> = vec![None; 3 * v * m];
        let mut last_f: Vec<Option<usize>> = vec![None; v];
        let mut last_b: Vec<Option<usize>> = vec![None; v];
        for (i, &s) in slots.iter().enumerate() {
            if s.chunk >= v || s.micro_batch >= m {
                return Err(format!(
                    "slot {i} ({}) is out of range: {v} chunk(s), {m} micro-batch(es)",
                    describe(s)
                ));
            }
            if s.pass == Pass::W && !split {
                return Err(format!(
                    "slot {i} ({}): {} does not split the backward",
                    describe(s),
                    self.kind
                ));
            }
            let key = (pass_index(s.pass) * v + s.chunk) * m + s.micro_batch;
            if let Some(j) = pos[key] {
                return Err(format!("slot {i} ({}) repeats slot {j}", describe(s)));
            }
            pos[key] = Some(i);
            let last = match s.pass {
                Pass::F => &mut last_f[s.chunk],
                Pass::B => &mut last_b[s.chunk],
                Pass::W => continue,
            };
            if let Some(prev) = *last {
                if prev >= s.micro_batch {
                    return Err(format!(
                        "slot {i} ({}) comes after micro-batch {prev}: {:?}s of a chunk must \
                         run in micro-batch order",
                        describe(s),
                        s.pass
                    ));
                }
            }
            *last = Some(s.micro_batch);
        }
        for c in 0..v {
            for k in 0..m {
                let at = |pass: Pass| pos[(pass_index(pass) * v + c) * m + k];
                let need = |pass: Pass| format!("{} is missing", describe(slot(k, c, pass)));
                let f = at(Pass::F).ok_or_else(|| need(Pass::F))?;
                let b = at(Pass::B).ok_or_else(|| need(Pass::B))?;
                if b < f {
                    return Err(format!(
                        "{} (slot {b}) runs before its forward (slot {f})",
                        describe(slot(k, c, Pass::B))
                    ));
                }
                if split {
                    let w = at(Pass::W).ok_or_else(|| need(Pass::W))?;
                    if w < b {
                        return Err(format!(
                            "{} (slot {w}) runs before its backward (slot {b})",
                            describe(slot(k, c, Pass::W))
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// What `s` on virtual stage `stage` waits for: (pass, virtual stage) of the same
    /// micro-batch.
    fn deps(&self, stage: usize, s: Slot) -> [Option<(Pass, usize)>; 2] {
        let last = self.stages() - 1;
        match s.pass {
            Pass::F => [stage.checked_sub(1).map(|up| (Pass::F, up)), None],
            Pass::B => [Some((Pass::F, stage)), (stage < last).then_some((Pass::B, stage + 1))],
            Pass::W => [Some((Pass::B, stage)), None],
        }
    }

    /// When `s` (on device `device`) may start as far as its inputs go; `None` while one of
    /// them has not run.
    fn ready_at(
        &self,
        device: usize,
        s: Slot,
        done: &Done,
        p2p_s: &dyn Fn(usize, usize) -> f64,
    ) -> Result<Option<f64>, String> {
        let stage = self.virtual_stage(device, s.chunk);
        let mut ready = 0.0f64;
        for (pass, from) in self.deps(stage, s).into_iter().flatten() {
            let Some(t) = done.get(pass, from, s.micro_batch) else {
                return Ok(None);
            };
            let hop = if from == stage {
                0.0
            } else {
                let hop = p2p_s(from, stage);
                if !hop.is_finite() || hop < 0.0 {
                    return Err(format!(
                        "p2p time from virtual stage {from} to {stage} is {hop}, not a finite \
                         non-negative number of seconds"
                    ));
                }
                hop
            };
            ready = ready.max(t + hop);
        }
        Ok(Some(ready))
    }

    /// Replays the schedule: each device runs its list strictly in order; a slot starts once
    /// the device is free and its inputs have arrived (a dependency on another virtual stage
    /// adds `p2p_s(from, to)`). Fails, naming the stuck devices, if the replay cannot finish.
    pub fn simulate(
        &self,
        duration: &dyn Fn(usize, Slot) -> f64,
        p2p_s: &dyn Fn(usize, usize) -> f64,
    ) -> Result<Timeline, String> {
        self.check_lists()?;
        let p = self.devices;
        let mut done = Done::new(self.stages(), self.micro_batches);
        let mut next = vec![0usize; p];
        let mut free = vec![0.0f64; p];
        let mut spans: Vec<Vec<Span>> =
            self.slots.iter().map(|s| Vec::with_capacity(s.len())).collect();
        loop {
            let mut progressed = false;
            for d in 0..p {
                while let Some(&s) = self.slots[d].get(next[d]) {
                    let Some(ready) = self.ready_at(d, s, &done, p2p_s)? else {
                        break;
                    };
                    let took = duration(d, s);
                    if !took.is_finite() || took < 0.0 {
                        return Err(format!(
                            "device {d}: duration of {} is {took}, not a finite non-negative \
                             number of seconds",
                            describe(s)
                        ));
                    }
                    let start_s = ready.max(free[d]);
                    let end_s = start_s + took;
                    done.set(s.pass, self.virtual_stage(d, s.chunk), s.micro_batch, end_s);
                    free[d] = end_s;
                    spans[d].push(Span { slot: s, start_s, end_s });
                    next[d] += 1;
                    progressed = true;
                }
            }
            if (0..p).all(|d| next[d] == self.slots[d].len()) {
                break;
            }
            if !progressed {
                return Err(self.deadlock(&next, &done));
            }
        }
        let makespan_s = free.iter().copied().fold(0.0, f64::max);
        Ok(Timeline { devices: p, spans, makespan_s })
    }

    /// Names every device that cannot go on, its slot and what that slot waits for.
    fn deadlock(&self, next: &[usize], done: &Done) -> String {
        let mut stuck = Vec::new();
        for (d, &i) in next.iter().enumerate() {
            let Some(&s) = self.slots[d].get(i) else {
                continue;
            };
            let stage = self.virtual_stage(d, s.chunk);
            let waits: Vec<String> = self
                .deps(stage, s)
                .into_iter()
                .flatten()
                .filter(|&(pass, from)| done.get(pass, from, s.micro_batch).is_none())
                .map(|(pass, from)| {
                    format!(
                        "{pass:?} of micro-batch {} on virtual stage {from} (device {})",
                        s.micro_batch,
                        from % self.devices
                    )
                })
                .collect();
            stuck.push(format!(
                "device {d} is stuck at slot {i} ({}), waiting for {}",
                describe(s),
                waits.join(" and ")
            ));
        }
        format!("{} schedule deadlocks with blocking receives: {}", self.kind, stuck.join("; "))
    }
}

impl Timeline {
    /// Idle share of the devices' time: `1 − Σ busy / (devices × makespan)`.
    pub fn bubble_fraction(&self) -> f64 {
        if self.devices == 0 || self.makespan_s <= 0.0 {
            return 0.0;
        }
        let busy: f64 = self.spans.iter().flatten().map(|s| s.end_s - s.start_s).sum();
        1.0 - busy / (self.devices as f64 * self.makespan_s)
    }

    /// A text Gantt chart, one line per device (`d0 |…|`), `width` characters of time: a
    /// forward shows the last digit of its micro-batch, a backward `B`, a weight-gradient pass
    /// `W`, idle time `.`. Each character shows the pass covering most of its interval.
    pub fn gantt_text(&self, width: usize) -> String {
        let width = width.max(1);
        let label = self.devices.saturating_sub(1).to_string().len();
        let mut out = String::new();
        for (d, spans) in self.spans.iter().enumerate() {
            out.push_str(&format!("d{d:<label$} |"));
            let mut first = 0usize;
            for c in 0..width {
                let t0 = self.makespan_s * c as f64 / width as f64;
                let t1 = self.makespan_s * (c + 1) as f64 / width as f64;
                while first < spans.len() && spans[first].end_s <= t0 {
                    first += 1;
                }
                let mut best: Option<(f64, Slot)> = None;
                let mut covered = 0.0;
                for s in spans[first..].iter().take_while(|s| s.start_s < t1) {
                    let overlap = s.end_s.min(t1) - s.start_s.max(t0);
                    covered += overlap.max(0.0);
                    if overlap > 0.0 && best.is_none_or(|(b, _)| overlap > b) {
                        best = Some((overlap, s.slot));
                    }
                }
                let ch = match best {
                    Some((_, s)) if covered * 2.0 >= t1 - t0 => match s.pass {
                        Pass::F => char::from_digit((s.micro_batch % 10) as u32, 10).unwrap_or('F'),
                        Pass::B => 'B',
                        Pass::W => 'W',
                    },
                    _ => '.',
                };
                out.push(ch);
            }
            out.push_str("|\n");
        }
        out
    }

    /// The timeline as an SVG document: one row per device (device 0 on top), a rectangle per
    /// slot coloured by pass (F blue, B orange, W green) and labelled with its micro-batch.
    pub fn svg(&self, title: &str) -> Result<String, String> {
        use plotters::prelude::*;
        use plotters::style::text_anchor::{HPos, Pos, VPos};

        let fail = |e: &dyn std::fmt::Display| format!("drawing the SVG failed: {e}");
        let rows = self.devices.max(1);
        let x_max = if self.makespan_s > 0.0 { self.makespan_s } else { 1.0 };
        let height = 90 + 36 * u32::try_from(rows).unwrap_or(u32::MAX / 64).min(1024);
        let mut buf = String::new();
        {
            let root = SVGBackend::with_string(&mut buf, (1000, height)).into_drawing_area();
            root.fill(&WHITE).map_err(|e| fail(&e))?;
            let mut chart = ChartBuilder::on(&root)
                .caption(title, ("sans-serif", 18))
                .margin(10)
                .x_label_area_size(30)
                .y_label_area_size(40)
                .build_cartesian_2d(0f64..x_max, 0f64..rows as f64)
                .map_err(|e| fail(&e))?;
            chart
                .configure_mesh()
                .disable_mesh()
                .y_labels(0)
                .x_desc("time (s)")
                .draw()
                .map_err(|e| fail(&e))?;
            let centred = ("sans-serif", 11)
                .into_font()
                .color(&BLACK)
                .pos(Pos::new(HPos::Center, VPos::Center));
            for (d, spans) in self.spans.iter().enumerate() {
                let y0 = (rows - 1 - d) as f64 + 0.1;
                let (y1, ym) = (y0 + 0.8, y0 + 0.4);
                let colour = |pass: Pass| match pass {
                    Pass::F => RGBColor(66, 133, 244),
                    Pass::B => RGBColor(244, 160, 0),
                    Pass::W => RGBColor(15, 157, 88),
                };
                chart
                    .draw_series(spans.iter().map(|s| {
                        Rectangle::new(
                            [(s.start_s, y0), (s.end_s, y1)],
                            colour(s.slot.pass).filled(),
                        )
                    }))
                    .map_err(|e| fail(&e))?;
                chart
                    .draw_series(spans.iter().map(|s| {
                        let mid = 0.5 * (s.start_s + s.end_s);
                        Text::new(s.slot.micro_batch.to_string(), (mid, ym), centred.clone())
                    }))
                    .map_err(|e| fail(&e))?;
                let (px, py) = chart.backend_coord(&(0.0, ym));
                root.draw(&Text::new(format!("d{d}"), (px - 30, py - 6), ("sans-serif", 12)))
                    .map_err(|e| fail(&e))?;
            }
            root.present().map_err(|e| fail(&e))?;
        }
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KINDS: [ScheduleKind; 3] =
        [ScheduleKind::Gpipe, ScheduleKind::OneFOneB, ScheduleKind::ZbH1];

    fn sched(kind: ScheduleKind, p: usize, m: usize) -> Schedule {
        build(kind, p, m).unwrap_or_else(|e| panic!("{kind} p={p} m={m}: {e}"))
    }

    /// F = 1 per device; the whole backward = 1, split as B = W = 1/2; interleaved chunks
    /// take 1/v of each, so every device does the same work under every schedule.
    fn timeline(s: &Schedule) -> Timeline {
        let v = s.chunks() as f64;
        let split = s.kind.splits_backward();
        let duration = move |_: usize, slot: Slot| match slot.pass {
            Pass::F => 1.0 / v,
            Pass::B if !split => 1.0 / v,
            Pass::B | Pass::W => 0.5 / v,
        };
        s.simulate(&duration, &|_, _| 0.0).unwrap_or_else(|e| panic!("{}: {e}", s.kind))
    }

    fn bubble(kind: ScheduleKind, p: usize, m: usize) -> f64 {
        timeline(&sched(kind, p, m)).bubble_fraction()
    }

    #[test]
    fn every_kind_validates_over_a_grid() {
        for p in [1, 2, 3, 4, 8] {
            for m in 1..=8 {
                for kind in KINDS {
                    let s = sched(kind, p, m);
                    s.validate().unwrap_or_else(|e| panic!("{kind} p={p} m={m}: {e}"));
                    let per = if kind.splits_backward() { 3 } else { 2 };
                    assert!(s.slots.iter().all(|l| l.len() == per * m), "{kind} p={p} m={m}");
                }
            }
            for v in [2, 3] {
                for m in (p..=16).step_by(p) {
                    let s = sched(ScheduleKind::Interleaved { v }, p, m);
                    s.validate().unwrap_or_else(|e| panic!("interleaved:{v} p={p} m={m}: {e}"));
                    assert!(s.slots.iter().all(|l| l.len() == 2 * m * v));
                }
            }
        }
    }

    #[test]
    fn bad_inputs_are_refused_with_the_fix() {
        let e = build(ScheduleKind::Interleaved { v: 2 }, 4, 6).err().unwrap_or_default();
        assert!(e.contains("multiple") && e.contains("use 8 micro-batches"), "{e}");
        assert!(build(ScheduleKind::OneFOneB, 0, 4).is_err());
        assert!(build(ScheduleKind::OneFOneB, 4, 0).is_err());
        assert!(build(ScheduleKind::Interleaved { v: 0 }, 2, 2).is_err());
    }

    #[test]
    fn megatron_interleaved_order() {
        // p = 2, v = 2, m = 4: device 0 warms up with (2-0-1)*2 + (2-1)*2 = 4 forwards:
        // micro-batches 0, 1 on chunk 0, then 0, 1 on chunk 1.
        let s = sched(ScheduleKind::Interleaved { v: 2 }, 2, 4);
        let first: Vec<(usize, usize)> =
            s.slots[0][..4].iter().map(|x| (x.micro_batch, x.chunk)).collect();
        assert_eq!(first, vec![(0, 0), (1, 0), (0, 1), (1, 1)]);
        assert!(s.slots[0][..4].iter().all(|x| x.pass == Pass::F));
        // Then the steady state pairs the 5th forward (micro-batch 2, chunk 0) with the first
        // backward (micro-batch 0 on the last chunk).
        assert_eq!(s.slots[0][4], slot(2, 0, Pass::F));
        assert_eq!(s.slots[0][5], slot(0, 1, Pass::B));
    }

    #[test]
    fn gpipe_and_1f1b_bubble_is_textbook() {
        for p in [1, 2, 3, 4, 8] {
            for m in 1..=8 {
                let want = (p - 1) as f64 / (m + p - 1) as f64;
                for kind in [ScheduleKind::Gpipe, ScheduleKind::OneFOneB] {
                    let got = bubble(kind, p, m);
                    assert!((got - want).abs() < 1e-9, "{kind} p={p} m={m}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn interleaving_divides_the_bubble_by_v() {
        // Chunks take 1/v of a stage's time: bubble (p-1)/v over busy m per device.
        for p in [2, 3, 4, 8] {
            for m in (p..=16).step_by(p) {
                for v in [2, 3] {
                    let got = bubble(ScheduleKind::Interleaved { v }, p, m);
                    let want = (p - 1) as f64 / (m * v + p - 1) as f64;
                    assert!((got - want).abs() < 1e-9, "v={v} p={p} m={m}: {got} vs {want}");
                    assert!(got < bubble(ScheduleKind::OneFOneB, p, m));
                }
            }
        }
    }

    #[test]
    fn zb_h1_shrinks_the_1f1b_bubble() {
        // Qi et al.: ZB-H1's bubble is (p-1)(T_F + T_B - T_W) = (p-1)·1 against 1F1B's
        // (p-1)(T_F + T_B + T_W) = (p-1)·2, once m >= p; the busy time is 2m either way.
        for p in [2, 3, 4, 8] {
            for m in 1..=16 {
                let got = bubble(ScheduleKind::ZbH1, p, m);
                assert!(got < bubble(ScheduleKind::OneFOneB, p, m), "p={p} m={m}");
                if m >= p {
                    let want = (p - 1) as f64 / (2 * m + p - 1) as f64;
                    assert!((got - want).abs() < 1e-9, "p={p} m={m}: {got} vs {want}");
                }
            }
        }
        assert_eq!(bubble(ScheduleKind::ZbH1, 1, 4), 0.0);
    }

    #[test]
    fn activations_in_flight() {
        for p in [1, 2, 3, 4, 8] {
            for m in 1..=8 {
                let gpipe = sched(ScheduleKind::Gpipe, p, m);
                let ofob = sched(ScheduleKind::OneFOneB, p, m);
                let zb = sched(ScheduleKind::ZbH1, p, m);
                for d in 0..p {
                    assert_eq!(gpipe.max_in_flight(d), m);
                    assert_eq!(ofob.max_in_flight(d), (p - d).min(m), "p={p} m={m} d={d}");
                    // ZB-H1 holds W's inputs longer on later devices, never past 1F1B's peak.
                    assert!(zb.max_in_flight(d) <= (p.min(m)), "p={p} m={m} d={d}");
                }
                let peak = |s: &Schedule| (0..p).map(|d| s.max_in_flight(d)).max();
                assert_eq!(peak(&zb), peak(&ofob), "p={p} m={m}");
            }
        }
        assert_eq!(sched(ScheduleKind::OneFOneB, 2, 2).max_in_flight(7), 0);
    }

    #[test]
    fn held_bytes_count_pending_weight_gradients() {
        for p in [1, 2, 3, 4, 8] {
            for m in 1..=8 {
                let ofob = sched(ScheduleKind::OneFOneB, p, m);
                let zb = sched(ScheduleKind::ZbH1, p, m);
                for d in 0..p {
                    // Whole micro-batches held until the last backward part: the count.
                    for s in [&ofob, &zb] {
                        let want = s.max_in_flight(d) as f64 * 3.0;
                        assert_eq!(s.peak_held(d, 3.0, 3.0), want, "p={p} m={m} d={d}");
                    }
                    // An unsplit backward never holds weight-gradient inputs.
                    assert_eq!(ofob.peak_held(d, 3.0, 100.0), ofob.peak_held(d, 3.0, 3.0));
                }
                // Checkpointed blocks keep 1 per micro-batch but recompute 10 that W reads:
                // ZB-H1's last device defers its W's by p − 1, so it holds min(p, m) of them.
                assert_eq!(zb.peak_held(p - 1, 1.0, 10.0), 10.0 * p.min(m) as f64, "p={p} m={m}");
                // Device 0 runs each W right after its B: one pending at a time, beside the
                // other micro-batches 1F1B keeps there.
                let first = zb.peak_held(0, 1.0, 10.0);
                assert_eq!(first, 10.0 + (p.min(m) - 1) as f64, "p={p} m={m}");
            }
        }
    }

    #[test]
    fn swapped_orders_are_refused_naming_the_device() {
        // B before its F on device 1.
        let mut s = sched(ScheduleKind::OneFOneB, 2, 2);
        s.slots[1].swap(0, 1);
        let e = s.validate().err().unwrap_or_default();
        assert!(e.contains("device 1") && e.contains("before its forward"), "{e}");
        // Structurally fine, but device 0 waits on a backward that device 1 cannot reach.
        let mut s = sched(ScheduleKind::OneFOneB, 2, 2);
        s.slots[0] = vec![
            slot(0, 0, Pass::F),
            slot(0, 0, Pass::B),
            slot(1, 0, Pass::F),
            slot(1, 0, Pass::B),
        ];
        s.slots[1] = vec![
            slot(0, 0, Pass::F),
            slot(1, 0, Pass::F),
            slot(0, 0, Pass::B),
            slot(1, 0, Pass::B),
        ];
        let e = s.validate().err().unwrap_or_default();
        assert!(e.contains("deadlock") && e.contains("device 0") && e.contains("device 1"), "{e}");
        // Forwards out of micro-batch order.
        let mut s = sched(ScheduleKind::Gpipe, 2, 3);
        s.slots[0].swap(0, 1);
        let e = s.validate().err().unwrap_or_default();
        assert!(e.contains("device 0") && e.contains("micro-batch order"), "{e}");
    }

    #[test]
    fn p2p_time_lands_on_the_critical_path() {
        // 1F1B, p = 2, m = 1: F, hop, F, B, hop, B with unit passes and a 0.25 s hop.
        let s = sched(ScheduleKind::OneFOneB, 2, 1);
        let t = s.simulate(&|_, _| 1.0, &|_, _| 0.25).unwrap_or_else(|e| panic!("{e}"));
        assert!((t.makespan_s - 4.5).abs() < 1e-12, "{}", t.makespan_s);
        assert_eq!(t.spans[1][0].start_s, 1.25);
        let bad = s.simulate(&|_, _| f64::NAN, &|_, _| 0.0);
        assert!(bad.err().unwrap_or_default().contains("device 0"));
    }

    #[test]
    fn gantt_and_svg_render() {
        let s = sched(ScheduleKind::ZbH1, 4, 8);
        let t = timeline(&s);
        let text = t.gantt_text(60);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4);
        for (d, line) in lines.iter().enumerate() {
            assert!(line.starts_with(&format!("d{d} |")), "{line}");
            assert_eq!(line.chars().count(), "d0 |".len() + 60 + 1);
        }
        assert!(lines[0].starts_with("d0 |0"), "{text}");
        assert!(text.contains('W') && text.contains('B') && text.contains('.'));
        let svg = t.svg("zb-h1, p=4, m=8").unwrap_or_else(|e| panic!("{e}"));
        assert!(svg.contains("<svg") && svg.contains("<rect"), "{svg}");
    }
}
