//! `#[experiment]`: parse the struct and its markers, check, then expand into the struct with a
//! "Compile key" doc section, its compile view and `impl nitro::Experiment`.

mod ast;
mod docs;
mod expand;

use proc_macro2::TokenStream;
use quote::quote;

use crate::ctxt::Ctxt;

pub(crate) fn expand(args: TokenStream, mut input: syn::DeriveInput) -> TokenStream {
    let cx = Ctxt::new();
    if !args.is_empty() {
        cx.error_at(
            &args,
            "`#[experiment]` takes no arguments; mark each field instead \
             (#[graph_const], #[device], #[device(trainable)], #[host])",
        );
    }

    let name = input.ident.clone();
    let fields = match &mut input.data {
        syn::Data::Struct(s) => match &mut s.fields {
            syn::Fields::Named(named) => Some(
                named
                    .named
                    .iter_mut()
                    .map(|f| {
                        let role = ast::parse_field(&cx, f);
                        ast::Field {
                            ident: f.ident.clone().unwrap_or_else(|| name.clone()),
                            name: ast::field_name(f),
                            ty: f.ty.clone(),
                            role,
                        }
                    })
                    .collect::<Vec<_>>(),
            ),
            syn::Fields::Unnamed(unnamed) => {
                cx.error_at(
                    &*unnamed,
                    format!(
                        "`#[experiment]` needs named fields: each field's name appears in the \
                         compile key and its docs; write `struct {name} {{ .. }}`"
                    ),
                );
                strip_markers(unnamed.unnamed.iter_mut());
                None
            }
            syn::Fields::Unit => {
                cx.error_at(
                    &name,
                    format!("`#[experiment]` needs a struct with named fields; `{name}` has none"),
                );
                None
            }
        },
        syn::Data::Enum(e) => {
            cx.error_at(
                e.enum_token,
                "`#[experiment]` applies to structs, not enums: an experiment has one fixed \
                 set of fields; put the enum in a #[graph_const] field of a struct instead",
            );
            strip_markers(e.variants.iter_mut().flat_map(|v| v.fields.iter_mut()));
            None
        }
        syn::Data::Union(u) => {
            cx.error_at(
                u.union_token,
                "`#[experiment]` applies to structs, not unions: a union's live field is not \
                 known, so no compile key can be built from it; use a struct",
            );
            strip_markers(u.fields.named.iter_mut());
            None
        }
    };

    // A field under `#[cfg]` may not exist, so nothing that names the fields can be emitted.
    let conditional = input_fields(&input).any(|f| {
        f.attrs
            .iter()
            .any(|a| a.path().is_ident("cfg") || a.path().is_ident("cfg_attr"))
    });
    let errors = cx.finish();
    match fields {
        // Field-level mistakes still expand with best-effort roles, so code that uses the
        // experiment sees no errors of its own: only the real one is reported.
        Some(fields) if !conditional => {
            let expanded = expand::expand(&mut input, &fields);
            quote!(#expanded #errors)
        }
        // Otherwise emit the item without markers (so the rest of the crate type-checks) plus
        // the errors.
        _ => quote!(#input #errors),
    }
}

fn input_fields(input: &syn::DeriveInput) -> impl Iterator<Item = &syn::Field> {
    let fields: Vec<&syn::Field> = match &input.data {
        syn::Data::Struct(s) => s.fields.iter().collect(),
        _ => Vec::new(),
    };
    fields.into_iter()
}

/// Removes markers from fields of an item that is rejected anyway, so they do not add
/// "unknown attribute" errors on top of the real one.
fn strip_markers<'a>(fields: impl Iterator<Item = &'a mut syn::Field>) {
    let quiet = Ctxt::new();
    for f in fields {
        ast::parse_field(&quiet, f);
    }
    drop(quiet.finish());
}
