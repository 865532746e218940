/* Misuse answered with errors, never a crash: NULL and garbage clients, NULL and misaligned
 * pointers, too-short outputs, out-of-range lengths, oversized batches, stale handles, double
 * release and abort, use after close and double close. */
#include "check.h"

#define LEN 4096

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    KvdClient *c = connect_or_die(argv[1], "c-misuse", 30000);
    KvdNamespaceDescriptor d = test_layout();
    KvdNamespaceId ns;
    OK(kvd_register_namespace(c, &d, &ns));
    uint8_t buf[LEN];
    fill(buf, LEN, 9);
    int32_t st[4];
    uint64_t ms;

    /* Clients that are not clients. */
    EXPECT(kvd_heartbeat(NULL, &ms), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_heartbeat((KvdClient *)(uintptr_t)0x1234, &ms), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_heartbeat((KvdClient *)(uintptr_t)0xffffffffffffffa5ull, &ms), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_close(NULL), KVD_ERR_INVALID_ARGUMENT);
    TRUE(strlen(kvd_last_error_message()) > 0);
    KvdErrorInfo info;
    OK(kvd_last_error_info(&info));
    TRUE(info.status == KVD_ERR_INVALID_ARGUMENT && !info.retryable);
    EXPECT(kvd_last_error_info(NULL), KVD_ERR_INVALID_ARGUMENT);

    /* NULL where something is required. */
    KvdClientOptions o;
    EXPECT(kvd_options_init(NULL, KVD_ABI_VERSION), KVD_ERR_INVALID_ARGUMENT);
    OK(kvd_options_init(&o, KVD_ABI_VERSION));
    KvdClient *none = NULL;
    EXPECT(kvd_connect(NULL, &o, &none), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_connect(argv[1], NULL, &none), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_connect(argv[1], &o, NULL), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_register_namespace(c, NULL, &ns), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_register_namespace(c, &d, NULL), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_exists(c, NULL, 1, (uint8_t[1]){0}, 1), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_alloc(c, NULL, 1, NULL, 0, NULL, st), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_pool_info(c, NULL), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_stats(c, NULL), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_counters(c, NULL, kvd_counter_count()), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_read(c, NULL, 0, buf, 1), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_view_acquire(c, NULL, NULL), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_view_still_valid(c, NULL), KVD_ERR_INVALID_ARGUMENT);

    /* Bad descriptors. */
    KvdNamespaceDescriptor bad = d;
    bad.dtype = 99;
    EXPECT(kvd_register_namespace(c, &bad, &ns), KVD_ERR_INVALID_ARGUMENT);
    bad = d;
    bad.tp_rank = 1; /* with tp_size 1 */
    EXPECT(kvd_namespace_id(&bad, &ns), KVD_ERR_INVALID_ARGUMENT);
    bad = d;
    bad.model_name = NULL; /* reads as "", which is refused */
    EXPECT(kvd_register_namespace(c, &bad, &ns), KVD_ERR_INVALID_ARGUMENT);
    OK(kvd_register_namespace(c, &d, &ns));

    /* Misaligned pointers. */
    KvdKey k = test_key(ns, 1, 0);
    KvdAllocation a = put_block(c, k, buf, LEN);
    _Alignas(8) unsigned char raw[sizeof(KvdHandle) + 8];
    memcpy(raw + 1, &a.handle, sizeof a.handle);
    EXPECT(kvd_release(c, (const KvdHandle *)(const void *)(raw + 1), 1, st), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_heartbeat(c, (uint64_t *)(void *)(raw + 1)), KVD_ERR_INVALID_ARGUMENT);

    /* Too-short outputs. */
    KvdKey many[9];
    for (uint32_t i = 0; i < 9; i++) many[i] = test_key(ns, 1, i);
    uint8_t bits[1];
    EXPECT(kvd_exists(c, many, 9, bits, 1), KVD_ERR_INVALID_ARGUMENT); /* 9 keys need 2 bytes */
    KvdBlockInfo hit[2];
    size_t nhit;
    EXPECT(kvd_lookup_prefix(c, &ns, &k.tag, 1, false, 0, hit, 0, &nhit, NULL), KVD_ERR_INVALID_ARGUMENT);
    uint32_t tokens[48] = {0};
    KvdTag tags[2];
    size_t ntags;
    EXPECT(kvd_block_tags(&ns, 16, tokens, 48, tags, 2, &ntags), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_block_tags(&ns, 0, tokens, 48, tags, 2, &ntags), KVD_ERR_INVALID_ARGUMENT);
    KvdBlockInfo b;
    OK(kvd_acquire(c, &k, 1, 0, &b, st));
    EXPECT(st[0], KVD_OK);
    uint64_t n;
    uint8_t small[16];
    EXPECT(kvd_read_verified(c, &b.handle, small, sizeof small, &n), KVD_ERR_INVALID_ARGUMENT);
    /* Out of the block's range. */
    EXPECT(kvd_read(c, &b.handle, LEN - 1, small, 2), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_read(c, &b.handle, UINT64_MAX, small, 2), KVD_ERR_INVALID_ARGUMENT);

    /* Double release: the second is answered in place, the pin is gone either way. */
    OK(kvd_release(c, &b.handle, 1, st));
    EXPECT(st[0], KVD_OK);
    OK(kvd_release(c, &b.handle, 1, st));
    TRUE(st[0] != KVD_OK);
    /* A released block is no longer readable or viewable here. */
    KvdView v;
    EXPECT(kvd_read(c, &b.handle, 0, small, 1), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_view_acquire(c, &b.handle, &v), KVD_ERR_INVALID_ARGUMENT);

    /* Writes: outside the page, to a sealed block, double abort. */
    KvdKey wk = test_key(ns, 2, 0);
    KvdAllocation w;
    OK(kvd_alloc(c, &wk, 1, NULL, 0, &w, st));
    EXPECT(kvd_write(c, &w.handle, w.capacity, buf, 1), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_write(c, &w.handle, 0, NULL, 1), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_write(c, &a.handle, 0, buf, 1), KVD_ERR_INVALID_ARGUMENT); /* sealed */
    uint8_t *page;
    uint64_t cap;
    EXPECT(kvd_block_mut(c, &a.handle, &page, &cap), KVD_ERR_INVALID_ARGUMENT);
    OK(kvd_abort(c, &w.handle, 1, st));
    EXPECT(st[0], KVD_OK);
    OK(kvd_abort(c, &w.handle, 1, st));
    TRUE(st[0] != KVD_OK);
    KvdBlockClass cls;
    memset(&cls, 0, sizeof cls);
    cls.kind = 7;
    EXPECT(kvd_alloc(c, &wk, 1, &cls, 0, &w, st), KVD_ERR_INVALID_ARGUMENT);

    /* A batch over the daemon's bound is refused before it is sent. */
    KvdPoolInfo p;
    OK(kvd_pool_info(c, &p));
    size_t big = (size_t)p.max_batch + 1;
    KvdKey *bigkeys = calloc(big, sizeof(KvdKey));
    uint8_t *bigbits = calloc((big + 7) / 8, 1);
    TRUE(bigkeys && bigbits);
    EXPECT(kvd_exists(c, bigkeys, big, bigbits, (big + 7) / 8), KVD_ERR_INVALID_ARGUMENT);
    free(bigkeys);
    free(bigbits);

    /* Status text for a code libkvd never returns. */
    TRUE(strcmp(kvd_status_str(12345), "unknown status") == 0);

    /* Use after close, and a double close. */
    OK(kvd_close(c));
    EXPECT(kvd_heartbeat(c, &ms), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_exists(c, &k, 1, bits, 1), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_close(c), KVD_ERR_INVALID_ARGUMENT);
    /* A new client does not answer to the old handle, even in the same slot. */
    KvdClient *c2 = connect_or_die(argv[1], "c-misuse-2", 30000);
    TRUE(c2 != c);
    EXPECT(kvd_heartbeat(c, &ms), KVD_ERR_INVALID_ARGUMENT);
    OK(kvd_heartbeat(c2, &ms));
    OK(kvd_close(c2));
    done("misuse");
    return 0;
}
