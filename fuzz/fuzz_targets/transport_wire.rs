//! The transfer engine's wire: what a peer (authenticated or not) can send. The TCP backend's
//! connection introduction, chunk requests and answers, segment descriptors, and the RDMA side
//! channel's frames. Anything decodes to a value or an error; a value re-encodes to itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use transport::link::wire::Bind;
use transport::rdma::wire::Message;
use transport::segment::SegmentDescriptor;
use transport::tcp::wire::{Request, Response};

fuzz_target!(|data: &[u8]| {
    if let Some(b) = data.first_chunk::<{ Bind::WIRE_BYTES }>()
        && let Ok(v) = Bind::decode(b)
    {
        assert_eq!(Bind::decode(&v.encode()).unwrap(), v);
    }
    if let Some(b) = data.first_chunk::<{ Request::WIRE_BYTES }>()
        && let Ok(v) = Request::decode(b)
    {
        assert_eq!(Request::decode(&v.encode()).unwrap(), v);
    }
    if let Some(b) = data.first_chunk::<{ Response::WIRE_BYTES }>() {
        let _ = Response::decode(b);
    }
    if let Ok(d) = SegmentDescriptor::decode(data) {
        assert_eq!(SegmentDescriptor::decode(&d.encode()).unwrap(), d);
    }
    if let Some((&kind, payload)) = data.split_first()
        && let Ok(m) = Message::decode(kind, payload)
    {
        let f = m.encode();
        assert_eq!(Message::parse(&f).unwrap(), m);
    }
    let _ = Message::parse(data);
});
