//! Code health as a test: the top-level modules of `tessera-plan` depend on each other without
//! a cycle (ARCHITECTURE.md, "Invariants"). A module is a file or a directory directly under
//! `src/`; it depends on another when its code names it through `crate::X`, `use crate::{X, ..}`
//! or a `super::` chain that climbs to the crate root (a name `lib.rs` re-exports, such as
//! `crate::Spec`, counts as its defining module). Comments do not count (a doc link is not a
//! dependency); unit-test modules do.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Edges that still close a cycle, allowed for now. Each one is debt: remove the edge in the code
/// and then here (the test fails on an entry whose edge is gone, so this list only shrinks).
const DEBT: &[(&str, &str)] = &[];

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Top-level module name → its files.
fn modules() -> BTreeMap<String, Vec<PathBuf>> {
    let mut mods = BTreeMap::new();
    for entry in std::fs::read_dir(src_dir()).expect("read src") {
        let path = entry.expect("dir entry").path();
        let name = path.file_stem().expect("file name").to_string_lossy().to_string();
        if path.is_dir() {
            let mut files = Vec::new();
            rust_files(&path, &mut files);
            mods.entry(name).or_insert_with(Vec::new).extend(files);
        } else if path.extension().is_some_and(|e| e == "rs") && name != "lib" {
            mods.entry(name).or_insert_with(Vec::new).push(path);
        }
    }
    mods
}

/// The code of a file without its `//` comments (line, doc and inner-doc comments).
fn without_comments(text: &str) -> String {
    text.lines()
        .map(|line| {
            // Cut at the first `//` that is not inside a string literal.
            let mut in_str = false;
            let bytes = line.as_bytes();
            let mut cut = line.len();
            let mut i = 0;
            while i < bytes.len() {
                match bytes[i] {
                    b'\\' if in_str => i += 1,
                    b'"' => in_str = !in_str,
                    b'/' if !in_str && bytes.get(i + 1) == Some(&b'/') => {
                        cut = i;
                        break;
                    }
                    _ => {}
                }
                i += 1;
            }
            &line[..cut]
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn ident_at(text: &str, at: usize) -> &str {
    let rest = &text[at..];
    let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(rest.len());
    &rest[..end]
}

/// The first segments named right after a path prefix ending at `at`: `X` for `X::..`, and each
/// top-level item's first segment for a `{X::a, Y, Z::{..}}` group.
fn first_segments(text: &str, at: usize) -> Vec<String> {
    if !text[at..].starts_with('{') {
        return vec![ident_at(text, at).to_string()];
    }
    let mut names = Vec::new();
    let mut depth = 0usize;
    let mut expect_name = true;
    let bytes = text.as_bytes();
    let mut i = at;
    while i < bytes.len() {
        match bytes[i] {
            b'{' => {
                depth += 1;
                expect_name = depth == 1;
            }
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            b',' if depth == 1 => expect_name = true,
            c if expect_name && depth == 1 && (c.is_ascii_alphabetic() || c == b'_') => {
                names.push(ident_at(text, i).to_string());
                expect_name = false;
            }
            _ => {}
        }
        i += 1;
    }
    names
}

/// `pub use module::{A, B};` lines of lib.rs: re-exported name → defining module.
fn reexports() -> BTreeMap<String, String> {
    let lib = std::fs::read_to_string(src_dir().join("lib.rs")).expect("read lib.rs");
    let mut map = BTreeMap::new();
    for line in without_comments(&lib).lines() {
        let Some(rest) = line.trim().strip_prefix("pub use ") else { continue };
        let Some((module, items)) = rest.split_once("::") else { continue };
        let items = items.trim_end_matches(';').trim_start_matches('{').trim_end_matches('}');
        for item in items.split(',') {
            let name = item.trim().rsplit(' ').next().unwrap_or_default();
            if !name.is_empty() {
                map.insert(name.to_string(), module.to_string());
            }
        }
    }
    map
}

/// Module → (module it depends on → a file that says so).
fn module_graph() -> BTreeMap<String, BTreeMap<String, PathBuf>> {
    let mods = modules();
    let reexported = reexports();
    let resolve = |name: &str| -> Option<String> {
        if mods.contains_key(name) {
            Some(name.to_string())
        } else {
            reexported.get(name).cloned()
        }
    };
    let src = src_dir();
    let mut graph: BTreeMap<String, BTreeMap<String, PathBuf>> = BTreeMap::new();
    for (module, files) in &mods {
        let node = graph.entry(module.clone()).or_default();
        for file in files {
            let rel = file.strip_prefix(&src).expect("under src");
            // How many `super::` reach the crate root from this file's module.
            let mut depth = rel.components().count();
            if rel.file_name().is_some_and(|n| n == "mod.rs") {
                depth -= 1;
            }
            let text = without_comments(&std::fs::read_to_string(file).expect("read source"));
            let mut targets = Vec::new();
            for (at, _) in text.match_indices("crate::") {
                let before = text[..at].chars().next_back();
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                    continue; // `tessera_plan_crate::` and the like
                }
                targets.extend(first_segments(&text, at + "crate::".len()));
            }
            let mut at = 0;
            while let Some(found) = text[at..].find("super::") {
                let start = at + found;
                let before = text[..start].chars().next_back();
                let mut end = start;
                let mut climbs = 0;
                while text[end..].starts_with("super::") {
                    end += "super::".len();
                    climbs += 1;
                }
                at = end;
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                    continue;
                }
                if climbs >= depth {
                    targets.extend(first_segments(&text, end));
                }
            }
            for target in targets {
                if let Some(to) = resolve(&target) {
                    if &to != module {
                        node.entry(to).or_insert_with(|| rel.to_path_buf());
                    }
                }
            }
        }
    }
    graph
}

/// A cycle through the graph, as `a -> b -> .. -> a`, if there is one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|n| n == node) {
            let mut cycle = path[i..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, done, path) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        if let Some(cycle) = visit(node, graph, &mut done, &mut Vec::new()) {
            return Some(cycle);
        }
    }
    None
}

#[test]
fn plan_modules_have_no_cycles() {
    let graph = module_graph();
    assert!(graph.len() > 10, "found only {} modules under {:?}", graph.len(), src_dir());
    for (from, to) in DEBT {
        assert!(
            graph.get(*from).is_some_and(|deps| deps.contains_key(*to)),
            "the allowed edge {from} -> {to} in DEBT is gone from the code: delete it from DEBT"
        );
    }
    let allowed: BTreeSet<(&str, &str)> = DEBT.iter().copied().collect();
    let kept: BTreeMap<String, BTreeSet<String>> = graph
        .iter()
        .map(|(from, deps)| {
            let deps = deps
                .keys()
                .filter(|to| !allowed.contains(&(from.as_str(), to.as_str())))
                .cloned()
                .collect();
            (from.clone(), deps)
        })
        .collect();
    if let Some(cycle) = find_cycle(&kept) {
        let edges: Vec<String> = cycle
            .windows(2)
            .map(|w| format!("  {} -> {} ({})", w[0], w[1], graph[&w[0]][&w[1]].display()))
            .collect();
        panic!(
            "tessera-plan's modules depend on each other in a cycle: {}\n{}\nMove what both \
             sides need into a module below them.",
            cycle.join(" -> "),
            edges.join("\n")
        );
    }
}

/// The checker itself: a `super::` chain from a nested file and a brace group both resolve.
#[test]
fn the_graph_reads_use_groups_and_super_chains() {
    let text = "use crate::{a::b, c, d::{e, f}};";
    assert_eq!(first_segments(text, "use crate::".len()), ["a", "c", "d"]);
    assert_eq!(
        without_comments("let x = 1; // crate::y\n\"//\" crate::z"),
        "let x = 1; \n\"//\" crate::z"
    );
    let graph = module_graph();
    // search/space.rs names `crate::context` or the like; search.rs names `crate::cost`.
    assert!(graph["search"].contains_key("cost"), "search -> cost is read: {:?}", graph["search"]);
    assert!(
        graph["spec"].contains_key("mesh"),
        "crate::Mesh resolves to mesh: {:?}",
        graph["spec"]
    );
}
