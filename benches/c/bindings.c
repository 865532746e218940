/* libkvd's half (from C) of the bindings' overhead measurement: the same three measurements as
 * `kvd-bench bindings` (see benches/src/bindings.rs), through kvd.h. Run by
 * scripts/bench-bindings.sh. Usage: bindings SOCKET SEED ITERS LOOKUPS */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvd.h"

#define PAGE_BYTES (2560u * 1024u)
#define BATCH 64
#define LOOKUP_TAGS 128
#define WARMUP 3

static void die(const char *what, int32_t s) {
    fprintf(stderr, "%s: %s: %s\n", what, kvd_status_str(s), kvd_last_error_message());
    exit(1);
}
#define CHECK(expr)                                                                            \
    do {                                                                                       \
        int32_t s_ = (expr);                                                                   \
        if (s_ != KVD_OK) die(#expr, s_);                                                      \
    } while (0)

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void report(const char *what, double *us, int n, double bytes_per_iter) {
    double total = 0;
    for (int i = 0; i < n; i++) total += us[i];
    qsort(us, (size_t)n, sizeof us[0], cmp);
    double p50 = us[(int)((n - 1) * 0.50 + 0.5)], p99 = us[(int)((n - 1) * 0.99 + 0.5)];
    double gbps = bytes_per_iter > 0 ? bytes_per_iter * n / (total / 1e6) / 1e9 : 0;
    printf("BENCH c %s p50_us=%.1f p99_us=%.1f gbps=%.2f\n", what, p50, p99, gbps);
}

static KvdTag tag(uint8_t seed, uint32_t family, uint32_t i) {
    KvdTag t;
    memset(&t, 0, sizeof t);
    t.bytes[0] = seed;
    memcpy(t.bytes + 1, &family, 4);
    memcpy(t.bytes + 5, &i, 4);
    return t;
}

static void put_batch(KvdClient *c, const KvdKey *keys, int n, uint8_t *const *pages, size_t len) {
    static KvdAllocation a[LOOKUP_TAGS];
    static int32_t st[LOOKUP_TAGS];
    static KvdSealItem items[LOOKUP_TAGS];
    static KvdHandle hs[LOOKUP_TAGS];
    static uint32_t sums[LOOKUP_TAGS];
    CHECK(kvd_alloc(c, keys, (size_t)n, NULL, 0, a, st));
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (st[i] != KVD_OK) continue;
        uint32_t crc = 0;
        CHECK(kvd_write_crc(c, &a[i].handle, 0, pages[i], len, 0, &crc));
        memset(&items[m], 0, sizeof items[m]);
        items[m].handle = a[i].handle;
        items[m].len = len;
        items[m].checksum = crc;
        items[m].has_checksum = true;
        hs[m++] = a[i].handle;
    }
    if (m == 0) return;
    CHECK(kvd_seal(c, items, (size_t)m, sums, st));
    for (int i = 0; i < m; i++)
        if (st[i] != KVD_OK) die("seal item", st[i]);
    CHECK(kvd_publish(c, hs, (size_t)m));
}

int main(int argc, char **argv) {
    if (argc < 5) return 2;
    uint8_t seed = (uint8_t)atoi(argv[2]);
    int iters = atoi(argv[3]), lookups = atoi(argv[4]);
    KvdClientOptions o;
    CHECK(kvd_options_init(&o, KVD_ABI_VERSION));
    o.name = "bench-c";
    KvdClient *c;
    CHECK(kvd_connect(argv[1], &o, &c));
    KvdNamespaceDescriptor d = {.model_name = "bench/bindings", .model_revision = "1", .tokenizer = "",
                                .adapter = "", .cache_salt = "", .rope = "", .dtype = KVD_DTYPE_BF16,
                                .num_layers = 1, .num_kv_heads = 1, .head_dim = 64, .tokens_per_block = 16,
                                .tp_size = 1, .pp_size = 1, .bytes_per_block = PAGE_BYTES};
    KvdNamespaceId ns;
    CHECK(kvd_register_namespace(c, &d, &ns));
    double *us = calloc((size_t)(lookups > iters ? lookups : iters), sizeof(double));

    /* lookup */
    static KvdTag tags[LOOKUP_TAGS];
    static KvdKey keys[LOOKUP_TAGS];
    static uint8_t small[4096];
    static uint8_t *smalls[LOOKUP_TAGS];
    memset(small, 7, sizeof small);
    for (uint32_t i = 0; i < LOOKUP_TAGS; i++) {
        tags[i] = tag(seed, 0, i);
        keys[i].namespace_id = ns;
        keys[i].tag = tags[i];
        smalls[i] = small;
    }
    put_batch(c, keys, LOOKUP_TAGS, smalls, sizeof small);
    static KvdBlockInfo hit[LOOKUP_TAGS];
    for (int i = 0; i < WARMUP + lookups; i++) {
        size_t n = 0;
        double t = now_us();
        CHECK(kvd_lookup_prefix(c, &ns, tags, LOOKUP_TAGS, false, 0, hit, LOOKUP_TAGS, &n, NULL));
        if (i >= WARMUP) us[i - WARMUP] = now_us() - t;
        if (n != LOOKUP_TAGS) die("lookup: not every tag hit", 0);
    }
    report("lookup128", us, lookups, 0);

    /* put */
    uint8_t *srcs[BATCH], *dsts[BATCH];
    for (int b = 0; b < BATCH; b++) {
        srcs[b] = malloc(PAGE_BYTES);
        dsts[b] = calloc(1, PAGE_BYTES);
        for (size_t i = 0; i < PAGE_BYTES; i++) srcs[b][i] = (uint8_t)i ^ (uint8_t)b;
    }
    static KvdKey last[BATCH];
    for (int it = 0; it < WARMUP + iters; it++) {
        for (uint32_t i = 0; i < BATCH; i++) {
            last[i].namespace_id = ns;
            last[i].tag = tag(seed, 1 + (uint32_t)it, i);
        }
        double t = now_us();
        put_batch(c, last, BATCH, srcs, PAGE_BYTES);
        if (it >= WARMUP) us[it - WARMUP] = now_us() - t;
    }
    report("put64x2.5MiB", us, iters, (double)BATCH * PAGE_BYTES);

    /* get */
    static KvdBlockInfo got[BATCH];
    static int32_t st[BATCH];
    static KvdHandle hs[BATCH];
    for (int it = 0; it < WARMUP + iters; it++) {
        double t = now_us();
        CHECK(kvd_acquire(c, last, BATCH, 0, got, st));
        for (int i = 0; i < BATCH; i++) {
            if (st[i] != KVD_OK) die("acquire item", st[i]);
            uint64_t n;
            CHECK(kvd_read_verified(c, &got[i].handle, dsts[i], PAGE_BYTES, &n));
            hs[i] = got[i].handle;
        }
        CHECK(kvd_release(c, hs, BATCH, st));
        if (it >= WARMUP) us[it - WARMUP] = now_us() - t;
    }
    if (memcmp(dsts[3], srcs[3], PAGE_BYTES) != 0) die("get: the bytes differ", 0);
    report("get64x2.5MiB", us, iters, (double)BATCH * PAGE_BYTES);
    CHECK(kvd_close(c));
    return 0;
}
