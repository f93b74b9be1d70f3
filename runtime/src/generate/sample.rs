//! Sampling on the device (placeholder: being written).
