/* The whole lifecycle through libkvd against a real daemon: connect, namespaces and tags,
 * alloc/write/seal/publish, exists, lookup with pins, zero-copy views, verified copies,
 * release, touch, remove_if, in-place writes, abort, reservations, a checkpoint manifest and
 * its restore, stats, the health canary, reconnect and close. */
#include "check.h"

#define N 4
#define LEN (64 * 1024)

static uint8_t data[N][LEN];
static uint8_t back[256 * 1024];

static void versions(void) {
    TRUE(strlen(kvd_version()) > 0);
    TRUE(kvd_abi_version() == KVD_ABI_VERSION);
    TRUE(strcmp(kvd_status_str(KVD_OK), "ok") == 0);
}

static void cache_blocks(KvdClient *c, KvdNamespaceId ns) {
    /* Tags chained from a token history of 4 blocks + 3 tokens (no tag for the partial one). */
    uint32_t tokens[N * 16 + 3];
    for (size_t i = 0; i < sizeof tokens / sizeof tokens[0]; i++) tokens[i] = (uint32_t)(i * 7 + 1);
    KvdTag tags[N + 1];
    size_t ntags = 0;
    OK(kvd_block_tags(&ns, 16, tokens, sizeof tokens / sizeof tokens[0], tags, N + 1, &ntags));
    TRUE(ntags == N);
    KvdKey keys[N + 1];
    for (size_t i = 0; i < N; i++) {
        keys[i].namespace_id = ns;
        keys[i].tag = tags[i];
    }
    keys[N] = test_key(ns, 99, 99); /* never written */
    tags[N] = keys[N].tag;

    /* Write the chain as one batch: alloc, copy with CRC, seal, publish the group. */
    KvdAllocation a[N];
    int32_t st[N + 1];
    uint32_t sums[N];
    OK(kvd_alloc(c, keys, N, NULL, 0, a, st));
    KvdSealItem seal[N];
    memset(seal, 0, sizeof seal);
    for (size_t i = 0; i < N; i++) {
        EXPECT(st[i], KVD_OK);
        TRUE(a[i].capacity >= LEN);
        fill(data[i], LEN, (uint8_t)i);
        uint32_t crc = 0;
        /* In two pieces, the CRC continued across them. */
        OK(kvd_write_crc(c, &a[i].handle, 0, data[i], LEN / 2, 0, &crc));
        OK(kvd_write_crc(c, &a[i].handle, LEN / 2, data[i] + LEN / 2, LEN / 2, crc, &crc));
        seal[i].handle = a[i].handle;
        seal[i].len = LEN;
        seal[i].checksum = crc;
        seal[i].has_checksum = true;
    }
    OK(kvd_seal(c, seal, N, sums, st));
    for (size_t i = 0; i < N; i++) {
        EXPECT(st[i], KVD_OK);
        TRUE(sums[i] == seal[i].checksum);
    }
    OK(kvd_publish(c, (const KvdHandle[]){a[0].handle, a[1].handle, a[2].handle, a[3].handle}, N));

    /* exists: the four, not the fifth. */
    uint8_t bits[1] = {0xff};
    OK(kvd_exists(c, keys, N + 1, bits, sizeof bits));
    TRUE(bits[0] == 0x0f);

    /* soft pins: the four (a shared prefix) until a deadline, not the missing fifth; ended. */
    uint8_t soft[1] = {0xff};
    OK(kvd_soft_pin(c, keys, N + 1, 60000, soft, sizeof soft));
    TRUE(soft[0] == 0x0f);
    OK(kvd_soft_pin(c, keys, N, 0, soft, sizeof soft));
    TRUE(soft[0] == 0x0f);
    EXPECT(kvd_soft_pin(c, keys, N + 1, 1, soft, 0), KVD_ERR_INVALID_ARGUMENT);

    /* The longest prefix, pinned. */
    KvdBlockInfo hit[N + 1];
    size_t nhit = 0;
    bool pinned = false;
    OK(kvd_lookup_prefix(c, &ns, tags, N + 1, true, 5000, hit, N + 1, &nhit, &pinned));
    TRUE(nhit == N && pinned);
    for (size_t i = 0; i < N; i++) {
        TRUE(hit[i].len == LEN && hit[i].checksum == sums[i] && hit[i].pin_ttl_ms == 5000);
        TRUE(memcmp(&hit[i].handle, &a[i].handle, sizeof(KvdHandle)) == 0);
        /* A zero-copy view: use the bytes, then ask. */
        KvdView v;
        OK(kvd_view_acquire(c, &hit[i].handle, &v));
        TRUE(v.len == LEN && memcmp(v.data, data[i], LEN) == 0);
        OK(kvd_view_still_valid(c, &v));
        /* The same bytes through the pool's address. */
        KvdPoolInfo p;
        OK(kvd_pool_info(c, &p));
        TRUE(memcmp(p.base + hit[i].offset, data[i], LEN) == 0);
        /* Copies: whole and verified, and a piece. */
        uint64_t n = 0;
        OK(kvd_read_verified(c, &hit[i].handle, back, sizeof back, &n));
        TRUE(n == LEN && memcmp(back, data[i], LEN) == 0);
        OK(kvd_read(c, &hit[i].handle, 100, back, 1000));
        TRUE(memcmp(back, data[i] + 100, 1000) == 0);
    }
    KvdHandle hs[N];
    for (size_t i = 0; i < N; i++) hs[i] = hit[i].handle;
    OK(kvd_release(c, hs, N, st));
    for (size_t i = 0; i < N; i++) EXPECT(st[i], KVD_OK);

    /* acquire: per key, a missing key is NOT_FOUND in its place. */
    KvdBlockInfo got[2];
    KvdKey two[2] = {keys[0], keys[N]};
    OK(kvd_acquire(c, two, 2, 0, got, st));
    EXPECT(st[0], KVD_OK);
    EXPECT(st[1], KVD_ERR_NOT_FOUND);
    OK(kvd_release(c, &got[0].handle, 1, st));
    OK(kvd_touch(c, keys, N));

    /* Compare-and-delete exactly that version; a second time finds nothing. */
    KvdRemoveItem rm;
    rm.key = keys[3];
    OK(kvd_handle_version(&a[3].handle, &rm.version));
    OK(kvd_remove_if(c, &rm, 1, st));
    EXPECT(st[0], KVD_OK);
    OK(kvd_remove_if(c, &rm, 1, st));
    TRUE(st[0] != KVD_OK);
    OK(kvd_exists(c, keys, N, bits, sizeof bits));
    TRUE(bits[0] == 0x07);
}

static void in_place_and_abort(KvdClient *c, KvdNamespaceId ns) {
    KvdKey k = test_key(ns, 2, 0);
    KvdAllocation a;
    int32_t st;
    OK(kvd_alloc(c, &k, 1, NULL, 0, &a, &st));
    EXPECT(st, KVD_OK);
    uint8_t *page = NULL;
    uint64_t cap = 0;
    OK(kvd_block_mut(c, &a.handle, &page, &cap));
    TRUE(page != NULL && cap == a.capacity);
    memset(page, 0xab, 4096);
    KvdSealItem s;
    memset(&s, 0, sizeof s);
    s.handle = a.handle;
    s.len = 4096; /* no checksum: the daemon computes it */
    uint32_t sum = 0;
    OK(kvd_seal(c, &s, 1, &sum, &st));
    EXPECT(st, KVD_OK);
    OK(kvd_publish(c, &a.handle, 1));
    KvdBlockInfo b;
    OK(kvd_acquire(c, &k, 1, 0, &b, &st));
    EXPECT(st, KVD_OK);
    uint64_t n = 0;
    OK(kvd_read_verified(c, &b.handle, back, sizeof back, &n));
    TRUE(n == 4096 && back[0] == 0xab && back[4095] == 0xab && b.checksum == sum);
    OK(kvd_release(c, &b.handle, 1, &st));

    /* An aborted block leaves nothing. */
    KvdKey k2 = test_key(ns, 2, 1);
    OK(kvd_alloc(c, &k2, 1, NULL, 0, &a, &st));
    OK(kvd_abort(c, &a.handle, 1, &st));
    EXPECT(st, KVD_OK);
    uint8_t bit = 0xff;
    OK(kvd_exists(c, &k2, 1, &bit, 1));
    TRUE(bit == 0);
}

static void checkpoint(KvdClient *c, KvdNamespaceId ns) {
    uint64_t r = 0;
    OK(kvd_reserve(c, 512 * 1024, &r));
    TRUE(r != 0);
    OK(kvd_release_reservation(c, r));

    const uint64_t req = 42, epoch = 1;
    KvdManifestInfo m;
    OK(kvd_manifest_begin(c, req, epoch, &ns, 1024 * 1024, 60000, &m));
    TRUE(m.request == req && m.epoch == epoch && m.tag_count == 0 && m.reservation != 0);
    uint32_t tokens[32];
    for (int i = 0; i < 32; i++) tokens[i] = (uint32_t)(1000 + i);
    KvdTag tags[2];
    size_t ntags = 0;
    OK(kvd_block_tags(&ns, 16, tokens, 32, tags, 2, &ntags));
    KvdKey keys[2] = {{ns, tags[0]}, {ns, tags[1]}};
    KvdBlockClass cls;
    memset(&cls, 0, sizeof cls);
    cls.kind = KVD_CLASS_CHECKPOINT;
    cls.request = req;
    cls.epoch = epoch;
    KvdAllocation a[2];
    int32_t st[2];
    OK(kvd_alloc(c, keys, 2, &cls, m.reservation, a, st));
    KvdSealItem s[2];
    memset(s, 0, sizeof s);
    for (int i = 0; i < 2; i++) {
        EXPECT(st[i], KVD_OK);
        fill(data[i], LEN, (uint8_t)(50 + i));
        OK(kvd_write_crc(c, &a[i].handle, 0, data[i], LEN, 0, &s[i].checksum));
        s[i].handle = a[i].handle;
        s[i].len = LEN;
        s[i].has_checksum = true;
    }
    uint32_t sums[2];
    OK(kvd_seal(c, s, 2, sums, st));
    KvdHandle hs[2] = {a[0].handle, a[1].handle};
    OK(kvd_manifest_extend(c, req, epoch, hs, 2, 32, &m));
    TRUE(m.tag_count == 2 && m.committed_tokens == 32);
    KvdTag back_tags[2];
    OK(kvd_manifest_get(c, req, &m, back_tags, 2));
    TRUE(memcmp(back_tags, tags, sizeof tags) == 0);
    uint64_t left = 0;
    OK(kvd_manifest_renew(c, req, epoch, 30000, &left));
    TRUE(left > 0 && left <= 30000);

    KvdRestoreInfo ri;
    KvdBlockInfo blocks[2];
    OK(kvd_restore_prefix(c, req, tokens, 32, &ri, blocks, 2));
    TRUE(ri.block_count == 2 && ri.tokens == 32 && ri.committed_tokens == 32 && ri.epoch == epoch);
    TRUE(blocks[1].checksum == sums[1]);
    OK(kvd_manifest_end(c, req, epoch));
    EXPECT(kvd_manifest_get(c, req, &m, NULL, 0), KVD_ERR_NOT_FOUND);
}

static void session(KvdClient *c) {
    uint64_t ms = 0;
    bool broken = true;
    OK(kvd_heartbeat(c, &ms));
    TRUE(ms > 0);
    OK(kvd_lease_left(c, &ms, &broken));
    TRUE(ms > 0 && !broken);
    OK(kvd_set_request(c, 7));
    OK(kvd_set_request(c, 0));
    KvdStats s;
    OK(kvd_stats(c, &s));
    TRUE(s.pages_total > 0 && s.sessions >= 1 && s.blocks_published >= N);
    TRUE(s.pages_free + s.pages_allocated + s.pages_writing + s.pages_sealed + s.pages_published +
             s.pages_retired + s.pages_quarantined == s.pages_total);
    KvdHealthReport h;
    OK(kvd_health_check(c, &h));
    TRUE(h.bytes == 4096 && h.elapsed_us > 0);

    KvdPoolInfo before, after;
    OK(kvd_pool_info(c, &before));
    TRUE(before.fd >= 0 && before.size_bytes == before.page_size_bytes * before.page_count);
    OK(kvd_reconnect(c));
    OK(kvd_pool_info(c, &after));
    TRUE(after.session != before.session && after.node_generation == before.node_generation);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s SOCKET\n", argv[0]);
        return 2;
    }
    versions();
    KvdClient *c = connect_or_die(argv[1], "c-lifecycle", 30000);
    KvdNamespaceDescriptor d = test_layout();
    KvdNamespaceId ns, local;
    OK(kvd_register_namespace(c, &d, &ns));
    OK(kvd_namespace_id(&d, &local));
    TRUE(memcmp(&ns, &local, sizeof ns) == 0);
    cache_blocks(c, ns);
    in_place_and_abort(c, ns);
    checkpoint(c, ns);
    session(c);
    OK(kvd_close(c));
    done("lifecycle");
    return 0;
}
