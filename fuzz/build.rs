//! The C ABI target calls libkvd through `include/kvd.h` (bindings made here, so the target
//! uses the header's own declarations) and links the libkvd.so that `scripts/fuzz.sh` built
//! with the same coverage flags (`KVD_LIBKVD_DIR`).
fn main() {
    println!("cargo:rerun-if-changed=../include/kvd.h");
    println!("cargo:rerun-if-env-changed=KVD_LIBKVD_DIR");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap());
    bindgen::Builder::default()
        .header("../include/kvd.h")
        .allowlist_function("kvd_.*")
        .allowlist_type("Kvd.*")
        .allowlist_var("KVD_.*")
        .generate()
        .expect("bindings for include/kvd.h")
        .write_to_file(out.join("kvd_h.rs"))
        .unwrap();
    if let Ok(dir) = std::env::var("KVD_LIBKVD_DIR") {
        println!("cargo:rustc-link-search=native={dir}");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    println!("cargo:rustc-link-lib=dylib=kvd");
}
