//! Procedural macros of [nitro](https://docs.rs/nitro): `#[experiment]`, `#[derive(ContentHash)]`
//! and `#[derive(Tree)]`.
//!
//! Use them through the `nitro` crate, which re-exports them and documents them with examples.
//! Each macro runs the same pipeline: parse the input into a small model, check it (collecting
//! every error), then expand. After an error the input item is still emitted, so one mistake
//! does not cascade through the rest of the crate.

mod bound;
mod content_hash;
mod ctxt;
mod experiment;
mod symbol;
mod tree;

use proc_macro::TokenStream;

/// Derives `nitro::ContentHash`. See the `nitro` crate for docs.
#[proc_macro_derive(ContentHash)]
pub fn derive_content_hash(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    content_hash::expand(&input).into()
}

/// Derives `nitro::Tree` and the mirror type. See the `nitro` crate for docs.
#[proc_macro_derive(Tree)]
pub fn derive_tree(input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    tree::expand(&input).into()
}

/// Declares an experiment. See the `nitro` crate for docs.
#[proc_macro_attribute]
pub fn experiment(args: TokenStream, input: TokenStream) -> TokenStream {
    let input = syn::parse_macro_input!(input as syn::DeriveInput);
    experiment::expand(args.into(), input).into()
}
