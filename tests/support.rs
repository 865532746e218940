//! Shared helpers for the integration tests (starting real daemons, free ports, waiting).
