/* Blocks between two daemons through libkvd: a push from node 1 to node 2 and a fetch back,
 * started without waiting and polled with kvd_transfers, byte-exact on arrival; and the
 * errors a caller can act on. argv[1]: node 1's socket (its peer table has node 2); argv[2]:
 * node 2's socket. */
#include <time.h>

#include "check.h"

#define LEN 65536
#define N 8

static uint8_t data[N][LEN];
static uint8_t got[LEN];

static void sleep_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&t, NULL);
}

/* Poll until the transfer ends (at most 30 s). */
static KvdTransferInfo wait_transfer(KvdClient *c, uint64_t id) {
    KvdTransferInfo t;
    memset(&t, 0, sizeof t);
    for (int i = 0; i < 3000; i++) {
        size_t found = 0;
        OK(kvd_transfers(c, &id, 1, &t, 1, &found));
        TRUE(found == 1 && t.id == id);
        if (t.state != KVD_TRANSFER_IN_FLIGHT) return t;
        sleep_ms(10);
    }
    TRUE(!"the transfer ended within 30 s");
    return t;
}

/* Every block of `k` is published behind `c`, with the bytes of `data[first..]`. */
static void all_there(KvdClient *c, const KvdKey *k, size_t n, size_t first) {
    KvdBlockInfo info[N];
    int32_t st[N];
    OK(kvd_acquire(c, k, n, 0, info, st));
    for (size_t i = 0; i < n; i++) {
        EXPECT(st[i], KVD_OK);
        uint64_t len = 0;
        OK(kvd_read_verified(c, &info[i].handle, got, LEN, &len));
        TRUE(len == LEN && memcmp(got, data[first + i], LEN) == 0);
    }
    KvdHandle h[N];
    for (size_t i = 0; i < n; i++) h[i] = info[i].handle;
    OK(kvd_release(c, h, n, st));
}

int main(int argc, char **argv) {
    if (argc != 3) return 2;
    KvdClient *a = connect_or_die(argv[1], "c-node-1", 10000);
    KvdClient *b = connect_or_die(argv[2], "c-node-2", 10000);
    KvdNamespaceDescriptor d = test_layout();
    KvdNamespaceId ns;
    OK(kvd_register_namespace(a, &d, &ns));
    OK(kvd_register_namespace(b, &d, &ns));
    KvdKey k[N];
    for (uint32_t i = 0; i < N; i++) {
        k[i] = test_key(ns, 31, i);
        fill(data[i], LEN, (uint8_t)(i + 1));
    }
    /* six blocks on node 1, two on node 2 */
    for (size_t i = 0; i < 6; i++) put_block(a, k[i], data[i], LEN);
    for (size_t i = 6; i < N; i++) put_block(b, k[i], data[i], LEN);

    uint64_t id = 0;
    OK(kvd_push(a, 2, k, 6, &id));
    KvdTransferInfo t = wait_transfer(a, id);
    TRUE(t.state == KVD_TRANSFER_DONE && t.status == KVD_OK && t.blocks == 6 && t.peer == 2);
    TRUE(t.bytes == 6 * (uint64_t)LEN);
    all_there(b, k, 6, 0);

    OK(kvd_fetch(a, 2, k + 6, 2, &id));
    t = wait_transfer(a, id);
    TRUE(t.state == KVD_TRANSFER_DONE && t.blocks == 2);
    all_there(a, k + 6, 2, 6);

    /* a hand-off: node 2 holds its two blocks for request 77 at epoch 2 (beyond its
       session); node 1 reads them bound to that pair, and an older epoch's read is refused */
    size_t held = 0;
    uint64_t held_bytes = 0;
    OK(kvd_hold_begin(b, 77, 2, k + 6, 2, 30000, &held, &held_bytes));
    TRUE(held == 2 && held_bytes == 2 * (uint64_t)LEN);
    EXPECT(kvd_hold_begin(b, 77, 1, k + 6, 2, 30000, NULL, NULL), KVD_ERR_STALE_EPOCH);
    OK(kvd_fetch_held(a, 2, 77, 1, k + 6, 2, 1, &id));
    t = wait_transfer(a, id);
    TRUE(t.state == KVD_TRANSFER_FAILED && t.status == KVD_ERR_NOT_FOUND);
    OK(kvd_fetch_held(a, 2, 77, 2, k + 6, 2, 0, &id));
    t = wait_transfer(a, id);
    TRUE(t.state == KVD_TRANSFER_DONE);
    int32_t ended = -1;
    OK(kvd_hold_end(b, 77, 1, &ended));
    TRUE(ended == 0); /* an older epoch ends nothing */
    OK(kvd_hold_end(b, 77, 2, &ended));
    TRUE(ended == 1);
    EXPECT(kvd_hold_begin(b, 78, 1, NULL, 1, 30000, NULL, NULL), KVD_ERR_INVALID_ARGUMENT);

    /* errors: a peer not in the table; too small an answer array; NULLs */
    EXPECT(kvd_push(a, 9, k, 1, &id), KVD_ERR_NOT_FOUND);
    uint64_t ids[2] = {id, id};
    size_t found = 0;
    KvdTransferInfo one;
    EXPECT(kvd_transfers(a, ids, 2, &one, 1, &found), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_push(a, 2, NULL, 1, &id), KVD_ERR_INVALID_ARGUMENT);
    EXPECT(kvd_fetch(a, 2, k, 1, NULL), KVD_ERR_INVALID_ARGUMENT);
    /* node 2's peers are node 1 alone: it cannot push to node 3 */
    EXPECT(kvd_push(b, 3, k + 6, 1, &id), KVD_ERR_NOT_FOUND);
    /* an unknown id is left out */
    uint64_t unknown = 123456;
    OK(kvd_transfers(a, &unknown, 1, &one, 1, &found));
    TRUE(found == 0);

    kvd_close(a);
    kvd_close(b);
    done("transfers");
    return 0;
}
