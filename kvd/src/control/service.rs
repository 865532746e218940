//! `kvd control`: the controller as an HTTP/JSON service (in progress).
