//! `kvd sim`: a deterministic discrete-event simulator of a serving cluster.
