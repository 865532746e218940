/* Block events through libkvd, as a KV-aware router drains them: stored and removed, in
 * order, in batches of the caller's array, and `lost` once the daemon's small ring (the test
 * daemon runs with --event-log-capacity 4) dropped events the router had not read. */
#include "check.h"

#define LEN 4096

static uint8_t data[LEN];

static int same_key(KvdKey a, KvdKey b) { return memcmp(&a, &b, sizeof a) == 0; }

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    KvdClient *w = connect_or_die(argv[1], "c-writer", 10000);
    KvdClient *router = connect_or_die(argv[1], "c-router", 10000);
    KvdNamespaceDescriptor d = test_layout();
    KvdNamespaceId ns;
    OK(kvd_register_namespace(w, &d, &ns));
    fill(data, LEN, 7);
    KvdKey k[7];
    for (uint32_t i = 0; i < 7; i++) k[i] = test_key(ns, 12, i);

    /* Nothing yet: the log stands at 1. */
    KvdBlockEvent ev[4];
    KvdEventBatch b;
    memset(&b, 0xff, sizeof b);
    OK(kvd_events(router, 0, ev, 4, &b));
    TRUE(b.count == 0 && b.next_seq == 1 && b.lost == 0);

    /* Two stored, one removed by compare-and-delete. */
    KvdAllocation a0 = put_block(w, k[0], data, LEN);
    put_block(w, k[1], data, LEN);
    KvdRemoveItem rm;
    rm.key = k[0];
    OK(kvd_handle_version(&a0.handle, &rm.version));
    int32_t st = -1;
    OK(kvd_remove_if(w, &rm, 1, &st));
    EXPECT(st, KVD_OK);

    /* Drained two at a time: 1, 2 then 3, then nothing. */
    OK(kvd_events(router, 0, ev, 2, &b));
    TRUE(b.count == 2 && b.next_seq == 3 && b.lost == 0);
    TRUE(ev[0].seq == 1 && ev[0].kind == KVD_EVENT_STORED && same_key(ev[0].key, k[0]));
    TRUE(ev[1].seq == 2 && ev[1].kind == KVD_EVENT_STORED && same_key(ev[1].key, k[1]));
    OK(kvd_events(router, b.next_seq, ev, 2, &b));
    TRUE(b.count == 1 && b.next_seq == 4 && b.lost == 0);
    TRUE(ev[0].seq == 3 && ev[0].kind == KVD_EVENT_REMOVED && same_key(ev[0].key, k[0]));
    TRUE(ev[0].reserved == 0);
    uint64_t since = b.next_seq;
    OK(kvd_events(router, since, ev, 2, &b));
    TRUE(b.count == 0 && b.next_seq == since && b.lost == 0);

    /* Five more stored (4..8) into a ring of four: a router at 4 lost one. */
    for (uint32_t i = 2; i < 7; i++) put_block(w, k[i], data, LEN);
    OK(kvd_events(router, since, ev, 4, &b));
    TRUE(b.lost == 1 && b.count == 4 && b.next_seq == 9);
    for (uint32_t i = 0; i < 4; i++) {
        TRUE(ev[i].seq == 5 + i && ev[i].kind == KVD_EVENT_STORED);
        TRUE(same_key(ev[i].key, k[3 + i]));
    }
    /* Zero capacity asks only where the log stands. */
    OK(kvd_events(router, 0, NULL, 0, &b));
    TRUE(b.count == 0 && b.next_seq == 5 && b.lost == 4);

    /* Misuse is an error, not a crash. */
    EXPECT(kvd_events(router, 0, ev, 4, NULL), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_events(router, 0, NULL, 4, &b), KVD_ERR_INVALID_ARGUMENT);
    KvdPoolInfo p;
    OK(kvd_pool_info(router, &p));
    EXPECT(kvd_events(router, 0, ev, (size_t)p.max_batch + 1, &b), KVD_ERR_INVALID_ARGUMENT);
    /* A sequence number past the end comes from another incarnation. */
    EXPECT(kvd_events(router, 1000, ev, 4, &b), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_events(NULL, 0, ev, 4, &b), KVD_ERR_INVALID_ARGUMENT);

    OK(kvd_close(router));
    EXPECT(kvd_events(router, 0, ev, 4, &b), KVD_ERR_INVALID_ARGUMENT);
    OK(kvd_close(w));
    done("events");
    return 0;
}
