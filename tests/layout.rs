//! No import circle in the house: within each package of the repository (`fuzz/` included), no
//! source file reaches back to itself through the `crate::` paths of the files it uses. Every
//! import then points down, and one that closes a loop fails here, naming the files and the
//! names that tie them.
//!
//! A file's imports are the `crate::` paths in its code (comments left out), each resolved to the
//! deepest module file it names. A file's paths to the crate's root (`lib.rs`, `main.rs`) and to
//! its own ancestors (as `super::` reaches them), and a parent's `mod`, are the module tree
//! itself and are not counted; `src/bin/` files are crates of their own, reached only through
//! the library.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Which files a file imports, with the names it takes from each.
type Imports = BTreeMap<PathBuf, BTreeMap<PathBuf, BTreeSet<String>>>;

#[test]
fn no_package_has_an_import_circle() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the repository above tests/");
    let mut circles = Vec::new();
    let packages = packages(root);
    assert!(
        packages.len() >= 10,
        "found only {} packages under {}",
        packages.len(),
        root.display()
    );
    for src in packages {
        let imports = imports(&src);
        for circle in circles_of(&imports) {
            let ties = describe(root, &imports, &circle);
            circles.push(format!("a circle of {} files:\n{ties}", circle.len()));
        }
    }
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}

/// Every package's `src/` in the repository, `target/` and hidden directories left out.
fn packages(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        if dir.join("Cargo.toml").is_file() && dir.join("src").is_dir() {
            found.push(dir.join("src"));
        }
        for entry in std::fs::read_dir(&dir).expect("read a directory").flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let skipped = name.starts_with('.') || name == "target" || name == "src";
            if entry.path().is_dir() && !skipped {
                dirs.push(entry.path());
            }
        }
    }
    found
}

/// The module files of the package whose source is `src`, by module path (`a::b` is
/// `src/a/b.rs` or `src/a/b/mod.rs`); the root and `src/bin/` are left out.
fn modules(src: &Path) -> BTreeMap<String, PathBuf> {
    let mut modules = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("read a directory").flatten() {
            let path = entry.path();
            if path.is_dir() && path != src.join("bin") {
                dirs.push(path);
                continue;
            }
            let Some(rel) = path.strip_prefix(src).ok().and_then(Path::to_str) else {
                continue;
            };
            let Some(stem) = rel.strip_suffix(".rs") else {
                continue;
            };
            let module = stem.strip_suffix("/mod").unwrap_or(stem).replace('/', "::");
            if !matches!(module.as_str(), "lib" | "main") {
                modules.insert(module, path);
            }
        }
    }
    modules
}

/// What each module file of the package at `src` imports from the others.
fn imports(src: &Path) -> Imports {
    let modules = modules(src);
    let mut imports = Imports::new();
    for (module, file) in &modules {
        let text = std::fs::read_to_string(file).expect("read a source file");
        let used = imports.entry(file.clone()).or_default();
        for path in crate_paths(&code(&text)) {
            let deepest = (1..=path.len())
                .rev()
                .find_map(|n| Some((n, modules.get(&path[..n].join("::"))?)));
            // A module's own file, or one of its ancestors' (as `super::` reaches them).
            let above = |n: usize| {
                module
                    .split("::")
                    .take(n)
                    .eq(path[..n].iter().map(String::as_str))
            };
            if let Some((n, target)) = deepest.filter(|&(n, _)| !above(n)) {
                let name = path.get(n).unwrap_or(&path[n - 1]).clone();
                used.entry(target.clone()).or_default().insert(name);
            }
        }
    }
    imports
}

/// `text` without its comments (from `//` to the end of the line; doc links are not imports).
fn code(text: &str) -> String {
    let lines = text
        .lines()
        .map(|line| line.split("//").next().unwrap_or(""));
    lines.collect::<Vec<_>>().join("\n")
}

/// Every `crate::` path in `code`, its `use` groups expanded: `crate::a::{b, c::D}` gives
/// `[a, b]` and `[a, c, D]` (`self` and renames dropped).
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    let bytes = code.as_bytes();
    let mut paths = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let before = at.checked_sub(1).map(|i| bytes[i]);
        if before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'$') {
            continue;
        }
        let mut i = at + "crate::".len();
        tree(bytes, &mut i, Vec::new(), &mut paths);
    }
    for path in &mut paths {
        path.retain(|segment| segment != "self");
    }
    paths.retain(|path| !path.is_empty());
    paths
}

/// Reads one path or `{…}` group at `i` under `prefix` into `out`.
fn tree(bytes: &[u8], i: &mut usize, mut prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    let skip_space = |i: &mut usize| {
        while bytes.get(*i).is_some_and(u8::is_ascii_whitespace) {
            *i += 1;
        }
    };
    loop {
        skip_space(i);
        if bytes.get(*i) == Some(&b'{') {
            *i += 1;
            loop {
                skip_space(i);
                match bytes.get(*i) {
                    None => return,
                    Some(b'}') => {
                        *i += 1;
                        return;
                    }
                    Some(_) => tree(bytes, i, prefix.clone(), out),
                }
                // Past a rename (`X as Y`) to the next item or the group's end.
                while bytes.get(*i).is_some_and(|&b| b != b',' && b != b'}') {
                    *i += 1;
                }
                if bytes.get(*i) == Some(&b',') {
                    *i += 1;
                }
            }
        }
        let start = *i;
        while bytes
            .get(*i)
            .is_some_and(|&b| b.is_ascii_alphanumeric() || b == b'_')
        {
            *i += 1;
        }
        if *i > start {
            prefix.push(String::from_utf8_lossy(&bytes[start..*i]).into_owned());
        }
        if *i == start || !bytes[*i..].starts_with(b"::") {
            out.push(prefix);
            return;
        }
        *i += 2;
    }
}

/// The files that reach back to themselves, grouped by the circle they share.
fn circles_of(imports: &Imports) -> Vec<BTreeSet<PathBuf>> {
    let reach = |from: &PathBuf| {
        let mut seen = BTreeSet::new();
        let mut next: Vec<&PathBuf> = imports[from].keys().collect();
        while let Some(file) = next.pop() {
            if seen.insert(file.clone()) {
                next.extend(imports.get(file).into_iter().flat_map(BTreeMap::keys));
            }
        }
        seen
    };
    let reached: BTreeMap<&PathBuf, BTreeSet<PathBuf>> =
        imports.keys().map(|file| (file, reach(file))).collect();
    let mut circles: Vec<BTreeSet<PathBuf>> = Vec::new();
    for (file, reaches) in &reached {
        if !reaches.contains(*file) || circles.iter().any(|c| c.contains(*file)) {
            continue;
        }
        let together = reaches
            .iter()
            .filter(|other| reached[other].contains(*file));
        circles.push(together.cloned().collect());
    }
    circles
}

/// `a.rs -> b.rs: Name, …` for each import between the files of `circle`, paths from `root`.
fn describe(root: &Path, imports: &Imports, circle: &BTreeSet<PathBuf>) -> String {
    let shown = |file: &Path| {
        file.strip_prefix(root)
            .unwrap_or(file)
            .display()
            .to_string()
    };
    let mut lines = Vec::new();
    for from in circle {
        for (to, names) in imports[from].iter().filter(|(to, _)| circle.contains(*to)) {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            lines.push(format!(
                "  {} -> {}: {}",
                shown(from),
                shown(to),
                names.join(", ")
            ));
        }
    }
    lines.join("\n")
}

/// The circles of a package made of `files` (path, text) in a directory of its own, each as
/// its files' paths, and how the first is described.
fn circles_in(name: &str, files: &[(&str, &str)]) -> (Vec<Vec<String>>, String) {
    let src = std::env::temp_dir().join(format!("lily-layout-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&src);
    for (path, text) in files {
        let path = src.join(path);
        std::fs::create_dir_all(path.parent().expect("a parent")).expect("a directory");
        std::fs::write(path, text).expect("a file");
    }
    let imports = imports(&src);
    let circles = circles_of(&imports);
    let first = circles.first().map(|c| describe(&src, &imports, c));
    let _ = std::fs::remove_dir_all(&src);
    let relative = |circle: &BTreeSet<PathBuf>| {
        let files = circle
            .iter()
            .map(|p| p.strip_prefix(&src).expect("inside").display());
        files.map(|p| p.to_string()).collect()
    };
    (
        circles.iter().map(relative).collect(),
        first.unwrap_or_default(),
    )
}

/// The check finds a circle through `use` groups, renames and paths in code, and none where only
/// the root, comments and `super::` tie files.
#[test]
fn a_circle_is_found_and_the_module_tree_is_not_one() {
    // a -> b -> c -> a::inner, and a::inner reaches only its parent a.
    let (circles, _) = circles_in(
        "tree",
        &[
            (
                "lib.rs",
                "pub mod a;\npub mod b;\npub mod c;\nuse crate::a::A;\n",
            ),
            (
                "a/mod.rs",
                "pub mod inner;\nuse crate::{b::{self, B as Renamed}, root_fn};\n",
            ),
            (
                "a/inner.rs",
                "use super::A;\n// crate::c::C is only a comment\n",
            ),
            ("b.rs", "fn f() { crate::c::make(); }\n"),
            ("c.rs", "use crate::a::inner::{self};\npub fn make() {}\n"),
        ],
    );
    assert!(circles.is_empty(), "{circles:?}");

    let (circles, shown) = circles_in(
        "circle",
        &[
            ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\n"),
            ("a.rs", "use crate::{b::{self, B as Renamed}};\n"),
            ("b.rs", "fn f() { crate::c::make(); }\n"),
            ("c.rs", "pub fn make() { let _ = crate::a::A; }\n"),
        ],
    );
    assert_eq!(circles, [["a.rs", "b.rs", "c.rs"]]);
    assert!(shown.contains("a.rs -> b.rs: B, b"), "{shown}");
}
