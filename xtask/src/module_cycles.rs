//! `cargo xtask check-cycles`: fails when the modules of a crate import each other in a cycle
//! (DESIGN.md: "no import cycles between the files of a crate").
//!
//! For every target of every workspace member (`src/lib.rs`, `src/main.rs`, `src/bin/*`) it
//! follows the `mod` declarations to the crate's files and reads, from each file, the `use`
//! declarations and the paths written in code that start with `crate::`, `super::`, `self::`
//! or a child module's name (`crate::apply::current_thread_affinity()` is as much a dependency
//! as a `use`). A path is resolved to the module that *defines* what it names: re-exports are
//! followed (`use crate::Error` through `lib.rs`'s `pub use error::Error` is a dependency on
//! `error`), including glob re-exports.
//!
//! The rule is the layering one: a dependency of module `a::x` on `b::y` is a dependency of the
//! sibling `a` on the sibling `b` (the children of their closest common ancestor), and the
//! siblings of every module must form no cycle. So `error.rs` importing from anywhere in
//! `policy/` while a file of `policy/` imports `error` is a cycle; a child using its parent's
//! items (`use super::GradScaler` in `scaler/state.rs`) is not, since a parent module and its
//! children are one unit seen from outside.
//!
//! Limits: `#[path]` attributes and macro-generated `mod`/`use` items are not seen, and `cfg`
//! is ignored (every `mod` counts).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

use crate::cmd::workspace_root;
use crate::rust_tokens::{Tok, Token, tokenize};

pub fn run(args: &[String]) -> Result<(), String> {
    if let Some(unknown) = args.first() {
        return Err(format!(
            "xtask check-cycles takes no arguments (got `{unknown}`)"
        ));
    }
    let root = workspace_root();
    let manifest = root.join("Cargo.toml");
    let text = fs::read_to_string(&manifest)
        .map_err(|e| format!("cannot read {}: {e}", manifest.display()))?;
    let mut report = Vec::new();
    let (mut crates, mut files) = (0, 0);
    for member in workspace_members(&text, &root)? {
        for target in crate_roots(&root.join(&member)) {
            let tree = CrateTree::load(&target, &|p: &Path| fs::read_to_string(p).ok())?;
            crates += 1;
            files += tree.files.len();
            let shown = target.strip_prefix(&root).unwrap_or(&target);
            for cycle in tree.cycles(&root) {
                report.push(format!("{}: {cycle}", shown.display()));
            }
        }
    }
    if report.is_empty() {
        println!(
            "check-cycles: no import cycles between the modules of {crates} crate targets ({files} files)"
        );
        Ok(())
    } else {
        Err(format!(
            "{} import cycle(s); move the shared item into a leaf module both sides import:\n{}",
            report.len(),
            report.join("\n")
        ))
    }
}

/// The `members` of the root manifest, with a trailing `/*` expanded to its subdirectories
/// that hold a `Cargo.toml`.
fn workspace_members(manifest: &str, root: &Path) -> Result<Vec<PathBuf>, String> {
    let start = manifest
        .find("members")
        .and_then(|m| manifest[m..].find('[').map(|b| m + b + 1))
        .ok_or("the root Cargo.toml has no `members = [...]`")?;
    let end = manifest[start..]
        .find(']')
        .ok_or("unterminated `members` list in the root Cargo.toml")?;
    let mut members = Vec::new();
    for entry in manifest[start..start + end].split(',') {
        let entry = entry.trim().trim_matches('"');
        if entry.is_empty() {
            continue;
        }
        if let Some(dir) = entry.strip_suffix("/*") {
            let mut found: Vec<PathBuf> = fs::read_dir(root.join(dir))
                .map_err(|e| format!("cannot list workspace members in {dir}: {e}"))?
                .filter_map(|d| d.ok().map(|d| d.path()))
                .filter(|p| p.join("Cargo.toml").is_file())
                .map(|p| p.strip_prefix(root).unwrap_or(&p).to_path_buf())
                .collect();
            found.sort();
            members.extend(found);
        } else {
            members.push(PathBuf::from(entry));
        }
    }
    Ok(members)
}

/// The crate root files of a package: library, main binary, and every `src/bin` binary.
fn crate_roots(package: &Path) -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = ["src/lib.rs", "src/main.rs"]
        .iter()
        .map(|f| package.join(f))
        .filter(|p| p.is_file())
        .collect();
    if let Ok(entries) = fs::read_dir(package.join("src/bin")) {
        let mut bins: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter_map(|p| match p.is_dir() {
                true => Some(p.join("main.rs")).filter(|m| m.is_file()),
                false => (p.extension().is_some_and(|e| e == "rs")).then_some(p),
            })
            .collect();
        bins.sort();
        roots.extend(bins);
    }
    roots
}

/// A module path below the crate root (`[]` is the root).
type ModPath = Vec<String>;

fn display(m: &[String]) -> String {
    std::iter::once("crate")
        .chain(m.iter().map(String::as_str))
        .collect::<Vec<_>>()
        .join("::")
}

/// A `use` binding: `name` in module `scope` stands for `target`, read from `scope`.
#[derive(Debug, Clone)]
struct Import {
    scope: ModPath,
    target: Vec<String>,
}

/// A path a file names, where, and from which module.
#[derive(Debug, Clone)]
struct PathRef {
    scope: ModPath,
    segments: Vec<String>,
    line: usize,
}

/// One crate target: its modules, the files holding them, and what each module declares.
#[derive(Debug, Default)]
struct CrateTree {
    /// Every module (file and inline) and the file it is written in.
    modules: HashMap<ModPath, PathBuf>,
    /// The modules that are a file of their own (not `mod name { … }`).
    files: BTreeMap<ModPath, PathBuf>,
    items: HashMap<ModPath, HashSet<String>>,
    bindings: HashMap<(ModPath, String), Import>,
    globs: HashMap<ModPath, Vec<Import>>,
    refs: Vec<PathRef>,
}

const ITEM_KEYWORDS: [&str; 8] = [
    "fn", "struct", "enum", "trait", "type", "const", "static", "union",
];

impl CrateTree {
    /// Reads the crate from its root file, following `mod name;` declarations.
    fn load(root: &Path, read: &dyn Fn(&Path) -> Option<String>) -> Result<CrateTree, String> {
        let mut tree = CrateTree::default();
        let mut pending = vec![(ModPath::new(), root.to_path_buf(), true)];
        while let Some((module, file, is_root)) = pending.pop() {
            let src = read(&file).ok_or_else(|| format!("cannot read {}", file.display()))?;
            // A crate root, `mod.rs` or `main.rs` keeps its children beside it; `a.rs` in `a/`.
            let child_dir = match is_root || file.file_name().is_some_and(|n| n == "mod.rs") {
                true => file.parent().unwrap_or(Path::new("")).to_path_buf(),
                false => file.with_extension(""),
            };
            tree.files.insert(module.clone(), file.clone());
            for (inline, name) in tree.scan_file(&module, &file, &tokenize(&src)) {
                let dir = inline.iter().fold(child_dir.clone(), |d, m| d.join(m));
                let flat = dir.join(format!("{name}.rs"));
                let nested = dir.join(&name).join("mod.rs");
                // A declared module without a file is cfg'd for another platform or a
                // compile error that cargo reports; either way it has no imports to read.
                if let Some(child) = [flat, nested].into_iter().find(|p| read(p).is_some()) {
                    let mut path = module.clone();
                    path.extend(inline);
                    path.push(name);
                    pending.push((path, child, false));
                }
            }
        }
        Ok(tree)
    }

    /// Records the modules, items, imports and paths of one file; returns its `mod name;`
    /// declarations as (inline modules around it, name).
    fn scan_file(
        &mut self,
        module: &ModPath,
        file: &Path,
        toks: &[Token],
    ) -> Vec<(Vec<String>, String)> {
        self.modules.insert(module.clone(), file.to_path_buf());
        let mut external = Vec::new();
        // One entry per open brace: the inline module it opens, if it does.
        let mut braces: Vec<Option<String>> = Vec::new();
        let ident = |k: usize| match toks.get(k).map(|t| &t.tok) {
            Some(Tok::Ident(s)) => Some(s.as_str()),
            _ => None,
        };
        let punct = |k: usize, c: char| toks.get(k).is_some_and(|t| t.tok == Tok::Punct(c));
        let mut i = 0;
        while i < toks.len() {
            let inline: Vec<String> = braces.iter().flatten().cloned().collect();
            let mut scope = module.clone();
            scope.extend(inline.iter().cloned());
            let after_sep = i > 0 && toks[i - 1].tok == Tok::PathSep;
            match (&toks[i].tok, ident(i + 1)) {
                (Tok::Punct('{'), _) => braces.push(None),
                (Tok::Punct('}'), _) => {
                    braces.pop();
                }
                (Tok::Ident(kw), Some(name)) if kw == "mod" && !after_sep => {
                    if punct(i + 2, '{') {
                        let mut path = scope.clone();
                        path.push(name.to_string());
                        self.modules.insert(path, file.to_path_buf());
                        braces.push(Some(name.to_string()));
                        i += 3;
                        continue;
                    }
                    external.push((inline, name.to_string()));
                    self.items
                        .entry(scope)
                        .or_default()
                        .insert(name.to_string());
                    i += 2;
                    continue;
                }
                (Tok::Ident(kw), _) if kw == "use" && !after_sep => {
                    i = self.scan_use(&scope, toks, i + 1);
                    continue;
                }
                (Tok::Ident(kw), Some(name))
                    if ITEM_KEYWORDS.contains(&kw.as_str()) || kw == "macro_rules" =>
                {
                    let name = if kw == "macro_rules" {
                        ident(i + 2)
                    } else {
                        Some(name)
                    };
                    if let Some(name) = name {
                        self.items
                            .entry(scope)
                            .or_default()
                            .insert(name.to_string());
                    }
                }
                (Tok::Ident(first), _)
                    if !after_sep && toks.get(i + 1).is_some_and(|t| t.tok == Tok::PathSep) =>
                {
                    let mut segments = vec![first.clone()];
                    let mut k = i + 1;
                    while toks.get(k).is_some_and(|t| t.tok == Tok::PathSep)
                        && let Some(next) = ident(k + 1)
                    {
                        segments.push(next.to_string());
                        k += 2;
                    }
                    let line = toks[i].line;
                    self.refs.push(PathRef {
                        scope,
                        segments,
                        line,
                    });
                    i = k;
                    continue;
                }
                _ => {}
            }
            i += 1;
        }
        external
    }

    /// Parses the use tree starting at `toks[i]` up to its `;`; returns the index after it.
    fn scan_use(&mut self, scope: &ModPath, toks: &[Token], mut i: usize) -> usize {
        let line = toks.get(i).map_or(0, |t| t.line);
        let mut leaves = Vec::new();
        use_tree(toks, &mut i, Vec::new(), &mut leaves);
        while i < toks.len() && toks[i].tok != Tok::Punct(';') {
            i += 1;
        }
        for leaf in leaves {
            let import = Import {
                scope: scope.clone(),
                target: leaf.path.clone(),
            };
            match leaf.binding {
                Binding::Glob => self.globs.entry(scope.clone()).or_default().push(import),
                Binding::Name(name) => {
                    self.bindings.insert((scope.clone(), name), import);
                }
                Binding::Underscore => {}
            }
            self.refs.push(PathRef {
                scope: scope.clone(),
                segments: leaf.path,
                line,
            });
        }
        i + 1
    }

    /// The module that defines what `segments` names from `scope`, or `None` when it is
    /// outside this crate.
    fn resolve(&self, scope: &[String], segments: &[String], depth: u32) -> Option<ModPath> {
        if depth > 16 || segments.is_empty() {
            return None;
        }
        let (mut cur, mut rest) = match segments[0].as_str() {
            "crate" | "$crate" => (ModPath::new(), &segments[1..]),
            "self" => (scope.to_vec(), &segments[1..]),
            "super" => {
                let ups = segments.iter().take_while(|s| *s == "super").count();
                let keep = scope.len().checked_sub(ups)?;
                (scope[..keep].to_vec(), &segments[ups..])
            }
            first => {
                let mut child = scope.to_vec();
                child.push(first.to_string());
                if self.modules.contains_key(&child) {
                    (child, &segments[1..])
                } else {
                    let import = self.bindings.get(&(scope.to_vec(), first.to_string()))?;
                    let m = self.resolve(&import.scope, &import.target, depth + 1)?;
                    (m, &segments[1..])
                }
            }
        };
        while let Some((seg, tail)) = rest.split_first() {
            let mut child = cur.clone();
            child.push(seg.clone());
            if self.modules.contains_key(&child) {
                cur = child;
            } else if let Some(defined_in) = self.lookup(&cur, seg, depth + 1) {
                cur = defined_in;
            } else {
                break;
            }
            rest = tail;
        }
        Some(cur)
    }

    /// Where the item `name` visible in module `m` is defined: `m` itself, or wherever a
    /// (glob) import of `m` leads.
    fn lookup(&self, m: &ModPath, name: &str, depth: u32) -> Option<ModPath> {
        if depth > 16 {
            return None;
        }
        if self.items.get(m).is_some_and(|items| items.contains(name)) {
            return Some(m.clone());
        }
        if let Some(import) = self.bindings.get(&(m.clone(), name.to_string())) {
            return self.resolve(&import.scope, &import.target, depth + 1);
        }
        self.globs.get(m)?.iter().find_map(|glob| {
            let from = self.resolve(&glob.scope, &glob.target, depth + 1)?;
            (&from != m).then(|| self.lookup(&from, name, depth + 1))?
        })
    }

    /// The file module holding module `m` (itself, or the file of an inline module).
    fn file_module(&self, m: &[String]) -> ModPath {
        (0..=m.len())
            .rev()
            .map(|n| m[..n].to_vec())
            .find(|p| self.files.contains_key(p))
            .unwrap_or_default()
    }

    /// Every cycle among the children of one module, each with the lines that make it (files
    /// shown relative to `base`).
    fn cycles(&self, base: &Path) -> Vec<String> {
        // (parent, from child, to child) -> the first reference that makes the edge.
        let mut edges: BTreeMap<(ModPath, String, String), (PathBuf, usize, String)> =
            BTreeMap::new();
        for r in &self.refs {
            let Some(target) = self.resolve(&r.scope, &r.segments, 0) else {
                continue;
            };
            let (from, to) = (self.file_module(&r.scope), self.file_module(&target));
            let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            let (Some(a), Some(b)) = (from.get(common), to.get(common)) else {
                continue; // the same module, or one inside the other
            };
            let file = &self.files[&from];
            let shown = file.strip_prefix(base).unwrap_or(file).to_path_buf();
            let witness = (shown, r.line, r.segments.join("::"));
            edges
                .entry((from[..common].to_vec(), a.clone(), b.clone()))
                .or_insert(witness);
        }
        let mut by_parent: BTreeMap<&ModPath, BTreeMap<&String, BTreeSet<&String>>> =
            BTreeMap::new();
        for (parent, a, b) in edges.keys() {
            by_parent
                .entry(parent)
                .or_default()
                .entry(a)
                .or_default()
                .insert(b);
        }
        let mut found = Vec::new();
        for (parent, graph) in by_parent {
            for cycle in simple_cycles_one_per_component(&graph) {
                let mut lines = vec![];
                let names: Vec<String> = cycle
                    .iter()
                    .chain(cycle.first())
                    .map(|c| {
                        let mut m = parent.clone();
                        m.push((*c).clone());
                        display(&m)
                    })
                    .collect();
                for pair in cycle.iter().zip(cycle.iter().cycle().skip(1)) {
                    let key = (parent.clone(), (*pair.0).clone(), (*pair.1).clone());
                    let (file, line, path) = &edges[&key];
                    lines.push(format!("    {}:{line} names {path}", file.display()));
                }
                found.push(format!("{}\n{}", names.join(" -> "), lines.join("\n")));
            }
        }
        found
    }
}

/// One cycle from each strongly connected component of more than one node (Tarjan's
/// algorithm finds the components; a walk inside one closes a cycle).
fn simple_cycles_one_per_component<'a>(
    graph: &BTreeMap<&'a String, BTreeSet<&'a String>>,
) -> Vec<Vec<&'a String>> {
    let nodes: BTreeSet<&String> = graph
        .iter()
        .flat_map(|(a, bs)| std::iter::once(*a).chain(bs.iter().copied()))
        .collect();
    let succ = |n: &String| graph.get(n).into_iter().flatten().copied();
    // Tarjan, recursive: the graphs are a crate's sibling modules, a few dozen at most.
    struct State<'a> {
        index: HashMap<&'a String, usize>,
        low: HashMap<&'a String, usize>,
        stack: Vec<&'a String>,
        on_stack: HashSet<&'a String>,
        components: Vec<Vec<&'a String>>,
    }
    fn visit<'a, I: Iterator<Item = &'a String>>(
        n: &'a String,
        succ: &dyn Fn(&String) -> I,
        s: &mut State<'a>,
    ) {
        let i = s.index.len();
        s.index.insert(n, i);
        s.low.insert(n, i);
        s.stack.push(n);
        s.on_stack.insert(n);
        for m in succ(n) {
            if !s.index.contains_key(m) {
                visit(m, succ, s);
                s.low.insert(n, s.low[n].min(s.low[m]));
            } else if s.on_stack.contains(m) {
                s.low.insert(n, s.low[n].min(s.index[m]));
            }
        }
        if s.low[n] == s.index[n] {
            let mut component = Vec::new();
            while let Some(m) = s.stack.pop() {
                s.on_stack.remove(m);
                component.push(m);
                if m == n {
                    break;
                }
            }
            s.components.push(component);
        }
    }
    let mut s = State {
        index: HashMap::new(),
        low: HashMap::new(),
        stack: Vec::new(),
        on_stack: HashSet::new(),
        components: Vec::new(),
    };
    for n in &nodes {
        if !s.index.contains_key(n) {
            visit(n, &succ, &mut s);
        }
    }
    s.components
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|component| {
            let inside: HashSet<&String> = component.iter().copied().collect();
            let start = *component.iter().min().unwrap_or(&component[0]);
            // Walk inside the component until a node repeats; the loop from it is a cycle.
            let mut walk = vec![start];
            loop {
                let last = *walk.last().unwrap_or(&start);
                let Some(next) = succ(last).find(|m| inside.contains(m)) else {
                    break walk;
                };
                if let Some(at) = walk.iter().position(|w| *w == next) {
                    break walk.split_off(at);
                }
                walk.push(next);
            }
        })
        .collect()
}

/// What a use-tree leaf binds.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Binding {
    Name(String),
    Glob,
    /// `use path as _;`
    Underscore,
}

#[derive(Debug, Clone)]
struct UseLeaf {
    path: Vec<String>,
    binding: Binding,
}

/// Reads one use tree (`a::b::{c, d::*, e as f, self}`) at `toks[*i]`, appending its leaves.
fn use_tree(toks: &[Token], i: &mut usize, mut prefix: Vec<String>, out: &mut Vec<UseLeaf>) {
    if toks.get(*i).is_some_and(|t| t.tok == Tok::PathSep) {
        *i += 1; // `use ::std::…`: an external crate, read it like any other path
    }
    while let Some(t) = toks.get(*i) {
        match &t.tok {
            Tok::Ident(seg) => {
                *i += 1;
                if toks.get(*i).is_some_and(|t| t.tok == Tok::PathSep) {
                    prefix.push(seg.clone());
                    *i += 1;
                    continue;
                }
                let (path, own) = match seg.as_str() {
                    "self" => (prefix.clone(), prefix.last().cloned().unwrap_or_default()),
                    _ => ([prefix.clone(), vec![seg.clone()]].concat(), seg.clone()),
                };
                let binding = match (
                    &toks.get(*i).map(|t| &t.tok),
                    toks.get(*i + 1).map(|t| &t.tok),
                ) {
                    (Some(Tok::Ident(kw)), Some(Tok::Ident(alias))) if kw == "as" => {
                        *i += 2;
                        if alias == "_" {
                            Binding::Underscore
                        } else {
                            Binding::Name(alias.clone())
                        }
                    }
                    _ => Binding::Name(own),
                };
                out.push(UseLeaf { path, binding });
                return;
            }
            Tok::Punct('*') => {
                *i += 1;
                out.push(UseLeaf {
                    path: prefix,
                    binding: Binding::Glob,
                });
                return;
            }
            Tok::Punct('{') => {
                *i += 1;
                while toks.get(*i).is_some_and(|t| t.tok != Tok::Punct('}')) {
                    use_tree(toks, i, prefix.clone(), out);
                    if toks.get(*i).is_some_and(|t| t.tok == Tok::Punct(',')) {
                        *i += 1;
                    } else if toks.get(*i).is_some_and(|t| t.tok != Tok::Punct('}')) {
                        *i += 1; // not a use tree: skip rather than loop
                    }
                }
                *i += 1;
                return;
            }
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cycles of a crate given as (path, source) pairs, `src/lib.rs` first.
    fn cycles(files: &[(&str, &str)]) -> Vec<String> {
        let map: HashMap<PathBuf, String> = files
            .iter()
            .map(|(p, s)| (PathBuf::from(p), s.to_string()))
            .collect();
        let tree = CrateTree::load(Path::new(files[0].0), &|p: &Path| map.get(p).cloned()).unwrap();
        tree.cycles(Path::new(""))
    }

    #[test]
    fn a_cycle_through_a_path_in_code_is_found_with_its_lines() {
        // tilearn-affinity before the fix: topology -> apply -> plan -> topology.
        let found = cycles(&[
            (
                "src/lib.rs",
                "pub mod apply;\npub mod plan;\npub mod topology;",
            ),
            (
                "src/topology.rs",
                "pub struct Topology;\nfn detect() {\n    let a = crate::apply::current_thread_affinity();\n}",
            ),
            (
                "src/apply.rs",
                "use crate::plan::RankPlan;\npub fn current_thread_affinity() {}",
            ),
            (
                "src/plan.rs",
                "use crate::topology::Topology;\npub struct RankPlan;",
            ),
        ]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("crate::apply -> crate::plan -> crate::topology -> crate::apply"),
            "{}",
            found[0]
        );
        assert!(found[0].contains("src/topology.rs:3 names crate::apply::current_thread_affinity"));
        assert!(found[0].contains("src/apply.rs:1 names crate::plan::RankPlan"));
    }

    #[test]
    fn siblings_through_super_are_a_cycle() {
        // tilearn-llm's cli/bench.rs <-> cli/bench_gpu.rs before the fix.
        let found = cycles(&[
            ("src/lib.rs", "mod cli;"),
            ("src/cli/mod.rs", "mod bench;\nmod bench_gpu;"),
            (
                "src/cli/bench.rs",
                "pub struct BenchResult;\nfn run() { super::bench_gpu::bench(); }",
            ),
            (
                "src/cli/bench_gpu.rs",
                "use super::bench::{BenchResult};\npub fn bench() {}",
            ),
        ]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].starts_with("crate::cli::bench -> crate::cli::bench_gpu -> crate::cli::bench")
        );
    }

    #[test]
    fn importing_from_a_submodule_tree_that_imports_back_is_a_cycle() {
        // adaptfp16 before the fix: error.rs names policy::Param (defined in policy/params.rs
        // and re-exported by policy/mod.rs), while policy/ uses crate::error.
        let found = cycles(&[
            (
                "src/lib.rs",
                "pub mod error;\npub mod policy;\npub use error::Error;",
            ),
            (
                "src/error.rs",
                "use crate::policy::{Param, PolicyId};\npub enum Error {}",
            ),
            (
                "src/policy/mod.rs",
                "mod params;\npub use params::{Param, PolicyId};\nuse crate::Error;",
            ),
            (
                "src/policy/params.rs",
                "pub enum Param {}\npub enum PolicyId {}",
            ),
        ]);
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].starts_with("crate::error -> crate::policy -> crate::error"));
        // The re-export through lib.rs was followed to error.rs.
        assert!(found[0].contains("src/policy/mod.rs:3 names crate::Error"));
    }

    #[test]
    fn a_leaf_module_both_sides_import_is_no_cycle() {
        let found = cycles(&[
            (
                "src/lib.rs",
                "pub mod error;\npub mod names;\npub mod policy;\npub use error::*;",
            ),
            (
                "src/error.rs",
                "use crate::names::{Param};\npub enum Error {}",
            ),
            ("src/names.rs", "pub enum Param {}"),
            (
                "src/policy/mod.rs",
                "use crate::Error;\nuse crate::names::Param;",
            ),
        ]);
        assert!(found.is_empty(), "{found:?}");
    }

    #[test]
    fn parent_and_child_comments_strings_and_tests_make_no_cycle() {
        let found = cycles(&[
            ("src/lib.rs", "pub mod scaler;\npub mod other;"),
            (
                "src/scaler/mod.rs",
                "mod state;\npub use state::ScalerState;\npub struct GradScaler;\n\
                 /// See [`crate::other::Thing`].\nconst S: &str = \"crate::other::X\";",
            ),
            (
                "src/scaler/state.rs",
                "use super::GradScaler;\npub struct ScalerState;",
            ),
            (
                "src/other.rs",
                "use crate::scaler::GradScaler;\npub struct Thing;\n\
                 #[cfg(test)]\nmod tests {\n    use super::*;\n    fn t() { let _ = super::Thing; }\n}",
            ),
        ]);
        assert!(found.is_empty(), "{found:?}");
    }

    #[test]
    fn members_are_read_from_the_root_manifest() {
        let manifest =
            "[workspace]\nresolver = \"3\"\nmembers = [\n    \"crates/a\",\n    \"xtask\",\n]\n";
        let members = workspace_members(manifest, Path::new("/nonexistent")).unwrap();
        assert_eq!(members, [PathBuf::from("crates/a"), PathBuf::from("xtask")]);
    }
}
