/* Shared helpers of the C tests of libkvd: checks that name the failing line, a test layout,
 * deterministic keys and bytes. Each program takes the daemon's socket path as argv[1] and
 * exits 0 only when every check passed. */
#ifndef KVD_TEST_CHECK_H
#define KVD_TEST_CHECK_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvd.h"

static int checks;

/* Fail the program unless `expr` returns `want`, printing both statuses and the last error. */
#define EXPECT(expr, want)                                                                     \
    do {                                                                                       \
        int32_t got_ = (expr);                                                                 \
        checks++;                                                                              \
        if (got_ != (want)) {                                                                  \
            fprintf(stderr, "%s:%d: %s returned %d (%s), expected %d (%s); last error: %s\n",  \
                    __FILE__, __LINE__, #expr, got_, kvd_status_str(got_), (want),             \
                    kvd_status_str(want), kvd_last_error_message());                           \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

#define OK(expr) EXPECT(expr, KVD_OK)

/* Fail the program unless `cond` holds. */
#define TRUE(cond)                                                                             \
    do {                                                                                       \
        checks++;                                                                              \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);                \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

static inline void done(const char *program) {
    printf("%s: %d checks passed\n", program, checks);
}

/* The tests' layout: 64 KiB blocks of 16 tokens (the test daemon's pages are 256 KiB). */
static inline KvdNamespaceDescriptor test_layout(void) {
    KvdNamespaceDescriptor d;
    memset(&d, 0, sizeof d);
    d.model_name = "test/c-tiny";
    d.model_revision = "r1";
    d.tokenizer = "tok-1";
    d.adapter = "";
    d.cache_salt = "";
    d.rope = "theta=1e6";
    d.dtype = KVD_DTYPE_BF16;
    d.num_layers = 2;
    d.num_kv_heads = 2;
    d.head_dim = 64;
    d.tokens_per_block = 16;
    d.tp_rank = 0;
    d.tp_size = 1;
    d.pp_rank = 0;
    d.pp_size = 1;
    d.bytes_per_block = 64 * 1024;
    return d;
}

/* Key i of a family `seed` in namespace `ns`. */
static inline KvdKey test_key(KvdNamespaceId ns, uint32_t seed, uint32_t i) {
    KvdKey k;
    memset(&k, 0, sizeof k);
    k.namespace_id = ns;
    memcpy(k.tag.bytes, &seed, sizeof seed);
    memcpy(k.tag.bytes + 4, &i, sizeof i);
    k.tag.bytes[31] = 0x5a;
    return k;
}

static inline void fill(uint8_t *buf, size_t len, uint8_t seed) {
    for (size_t i = 0; i < len; i++) buf[i] = (uint8_t)(i * 151u + seed) ^ (uint8_t)(i >> 9);
}

static inline KvdClient *connect_or_die(const char *socket, const char *name, uint64_t lease_ms) {
    KvdClientOptions o;
    OK(kvd_options_init(&o, KVD_ABI_VERSION));
    o.name = name;
    o.lease_ttl_ms = lease_ms;
    o.populate = false;
    KvdClient *c = NULL;
    OK(kvd_connect(socket, &o, &c));
    TRUE(c != NULL);
    return c;
}

/* Allocate, write (CRC in the copy), seal and publish one cache block of `len` bytes. */
static inline KvdAllocation put_block(KvdClient *c, KvdKey key, const uint8_t *data, size_t len) {
    KvdAllocation a;
    int32_t st = -1;
    OK(kvd_alloc(c, &key, 1, NULL, 0, &a, &st));
    EXPECT(st, KVD_OK);
    uint32_t crc = 0, recorded = 0;
    OK(kvd_write_crc(c, &a.handle, 0, data, len, 0, &crc));
    KvdSealItem s;
    memset(&s, 0, sizeof s);
    s.handle = a.handle;
    s.len = len;
    s.checksum = crc;
    s.has_checksum = true;
    OK(kvd_seal(c, &s, 1, &recorded, &st));
    EXPECT(st, KVD_OK);
    TRUE(recorded == crc);
    OK(kvd_publish(c, &a.handle, 1));
    return a;
}

#endif
