/* libkvd in ten lines: connect, register a layout, put one block, publish it. */
#include <stdio.h>
#include <string.h>
#include "kvd.h"

int main(int argc, char **argv) {
    KvdClientOptions o; KvdClient *c; KvdNamespaceId ns; KvdAllocation a; int32_t st; uint32_t crc, sum;
    KvdNamespaceDescriptor d = {.model_name = "example/tiny", .model_revision = "r1", .dtype = KVD_DTYPE_BF16,
        .num_layers = 1, .num_kv_heads = 1, .head_dim = 64, .tokens_per_block = 16, .tp_size = 1, .pp_size = 1,
        .bytes_per_block = 4096};
    static const char page[4096] = "hello, kvd";
    if (kvd_options_init(&o, KVD_ABI_VERSION) || kvd_connect(argc > 1 ? argv[1] : "kvd-data/kvd.sock", &o, &c)
        || kvd_register_namespace(c, &d, &ns)) return fprintf(stderr, "%s\n", kvd_last_error_message()), 1;
    KvdKey key = {.namespace_id = ns, .tag = {{1, 2, 3}}};
    if (kvd_alloc(c, &key, 1, NULL, 0, &a, &st) || st || kvd_write_crc(c, &a.handle, 0, (const uint8_t *)page, sizeof page, 0, &crc)
        || kvd_seal(c, &(KvdSealItem){.handle = a.handle, .len = sizeof page, .checksum = crc, .has_checksum = true}, 1, &sum, &st)
        || st || kvd_publish(c, &a.handle, 1)) return fprintf(stderr, "%s\n", kvd_last_error_message()), 1;
    printf("published block at page %u, crc %08x\n", a.handle.slot, crc);
    return kvd_close(c);
}
