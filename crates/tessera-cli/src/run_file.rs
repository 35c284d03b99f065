//! `--config FILE`: a run file. A TOML file holds any of a command's flags under their long
//! names (`model = "gpt2-tiny"`, `batch = 8`, `memory-budget = "20GiB"`, `baseline = ["chen",
//! "megatron"]`, `explain = true`; `-` and `_` alike), and the flags given on the command line
//! win over it. The keys, their kinds (switch, value, repeatable) and their values' parsers are
//! the command's own clap definitions, read from its `Command`: a run file takes exactly what
//! the command line takes. Before clap parses, the file becomes `--flag=value` entries right
//! after the subcommand's name; a flag the command line gives drops the file's entry, so each
//! flag appears once and clap's parse is the one that sets every value. A run file that cannot
//! be read, or holds a key or value the command does not take, is the command's failure: the
//! command line is parsed without it (for `--format`) and the command does not run.

use anyhow::{anyhow, bail, Context, Result};
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command};
use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The argument (its id and long name) naming the run file: a subcommand that declares it
/// takes run files.
pub const FLAG: &str = "config";

/// Whether the run file the subcommand of `matches` names sets `format = "json"`: a run file
/// the command cannot take is then reported as JSON, as its flags asked.
pub fn says_json(matches: &ArgMatches) -> bool {
    let Some((_, sub)) = matches.subcommand() else { return false };
    let Some(file) = sub.try_get_one::<PathBuf>(FLAG).ok().flatten() else { return false };
    let Ok(text) = std::fs::read_to_string(file) else { return false };
    let Ok(table) = text.parse::<toml::Table>() else { return false };
    table.get("format").and_then(toml::Value::as_str) == Some("json")
}

/// The command line with the run file's flags in it.
pub struct Expanded {
    pub argv: Vec<OsString>,
    /// The run file `--config` named, if any.
    pub file: Option<PathBuf>,
    /// The ids of the arguments whose values come from the run file.
    pub ids: BTreeSet<String>,
    /// What is wrong with the run file (then `argv` is the command line as given).
    pub checked: Result<()>,
}

/// `argv` with the flags of the run file its subcommand's `--config` names (if any) inserted
/// after the subcommand's name, less those the command line gives. A command line clap
/// refuses (or `--help`, `--version`) comes back unchanged, for clap to report.
pub fn expand(cli: &Command, argv: Vec<OsString>) -> Expanded {
    let unchanged = |argv, checked| Expanded { argv, file: None, ids: BTreeSet::new(), checked };
    let Ok(matches) = cli.clone().try_get_matches_from(&argv) else {
        return unchanged(argv, Ok(()));
    };
    let Some((name, given)) = matches.subcommand() else { return unchanged(argv, Ok(())) };
    let Some(file) = given.try_get_one::<PathBuf>(FLAG).ok().flatten().cloned() else {
        return unchanged(argv, Ok(()));
    };
    let title = format!("{} {name}", cli.get_name());
    let entries = cli
        .find_subcommand(name)
        .ok_or_else(|| anyhow!("no subcommand `{name}`"))
        .and_then(|cmd| file_entries(cmd, &title, given, &file))
        .with_context(|| format!("run file {}", file.display()));
    let (entries, ids) = match entries {
        Ok(found) => found,
        Err(e) => return unchanged(argv, Err(e)),
    };
    let mut argv = argv;
    let at =
        argv.iter().skip(1).position(|a| a.to_str() == Some(name)).map_or(argv.len(), |i| i + 2);
    argv.splice(at..at, entries);
    Expanded { argv, file: Some(file), ids, checked: Ok(()) }
}

/// The run file's flags as command-line entries, less those `given` on the command line, and
/// the ids of the arguments they set. Every key is checked, overridden or not.
fn file_entries(
    cmd: &Command,
    title: &str,
    given: &ArgMatches,
    file: &Path,
) -> Result<(Vec<OsString>, BTreeSet<String>)> {
    let text = std::fs::read_to_string(file).context("reading it")?;
    let table: toml::Table = text.parse().map_err(|e| toml_error(&text, &e))?;
    let flags: Vec<&Arg> = cmd
        .get_arguments()
        .filter(|a| a.get_long().is_some_and(|l| l != FLAG))
        .filter(|a| !matches!(a.get_action(), ArgAction::Help | ArgAction::Version))
        .collect();
    let (mut entries, mut ids, mut seen) = (Vec::new(), BTreeSet::new(), BTreeSet::new());
    for (key, value) in &table {
        let long = key.replace('_', "-");
        if long == FLAG {
            bail!("`{key}`: a run file cannot name another run file");
        }
        let Some(arg) = flags.iter().find(|a| a.get_long() == Some(long.as_str())) else {
            bail!(unknown_key(key, title, &flags));
        };
        if !seen.insert(long.clone()) {
            bail!("`{key}`: --{long} is given twice (`-` and `_` spell the same key)");
        }
        let values = entries_of(arg, &long, key, value)?;
        let id = arg.get_id().as_str();
        if given.value_source(id) != Some(ValueSource::CommandLine) && !values.is_empty() {
            entries.extend(values);
            ids.insert(id.to_string());
        }
    }
    Ok((entries, ids))
}

/// The command-line entries of `key = value` for the flag `arg` (`--long`), by its action: a
/// switch takes `true` or `false`, a value a string or a number, a repeatable flag (or one of
/// several values) a list of them too; each value must pass the flag's own parser.
fn entries_of(arg: &Arg, long: &str, key: &str, value: &toml::Value) -> Result<Vec<OsString>> {
    let shown = format!("`{key} = {value}`");
    let flag = || OsString::from(format!("--{long}"));
    let action = arg.get_action();
    match action {
        ArgAction::SetTrue | ArgAction::SetFalse => match value {
            toml::Value::Boolean(on) => {
                let set = *on == matches!(action, ArgAction::SetTrue);
                Ok(if set { vec![flag()] } else { vec![] })
            }
            _ => bail!("{shown}: --{long} is a switch: expected true or false"),
        },
        ArgAction::Count => match value.as_integer().and_then(|n| usize::try_from(n).ok()) {
            Some(n) => Ok(vec![flag(); n]),
            None => bail!("{shown}: --{long} counts: expected a whole number, 0 or more"),
        },
        ArgAction::Set | ArgAction::Append => {
            let repeatable = matches!(action, ArgAction::Append);
            let several = repeatable || arg.get_num_args().is_some_and(|r| r.max_values() > 1);
            let items: Vec<&toml::Value> = match value {
                toml::Value::Array(items) if several => items.iter().collect(),
                one => vec![one],
            };
            let mut texts = Vec::new();
            for item in items {
                let Some(text) = scalar(arg, item) else {
                    bail!("{shown}: --{long} expects {}", wants(arg, several));
                };
                check(arg, &text).map_err(|why| anyhow!("{shown}: not a valid --{long}: {why}"))?;
                texts.push(text);
            }
            Ok(match (repeatable, texts.len()) {
                (_, 0) => vec![],
                (true, _) | (false, 1) => {
                    texts.iter().map(|t| OsString::from(format!("--{long}={t}"))).collect()
                }
                (false, _) => {
                    std::iter::once(flag()).chain(texts.into_iter().map(Into::into)).collect()
                }
            })
        }
        _ => bail!("{shown}: --{long} cannot be set from a run file"),
    }
}

/// A TOML scalar as the command line would spell it; `None` for what no flag value is (a
/// list, a table, or true/false where the flag does not take a boolean).
fn scalar(arg: &Arg, value: &toml::Value) -> Option<String> {
    match value {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        // `{:?}` keeps the point (`8.0`), so an integer flag refuses it.
        toml::Value::Float(f) => Some(format!("{f:?}")),
        toml::Value::Boolean(b) if takes_bool(arg) => Some(b.to_string()),
        toml::Value::Datetime(d) => Some(d.to_string()),
        _ => None,
    }
}

fn takes_bool(arg: &Arg) -> bool {
    arg.get_value_parser().type_id() == std::any::TypeId::of::<bool>()
}

/// What the flag's values are, for an error message.
fn wants(arg: &Arg, several: bool) -> String {
    let names = possible_values(arg);
    let one = if !names.is_empty() {
        format!("one of {}", names.join(", "))
    } else if takes_bool(arg) {
        "true or false".to_string()
    } else {
        "a string or a number".to_string()
    };
    if several {
        format!("{one}, or a list of them")
    } else {
        one
    }
}

fn possible_values(arg: &Arg) -> Vec<String> {
    arg.get_possible_values()
        .iter()
        .filter(|p| !p.is_hide_set())
        .map(|p| p.get_name().to_string())
        .collect()
}

/// Runs `text` through the flag's own value parser (on a command holding only that flag).
fn check(arg: &Arg, text: &str) -> std::result::Result<(), String> {
    let probe = Arg::new("value")
        .long("value")
        .action(ArgAction::Set)
        .value_parser(arg.get_value_parser().clone());
    let cmd = Command::new("run-file").no_binary_name(true).disable_help_flag(true).arg(probe);
    match cmd.try_get_matches_from([format!("--value={text}")]) {
        Ok(_) => Ok(()),
        Err(e) => {
            let names = possible_values(arg);
            if !names.is_empty() {
                return Err(format!("expected one of {}", names.join(", ")));
            }
            if let Some(why) = std::error::Error::source(&e) {
                return Err(why.to_string());
            }
            let text = e.to_string();
            Err(text.lines().next().unwrap_or_default().trim_start_matches("error: ").to_string())
        }
    }
}

/// An unknown key: the closest flag, if one is close, and every key the command takes.
fn unknown_key(key: &str, title: &str, flags: &[&Arg]) -> String {
    let mut valid: Vec<&str> =
        flags.iter().filter(|a| !a.is_hide_set()).filter_map(|a| a.get_long()).collect();
    valid.sort_unstable();
    let long = key.replace('_', "-");
    let near = valid
        .iter()
        .map(|v| (edit_distance(&long, v), *v))
        .filter(|&(d, v)| {
            d <= 2 || 3 * d <= long.chars().count() || long.starts_with(v) || v.starts_with(&long)
        })
        .min();
    let hint = near.map(|(_, v)| format!(" (did you mean `{v}`?)")).unwrap_or_default();
    format!("unknown key `{key}`{hint}; the keys of `{title}` are its flags: {}", valid.join(", "))
}

/// Levenshtein distance over characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != *cb)).min(row[j] + 1).min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// A TOML syntax error on one line: where, and what.
fn toml_error(text: &str, e: &toml::de::Error) -> anyhow::Error {
    let message = e.message().trim().replace('\n', "; ");
    match e.span() {
        Some(span) => {
            let line = text.as_bytes().iter().take(span.start).filter(|&&b| b == b'\n').count() + 1;
            anyhow!("line {line}: {message}")
        }
        None => anyhow!("{message}"),
    }
}
