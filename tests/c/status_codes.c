/* Every status code a caller can provoke against one daemon (started by tests/ffi_c.rs with
 * --verify-supplied-checksums and at most 3 sessions per process). UNAVAILABLE and
 * DISCONNECTED need the daemon to drain or die: drills.c. UNSUPPORTED comes from the
 * kvd_cuda_* calls of a libkvd without CUDA: cuda.c. DEADLINE has no path through the local
 * protocol, and INTERNAL is a libkvd bug. */
#include <time.h>

#include "check.h"

#define LEN 8192

static uint8_t buf[LEN];

static void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

static KvdAllocation alloc_one(KvdClient *c, KvdKey k) {
    KvdAllocation a;
    int32_t st = -1;
    OK(kvd_alloc(c, &k, 1, NULL, 0, &a, &st));
    EXPECT(st, KVD_OK);
    return a;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    KvdClient *c = connect_or_die(argv[1], "c-status", 30000);
    KvdNamespaceDescriptor d = test_layout();
    KvdNamespaceId ns;
    OK(kvd_register_namespace(c, &d, &ns));
    fill(buf, LEN, 3);
    int32_t st;
    uint32_t sum;
    KvdErrorInfo info;

    /* STALE_GENERATION: a handle whose block generation is not the page's. */
    KvdAllocation a = alloc_one(c, test_key(ns, 10, 0));
    KvdSealItem s;
    memset(&s, 0, sizeof s);
    s.handle = a.handle;
    s.handle.generation += 1000;
    s.len = 1;
    OK(kvd_seal(c, &s, 1, &sum, &st));
    EXPECT(st, KVD_ERR_STALE_GENERATION);

    /* ILLEGAL_TRANSITION: publishing a block that is still WRITING. */
    EXPECT(kvd_publish(c, &a.handle, 1), KVD_ERR_ILLEGAL_TRANSITION);
    OK(kvd_abort(c, &a.handle, 1, &st));

    /* NO_SPACE: a reservation larger than the pool (with its numbers in the info). */
    uint64_t r;
    EXPECT(kvd_reserve(c, (uint64_t)1 << 40, &r), KVD_ERR_NO_SPACE);
    OK(kvd_last_error_info(&info));
    TRUE(info.status == KVD_ERR_NO_SPACE && info.retryable && info.requested_bytes == (uint64_t)1 << 40);

    /* OVERLOADED: a fourth session from this process (the daemon allows three). */
    KvdClient *c2 = connect_or_die(argv[1], "c-status-2", 30000);
    KvdClient *c3 = connect_or_die(argv[1], "c-status-3", 30000);
    KvdClientOptions o;
    OK(kvd_options_init(&o, KVD_ABI_VERSION));
    KvdClient *c4 = NULL;
    EXPECT(kvd_connect(argv[1], &o, &c4), KVD_ERR_OVERLOADED);
    TRUE(c4 == NULL);
    OK(kvd_last_error_info(&info));
    TRUE(info.retryable && info.retry_after_ms > 0);
    OK(kvd_close(c3));

    /* NOT_FOUND: an unknown manifest, an unknown key. */
    KvdManifestInfo m;
    EXPECT(kvd_manifest_get(c, 555, &m, NULL, 0), KVD_ERR_NOT_FOUND);
    KvdKey missing = test_key(ns, 11, 0);
    KvdBlockInfo b;
    OK(kvd_acquire(c, &missing, 1, 0, &b, &st));
    EXPECT(st, KVD_ERR_NOT_FOUND);

    /* ALREADY_EXISTS: allocating a published key, and one another session is writing (busy). */
    KvdKey k = test_key(ns, 12, 0);
    put_block(c, k, buf, LEN);
    KvdAllocation dup;
    OK(kvd_alloc(c, &k, 1, NULL, 0, &dup, &st));
    EXPECT(st, KVD_ERR_ALREADY_EXISTS);
    KvdKey busy = test_key(ns, 12, 1);
    KvdAllocation mine = alloc_one(c, busy);
    OK(kvd_alloc(c2, &busy, 1, NULL, 0, &dup, &st));
    EXPECT(st, KVD_ERR_ALREADY_EXISTS);
    OK(kvd_abort(c, &mine.handle, 1, &st));

    /* CORRUPT at seal: a supplied checksum that does not match the bytes (the daemon verifies). */
    a = alloc_one(c, test_key(ns, 13, 0));
    OK(kvd_write_crc(c, &a.handle, 0, buf, LEN, 0, &sum));
    s.handle = a.handle;
    s.len = LEN;
    s.checksum = sum ^ 1;
    s.has_checksum = true;
    OK(kvd_seal(c, &s, 1, &sum, &st));
    EXPECT(st, KVD_ERR_CORRUPT);
    OK(kvd_abort(c, &a.handle, 1, &st));

    /* CORRUPT on read: bytes changed under a sealed block (through the shared mapping, as a
     * stray write would); the daemon's copy fails too, so it quarantines the block. */
    KvdKey ck = test_key(ns, 14, 0);
    put_block(c, ck, buf, LEN);
    OK(kvd_acquire(c, &ck, 1, 0, &b, &st));
    EXPECT(st, KVD_OK);
    KvdPoolInfo p;
    OK(kvd_pool_info(c, &p));
    p.base[b.offset + 10] ^= 0xff;
    uint64_t n;
    uint8_t back[LEN];
    EXPECT(kvd_read_verified(c, &b.handle, back, sizeof back, &n), KVD_ERR_CORRUPT);
    OK(kvd_last_error_info(&info));
    TRUE(info.corruption == KVD_CORRUPTION_QUARANTINED && info.expected_checksum == b.checksum);
    TRUE(info.found_checksum != info.expected_checksum);
    uint8_t bit = 0xff;
    OK(kvd_exists(c, &ck, 1, &bit, 1));
    TRUE(bit == 0); /* quarantined: a miss */
    OK(kvd_release(c, &b.handle, 1, &st));

    /* INVALID_ARGUMENT: reading a block this session does not pin. */
    EXPECT(kvd_read(c, &b.handle, 0, back, 10), KVD_ERR_INVALID_ARGUMENT);

    /* STALE_EPOCH: extending a manifest with an older epoch. */
    OK(kvd_manifest_begin(c, 77, 2, &ns, 0, 60000, &m));
    EXPECT(kvd_manifest_extend(c, 77, 1, NULL, 0, 0, &m), KVD_ERR_STALE_EPOCH);
    OK(kvd_manifest_end(c, 77, 2));

    /* STALE_GENERATION through a view: taken while pinned, checked after the page moved on. */
    KvdKey vk = test_key(ns, 15, 0);
    KvdAllocation va = put_block(c, vk, buf, LEN);
    OK(kvd_acquire(c, &vk, 1, 0, &b, &st));
    KvdView v;
    OK(kvd_view_acquire(c, &b.handle, &v));
    OK(kvd_view_still_valid(c, &v));
    OK(kvd_release(c, &b.handle, 1, &st));
    KvdRemoveItem rm;
    rm.key = vk;
    OK(kvd_handle_version(&va.handle, &rm.version));
    OK(kvd_remove_if(c, &rm, 1, &st));
    EXPECT(st, KVD_OK);
    EXPECT(kvd_view_still_valid(c, &v), KVD_ERR_STALE_GENERATION);

    /* LEASE_EXPIRED: a read of a pinned block after its pin's TTL. */
    OK(kvd_acquire(c, &k, 1, 100, &b, &st));
    EXPECT(st, KVD_OK);
    TRUE(b.pin_ttl_ms == 100);
    sleep_ms(300);
    EXPECT(kvd_read(c, &b.handle, 0, back, 10), KVD_ERR_LEASE_EXPIRED);
    EXPECT(kvd_view_acquire(c, &b.handle, &v), KVD_ERR_LEASE_EXPIRED);

    /* PROTOCOL: a caller built against another ABI version. */
    EXPECT(kvd_options_init(&o, KVD_ABI_VERSION + 1), KVD_ERR_PROTOCOL);
    o.abi_version = KVD_ABI_VERSION + 1;
    EXPECT(kvd_connect(argv[1], &o, &c4), KVD_ERR_PROTOCOL);

    /* IO: no daemon at that path. */
    OK(kvd_options_init(&o, KVD_ABI_VERSION));
    EXPECT(kvd_connect("/nonexistent/kvd.sock", &o, &c4), KVD_ERR_IO);

    OK(kvd_close(c2));
    OK(kvd_close(c));
    done("status_codes");
    return 0;
}
