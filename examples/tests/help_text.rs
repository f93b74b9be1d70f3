//! `chargpt --help` reads as text for a person: clap takes a command's description from the doc
//! comment of its arguments' struct unless told otherwise, and `chargpt::Args`'s doc comment
//! holds a doc test and links for rustdoc. Its `about` and `long_about` are given explicitly;
//! this holds them (and the flags' own help) free of rustdoc's markup.
#![allow(missing_docs)]

use clap::CommandFactory;
use nitro_examples::chargpt::Args;

/// Rustdoc markup that must not reach a terminal.
const MARKUP: [&str; 4] = ["```", "use clap", "[`", "](crate::"];

#[test]
fn chargpt_help_holds_no_rustdoc_markup() {
    let mut command = Args::command();
    let short = command.render_help().to_string();
    let long = command.render_long_help().to_string();
    for help in [&short, &long] {
        for markup in MARKUP {
            assert!(
                !help.contains(markup),
                "{markup:?} in chargpt's help:\n{help}"
            );
        }
    }
    assert!(
        long.contains("held-out bits per character"),
        "the description is missing:\n{long}"
    );
    assert!(long.contains("--steps"), "{long}");
}
