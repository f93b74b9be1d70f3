//! The attribute keywords, in one place.

/// `#[graph_const]`: the field shapes the graph.
pub(crate) const GRAPH_CONST: &str = "graph_const";
/// `#[device]`: the field is a traced input.
pub(crate) const DEVICE: &str = "device";
/// `#[host]`: the field is invisible to traced code.
pub(crate) const HOST: &str = "host";
/// `#[device(trainable)]`: gradients flow to the field.
pub(crate) const TRAINABLE: &str = "trainable";
/// `#[device(frozen)]`: the field never changes while training; cached stages read it.
pub(crate) const FROZEN: &str = "frozen";

/// Every role marker.
pub(crate) const MARKERS: [&str; 3] = [GRAPH_CONST, DEVICE, HOST];

/// The marker list as users write it, for error messages.
pub(crate) const MARKERS_HELP: &str =
    "the role markers are #[graph_const], #[device], #[device(trainable)], #[device(frozen)] \
     and #[host]";
