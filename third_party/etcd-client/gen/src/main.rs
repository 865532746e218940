//! `etcd-client-gen OUT_DIR`: the gRPC code of ../proto/ into OUT_DIR, as upstream
//! etcd-client 0.15.0's build.rs makes it (client only).

fn main() {
    let out = std::env::args().nth(1).expect("usage: etcd-client-gen OUT_DIR");
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../proto");
    let protos = [
        "auth.proto",
        "kv.proto",
        "rpc.proto",
        "v3election.proto",
        "v3lock.proto",
    ]
    .map(|p| format!("{root}/{p}"));
    tonic_build::configure()
        .build_server(false)
        .out_dir(out)
        .compile_protos(&protos, &[root])
        .expect("compile the etcd protos (is protoc installed?)");
}
