//! The README shows the handler of `src/bin/handler.rs`: the two must stay the same text.

#[test]
fn the_readme_handler_is_the_compiled_one() {
    let readme = include_str!("../../../README.md");
    let source = include_str!("../src/bin/handler.rs");
    let sample: String = source
        .split("// ANCHOR: handler\n")
        .nth(1)
        .and_then(|rest| rest.split("// ANCHOR_END: handler\n").next())
        .expect("src/bin/handler.rs has the `handler` anchor")
        .to_owned();
    let block = readme
        .split("```rust\n")
        .nth(1)
        .and_then(|rest| rest.split("```\n").next())
        .expect("the README has a rust block");
    assert_eq!(
        block, sample,
        "README.md's handler differs from docs/samples/src/bin/handler.rs: copy the sample"
    );
}
