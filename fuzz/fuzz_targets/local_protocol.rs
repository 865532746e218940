//! The local protocol's decoders (what the daemon reads from any process on the node): frame
//! headers, and request and reply bodies. Anything decodes to a value or an error; a value
//! re-encodes to bytes that decode to the same value.
#![no_main]

use kvd_core::protocol::frame;
use kvd_core::protocol::messages::{Hello, Reply, Request, Response};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(h) = data.first_chunk::<{ frame::FRAME_HEADER_BYTES }>() {
        let _ = frame::decode_header(h, 1 << 20);
    }
    let _ = frame::decode_frame::<Hello>(data);
    let _ = frame::decode_frame::<Response>(data);
    let _ = frame::decode_body::<Reply>(data);
    if let Ok(r) = frame::decode_body::<Request>(data) {
        // a request that decodes re-encodes (if it fits a frame) to one that decodes the same
        if let Ok(again) = frame::encode(&r) {
            let back: Request = frame::decode_frame(&again).expect("a re-encoded request decodes");
            assert_eq!(format!("{back:?}"), format!("{r:?}"));
        }
    }
});
