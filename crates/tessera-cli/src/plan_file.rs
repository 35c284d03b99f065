//! A plan file is made for one run: its model, batch, sequence length and precision. `train
//! --plan FILE` and `plan --plan FILE` take those from the file, so `tessera plan ... --out
//! plan.json && tessera train --plan plan.json` trains what was planned; a flag given on the
//! command line that disagrees with the file is refused, naming both values (the layout was
//! chosen, and its memory predicted, for the file's run).

use crate::profile_cmd::Precision;
use anyhow::{bail, Context, Result};
use std::collections::BTreeSet;
use std::path::Path;
use tessera_plan::plan::Plan;

/// The flags given on the command line (clap ids), as opposed to their defaults; and the run
/// file (`--config`, [`crate::run_file`]) with the ids of those it gave.
#[derive(Clone, Debug, Default)]
pub struct Given(BTreeSet<String>, Option<(String, BTreeSet<String>)>);

impl Given {
    /// The ids of `matches`' arguments whose value came from the command line.
    pub fn from_matches(matches: &clap::ArgMatches) -> Given {
        Given(
            matches
                .ids()
                .filter(|id| {
                    matches.value_source(id.as_str())
                        == Some(clap::parser::ValueSource::CommandLine)
                })
                .map(|id| id.to_string())
                .collect(),
            None,
        )
    }

    /// Says which of the given flags' values came from the run file `file`: `ids`.
    pub fn with_run_file(mut self, file: Option<&Path>, ids: &BTreeSet<String>) -> Given {
        self.1 = file.map(|f| (f.display().to_string(), ids.clone()));
        self
    }

    pub fn has(&self, id: &str) -> bool {
        self.0.contains(id)
    }

    /// Whether the user set flag `id`, on the command line or in the run file.
    pub fn gave(&self, id: &str) -> bool {
        self.has(id) || self.1.as_ref().is_some_and(|(_, ids)| ids.contains(id))
    }

    /// `value`, the flag `name`'s, saying whether the user gave it.
    pub fn flag<'a, T>(&self, name: &'static str, value: &'a mut T) -> Flag<'a, T> {
        let run_file = self.1.as_ref().filter(|(_, ids)| ids.contains(name));
        Flag { name, value, given: self.has(name), run_file: run_file.map(|(f, _)| f.clone()) }
    }
}

/// What a run-defining flag holds, and whether the user gave it (on the command line, or in
/// the run file `run_file`).
pub struct Flag<'a, T> {
    pub name: &'static str,
    pub value: &'a mut T,
    pub given: bool,
    pub run_file: Option<String>,
}

/// The run a plan file was made for.
pub struct PlanRun {
    pub model: String,
    pub batch: usize,
    pub seq: usize,
    pub dtype: Precision,
}

/// The run recorded in the plan file `plan`; `None` when `plan` is not a file (`auto` or a
/// config string).
pub fn read(plan: &str) -> Result<Option<PlanRun>> {
    let path = Path::new(plan);
    if !path.is_file() {
        return Ok(None);
    }
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading plan file {plan}"))?;
    let file: Plan = serde_json::from_str(&text)
        .map_err(|e| anyhow::anyhow!("plan file {plan} is not a plan: {e}"))?;
    let precisions = [Precision::Fp32, Precision::Bf16, Precision::Fp16];
    let Some(dtype) = precisions.into_iter().find(|p| p.dtype().to_string() == file.dtype) else {
        bail!(
            "plan file {plan} records dtype `{}`, which is none of fp32, bf16, fp16: re-plan with \
             `tessera plan --dtype ... --out {plan}`",
            file.dtype
        );
    };
    Ok(Some(PlanRun { model: file.model, batch: file.batch, seq: file.seq, dtype }))
}

/// Each flag not given takes the file's value; a given one must equal it.
fn adopt<T: PartialEq + Clone + std::fmt::Display>(
    plan: &str,
    flag: Flag<'_, T>,
    file: &T,
) -> Result<()> {
    if !flag.given {
        *flag.value = file.clone();
    } else if flag.value != file {
        let (name, given) = (flag.name, &flag.value);
        let (what, drop) = match &flag.run_file {
            Some(run) => {
                (format!("{name} = {given} in run file {run}"), format!("remove it from {run}"))
            }
            None => (format!("--{name} {given}"), format!("drop --{name}")),
        };
        bail!(
            "{what} differs from the {name} {file} that plan file {plan} was made for: {drop} to \
             run the planned {name}, or make a plan for this run (`tessera plan ... --{name} \
             {given} --out FILE`)"
        );
    }
    Ok(())
}

/// Takes the model, batch, sequence length and precision from the plan file `plan` (when it
/// is one) into the flags the user did not give, and refuses those that disagree. `model` is
/// `None` where the model comes from elsewhere (`train --init DIR`).
pub fn adopt_run(
    plan: &str,
    model: Option<Flag<'_, String>>,
    batch: Flag<'_, usize>,
    seq: Flag<'_, usize>,
    dtype: Flag<'_, Precision>,
) -> Result<()> {
    let Some(run) = read(plan)? else { return Ok(()) };
    if let Some(model) = model {
        adopt(plan, model, &run.model)?;
    }
    adopt(plan, batch, &run.batch)?;
    adopt(plan, seq, &run.seq)?;
    adopt(plan, dtype, &run.dtype)
}
