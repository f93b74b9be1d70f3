//! Checkpoints in `safetensors` format: Device fields, optimizer state, step and the GraphConst
//! digests, written atomically.
