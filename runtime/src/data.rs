//! In-memory datasets: arrays with a content digest, batching, shuffling and splits.
