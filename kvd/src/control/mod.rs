//! The control shim: load-aware checkpoint placement, recovery dispatch, request epochs.
