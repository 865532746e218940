//! Same-node data movement.
