/* Instance groups from C: two ranks (two clients, two sessions) of one tensor-parallel
 * instance. A step is published only when both committed; when one rank's session ends, the
 * instance fails as a whole and its open step is aborted on the other rank too. */
#include "check.h"

#define LEN (64 * 1024)
static uint8_t data[LEN];

static KvdClient *rank_client(const char *socket, const char *name) {
    KvdClientOptions o;
    OK(kvd_options_init(&o, KVD_ABI_VERSION));
    o.name = name;
    o.lease_ttl_ms = 30000;
    KvdClient *c = NULL;
    OK(kvd_connect(socket, &o, &c));
    return c;
}

/* Allocate, fill and seal one cache block of key `k`; its handle. */
static KvdHandle sealed(KvdClient *c, KvdKey k) {
    KvdAllocation a;
    int32_t st;
    OK(kvd_alloc(c, &k, 1, NULL, 0, &a, &st));
    EXPECT(st, KVD_OK);
    fill(data, LEN, 5);
    OK(kvd_write(c, &a.handle, 0, data, LEN));
    KvdSealItem s;
    memset(&s, 0, sizeof s);
    s.handle = a.handle;
    s.len = LEN;
    uint32_t sum;
    OK(kvd_seal(c, &s, 1, &sum, &st));
    EXPECT(st, KVD_OK);
    return a.handle;
}

static bool visible(KvdClient *c, KvdKey k) {
    uint8_t bit = 0;
    OK(kvd_exists(c, &k, 1, &bit, 1));
    return (bit & 1) != 0;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    KvdClient *r0 = rank_client(argv[1], "rank-0");
    KvdClient *r1 = rank_client(argv[1], "rank-1");
    KvdNamespaceDescriptor d = test_layout();
    KvdNamespaceId ns;
    OK(kvd_register_namespace(r0, &d, &ns));
    OK(kvd_register_namespace(r1, &d, &ns));
    OK(kvd_instance_join(r0, 7, 1, 0, 2));
    OK(kvd_instance_join(r1, 7, 1, 1, 2));
    EXPECT(kvd_instance_join(r1, 7, 1, 0, 2), KVD_ERR_INVALID_ARGUMENT); /* rank 0 is taken */
    EXPECT(kvd_instance_join(r0, 7, 1, 5, 2), KVD_ERR_INVALID_ARGUMENT);

    /* step 0: published only by the second commit */
    KvdKey k0 = test_key(ns, 1, 0), k1 = test_key(ns, 1, 1);
    KvdHandle h0 = sealed(r0, k0), h1 = sealed(r1, k1);
    bool published = true;
    OK(kvd_instance_commit(r0, 7, 1, 0, &h0, 1, &published));
    TRUE(!published && !visible(r0, k0));
    OK(kvd_instance_commit(r1, 7, 1, 0, &h1, 1, &published));
    TRUE(published && visible(r0, k0) && visible(r0, k1));

    /* step 1: rank 0 commits, rank 1 goes away before it does */
    KvdKey k2 = test_key(ns, 2, 0), k3 = test_key(ns, 2, 1);
    KvdHandle h2 = sealed(r0, k2);
    (void)sealed(r1, k3);
    OK(kvd_instance_commit(r0, 7, 1, 1, &h2, 1, NULL));
    OK(kvd_close(r1));
    TRUE(!visible(r0, k2) && !visible(r0, k3));
    EXPECT(kvd_instance_commit(r0, 7, 1, 2, &h2, 1, &published), KVD_ERR_UNAVAILABLE);
    TRUE(strstr(kvd_last_error_message(), "instance 7 has failed") != NULL);
    /* its step-1 block was aborted: publishing it is refused */
    EXPECT(kvd_publish(r0, &h2, 1), KVD_ERR_STALE_GENERATION);
    TRUE(visible(r0, k0)); /* step 0 stays */
    OK(kvd_close(r0));
    done("instances");
    return 0;
}
