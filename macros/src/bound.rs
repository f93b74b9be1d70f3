//! Helpers for generics: which types mention a type parameter, and where-clause building.

use std::collections::BTreeSet;

use proc_macro2::TokenStream;
use quote::{quote_spanned, ToTokens};
use syn::spanned::Spanned;
use syn::visit::Visit;

/// The names of `generics`' type parameters.
pub(crate) fn type_params(generics: &syn::Generics) -> BTreeSet<String> {
    generics
        .type_params()
        .map(|p| p.ident.to_string())
        .collect()
}

/// Whether `ty` mentions one of `params` (as a path segment, e.g. `T`, `Vec<T>`, `T::Item`).
pub(crate) fn mentions(ty: &syn::Type, params: &BTreeSet<String>) -> bool {
    struct Finder<'a> {
        params: &'a BTreeSet<String>,
        found: bool,
    }
    impl<'ast> Visit<'ast> for Finder<'_> {
        fn visit_path(&mut self, path: &'ast syn::Path) {
            if let Some(first) = path.segments.first() {
                if self.params.contains(&first.ident.to_string()) {
                    self.found = true;
                }
            }
            syn::visit::visit_path(self, path);
        }
    }
    let mut f = Finder {
        params,
        found: false,
    };
    f.visit_type(ty);
    f.found
}

/// A where clause: `generics`' own predicates plus `Ty: Trait` for each given field type that
/// mentions a type parameter. Each added predicate is spanned at its field type.
pub(crate) fn where_clause_with(
    generics: &syn::Generics,
    field_types: &[&syn::Type],
    trait_path: &TokenStream,
) -> TokenStream {
    let params = type_params(generics);
    let own = generics
        .where_clause
        .as_ref()
        .map(|w| {
            w.predicates
                .iter()
                .map(|p| p.to_token_stream())
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    let added = field_types
        .iter()
        .filter(|ty| mentions(ty, &params))
        .map(|ty| quote_spanned!(ty.span()=> #ty: #trait_path));
    let all: Vec<TokenStream> = own.into_iter().chain(added).collect();
    if all.is_empty() {
        TokenStream::new()
    } else {
        quote::quote!(where #(#all),*)
    }
}

/// The type's text with all whitespace removed (`Vec<Dense>`), as it enters schema digests and docs.
pub(crate) fn type_text(ty: &syn::Type) -> String {
    ty.to_token_stream()
        .to_string()
        .chars()
        .filter(|c| !c.is_whitespace())
        .collect()
}
