//! The model of an `#[experiment]` struct: its fields and their roles, parsed from the markers.

use proc_macro2::Span;
use syn::spanned::Spanned;

use crate::ctxt::Ctxt;
use crate::symbol::{DEVICE, FROZEN, GRAPH_CONST, HOST, MARKERS, MARKERS_HELP, TRAINABLE};

/// A field's role, as parsed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    GraphConst,
    Device {
        trainable: bool,
    },
    /// `#[device(frozen)]`: a traced input that never changes while training.
    Frozen,
    Host,
}

impl Role {
    /// The `nitro::Role` expression for this role.
    pub(crate) fn tokens(self) -> proc_macro2::TokenStream {
        match self {
            Role::GraphConst => quote::quote!(::nitro::__private::Role::GraphConst),
            Role::Device { trainable } => {
                quote::quote!(::nitro::__private::Role::Device { trainable: #trainable })
            }
            Role::Frozen => quote::quote!(::nitro::__private::Role::Frozen),
            Role::Host => quote::quote!(::nitro::__private::Role::Host),
        }
    }

    /// Whether the field is a traced input (Device, trainable or not, or frozen).
    pub(crate) fn is_device(self) -> bool {
        matches!(self, Role::Device { .. } | Role::Frozen)
    }

    /// A stable tag for the schema digest.
    pub(crate) fn tag(self) -> u8 {
        match self {
            Role::GraphConst => 0,
            Role::Device { trainable: false } => 1,
            Role::Device { trainable: true } => 2,
            Role::Host => 3,
            Role::Frozen => 4,
        }
    }

    /// The role's name in docs (the same words as `nitro::Role::label`).
    pub(crate) fn label(self) -> &'static str {
        match self {
            Role::GraphConst => "GraphConst",
            Role::Device { trainable: false } => "Device",
            Role::Device { trainable: true } => "Device, trainable",
            Role::Frozen => "Device, frozen",
            Role::Host => "Host",
        }
    }

    /// How the role enters the key, in docs (the same words as `nitro::Role::enters_key_as`).
    pub(crate) fn enters_key_as(self) -> &'static str {
        match self {
            Role::GraphConst => "content hash (blake3)",
            Role::Device { .. } => "dtypes and shapes of its leaves, never values",
            Role::Frozen => {
                "dtypes and shapes of its leaves, never values (its content names cached stage outputs)"
            }
            Role::Host => "nothing — not visible to traced code",
        }
    }
}

/// One field of the experiment.
pub(crate) struct Field {
    pub(crate) ident: syn::Ident,
    /// The name users write in paths, docs and the manifest (`r#type` is `type`).
    pub(crate) name: String,
    pub(crate) ty: syn::Type,
    pub(crate) role: Role,
}

/// Parses the role of `field` from its markers, reporting every bad marker into `cx`, and
/// removes the markers from the field's attributes. Unmarked fields are Host.
///
/// The role is best effort even after an error (the first marker wins, a bad option is
/// ignored), so the expansion can still be emitted and one mistake does not cascade into
/// errors wherever the experiment is used.
pub(crate) fn parse_field(cx: &Ctxt, field: &mut syn::Field) -> Role {
    let name = field_name(field);
    let mut role: Option<(Role, &'static str)> = None;
    let mut kept = Vec::with_capacity(field.attrs.len());
    for attr in std::mem::take(&mut field.attrs) {
        let Some(marker) = marker_of(&attr) else {
            if let Some(suggestion) = misspelled_marker(&attr) {
                cx.error_at(
                    attr.path(),
                    format!(
                        "unknown nitro marker `#[{}]` on field `{name}`; did you mean \
                         `#[{suggestion}]`? ({MARKERS_HELP})",
                        path_text(attr.path())
                    ),
                );
                continue;
            }
            if attr.path().is_ident("cfg") || attr.path().is_ident("cfg_attr") {
                cx.error_at(
                    &attr,
                    format!(
                        "`#[{}]` on experiment field `{name}` is not supported: an experiment's \
                         fields, and so its compile key, must be the same in every build; make \
                         the field's type conditional instead, or move the field out of the experiment",
                        path_text(attr.path())
                    ),
                );
            }
            kept.push(attr);
            continue;
        };
        let parsed = match marker {
            GRAPH_CONST => {
                check_plain(cx, &attr, marker, &name);
                Role::GraphConst
            }
            HOST => {
                check_plain(cx, &attr, marker, &name);
                Role::Host
            }
            _ => parse_device(cx, &attr, &name),
        };
        match role {
            None => role = Some((parsed, marker)),
            Some((_, first)) if first == marker => cx.error_at(
                &attr,
                format!("duplicate `#[{marker}]` marker on field `{name}`; write it once"),
            ),
            Some((_, first)) => cx.error_at(
                &attr,
                format!(
                    "field `{name}` has two roles, `#[{first}]` and `#[{marker}]`; a field has \
                     exactly one role ({MARKERS_HELP})"
                ),
            ),
        }
    }
    field.attrs = kept;
    role.map_or(Role::Host, |(r, _)| r)
}

/// The field's name as users write it in paths and docs (`r#type` is `type`).
pub(crate) fn field_name(field: &syn::Field) -> String {
    use syn::ext::IdentExt;
    field
        .ident
        .as_ref()
        .map(|i| i.unraw().to_string())
        .unwrap_or_default()
}

/// The marker an attribute is, if it is one of ours.
fn marker_of(attr: &syn::Attribute) -> Option<&'static str> {
    MARKERS.into_iter().find(|m| attr.path().is_ident(m))
}

/// `#[graph_const]` and `#[host]` take no options.
fn check_plain(cx: &Ctxt, attr: &syn::Attribute, marker: &str, name: &str) {
    if !matches!(attr.meta, syn::Meta::Path(_)) {
        cx.error_at(
            &attr.meta,
            format!("`#[{marker}]` on field `{name}` takes no options; write `#[{marker}]`"),
        );
    }
}

/// `#[device]`, `#[device(trainable)]` or `#[device(frozen)]`.
fn parse_device(cx: &Ctxt, attr: &syn::Attribute, name: &str) -> Role {
    let list = match &attr.meta {
        syn::Meta::Path(_) => return Role::Device { trainable: false },
        syn::Meta::List(list) => list,
        syn::Meta::NameValue(nv) => {
            cx.error_at(
                nv,
                format!(
                    "`#[{DEVICE}]` on field `{name}` takes options in parentheses: \
                     `#[{DEVICE}({TRAINABLE})]` or `#[{DEVICE}({FROZEN})]`"
                ),
            );
            return Role::Device { trainable: false };
        }
    };
    let mut trainable: Option<Span> = None;
    let mut frozen: Option<Span> = None;
    let result = list.parse_nested_meta(|meta| {
        let option = if meta.path.is_ident(TRAINABLE) {
            Some((TRAINABLE, &mut trainable))
        } else if meta.path.is_ident(FROZEN) {
            Some((FROZEN, &mut frozen))
        } else {
            None
        };
        if let Some((word, slot)) = option {
            if slot.is_some() {
                cx.error_at(
                    &meta.path,
                    format!(
                        "duplicate `{word}` option in `#[{DEVICE}(...)]` on field `{name}`; \
                         write it once"
                    ),
                );
            }
            *slot = Some(meta.path.span());
            if !meta.input.is_empty() && !meta.input.peek(syn::Token![,]) {
                return Err(meta.error(format!("`{word}` takes no value")));
            }
            Ok(())
        } else {
            cx.error_at(
                &meta.path,
                format!(
                    "unknown `#[{DEVICE}]` option `{}` on field `{name}`; the options are \
                     `{TRAINABLE}` and `{FROZEN}`",
                    path_text(&meta.path)
                ),
            );
            // Skip a value such as `= 1` or `(..)` so parsing can go on to the next option.
            if meta.input.peek(syn::Token![=]) {
                let _: syn::Token![=] = meta.input.parse()?;
                let _: syn::Expr = meta.input.parse()?;
            } else if meta.input.peek(syn::token::Paren) {
                let _content;
                syn::parenthesized!(_content in meta.input);
            }
            Ok(())
        }
    });
    if let Err(e) = result {
        cx.push(e);
    }
    match (trainable, frozen) {
        (Some(_), Some(at)) => {
            cx.error_at(
                syn::Ident::new(FROZEN, at),
                format!(
                    "field `{name}` is marked both `{TRAINABLE}` and `{FROZEN}`: a frozen field \
                     never changes while training, so it cannot be trained; keep one"
                ),
            );
            Role::Device { trainable: true }
        }
        (_, Some(_)) => Role::Frozen,
        (trainable, None) => Role::Device {
            trainable: trainable.is_some(),
        },
    }
}

/// A near miss of a marker: `#[graphconst]`, `#[GraphConst]`, `#[devices]`, `#[trainable]`, …
fn misspelled_marker(attr: &syn::Attribute) -> Option<&'static str> {
    let ident = attr.path().get_ident()?.to_string();
    let squashed: String = ident
        .chars()
        .filter(|c| *c != '_' && *c != '-')
        .flat_map(char::to_lowercase)
        .collect();
    if squashed == TRAINABLE {
        return Some("device(trainable)");
    }
    MARKERS.into_iter().find(|m| {
        let target: String = m.chars().filter(|c| *c != '_').collect();
        squashed == target || edit_distance(&squashed, &target) <= 2 && target.len() > 4
    })
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur.push(sub.min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

fn path_text(path: &syn::Path) -> String {
    path.segments
        .iter()
        .map(|s| s.ident.to_string())
        .collect::<Vec<_>>()
        .join("::")
}
